"""A Ray actor of a training run that died (killed, out of memory, crashed), named in one line.

When a process of the pipeline dies in the middle of a step (the generation server, an
agent-loop or reward worker), the task that waited on it raises Ray's ``ActorDiedError``, and
that error reaches the launcher wrapped once per actor it went through, as a traceback of a
hundred lines whose only useful facts are the dead actor's class and process. verl does not
retry a step, and a sync trainer cannot continue without a server whose weights it knows, so the
run stops; :func:`stop_line` says which actor died and where the run can resume. Nothing is
lost: verl saves step N's checkpoint before step N+1 starts (a save is written into a
``.partial`` folder and renamed, :mod:`infmem_verl.cpu.checkpoint`), and the tracker file names
only complete ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# The pipeline's actor classes (CPU backend and stock verl's GPU rollout), by their role.
ROLES = {
    "CPUGenerationServer": "the generation server",
    "vLLMHttpServer": "a vLLM generation server",
    "SGLangHttpServer": "an SGLang generation server",
    "AgentLoopWorker": "an agent-loop worker",
    "AgentLoopWorkerTQ": "an agent-loop worker",
    "RewardLoopWorker": "a reward worker",
}
TRACKER = "latest_checkpointed_iteration.txt"  # verl's: the last complete checkpoint's step


class TrainingStopped(RuntimeError):
    """The run stopped on a fault it cannot continue from; the message is :func:`stop_line`'s."""


@dataclass(frozen=True)
class DeadActor:
    """What Ray's ``ActorDiedError`` says of the actor: its class, process and why it ended."""

    class_name: str
    pid: int | None
    reason: str  # Ray's first sentence on the cause, e.g. "its worker process has died"

    @property
    def role(self) -> str:
        return ROLES.get(self.class_name, "a Ray actor")


def dead_actor(err: BaseException) -> DeadActor | None:
    """The dead actor an error of a training run reports, or ``None`` when it is another fault.

    Read from the message: Ray writes the class and pid into ``ActorDiedError``'s text, and that
    text travels inside every ``RayTaskError`` that wraps it.
    """
    from ray.exceptions import ActorDiedError

    if not isinstance(err, ActorDiedError):  # a RayTaskError caused by one is an instance too
        return None
    text = str(err)
    found = re.search(r"class_name: (\w+)", text)
    if found is None:
        return None
    pid = re.search(r"\bpid: (\d+)", text[found.end():])
    reason = re.search(r"The actor is dead because ([^.\n]+)", text)
    return DeadActor(found.group(1), int(pid.group(1)) if pid else None, reason.group(1) if reason else "unknown")


def stop_line(actor: DeadActor, checkpoints: Path) -> str:
    """One line: which actor died, and the checkpoint the same command resumes from."""
    process = f", pid {actor.pid}" if actor.pid is not None else ""
    tracker = checkpoints / TRACKER
    step = tracker.read_text().strip() if tracker.is_file() else None
    resume = (
        f"the last complete checkpoint is {checkpoints / f'global_step_{step}'}; the same command with "
        "trainer.resume_mode=auto resumes from it"
        if step
        else f"no checkpoint was complete in {checkpoints}; the run starts again from step 1"
    )
    return (
        f"training stopped: {actor.role} ({actor.class_name}{process}) died in the middle of a step "
        f"({actor.reason}); {resume} (Ray's traceback: run.log)"
    )
