"""Per-turn facts that travel with every training sequence, from the agent loop to the reward.

verl carries one free-form dict per sequence (``AgentLoopOutput.extra_fields``) to the reward
manager (as ``non_tensor_batch["tool_extra_fields"]``) and into TransferQueue. The agent loop writes
a :class:`TurnFacts` there for each LLM call; the reward manager rebuilds them to score the whole
trajectory. Keeping the schema in one dataclass means the writer and the reader cannot drift.

Pure Python (no verl import): the reward components and their tests use it on their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from infmem_verl.agent.trajectory import Trajectory, Turn

# verl's TokenOutput step fields, copied per sequence: the v1 trainer reads min/max_global_steps
# from every sequence's extra_fields to compute its off-policy staleness metrics.
STEP_FIELDS = ("global_steps", "min_global_steps", "max_global_steps")


@dataclass
class TurnFacts:
    """What the reward and the logs need to know about one LLM call of a trajectory.

    Trajectory-level facts (``agent``, ``num_chunks``, ``stop_step``) are repeated on every turn so
    that any single sequence is self-describing. ``memory_text`` is the memory after a Write
    (``None`` on other turns); ``prediction`` is the parsed final answer on the Answer turn.
    """

    agent: str
    turn_index: int
    turn_kind: str  # "prethink" | "write" | "answer"
    chunk_index: int
    num_chunks: int
    stop_step: int | None  # chunks read when the controller stopped; None when it read them all
    valid: bool
    llm_calls: int = 1  # generate calls behind this sequence (2 for a two-stage thinking call)
    prefill_tokens: int = 0  # prompt tokens sent over those calls (the cost ledger's prefill)
    flags: list[str] = field(default_factory=list)
    action: str | None = None  # PreThink decision: "retrieve" | "stop" | "continue"
    # PreThink: the retrieval asked for and the units it returned; why an invalid turn is invalid.
    # Small, and what a person reading a training trajectory wants (python -m infmem_verl.inspect).
    query: str | None = None
    top_k: int | None = None
    retrieved_units: list[int] = field(default_factory=list)
    reason: str = ""
    memory_tokens: int = 0
    retrieval_s: float = 0.0  # wall time of the turn's retrieval (PreThink turns that retrieved)
    generate_s: float = 0.0  # wall time the turn awaited its generate calls
    rollout_s: float = 0.0  # wall time of the whole trajectory (trajectory-level, on every turn)
    memory_text: str | None = None
    prediction: str | None = None
    global_steps: int | None = None
    min_global_steps: int | None = None
    max_global_steps: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "turn") -> TurnFacts:
        """Rebuild from an ``extra_fields`` dict, ignoring keys verl itself adds there."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected the turn facts dict in extra_fields, got {type(data).__name__}")
        missing = [name for name in _REQUIRED if name not in data]
        if missing:
            raise ValueError(
                f"{where}: extra_fields lack turn facts {missing}; was it produced by an infmem agent loop?"
            )
        kwargs = {k: v for k, v in data.items() if k in _FIELDS}
        kwargs["flags"] = list(kwargs.get("flags") or [])
        kwargs["retrieved_units"] = [int(u) for u in kwargs.get("retrieved_units") or []]
        return cls(**kwargs)


_FIELDS = frozenset(f.name for f in dataclasses.fields(TurnFacts))
_REQUIRED = tuple(
    f.name
    for f in dataclasses.fields(TurnFacts)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)


def turn_facts(trajectory: Trajectory, index: int, turn: Turn) -> TurnFacts:
    """The facts of ``trajectory.turns[index]``, with verl's step fields from the turn's backend extras."""
    steps = {name: _optional_int(turn.extra.get(name)) for name in STEP_FIELDS}
    return TurnFacts(
        agent=trajectory.agent,
        turn_index=index,
        turn_kind=turn.kind,
        chunk_index=turn.chunk_index,
        num_chunks=trajectory.num_chunks,
        stop_step=trajectory.stop_step,
        valid=bool(turn.valid),
        llm_calls=int(turn.llm_calls),
        prefill_tokens=int(turn.prefill_tokens),
        flags=list(turn.flags),
        action=turn.action.kind if turn.action is not None else None,
        query=turn.action.query if turn.action is not None else None,
        top_k=turn.action.top_k if turn.action is not None else None,
        retrieved_units=[int(u) for u in turn.retrieved_units] if turn.kind == "prethink" else [],
        reason=turn.reason,
        memory_tokens=int(turn.memory_tokens),
        retrieval_s=float(turn.retrieval_s),
        generate_s=float(turn.generate_s),
        rollout_s=float(trajectory.rollout_s),
        memory_text=turn.memory_text if turn.kind == "write" else None,
        prediction=trajectory.prediction if turn.kind == "answer" else None,
        **steps,
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
