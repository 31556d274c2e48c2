"""Reward components: functions that score one whole trajectory, chosen by dotted path.

The ``infmem`` reward manager sums ``weight * component(record, **kwargs)`` over the components
configured under ``infmem.reward.components`` (name -> ``{_target_, weight, **kwargs}``), so a user
swaps or adds a component by naming any importable function; nothing here needs to change.

A component takes a :class:`TrajectoryRecord` and returns a float. The three built-ins:

* :func:`outcome` - EM (default, what the reference trains on), F1 or sub-EM of the boxed answer
  against all gold answers.
* :func:`early_stop` - the reference's reward for stopping soon after the gold answer entered
  memory, ``gamma ** (d - 1)`` (spec section 4.2), with its flaws fixed (spec 8.1 item 5): ``d``
  is counted per sample, the answer is matched on word boundaries (so "no" is not found in
  "not"), yes/no golds never count as found, and the answer must still be in memory when the
  agent stops. By default it is paid only when the final answer is correct (EM): ungated, as in
  the reference, a policy can collect it by filling the memory with candidate answers and
  stopping at once, whatever it answers.
* :func:`protocol` - 0.5 when every PreThink action parsed, plus 0.5 when every Write closed its
  thinking and produced a memory within the cap (the reference's ``fc_ok`` and ``mem_ok``).

Pure Python (no verl import), so the components are unit-testable and usable in evaluation.
"""

from __future__ import annotations

import importlib
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.trajectory import (
    FLAG_INVALID_ACTION,
    FLAG_MEMORY_KEPT,
    FLAG_MEMORY_TRUNCATED,
    FLAG_OUTPUT_TRUNCATED,
    FLAG_THINK_CLOSED_BY_LOOP,
    FLAG_THINK_UNCLOSED,
)
from infmem_verl.reward.metrics import ANSWER_METRICS, answer_in_text, is_yes_no, score_answer
from infmem_verl.agent.facts import TurnFacts

# A Write with any of these did not close its thinking, or did not leave a memory within the cap.
MEMORY_FAILURES = frozenset(
    {FLAG_THINK_UNCLOSED, FLAG_THINK_CLOSED_BY_LOOP, FLAG_MEMORY_TRUNCATED, FLAG_OUTPUT_TRUNCATED, FLAG_MEMORY_KEPT}
)


@dataclass
class TrajectoryRecord:
    """One trajectory as the reward sees it: its turns in order (answer last) and the golds.

    ``solution_str`` is the decoded response of the final sequence, what verl hands a
    ``reward.custom_reward_function`` as ``solution_str``.
    """

    turns: list[TurnFacts]
    golds: list[str]
    solution_str: str = ""
    data_source: str = "unknown"
    extra_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError("turns: a trajectory has at least its answer turn")

    @property
    def prediction(self) -> str | None:
        """The parsed final answer; None when the last turn is not an answer or had none."""
        last = self.turns[-1]
        return last.prediction if last.turn_kind == "answer" else None

    @property
    def writes(self) -> list[TurnFacts]:
        return [t for t in self.turns if t.turn_kind == "write"]

    @property
    def chunks_read(self) -> int:
        return len(self.writes)

    @property
    def stop_step(self) -> int | None:
        return self.turns[-1].stop_step

    @property
    def num_chunks(self) -> int:
        return self.turns[-1].num_chunks


def outcome(record: TrajectoryRecord, metric: str = "em") -> float:
    """The final answer's score under ``metric`` (em, f1, sub_em, sub_em_strict), best over golds."""
    if metric not in ANSWER_METRICS:
        raise ValueError(f"metric: expected one of {list(ANSWER_METRICS)}, got {metric!r}")
    return score_answer(record.prediction, record.golds)[metric]


