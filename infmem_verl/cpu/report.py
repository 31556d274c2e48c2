"""The one-line step and validation summaries every backend's console prints.

A reader of a memory-agent run wants trajectories: the reward and its components, accuracy,
chunks read, where the controller stopped, LLM calls. The step line shows the per-trajectory
means every trainer mode of ours logs (``infmem/...``, :mod:`infmem_verl.metrics`); the
validation line averages verl's per-data-source ``mean@n`` values. Pure functions over plain
values, so they test without verl.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from infmem_verl.metrics import PREFIX


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(float(value), spec)


def step_line(step: int, total: int, metrics: Mapping[str, Any], components: Sequence[str]) -> str:
    """The per-step summary: reward and components, accuracy, reading, calls, the update, time."""

    def ours(name: str, spec: str = ".3f") -> str:
        return _fmt(metrics.get(f"{PREFIX}/{name}"), spec)

    def verls(key: str, spec: str) -> str:
        return _fmt(metrics.get(key), spec)

    trajectories = metrics.get(f"{PREFIX}/trajectories") or 0
    stopped = (metrics.get(f"{PREFIX}/stopped") or 0) * trajectories
    parts = ", ".join(f"{c} {ours(c)}" for c in components)
    return " | ".join(
        [
            f"[infmem] step {step}/{total}",
            f"reward {ours('reward')} ({parts})",
            f"acc {ours('acc')}",
            f"chunks read {ours('chunks_read', '.1f')}/{ours('num_chunks', '.1f')}",
            f"stopped {stopped:.0f}/{trajectories:.0f} at step {ours('stop_step', '.1f')}",
            f"llm calls {ours('llm_calls', '.1f')}/traj",
            # Measured from verl's unreduced update output by infmem_sync; the CPU engine's own count.
            f"optimizer steps {ours('optimizer_steps', '.0f') if f'{PREFIX}/optimizer_steps' in metrics else verls('actor/optimizer_steps', '.0f')}",
            f"loss {verls('actor/loss', '.4f')} (pg {verls('actor/pg_loss', '.4f')})",
            f"grad norm {verls('actor/grad_norm', '.4f')}",
            f"rollout-vs-engine prob diff {verls('training/rollout_probs_diff_max', '.1e')}",
            f"{verls('timing_s/step', '.1f')}s",
        ]
    )


_VAL_KEY = re.compile(r"^val-(?:core|aux)/(?P<source>[^/]+)/(?P<name>[^/]+)/mean@(?P<n>\d+)$")


def validation_line(metrics: Mapping[str, Any], names: Sequence[str]) -> str:
    """The validation summary: each of ``names`` averaged over data sources (verl's mean@n)."""
    values: dict[str, list[float]] = defaultdict(list)
    for key, value in metrics.items():
        match = _VAL_KEY.match(key)
        if match and match["name"] in names:
            values[match["name"]].append(float(value))
    shown = " | ".join(f"{name} {_fmt(sum(v) / len(v))}" for name in names if (v := values.get(name)))
    return f"[infmem] validation | {shown or 'no metrics'}"
