"""The cluster path, run for real on this machine (issue 28 item 5): a two-node Ray cluster started
by recipes/ray_head.sh and recipes/ray_worker.sh (two raylets on loopback, each with its own session
folder and CPU count), and the smoke recipe submitted to it by recipes/submit.sh as a Ray job, twice:
one RL step that saves, then the same command resuming to step 2.

What a first multi-node run would get wrong, each checked here: the job's entrypoint joins the
cluster it did not start (RAY_ADDRESS from Ray's job supervisor) and counts both nodes' resources;
verl places an agent-loop worker on each node, and both read the document store at the same
absolute path; checkpoints go to an absolute folder outside Ray's per-node copy of the uploaded
checkout, and the second job resumes from the first one's. The same again on verl's own workers
(``infmem.backend=verl-cpu``, the cluster in the vLLM venv): one FSDP2 rank and one vLLM-CPU replica
on each node, their gloo group across the nodes, as a multi-node GPU run places them.

The cluster tests are too long for the suite (two smoke jobs on the CPU backend: 3 min 20 s on 2
cores under light load, 12 min under heavy; docs/experiments/2026-12-03-two-node-cluster.md; two
verl-cpu jobs: docs/experiments/2026-12-05-verl-cpu-cluster.md): `make smoke-cluster` runs them
(INFMEM_CLUSTER_SMOKE=1); without that they are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from ray_jobs import Cluster, alive_nodes, ray_cluster, ray_env, submit_when_ready, wait_for_job
from vllm_server import require_vllm

REPO = Path(__file__).resolve().parents[1]

cluster_smoke = pytest.mark.skipif(
    os.environ.get("INFMEM_CLUSTER_SMOKE") != "1",
    reason="two smoke jobs on a two-node Ray cluster take 3-12 min a test: `make smoke-cluster` runs them",
)

# 16 logical CPUs in all, what the CPU backend's actors reserve on one machine (MIN_RAY_CPUS), split
# unevenly so that the total the job counts can only be the sum of both nodes.
HEAD_CPUS, WORKER_CPUS = 9, 7
RUN = "smoke-cluster"
# Both clusters' jobs: a checkpoint every step, the next job resuming from it, one agent-loop
# worker per node (verl places them round-robin over the nodes), no validation.
SAVE_AND_RESUME = (
    "trainer.save_freq=1",
    "trainer.resume_mode=auto",
    "trainer.test_freq=-1",
    "actor_rollout_ref.rollout.agent.num_workers=2",
)
# The smallest smoke that still saves: 2 prompts x n=2 (GRPO needs a group), 8K-token documents in
# two 4K chunks.
SMOKE = (
    "+recipe=smoke",
    *SAVE_AND_RESUME,
    "infmem.bootstrap.train_samples=2",
    "infmem.bootstrap.val_samples=1",
    "infmem.bootstrap.doc_tokens=8000",
)


# verl's own workers across the two nodes (infmem.backend=verl-cpu): one gloo rank on each node's
# logical GPU slot, its hybrid vLLM-CPU replica beside it, the nodes running in the vLLM venv; the
# smoke_verl recipe's model and documents.
VERL_RUN = "smoke-verl-cluster"
VERL_SMOKE = ("+recipe=smoke_verl", "trainer.nnodes=2", "trainer.n_gpus_per_node=1", *SAVE_AND_RESUME)
# Logical CPUs: verl reserves CPUS_PER_RANK beside each rank's slot; the driver's actors take the rest.
VERL_HEAD_CPUS, VERL_WORKER_CPUS = 20, 16


def submit(cluster: Cluster, shared: Path, *overrides: str, run: str = RUN, smoke: tuple[str, ...] = SMOKE,
           python: Path | None = None) -> str:  # fmt: skip
    """recipes/submit.sh --no-wait with ``overrides`` after ``smoke``, from the venv of ``python``;
    returns the submission id."""
    command = ["bash", str(REPO / "recipes" / "submit.sh"), "--address", cluster.jobs, "--shared", str(shared),
               "--name", run, "--no-wait", "--", *smoke, *overrides]  # fmt: skip

    def once() -> str:
        done = subprocess.run(command, env=ray_env(python), capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"submit.sh failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("Submitting "))

    return submit_when_ready(once)


def finished_job(cluster: Cluster, job: str, seconds: float) -> str:
    """The logs of ``job``, after asserting that it succeeded."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(cluster.jobs)
    status = wait_for_job(client, job, seconds)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-6000:]
    return logs


