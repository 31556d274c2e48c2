"""Trajectory-level metrics of memory-agent runs: one definition for training, validation and logs.

verl's v1 trainer logs statistics over *rows*, and a memory-agent trajectory is many rows (one
per LLM call, about two per chunk read): its ``critic/score/mean`` weighs a trajectory that read
the whole document several times more than one that stopped early, and it does not log the
reward manager's ``reward_extra_info`` during training at all. Here every value is computed per
trajectory from its per-turn facts (:class:`~infmem_verl.agent.facts.TurnFacts`, in each
sequence's ``extra_fields``) and only then averaged over trajectories:

* :func:`trajectory_values` - one trajectory's reading, stopping, retrieval, protocol, memory,
  call and token figures. The ``infmem`` reward manager adds them to ``reward_extra_info``, so
  verl's own validation (which keeps the final sequence per trajectory) reports them per
  trajectory; the trainer modes compute them per training step from TransferQueue.
* :func:`summarize` - a batch of per-trajectory values as logged metrics: means, and protocol
  error rates per turn kind (errors over turns of that kind, pooled over the batch).
* :func:`log_prob_gap` - how far the trainer's recomputed log-probs are from the rollout's.

Pure Python and torch (no verl import): the reward manager, both trainer modes and tests share it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from infmem_verl.agent.trajectory import TURN_KINDS
from infmem_verl.reward.components import TrajectoryRecord, breaks_protocol
from infmem_verl.agent.facts import TurnFacts

PREFIX = "infmem"
# Per-trajectory counts that only make sense pooled into a rate (see summarize), never averaged.
_ERRORS = tuple(f"{kind}_errors" for kind in TURN_KINDS)


def protocol_error(turn: TurnFacts) -> bool:
    """A turn that broke the protocol: what the reward holds against it, or an unusable output.

    PreThink without a valid action, Write without a closed, capped memory
    (:func:`~infmem_verl.reward.components.breaks_protocol`), or any turn the agent marked invalid
    (an Answer without a parsable final answer).
    """
    return breaks_protocol(turn) or not turn.valid


def trajectory_values(
    record: TrajectoryRecord, prompt_tokens: Sequence[int], response_tokens: Sequence[int]
) -> dict[str, float | None]:
    """The figures of one trajectory, from its record (turns in order, answer last) and its turns'
    token counts.

    Every trajectory gets the same keys (verl gathers ``reward_extra_info`` across trajectories);
    ``None`` marks a value the trajectory does not have, left out of means:

    * ``chunks_read``, ``num_chunks``, ``read_fraction``;
    * ``stop_step`` - chunks read when the controller stopped, ``None`` when it never did (so a mean
      is over the trajectories that stopped); ``stopped`` (the controller stopped) and
      ``stopped_early`` (before the last chunk);
    * ``retrieval_calls`` - PreThink turns that retrieved; ``retrieval_s`` - seconds they spent
      searching (BM25, and the dense stage's query-time embedding when it is on);
    * ``generate_s`` - seconds the turns awaited their generate calls; ``rollout_s`` - the
      trajectory's wall time (0 in records from before it was recorded);
    * ``llm_calls`` (generate calls; a two-stage thinking call is two) and ``llm_sequences``
      (training sequences); ``prompt_tokens``, ``response_tokens``, ``tokens`` summed over turns;
    * ``memory_tokens`` - the final memory's size (0 before any Write);
    * ``invalid_turns``, ``has_answer``, and per turn kind ``<kind>_turns`` and ``<kind>_errors``
      (:func:`protocol_error`).
    """
    turns = record.turns
    if not len(turns) == len(prompt_tokens) == len(response_tokens):
        raise ValueError(
            f"prompt_tokens / response_tokens: expected one count per turn ({len(turns)}), "
            f"got {len(prompt_tokens)} / {len(response_tokens)}"
        )
    writes, num_chunks, stop = record.writes, record.num_chunks, record.stop_step
    values = {
        "chunks_read": float(len(writes)),
        "num_chunks": float(num_chunks),
        "read_fraction": len(writes) / max(num_chunks, 1),
        "stop_step": float(stop) if stop is not None else None,
        "stopped": float(stop is not None),
        "stopped_early": float(stop is not None and stop < num_chunks),
        "retrieval_calls": float(sum(t.action == "retrieve" for t in turns)),
        "retrieval_s": float(sum(t.retrieval_s for t in turns)),
        "generate_s": float(sum(t.generate_s for t in turns)),
        "rollout_s": float(max((t.rollout_s for t in turns), default=0.0)),
        "llm_calls": float(sum(t.llm_calls for t in turns)),
        "llm_sequences": float(len(turns)),
        "prompt_tokens": float(sum(prompt_tokens)),
        "response_tokens": float(sum(response_tokens)),
        "tokens": float(sum(prompt_tokens) + sum(response_tokens)),
        "memory_tokens": float(writes[-1].memory_tokens if writes else 0),
        "invalid_turns": float(sum(not t.valid for t in turns)),
        "has_answer": float(record.prediction is not None),
    }
    for kind in TURN_KINDS:
        of_kind = [t for t in turns if t.turn_kind == kind]
        values[f"{kind}_turns"] = float(len(of_kind))
        values[f"{kind}_errors"] = float(sum(protocol_error(t) for t in of_kind))
    return values


def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``values`` that are finite numbers (tensors and numpy scalars too), as floats.

    ``reward_extra_info`` is free-form (a custom reward may add text or leave a value out), and a
    NaN would poison every mean it enters, so anything else is left out.
    """
    out = {}
    for name, value in values.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):  # text, None, lists, multi-element tensors
            continue
        if math.isfinite(number):
            out[name] = number
    return out


