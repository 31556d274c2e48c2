"""The token-in / token-out interface every model backend implements.

The agent loops only ever talk to a :class:`Policy`: verl's server client (training), an
OpenAI-compatible HTTP server (evaluation, distillation) and an in-process transformers model
(CPU, tests) all implement it, so one loop serves every use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings. ``temperature == 0`` means greedy decoding."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Generation:
    """What one generate call returns.

    ``log_probs[i]`` is the log-probability of ``token_ids[i]`` under the sampling distribution
    (logits divided by the temperature, as verl's actor recomputes them); ``None`` when the
    backend was not asked for them. ``finish_reason`` is ``"stop"`` when the model emitted an end
    token, which is then the last element of ``token_ids`` (training must see it, so that the
    model learns to stop); ``"length"`` when ``max_tokens`` ran out.
    ``extra`` carries backend facts that must travel with the turn (e.g. verl's global-step
    fields of ``TokenOutput``).
    """

    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: FinishReason
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    """An async language model that continues a prompt given as token ids."""

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation: ...
