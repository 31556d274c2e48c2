"""verl plugin entry point (``verl.plugins: infmem = infmem_verl.plugin`` in setup.py).

``import verl`` loads every ``verl.plugins`` entry point in every process: the driver, the
TaskRunner, the agent-loop and reward-loop workers (Ray actors). Importing this module registers:

* agent loops ``infmem_agent`` and ``memagent_agent`` (:mod:`infmem_verl.rollout.agent_loop`),
* reward manager ``infmem`` (:mod:`infmem_verl.reward.manager`),
* trainer mode ``infmem_sync`` (:mod:`infmem_verl.rollout.trainer`),
* trainer mode ``infmem_cpu``, the CPU backend (:mod:`infmem_verl.cpu.trainer`).

verl logs plugin import errors only at DEBUG level, so a failure here is logged as an error
(with its traceback) before verl swallows it; otherwise the loops would silently be missing.
"""

from __future__ import annotations

import importlib
import logging

REGISTERING_MODULES = (
    "infmem_verl.rollout.agent_loop",
    "infmem_verl.reward.manager",
    "infmem_verl.rollout.trainer",
    "infmem_verl.cpu.trainer",
)

AGENT_LOOPS = ("infmem_agent", "memagent_agent")
REWARD_MANAGERS = ("infmem",)
TRAINER_MODES = ("infmem_sync", "infmem_cpu")


def register() -> None:
    """Import the modules whose decorators register our classes with verl (idempotent)."""
    for name in REGISTERING_MODULES:
        try:
            importlib.import_module(name)
        except Exception:
            logging.getLogger(__name__).exception(
                "infmem plugin: importing %s failed; its verl registrations are missing", name
            )
            raise


register()
