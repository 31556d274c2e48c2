"""The framework-free agent core: documents, retrieval, protocol, memory and the agent loops.

Nothing in this package imports verl or ray, so evaluation, distillation and tests run it alone.
Names are resolved lazily so that importing one submodule (e.g. ``agent.config``) does not pull
in the tokenizer-heavy ones.
"""

import importlib

_EXPORTS = {
    "AgentConfig": "config",
    "ConfigError": "config",
    "agent_config": "config",
    "Generation": "policy",
    "Policy": "policy",
    "SamplingParams": "policy",
    "Action": "trajectory",
    "Trajectory": "trajectory",
    "Turn": "trajectory",
    "AGENTS": "loops",
    "AgentLoop": "loops",
    "InfMemAgent": "loops",
    "MemAgent": "loops",
    "build_agent": "loops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
