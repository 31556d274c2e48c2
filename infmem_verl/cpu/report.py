"""Per-trajectory training metrics and the one-line step and validation summaries.

verl's step metrics count sequences (one per LLM call); a reader of a memory-agent run wants
trajectories: the reward and its components, accuracy, chunks read, where the controller
stopped, LLM calls. These come from each sequence's ``extra_fields`` in TransferQueue (the turn
facts the agent loop wrote and the ``reward_extra_info`` the reward manager added), grouped by
trajectory (``{uid}_{session}``). Pure functions over plain values, so they test without verl.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from infmem_verl.rollout.facts import TurnFacts

PREFIX = "infmem"


def session_and_index(key: str) -> tuple[str, int]:
    """``{uid}_{session}_{index}`` -> (``{uid}_{session}``, index)."""
    session, _, index = key.rpartition("_")
    return session, int(index)


def trajectory_metrics(keys: Sequence[str], extra_fields: Sequence[Mapping[str, Any]], scores: Sequence[float]) -> dict:
    """Means over the trajectories of a batch, under ``infmem/...`` names.

    ``keys``, ``extra_fields`` and ``scores`` (each sequence's reward) are aligned, padding rows
    excluded. Every sequence of a trajectory carries the trajectory's reward and
    ``reward_extra_info``; the final sequence (highest index) is read. ``llm_calls`` sums the
    generate calls of all sequences; ``stop_step`` averages over the trajectories that stopped
    (NaN when none did), ``stopped`` is the fraction that stopped.
    """
    sessions: dict[str, list[int]] = defaultdict(list)
    for row, key in enumerate(keys):
        sessions[session_and_index(key)[0]].append(row)
    totals: dict[str, float] = defaultdict(float)
    stop_steps = []
    for rows in sessions.values():
        final = max(rows, key=lambda r: session_and_index(keys[r])[1])
        facts = [TurnFacts.from_dict(extra_fields[r], f"sequence {keys[r]}") for r in rows]
        for name, value in extra_fields[final].get("reward_extra_info", {}).items():
            totals[name] += float(value)
        totals["reward"] += float(scores[final])
        totals["llm_calls"] += sum(f.llm_calls for f in facts)
        stop = facts[0].stop_step
        totals["stopped"] += stop is not None
        if stop is not None:
            stop_steps.append(stop)
    count = len(sessions)
    out = {f"{PREFIX}/{name}": value / count for name, value in totals.items()}
    out[f"{PREFIX}/stop_step"] = sum(stop_steps) / len(stop_steps) if stop_steps else math.nan
    out[f"{PREFIX}/trajectories"] = float(count)
    return out


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
            f"[infmem cpu] step {step}/{total}",
            f"reward {ours('reward')} ({parts})",
            f"acc {ours('acc')}",
            f"chunks read {ours('chunks_read', '.1f')}/{ours('num_chunks', '.1f')}",
            f"stopped {stopped:.0f}/{trajectories:.0f} at step {ours('stop_step', '.1f')}",
            f"llm calls {ours('llm_calls', '.1f')}/traj",
            f"optimizer steps {verls('actor/optimizer_steps', '.0f')}",
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
    return f"[infmem cpu] validation | {shown or 'no metrics'}"
