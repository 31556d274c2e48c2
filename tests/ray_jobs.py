"""Helpers of the tests that submit real Ray jobs to a real job server (tests/test_preflight.py,
tests/test_cluster.py): a cluster started by the repo's own scripts, submission once its job agent
is up, the wait for a job's end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[1]

T = TypeVar("T")


def submit_when_ready(submit: Callable[[], T], seconds: float = 120) -> T:
    """``submit()`` once the job server takes jobs: its job agent starts a few seconds after the
    head (longer on loaded cores), and until then a submission fails with a RuntimeError."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return submit()
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def wait_for_job(client, job: str, seconds: float = 600):
    """The final status of ``job`` (TimeoutError, naming the last status, after ``seconds``)."""
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + seconds
    while (status := client.get_job_status(job)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray job {job} still {status} after {seconds:.0f} s")
        time.sleep(0.5)
    return status


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Cluster:
    gcs: str  # HOST:PORT the nodes join
    jobs: str  # the job server's URL
    temp_dirs: list[Path]  # one session folder per node


def ray_env(python: Path | None = None) -> dict[str, str]:
    """The venv of ``python`` (default: this one) first on PATH, its `ray` and `python`: the job's
    entrypoint (`python -m ...`) and verl's workers run in the raylets' environment."""
    bin_dir = Path(python or sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", **AUTH)
    # Models and the tokenizer from this machine's cache (submit.sh --shared would point HF_HOME at
    # the shared folder, where nothing was downloaded: the job is offline).
    env.setdefault("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


# Ray 2.60's `ray start --head` turns token authentication on by itself when ~/.ray/auth_token exists,
# and a node joining without RAY_AUTH_MODE=token is then refused (InvalidAuthToken): every node, and
# every client (submit.sh, the state API), runs with it, reading the token from that one file.
AUTH = {"RAY_AUTH_MODE": "token"}


def alive_nodes(jobs: str) -> list:
    from ray.util.state import list_nodes

    try:
        return [n for n in list_nodes(address=jobs, raise_on_missing_output=False) if n.state == "ALIVE"]
    except Exception:  # the dashboard is still starting (connection refused, 5xx)
        return []


@contextmanager
def ray_cluster(
    root: Path,
    head_cpus: int,
    worker_cpus: int | None = None,
    head_gpus: int = 0,
    worker_gpus: int = 0,
    python: Path | None = None,
) -> Iterator[Cluster]:
    """A head and (with ``worker_cpus``) a second node on loopback, each a real `ray start --block`
    started by the repo's scripts in its own process group, with its own session folder and
    dashboard-agent port (Ray's default, 52365, is taken by whichever Ray started first on this
    machine, and a job server without its agent takes no job); stopped (and every process of
    theirs gone) on exit. ``head_gpus`` / ``worker_gpus``: logical GPUs each node declares (Ray
    counts and places them; nothing here uses a device: a verl-cpu rank takes one). ``python``: the
    venv the nodes run in (default: this one; the vLLM venv for verl-cpu jobs).

    Not `ray stop`: it kills every Ray process of the machine by name, other runs' included."""
    port, dashboard = free_port(), free_port()
    root.mkdir(parents=True, exist_ok=True)
    head_dir, worker_dir = root / "head", root / "worker"
    cluster = Cluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}", [head_dir])
    env = ray_env(python)
    # Token mode needs a token file, which a fresh machine has only once some Ray session has
    # written one (the first head would refuse to start): made here if missing, kept if present.
    subprocess.run(["ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=120)
    nodes: list[subprocess.Popen] = []

    def start(script: str, *args: str, log: Path) -> None:
        command = ["bash", str(REPO / "recipes" / script), "--node-ip", "127.0.0.1", *args, "--block"]
        with log.open("w") as out:
            nodes.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start("ray_head.sh", "--port", str(port), "--dashboard-port", str(dashboard), "--num-cpus", str(head_cpus),
              "--num-gpus", str(head_gpus), "--temp-dir", str(head_dir), "--agent-port", str(free_port()), log=root / "head.log")  # fmt: skip
        _wait(lambda: (head_dir / "ray_current_cluster").is_file(), 180, "the Ray head", root / "head.log")
        if worker_cpus is not None:
            cluster.temp_dirs.append(worker_dir)
            start("ray_worker.sh", "--address", cluster.gcs, "--num-cpus", str(worker_cpus), "--num-gpus", str(worker_gpus), "--temp-dir",
                  str(worker_dir), "--agent-port", str(free_port()), log=root / "worker.log")  # fmt: skip
        nodes_up = len(cluster.temp_dirs)
        _wait(lambda: len(alive_nodes(cluster.jobs)) == nodes_up, 180, "the nodes", root / "head.log")
        yield cluster
    finally:
        for node in reversed(nodes):  # SIGTERM: `ray start --block` stops its node's processes
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        _kill_leftovers(root)


def _wait(ready, seconds: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not start in {seconds:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(1)


def _kill_leftovers(root: Path) -> None:
    """Kill, by pid, any process still naming one of this cluster's session folders (a worker the
    raylet did not take down with it), then assert none is left."""
    import psutil

    def ours() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            if any(str(root) in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        return found

    for proc in ours():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(ours(), timeout=30)
    assert not ours(), f"Ray processes of {root} left running: {[p.pid for p in ours()]}"
