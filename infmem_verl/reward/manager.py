"""The ``infmem`` reward manager: scores a whole multi-sequence trajectory in verl's reward loop.

verl 0.9.1's v1 agent-loop worker calls the reward loop once per trajectory with a ``DataProto``
holding every sequence of that trajectory (one per LLM call, answer last), then copies the score
to all of them. Built-in managers score only the last sequence; this one rebuilds the trajectory
from the per-turn facts the agent loop stored in ``extra_fields`` and sums the configured
components (:mod:`infmem_verl.reward.components`).

``reward.custom_reward_function`` keeps verl's meaning: when set, it scores the outcome (it gets
verl's usual ``data_source, solution_str, ground_truth, extra_info``; ``extra_info["turns"]`` adds
the turn facts) in place of the ``outcome`` component.

Every trajectory returns the same ``reward_extra_info`` keys (verl stacks them across
trajectories): ``acc`` (the outcome, so validation reports accuracy), one key per component, the
answer metrics, and the trajectory's figures (:mod:`infmem_verl.metrics`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from infmem_verl.metrics import trajectory_values
from infmem_verl.reward.components import Component, TrajectoryRecord, load_components
from infmem_verl.reward.metrics import score_answer
from infmem_verl.agent.facts import TurnFacts

OUTCOME = "outcome"


@register("infmem")
class InfMemRewardManager(RewardManagerBase):
    """Weighted sum of trajectory-level reward components (see module docstring)."""

    def __init__(self, config, tokenizer, compute_score, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)
        self.components: list[Component] = load_components(config.infmem.reward.components)
        # verl passes its default scorer when no custom function is set; only a configured path
        # means the user wants their own outcome.
        has_custom = bool(config.reward.custom_reward_function.get("path"))
        self.custom_outcome = compute_score if has_custom else None

    async def run_single(self, data: DataProto) -> dict:
        record = trajectory_record(data, self.tokenizer)
        custom = self.custom_outcome is not None and any(c.name == OUTCOME for c in self.components)
        outcome = await self._custom_outcome(record) if custom else None
        tokens = (data.non_tensor_batch["prompt_len"], data.non_tensor_batch["response_len"])
        return score_trajectory(self.components, record, *tokens, outcome=outcome)

    async def _custom_outcome(self, record: TrajectoryRecord) -> float:
        kwargs = dict(
            data_source=record.data_source,
            solution_str=record.solution_str,
            ground_truth=record.golds,
            extra_info={**record.extra_info, "turns": [t.to_dict() for t in record.turns]},
        )
        if inspect.iscoroutinefunction(self.custom_outcome):  # also true for verl's partial wrapper
            result = await self.custom_outcome(**kwargs)
        else:
            result = await self.loop.run_in_executor(None, lambda: self.custom_outcome(**kwargs))
        return float(result["score"] if isinstance(result, dict) else result)


def trajectory_record(data: DataProto, tokenizer) -> TrajectoryRecord:
    """The trajectory held by ``data`` (one row per LLM call, answer last, as verl builds it)."""
    if len(data) == 0:
        raise ValueError("data: empty trajectory")
    non_tensor = data.non_tensor_batch
    for key in ("tool_extra_fields", "reward_model", "prompt_len", "response_len"):
        if key not in non_tensor:
            raise ValueError(
                f"data.non_tensor_batch lacks {key!r} (has {sorted(non_tensor)}); the infmem reward manager "
                "scores whole trajectories from the agent-loop worker (rule-based reward, not a colocated reward model)"
            )
    last = len(data) - 1
    response = data.batch["responses"][last][: int(non_tensor["response_len"][last])]
    sample = {key: non_tensor[key][last] for key in ("reward_model", "data_source", "extra_info") if key in non_tensor}
    return build_record(non_tensor["tool_extra_fields"], sample, response.tolist(), tokenizer)


def build_record(facts: Sequence[Mapping], sample: Mapping[str, Any], answer_ids: Sequence[int], tokenizer) -> TrajectoryRecord:
    """A trajectory's record from its turns' facts (answer last), its dataset row's columns
    (``reward_model``, optional ``data_source`` and ``extra_info``) and the final response's ids:
    what the reward manager rebuilds from verl's batch and the agent loop has at hand."""
    turns = [TurnFacts.from_dict(f, f"row {i}") for i, f in enumerate(facts)]
    return TrajectoryRecord(
        turns=turns,
        golds=gold_answers(sample["reward_model"]),
        solution_str=tokenizer.decode(list(answer_ids), skip_special_tokens=True),
        data_source=str(sample["data_source"]) if "data_source" in sample else "unknown",
        extra_info=dict(sample.get("extra_info") or {}),
    )


def score_trajectory(
    components: Sequence[Component],
    record: TrajectoryRecord,
    prompt_tokens: Sequence[int],
    response_tokens: Sequence[int],
    outcome: float | None = None,
) -> dict:
    """``{"reward_score", "reward_extra_info"}`` of one trajectory: the weighted sum of ``components``
    (``outcome``, when given, replaces the outcome component: a custom reward function's score)."""
    scores = {
        c.name: outcome if c.name == OUTCOME and outcome is not None else c.score(record) for c in components
    }
    reward = sum(c.weight * scores[c.name] for c in components)
    return {"reward_score": float(reward), "reward_extra_info": extra_info(record, scores, prompt_tokens, response_tokens)}


def gold_answers(reward_model: Any) -> list[str]:
    """``reward_model["ground_truth"]`` as a list of strings (a single string is one answer)."""
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if isinstance(truth, str):
        truth = [truth]
    elif isinstance(truth, np.ndarray):
        truth = truth.tolist()
    if not isinstance(truth, list | tuple) or not truth or not all(isinstance(g, str) for g in truth):
        raise ValueError(f"reward_model.ground_truth: expected a string or a non-empty list of strings, got {truth!r}")
    return list(truth)


def extra_info(
    record: TrajectoryRecord, scores: dict[str, float], prompt_tokens: Sequence[int], response_tokens: Sequence[int]
) -> dict[str, float | None]:
    """The logged facts of one trajectory; the same keys for every trajectory of a run.

    ``acc`` (the outcome), the components, the answer metrics, and the trajectory's reading,
    stopping, retrieval, protocol, memory, call and token figures
    (:func:`infmem_verl.metrics.trajectory_values`, one definition for training and validation;
    ``None`` where a trajectory has no value, e.g. the stop step of one that never stopped).
    """
    answer = score_answer(record.prediction, record.golds)
    return {
        "acc": scores.get(OUTCOME, answer["em"]),
        **scores,
        **answer,
        **trajectory_values(record, prompt_tokens, response_tokens),
    }
