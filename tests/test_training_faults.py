"""Faults during training, survived: a process of the pipeline (the generation server, an
agent-loop worker) SIGKILLed in the middle of a step of a real ``+recipe=smoke``
run on the CPU backend (verl's own trainer loop, see infmem_verl/cpu), as an out-of-memory kill
or a crash would end it.

The run saves after every step. Step 2's rollout is held inside its scoring (the agent loop
waits on the reward worker; see :func:`held_letters`) while the test kills the actor, then let
go. The run must stop within a bound with one console line naming the dead actor and the
checkpoint to resume from, and leave no step-2 checkpoint that resume would load; the same
command, resumed from step 1, meets the second fault in its step 2. That a resumed run trains
its step and saves it is checked on the smoke's own Ctrl-C and resume (tests/test_metrics_tb.py),
from the same state a kill leaves (the tracker at 1, nothing of step 2). (Faults at the save
itself: tests/test_checkpoint_faults.py.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from test_metrics_tb import _alive, _command, _environment, _kill_tree, _sigint_as_in_a_terminal, _tracker, letters

RUN_TIMEOUT_S = 900
STOP_TIMEOUT_S = 180  # from the kill to the run's exit: Ray reports a dead actor within seconds
# Set for the launches that meet a fault: the run's folder, where the hold's two files appear.
HOLD = "INFMEM_TEST_HOLD_STEP_2"
HOLDING, RELEASED = "holding", "released"
# The stopped-and-resumed run's overrides this run leaves out: no validation, no Ctrl-C hold,
# no records beyond the checkpoints (every pass costs CPU seconds on shared cores).
DROPPED = ("+infmem.reward.components.letters", "trainer.test_freq", "trainer.val_before_train",
           "trainer.rollout_data_dir", "trainer.logger", "infmem.records.trajectories")  # fmt: skip
ADDED = [
    "+infmem.reward.components.letters={_target_:test_training_faults.held_letters,weight:1.0}",
    "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[console]",
]  # fmt: skip


def held_letters(record) -> float:
    """Reward component: ``test_metrics_tb.letters``, scored in step 2 of a process launched with
    ``HOLD`` only after the test has killed its actor (it writes ``holding`` with its pid, waits
    for ``released``).

    Step 2 is the one whose scoring finds the tracker at 1 (step 1 scores before any save).
    """
    folder = os.environ.get(HOLD)
    tracker = _tracker(Path(folder)) if folder else None
    if tracker and tracker.is_file() and tracker.read_text().strip() == "1":
        written = Path(folder) / f"{HOLDING}.tmp"
        written.write_text(str(os.getpid()))
        written.rename(Path(folder) / HOLDING)  # the test never reads it half-written
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (Path(folder) / RELEASED).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    return letters(record)


def command(root: Path) -> list[str]:
    return [a for a in _command(root) if a.partition("=")[0] not in DROPPED] + ADDED


def environment(root: Path) -> dict[str, str]:
    env = _environment(root)
    env.pop("INFMEM_VERBOSE")  # the compact console a user sees: the fault must be named there
    return env


def actor_process(run: subprocess.Popen, class_name: str, holder: int) -> psutil.Process | None:
    """The process of the run's actor ``class_name`` (Ray titles it ``ray::ClassName...``): the
    one holding the scoring (``holder``) when it is of that class, else the first one found."""
    found = []
    for process in psutil.Process(run.pid).children(recursive=True):
        try:
            if f"ray::{class_name}" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return next((p for p in found if p.pid == holder), found[0] if found else None)


def stop_mid_step(root: Path, cmd: list[str], env: dict[str, str], class_name: str, role: str, log_name: str) -> None:
    """Launch ``cmd``, SIGKILL its ``class_name`` actor while step 2's scoring is held, and check
    the run stops in time, naming it, with nothing of step 2 saved and no Ray process left."""
    for name in (HOLDING, RELEASED):
        (root / name).unlink(missing_ok=True)
    log_path = root / log_name
    with log_path.open("w") as log:
        run = subprocess.Popen(cmd, cwd=root, env={**env, HOLD: str(root)}, stdout=log, stderr=subprocess.STDOUT,
                               preexec_fn=_sigint_as_in_a_terminal)  # fmt: skip
        started: list[int] = []
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not (root / HOLDING).is_file():
                assert run.poll() is None, f"the run ended early:\n{log_path.read_text()[-4000:]}"
                assert time.monotonic() < deadline, "step 2's scoring was not reached in time"
                time.sleep(0.2)
            victim = actor_process(run, class_name, int((root / HOLDING).read_text()))
            assert victim is not None, f"no {class_name} among the run's processes"
            started = [p.pid for p in psutil.Process(run.pid).children(recursive=True)]
            victim.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            (root / RELEASED).touch()  # the rest of step 2 goes on, and meets the dead actor
            try:
                run.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the run still waits {STOP_TIMEOUT_S} s after {class_name} was killed")
            print(f"{class_name}: the run stopped {time.monotonic() - killed_at:.1f} s after the kill")
        finally:
            if run.poll() is None:
                _kill_tree(run)
    console = log_path.read_text()
    assert run.returncode == 1, console[-4000:]
    line = rf"\[infmem\] training stopped: {role} \({class_name}, pid {victim.pid}\) died in the middle of a step"
    assert re.search(line + r" \(.+\); the last complete checkpoint is \S+global_step_1;", console), console[-4000:]
    assert "Traceback" not in console  # Ray's goes to run.log
    assert _tracker(root).read_text().strip() == "1"
    assert not (root / "checkpoints" / "global_step_2" / "actor").exists()  # nothing resume would load
    wait_until = time.monotonic() + 60
    while any(_alive(p) for p in started) and time.monotonic() < wait_until:
        time.sleep(1)
    assert not [p for p in started if _alive(p)], "Ray processes outlived the stopped run"


def test_actors_killed_mid_step_stop_the_run_naming_them_and_the_resume_starts_at_that_step(tmp_path):
    """Two faults, one after the other: the generation server killed in step 2 of the first run,
    then an agent-loop worker (the one whose scoring holds step 2) in the resumed run's step 2.
    (Rule-based rewards are scored in the agent-loop worker, so the smoke starts none of verl's
    RewardLoopWorker actors: reward.num_workers is 0.) Two launches of the smoke, about a minute and
    a half of the suite each; a third that completed step 2 (2026-12-07: 370 s for the three in a
    suite) repeated what tests/test_metrics_tb.py checks of a resume."""
    root = tmp_path
    cmd, env = command(root), environment(root)
    stop_mid_step(root, cmd, env, "CPUGenerationServer", "the generation server", "first.log")
    stop_mid_step(root, cmd, env, "AgentLoopWorkerTQ", "an agent-loop worker", "resumed.log")
    assert "[infmem] step 1/2" not in (root / "resumed.log").read_text()  # the second launch resumed
