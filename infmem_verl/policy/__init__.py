"""Policy backends: implementations of :class:`infmem_verl.agent.policy.Policy`.

Backends are imported lazily, so importing one (e.g. the verl server adapter) does not pull in
another's heavy dependencies.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TransformersPolicy"]


def __getattr__(name: str) -> Any:
    if name == "TransformersPolicy":
        from infmem_verl.policy.transformers import TransformersPolicy

        return TransformersPolicy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