def shared_data(shared: Path) -> tuple[str, str]:
    """The data overrides of a job whose data files the bootstrap writes under the shared folder."""
    data = shared / "data"
    return f"data.train_files={data}/train.parquet", f"data.val_files={data}/val.parquet"


def logged_steps(records: Path) -> list[dict]:
    """Every line of the jobs' ``steps.jsonl``, as written (a step logged twice shows twice)."""
    return [json.loads(line) for line in (records / "steps.jsonl").read_text().splitlines()]


def print_job_lines(tag: str, logs: dict[str, str]) -> None:
    """Each job's backend, cluster and step lines, under ``tag``."""
    for job, text in logs.items():
        for line in text.splitlines():
            if line.startswith(("[infmem] Ray cluster", "[infmem] backend", "[infmem] step")):
                print(f"[{tag}] {job}: {line}", flush=True)


def agent_loop_placement(cluster: Cluster) -> dict[str, str]:
    """Ray's record of where the agent-loop workers of the jobs so far ran: actor name -> node id."""
    return {name: node for name, (_, node) in actor_placement(cluster).items() if name.startswith("agent_loop_worker_")}


def actor_placement(cluster: Cluster) -> dict[str, tuple[str, str]]:
    """Ray's record of the named actors of the jobs so far: name -> (class name, node id)."""
    from ray.util.state import list_actors

    actors = list_actors(address=cluster.jobs, detail=True, limit=1000, raise_on_missing_output=False)
    return {a.name: (a.class_name, a.node_id) for a in actors if a.name}


def test_a_cpu_run_joining_a_ray_cluster_leaves_the_cpu_count_to_the_cluster(monkeypatch):
    """In a Ray job (RAY_ADDRESS set by Ray's job supervisor) verl's ray.init connects, and Ray
    refuses num_cpus / include_dashboard there: the CPU backend sets them only for a Ray it starts."""
    from hydra import compose, initialize_config_dir

    from infmem_verl import conf_dir
    from infmem_verl.cpu.backend import MIN_RAY_CPUS, apply_cpu_backend

    def ray_init(address: str | None):
        if address is None:
            monkeypatch.delenv("RAY_ADDRESS", raising=False)
        else:
            monkeypatch.setenv("RAY_ADDRESS", address)
        with initialize_config_dir(str(conf_dir()), version_base=None):
            config = compose("infmem_trainer", overrides=["+recipe=smoke"])
        apply_cpu_backend(config)
        assert config.trainer.v1.trainer_mode == "infmem_cpu"
        return config.ray_kwargs.ray_init

    alone = ray_init(None)
    assert alone.num_cpus >= MIN_RAY_CPUS and alone.include_dashboard is False
    joined = ray_init("10.0.0.1:6379")
    assert joined.get("num_cpus") is None and joined.get("include_dashboard") is None


@cluster_smoke
def test_a_smoke_job_on_a_two_node_cluster_saves_and_resumes(tmp_path, token_auth):
    shared = tmp_path / "shared"  # "shared storage": one absolute path both nodes see
    data_args = shared_data(shared)
    started = time.monotonic()
    # Ray's session folders hold its Unix sockets, whose paths must stay under 108 bytes.
    ray_root = Path(tempfile.mkdtemp(prefix="infmem-ray-", dir="/tmp"))
    with ray_cluster(ray_root, HEAD_CPUS, WORKER_CPUS) as cluster:
        nodes = {n.node_id: n for n in alive_nodes(cluster.jobs)}
        assert sorted(int(n.resources_total["CPU"]) for n in nodes.values()) == sorted([HEAD_CPUS, WORKER_CPUS])
        up = time.monotonic()

        first = finished_job(cluster, submit(cluster, shared, *data_args, "trainer.total_training_steps=1"), 1200)
        one = time.monotonic()
        placed_first = agent_loop_placement(cluster)
        second = finished_job(cluster, submit(cluster, shared, *data_args, "trainer.total_training_steps=2"), 1200)
        two = time.monotonic()
        placed = agent_loop_placement(cluster)
    print(
        f"\n[cluster smoke] cluster up {up - started:.0f} s, job 1 (step 1, save) {one - up:.0f} s, "
        f"job 2 (resume, step 2, save) {two - one:.0f} s, stop {time.monotonic() - two:.0f} s",
        flush=True,
    )
    print(f"[cluster smoke] agent-loop workers -> node: {placed}", flush=True)
    print_job_lines("cluster smoke", {"job 1": first, "job 2": second})

    # The entrypoint joined the cluster and counted both nodes: 9 + 7 CPUs, from the job's own log.
    for logs in (first, second):
        assert f"[infmem] Ray cluster: 2 alive node(s), CPU={HEAD_CPUS + WORKER_CPUS:g} in all" in logs, logs[-4000:]
    # One agent-loop worker on each node per job. verl hands each worker an equal share of the step's
    # 4 trajectories, and each trajectory resolves its document from the store at the shared path in
    # its worker: none failed, and every one read its document's chunks, on both nodes.
    assert len(placed_first) == 2 and set(placed_first.values()) == set(nodes), placed_first
    assert len(placed) == 4 and set(placed.values()) == set(nodes), placed
    assert "[infmem] step 1/1" in first, first[-4000:]
    records = shared / "tensorboard" / RUN
    steps = logged_steps(records)
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        assert step["infmem/failed_trajectories"] == 0 and step["infmem/chunks_read"] == step["infmem/num_chunks"] == 2
        assert len((records / "trajectories" / f"step_{step['step']}.jsonl").read_text().splitlines()) == 4

    # Checkpoints in the absolute folder submit.sh --shared chose, not in Ray's copy of the checkout.
    checkpoints = shared / "checkpoints" / RUN
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (checkpoints / "global_step_2" / "actor").is_dir()
    assert not list(ray_root.rglob("global_step_*"))
    shutil.rmtree(ray_root, ignore_errors=True)
    # The second job resumed from the first one's step 1 and trained step 2 only.
    assert "[infmem] step 2/2" in second and "[infmem] step 1/" not in second, second[-4000:]


