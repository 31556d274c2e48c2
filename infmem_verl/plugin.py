"""verl plugin entry point (``verl.plugins: infmem = infmem_verl.plugin`` in setup.py).

``import verl`` loads every ``verl.plugins`` entry point (and ``VERL_USE_EXTERNAL_MODULES``) in
every process it runs in: the driver and TaskRunner, but also every FSDP worker, vLLM server and
vLLM's engine subprocesses. Most of them never read our registrations, so importing this module
imports nothing of verl's: each registration runs when, and only where, the verl package holding
its registry is imported (after that package has finished importing):

* ``verl.experimental.agent_loop`` (agent-loop workers): agent loops ``infmem_agent`` and
  ``memagent_agent`` (:mod:`infmem_verl.verl_plugin.agent_loop`);
* ``verl.experimental.reward_loop`` (reward-loop workers): reward manager ``infmem``
  (:mod:`infmem_verl.reward.manager`);
* ``verl.trainer.ppo.v1`` (the TaskRunner): trainer modes ``infmem_sync``
  (:mod:`infmem_verl.verl_plugin.trainer`) and ``infmem_cpu``, the CPU backend (:mod:`infmem_verl.cpu.trainer`);
* ``verl.plugin.platform`` (every process; ``import verl`` imports it before loading plugins): the
  ``cpu`` platform that ``VERL_PLATFORM=cpu`` selects (:mod:`infmem_verl.verl_plugin.platform`);
* ``verl.workers.engine`` (training workers): verl's FSDP engines for that platform's ``cpu``
  device (:mod:`infmem_verl.verl_plugin.cpu_engine`);
* ``verl.workers.rollout.replica`` (where verl's ``LLMServerManager`` builds the rollout
  replicas): on that platform, the ``vllm`` replica whose weight sync vLLM's CPU build can take
  (:mod:`infmem_verl.verl_plugin.vllm_cpu_replica`).

It also lets verl find vLLM's CPU build by the distribution name it looks up
(:mod:`infmem_verl.verl_plugin.vllm_cpu`; a metadata finder, no verl import).

verl logs plugin import errors only at DEBUG level, so a failing registration is logged as an
error (with its traceback) and raised, rather than leaving the names silently missing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys

from infmem_verl.verl_plugin import vllm_cpu

# verl package -> our modules whose decorators register into that package's registry.
REGISTRATIONS = {
    "verl.experimental.agent_loop": ("infmem_verl.verl_plugin.agent_loop",),
    "verl.experimental.reward_loop": ("infmem_verl.reward.manager",),
    "verl.trainer.ppo.v1": ("infmem_verl.verl_plugin.trainer", "infmem_verl.cpu.trainer"),
    "verl.plugin.platform": ("infmem_verl.verl_plugin.platform",),
    "verl.workers.engine": ("infmem_verl.verl_plugin.cpu_engine",),
    "verl.workers.rollout.replica": ("infmem_verl.verl_plugin.vllm_cpu_replica",),
}
REGISTERING_MODULES = tuple(m for modules in REGISTRATIONS.values() for m in modules)

AGENT_LOOPS = ("infmem_agent", "memagent_agent")
REWARD_MANAGERS = ("infmem",)
TRAINER_MODES = ("infmem_sync", "infmem_cpu")
PLATFORMS = ("cpu",)


def _initializing(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False)


def _register(package: str) -> None:
    # When one of our modules is mid-import (it imported the verl package itself, e.g. a direct
    # `import infmem_verl.verl_plugin.trainer`), the group waits for the next register() call:
    # importing the rest now would meet the half-built module.
    if any(_initializing(name) for name in REGISTRATIONS[package]):
        return
    for name in REGISTRATIONS[package]:
        try:
            importlib.import_module(name)
        except Exception:
            logging.getLogger(__name__).exception(
                "infmem plugin: importing %s failed; its verl registrations are missing", name
            )
            raise


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a watched verl package with the other finders, and registers ours once it has executed."""

    def find_spec(self, name, path, target=None):
        if name not in REGISTRATIONS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        self._loaders = getattr(self, "_loaders", {})
        self._loaders[name] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module) -> None:
        name = module.__spec__.name
        loader = self._loaders.pop(name)
        module.__spec__.loader = module.__loader__ = loader  # resources are read through verl's own loader
        loader.exec_module(module)
        _register(name)


def register() -> None:
    """Register now for the watched packages already imported, later for the others (idempotent;
    the entry point calls it on import, :func:`infmem_verl.main.prepare_config` again)."""
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
    vllm_cpu.install()
    for package in REGISTRATIONS:
        if package in sys.modules:
            _register(package)


register()