def summarize(trajectories: Sequence[Mapping[str, Any]], prefix: str = PREFIX) -> dict[str, float]:
    """Batch metrics ``<prefix>/<name>`` from per-trajectory values (e.g. :func:`trajectory_values`
    merged with the reward and its components).

    Each name is averaged over the trajectories that have it as a finite number (:func:`numeric`).
    Protocol errors become ``<prefix>/protocol_error_rate/<kind>``: errors over turns of that kind
    in the whole batch, so a trajectory with more turns of a kind counts more, as a rate
    per turn should; absent when the batch has no turn of that kind (MemAgent has no PreThink).
    ``<prefix>/rollout/efficiency`` is :func:`rollout_efficiency` (absent without rollout times);
    ``<prefix>/trajectories`` is the count.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for values in trajectories:
        for name, value in numeric(values).items():
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    out = {f"{prefix}/{name}": sums[name] / counts[name] for name in sums if name not in _ERRORS}
    for kind in TURN_KINDS:
        turns = sums.get(f"{kind}_turns", 0.0)
        if turns > 0:
            out[f"{prefix}/protocol_error_rate/{kind}"] = sums.get(f"{kind}_errors", 0.0) / turns
    efficiency = rollout_efficiency(trajectories)
    if efficiency is not None:
        out[f"{prefix}/rollout/efficiency"] = efficiency
    out[f"{prefix}/trajectories"] = float(len(trajectories))
    return out


def rollout_efficiency(trajectories: Sequence[Mapping[str, Any]]) -> float | None:
    """Time the trajectories spent awaiting generate calls over their wall time, pooled over the
    batch (``generate_s`` and ``rollout_s`` of :func:`trajectory_values`); None when none has a
    rollout time.

    A trajectory has at most one call in flight, so this is the share of the rollout during which
    its request occupies the server, against a raw client that sends the same calls back to back:
    ``python -m bench.rollout`` measures that ratio by replaying the calls and prints this
    estimate beside it. What it misses is our code between calls (document preparation,
    retrieval, prompts, parsing, the client) and the event loop keeping a ready call waiting.
    """
    pairs = [numeric(t) for t in trajectories]
    total = sum(p.get("rollout_s", 0.0) for p in pairs)
    if total <= 0:
        return None
    return sum(p.get("generate_s", 0.0) for p in pairs if p.get("rollout_s", 0.0) > 0) / total


def log_prob_gap(
    trainer_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """``|trainer - rollout|`` per trained token (mask 1), in log space: mean and max.

    The rollout engine samples with its own numerics (vLLM kernels, bfloat16); a growing gap
    means the update trains on a policy other than the one that sampled. Tensors are padded
    ``(rows, response_length)``; an empty mask gives no metrics.
    """
    mask = response_mask.bool()
    if not mask.any():
        return {}
    gap = (trainer_log_probs.float() - rollout_log_probs.float()).abs()[mask]
    return {f"{PREFIX}/log_prob_gap/mean": float(gap.mean()), f"{PREFIX}/log_prob_gap/max": float(gap.max())}