@cluster_smoke
def test_a_verl_cpu_job_spans_both_nodes_saves_and_resumes(tmp_path, token_auth):
    """verl's own workers in a Ray job on the two-node cluster, as a multi-node GPU run places them:
    rank 0 on one node, rank 1 on the other (each node declares one logical GPU slot), their gloo
    group across the nodes, a vLLM-CPU replica beside each rank, verl's weight sync; then the same
    command resumes from the first job's checkpoint."""
    python = require_vllm()
    shared = tmp_path / "shared"
    data_args = shared_data(shared)
    started = time.monotonic()
    ray_root = Path(tempfile.mkdtemp(prefix="infmem-ray-", dir="/tmp"))

    def job(steps: int) -> str:
        submitted = submit(cluster, shared, *data_args, f"trainer.total_training_steps={steps}", run=VERL_RUN,
                           smoke=VERL_SMOKE, python=python)  # fmt: skip
        return finished_job(cluster, submitted, 1500)

    with ray_cluster(ray_root, VERL_HEAD_CPUS, VERL_WORKER_CPUS, head_gpus=1, worker_gpus=1, python=python) as cluster:
        nodes = {n.node_id for n in alive_nodes(cluster.jobs)}
        up = time.monotonic()
        first = job(1)
        one = time.monotonic()
        second = job(2)
        two = time.monotonic()
        placed = actor_placement(cluster)
    print(f"\n[verl-cpu cluster] cluster up {up - started:.0f} s, job 1 {one - up:.0f} s, job 2 {two - one:.0f} s", flush=True)
    print(f"[verl-cpu cluster] actors: {sorted((c, n[:8]) for c, n in placed.values())}", flush=True)
    print_job_lines("verl-cpu cluster", {"job 1": first, "job 2": second})

    total_cpus = VERL_HEAD_CPUS + VERL_WORKER_CPUS
    for logs in (first, second):
        assert "[infmem] backend: verl-cpu - verl's own workers on 2 gloo rank(s) of the Ray cluster" in logs, logs[-4000:]
        assert f"[infmem] Ray cluster: 2 alive node(s), CPU={total_cpus:g}, GPU=2 in all" in logs, logs[-4000:]
    # verl's trainer ranks and their vLLM servers on both nodes (each node has one slot).
    for kind in ("WorkerDict", "vLLMHttpServer"):
        assert {node for cls, node in placed.values() if kind in cls} == nodes, (kind, placed)
    records = shared / "tensorboard" / VERL_RUN
    steps = logged_steps(records)
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        assert step["infmem/failed_trajectories"] == 0 and step["infmem/optimizer_steps"] == 2, step
    checkpoints = shared / "checkpoints" / VERL_RUN
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for rank in range(2):
        assert (checkpoints / "global_step_2" / "actor" / f"model_world_size_2_rank_{rank}.pt").is_file()
    assert not list(ray_root.rglob("global_step_*"))
    shutil.rmtree(ray_root, ignore_errors=True)
    assert "[infmem] step 2/2" in second and "[infmem] step 1/" not in second, second[-4000:]
