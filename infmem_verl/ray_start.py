"""Ray's local node started once more when its raylet gave up waiting for a slow dashboard agent.

A ``ray.init`` that starts a node has the raylet wait for the dashboard agent (a Python process
importing Ray's dashboard modules) to write its port files, and Ray 2.60's raylet aborts after a
fixed 15 s (ray-project/ray#65983); ``ray.init`` then fails 30 s later with "The current node
timed out during startup", the raylet's reason only in its log. On a loaded 2-core machine the
agent can take longer: twice in four suites here (2026-12-07) the resumed smoke launch of
``tests/test_metrics_tb.py`` failed so while the other test worker trained. Fixed agent ports
would skip the wait, but ``ray.init`` passes none of them (only ``ray start``'s flags do). So a
launch whose node timed out stops what that attempt started and starts again, once.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

NODE_START_TIMEOUT = "The current node timed out during startup"
NODE_START_TRIES = 2
# A Ray session's name, in the command line of every process it starts (--session-name, --session-dir).
SESSION_NAME = re.compile(r"session_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}_\d+_\d+")


def stop_ray_children() -> list[int]:
    """SIGKILL what a failed ``ray.init`` left and wait for it to end; the pids.

    That is every process below this one that runs from Ray's package (GCS, raylet, agents, log
    monitor) and every process of the same Ray sessions elsewhere: the raylet aborts, so the agent
    it started, still importing, has become an orphan of ``init``.
    """
    import psutil
    import ray

    package = os.path.dirname(ray.__file__)
    ours = [p for p in psutil.Process().children(recursive=True) if package in _command_line(p)]
    sessions = {name for p in ours for name in SESSION_NAME.findall(_command_line(p))}
    orphans = [
        p for p in psutil.process_iter()
        if p.pid != os.getpid() and p not in ours and any(name in _command_line(p) for name in sessions)
    ]  # fmt: skip
    killed = []
    for process in ours + orphans:
        try:
            process.kill()
            killed.append(process)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(killed, timeout=30)
    return [p.pid for p in killed]


def _command_line(process) -> str:
    import psutil

    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def start_ray_retrying(start: Callable[[], T]) -> T:
    """``start()`` (a call that begins with ``ray.init``), made again once when Ray's node timed out
    starting; any other error, or one raised once Ray is up, goes to the caller."""
    import ray

    for _ in range(NODE_START_TRIES - 1):
        try:
            return start()
        except Exception as err:
            if ray.is_initialized() or NODE_START_TIMEOUT not in str(err):
                raise
            stopped = stop_ray_children()
            print(
                f"[infmem] Ray's node did not start in time (its raylet waits 15 s for the dashboard agent, "
                f"ray-project/ray#65983): stopped the {len(stopped)} processes it left (pids {stopped}), starting again",
                file=sys.stderr,
                flush=True,
            )
    return start()
