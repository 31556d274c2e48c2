"""Records of what an agent did: one :class:`Turn` per LLM call, gathered in a :class:`Trajectory`.

Every consumer reads these records: verl's agent loop turns each turn into a training sequence,
the reward manager scores the trajectory, evaluation and distillation write them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

TurnKind = Literal["prethink", "write", "answer"]
TURN_KINDS: tuple[TurnKind, ...] = get_args(TurnKind)

# Flags a turn may carry. A flagged turn is still a turn: no model output makes a loop raise.
FLAG_INVALID_ACTION = "invalid_action"  # PreThink output had no parsable action after </think>
FLAG_TOPK_CLAMPED = "top_k_clamped"  # an integer top_k outside the configured range was clamped
FLAG_THINK_CLOSED_BY_LOOP = "think_closed_by_loop"  # two-stage: the loop appended </think>
FLAG_THINK_UNCLOSED = "think_unclosed"  # single-pass: thinking never closed, output unusable
FLAG_MEMORY_TRUNCATED = "memory_truncated"  # memory longer than the cap, cut to it
FLAG_MEMORY_KEPT = "memory_kept"  # the Write produced no usable memory; the old one was kept
FLAG_OUTPUT_TRUNCATED = "output_truncated"  # the output budget ran out before the end token
FLAG_NO_ANSWER = "no_answer"  # Answer turn without a parsable final answer
FLAG_EVIDENCE_SHORTENED = "evidence_shortened"  # prompt budget: retrieved evidence cut
FLAG_CHUNK_SHORTENED = "chunk_shortened"  # prompt budget: chunk text cut


@dataclass
class Action:
    """A controller decision parsed from a PreThink output.

    ``kind`` is ``"retrieve"``, ``"stop"`` or ``"continue"`` (read on without retrieval: the
    fallback for invalid outputs under ``invalid_action="continue"``). ``valid`` is False when the
    output did not follow the grammar and ``reason`` says why; ``clamped`` marks an integer top_k
    that was moved into the configured range; ``restarts_votes`` marks a stop vote that restarts
    the count of consecutive votes at 1 (a no-call output under ``controller.no_call_stops``).
    """

    kind: Literal["retrieve", "stop", "continue"]
    query: str | None = None
    top_k: int | None = None
    valid: bool = True
    reason: str = ""
    clamped: bool = False
    restarts_votes: bool = False


@dataclass
class Turn:
    """One LLM call of a trajectory.

    ``response_ids`` holds every token of the response including tokens the loop injected
    (``response_mask`` 0 there, 1 on model tokens); ``log_probs`` has one value per response
    token (0.0 on injected tokens). Token arrays are numpy int32 and are ``None`` when the agent
    runs with ``record_token_ids=False``; the counts are always kept.
    """

    kind: TurnKind
    chunk_index: int  # chunk about to be read (prethink/write); chunks read so far (answer)
    prompt_ids: np.ndarray | None
    response_ids: np.ndarray | None
    response_mask: np.ndarray | None
    log_probs: np.ndarray | None
    prompt_tokens: int
    response_tokens: int
    generated_tokens: int  # model-generated tokens (response minus injected)
    finish_reason: str
    llm_calls: int  # generate calls behind this turn (2 for a two-stage call)
    prefill_tokens: int = 0  # prompt tokens of all those calls (a continuation resends prompt + thinking)
    valid: bool = True
    flags: list[str] = field(default_factory=list)
    reason: str = ""
    text: str = ""  # the output part after </think> (action / memory / answer text)
    action: Action | None = None
    retrieved_units: list[int] = field(default_factory=list)
    retrieval_s: float = 0.0  # wall time of this PreThink's search (the dense stage's embedding included)
    memory_text: str | None = None  # memory after this turn (write turns)
    memory_tokens: int = 0
    latency_s: float = 0.0
    generate_s: float = 0.0  # of latency_s, the time awaiting the policy's generate calls
    extra: dict[str, Any] = field(default_factory=dict)  # backend facts (e.g. verl step fields)


@dataclass
class TrajectorySummary:
    num_chunks: int
    chunks_read: int
    stopped_early: bool
    stop_step: int | None  # chunks read when the controller stopped; None when it never did
    llm_calls: int
    turns: int
    prompt_tokens: int
    response_tokens: int
    retrieval_calls: int
    invalid_turns: int


@dataclass
class Trajectory:
    """All turns of one agent run on one sample, the answer turn last."""

    agent: Literal["infmem", "memagent"]
    question: str
    turns: list[Turn] = field(repr=False)  # megabytes for a 1M-token run; summary() says it short
    num_chunks: int
    stop_step: int | None
    answer_text: str  # the answer turn's output (after </think>)
    prediction: str | None  # parsed final answer; None when absent (flagged on the answer turn)
    # Wall time of the whole rollout, document preparation included (the rollout-efficiency
    # figure's denominator; the verl agent loop adds the document's resolution).
    rollout_s: float = 0.0

    @property
    def chunks_read(self) -> int:
        return sum(1 for t in self.turns if t.kind == "write")

    def summary(self) -> TrajectorySummary:
        return TrajectorySummary(
            num_chunks=self.num_chunks,
            chunks_read=self.chunks_read,
            stopped_early=self.stop_step is not None and self.stop_step < self.num_chunks,
            stop_step=self.stop_step,
            llm_calls=sum(t.llm_calls for t in self.turns),
            turns=len(self.turns),
            prompt_tokens=sum(t.prompt_tokens for t in self.turns),
            response_tokens=sum(t.response_tokens for t in self.turns),
            retrieval_calls=sum(1 for t in self.turns if t.action is not None and t.action.kind == "retrieve"),
            invalid_turns=sum(1 for t in self.turns if not t.valid),
        )
