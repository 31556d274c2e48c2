"""A launch whose Ray node times out starting starts it again (infmem_verl/ray_start.py), on a real
Ray node whose first dashboard agent is made slow the way a loaded machine makes it slow: it
starts late, past the raylet's 15-s wait."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import psutil
import pytest

from infmem_verl.ray_start import start_ray_retrying

# Imported at start by every Python process that finds it on PYTHONPATH, the dashboard agent the
# raylet starts included: the first agent (the one that finds the flag) sleeps past the wait.
SLOW_FIRST_AGENT = """
import os, sys, time
flag = os.environ.get("SLOW_AGENT_FLAG")
if flag and any(a.endswith(os.path.join("dashboard", "agent.py")) for a in sys.argv) and os.path.exists(flag):
    os.remove(flag)
    with open(flag + ".pid", "w") as out:
        out.write(str(os.getpid()))
    time.sleep(120)
"""

DRIVER = """
import ray
from infmem_verl.ray_start import start_ray_retrying

def start():
    ray.init(num_cpus=1, include_dashboard=False)
    return ray.get(ray.remote(lambda: 6 * 7).remote())

print("answer", start_ray_retrying(start))
ray.shutdown()
"""


def test_a_node_whose_dashboard_agent_is_late_is_started_again_and_the_first_attempt_stopped(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(SLOW_FIRST_AGENT))
    flag = tmp_path / "slow-agent"
    flag.touch()
    env = {"PYTHONPATH": str(tmp_path), "SLOW_AGENT_FLAG": str(flag), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", DRIVER], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert not flag.exists()  # the first agent was slow
    assert "answer 42" in run.stdout
    notice = re.search(r"\[infmem\] Ray's node did not start in time .+ stopped the (\d+) processes it left \(pids \[([\d, ]+)\]\)", run.stderr)
    assert notice, run.stderr[-4000:]
    pids = [int(p) for p in notice[2].split(",")]
    late_agent = int((tmp_path / "slow-agent.pid").read_text())
    assert len(pids) == int(notice[1]) and late_agent in pids  # the raylet's orphan, by its session
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_any_other_error_goes_to_the_caller_at_once():
    calls = []

    def start():
        calls.append(1)
        raise RuntimeError("no such file: train.parquet")

    with pytest.raises(RuntimeError, match="train.parquet"):
        start_ray_retrying(start)
    assert calls == [1]