def early_stop(record: TrajectoryRecord, gamma: float = 0.6, gate: str = "em", gate_min: float = 1.0) -> float:
    """``gamma ** (d - 1)`` for reading ``d`` chunks from the answer's first appearance in memory.

    With ``f`` the 0-based index of the first Write whose memory contains a gold answer (whole
    words; yes/no golds are never found) and ``s`` the number of Writes when reading ended (the
    stop step, or every chunk when the agent never stopped), ``d = s - f >= 1``: stopping right
    after the answer arrived scores 1. Zero when the answer never entered memory, when it is no
    longer in memory at the end, or when the final answer scores below ``gate_min`` under the
    metric ``gate`` (one of :data:`ANSWER_METRICS`; ``"none"``: ungated, the reference's formula).
    """
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma: expected a number in (0, 1], got {gamma!r}")
    if gate != "none" and gate not in ANSWER_METRICS:
        raise ValueError(f"gate: expected 'none' or one of {list(ANSWER_METRICS)}, got {gate!r}")
    if isinstance(gate_min, bool) or not isinstance(gate_min, numbers.Real) or not 0 < gate_min <= 1:
        raise ValueError(f"gate_min: expected a number in (0, 1], got {gate_min!r}")
    writes = record.writes
    holds = [answer_in_memory(w.memory_text, record.golds) for w in writes]
    if not any(holds) or not holds[-1]:
        return 0.0
    if gate != "none" and score_answer(record.prediction, record.golds)[gate] < gate_min:
        return 0.0
    distance = len(writes) - holds.index(True)
    return float(gamma ** (distance - 1))


def protocol(record: TrajectoryRecord) -> float:
    """0.5 if every PreThink action parsed + 0.5 if every Write left a closed, capped memory."""
    actions_ok = not any(action_failed(t) for t in record.turns)
    memories_ok = not any(memory_failed(t) for t in record.turns)
    return 0.5 * actions_ok + 0.5 * memories_ok


def action_failed(turn: TurnFacts) -> bool:
    """A PreThink whose output had no valid action (the controller fell back to a default)."""
    return turn.turn_kind == "prethink" and (not turn.valid or FLAG_INVALID_ACTION in turn.flags)


def memory_failed(turn: TurnFacts) -> bool:
    """A Write that did not close its thinking or did not leave a memory within the cap."""
    return turn.turn_kind == "write" and bool(MEMORY_FAILURES.intersection(turn.flags))


def breaks_protocol(turn: TurnFacts) -> bool:
    """The turn the protocol reward (and the per-turn penalty of the trainer) holds responsible."""
    return action_failed(turn) or memory_failed(turn)


def answer_in_memory(memory: str | None, golds: list[str]) -> bool:
    """A gold answer (not yes/no) stands in ``memory`` as whole words."""
    return bool(memory) and any(answer_in_text(gold, memory) for gold in golds if not is_yes_no(gold))


BUILT_INS = (outcome, early_stop, protocol)


@dataclass
class Component:
    """A configured component: ``weight * fn(record, **kwargs)``."""

    name: str
    fn: Callable[..., float]
    weight: float
    kwargs: dict[str, Any] = field(default_factory=dict)

    def score(self, record: TrajectoryRecord) -> float:
        value = self.fn(record, **self.kwargs)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"reward component {self.name!r} returned {value!r}; expected a number")
        return float(value)


def load_components(specs: Mapping[str, Mapping[str, Any]], path: str = "infmem.reward.components") -> list[Component]:
    """Components from their config (name -> ``{_target_, weight, **kwargs}``), imported and checked.

    Raises :class:`ConfigError` naming the component's key when ``_target_`` is missing or cannot
    be imported, or ``weight`` is not a number.
    """
    if not specs:
        raise ConfigError(f"{path}: expected at least one reward component (choose a reward_fn preset)")
    components = []
    for name, spec in specs.items():
        where = f"{path}.{name}"
        if not isinstance(spec, Mapping) or "_target_" not in spec:
            raise ConfigError(f"{where}: expected a mapping with _target_ (dotted path of a function), got {spec!r}")
        kwargs = {k: v for k, v in spec.items() if k not in ("_target_", "weight")}
        weight = spec.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise ConfigError(f"{where}.weight: expected a number, got {weight!r}")
        components.append(
            Component(str(name), import_target(spec["_target_"], f"{where}._target_"), float(weight), kwargs)
        )
    return components


def import_target(target: Any, where: str) -> Callable[..., Any]:
    """The callable at dotted path ``target`` ("package.module.function"), or ConfigError naming ``where``."""
    if not isinstance(target, str) or "." not in target:
        raise ConfigError(f"{where}: expected a dotted path 'package.module.function', got {target!r}")
    module_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{where}: cannot import module {module_name!r} of {target!r} ({exc}); built-in components: "
            f"{[f'{__name__}.{fn.__name__}' for fn in BUILT_INS]}"
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(f"{where}: {module_name!r} has no function {attr!r}; available: {available}")
    return fn
