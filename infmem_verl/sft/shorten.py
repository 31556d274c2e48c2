"""Shortening over-long thinking in distilled calls (an option of the reference, spec §5.1).

The reference had a second model rewrite the ``<think>`` body of long assistant turns (over 512
tokens, or closed by the forced-stop sentence) to about a third of its length, checked that the
text after ``</think>`` was unchanged, and trained on the rewrites for every call but PreThink
(the checkpoint ``..._thinking_shorter_mixed_traj_distilled``). Here the teacher endpoint does the
rewrite, thinking off and greedy, and only the thinking tokens are replaced: the new response is
``<think>\\n{rewrite}\\n</think>`` followed by the original tokens after the first ``</think>``,
unchanged to the token. All of it is trained, the closing tag too (the student learns to close
its thinking itself rather than being cut by the loop).

A rewrite is kept only when the teacher finished it (end token, not the budget), it is not
empty, holds no think tags and is shorter than the original; otherwise the turn keeps its
original response and the reason is recorded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from infmem_verl.agent.policy import Policy, SamplingParams
from infmem_verl.agent.protocol import THINK_END, THINK_START, encode_text, think_end_token_id
from infmem_verl.agent.trajectory import FLAG_THINK_CLOSED_BY_LOOP, TURN_KINDS

from .records import TurnRecord

# The least output budget a rewrite gets, whatever the ratio.
_MIN_BUDGET = 16


@dataclass(frozen=True)
class ShortenConfig:
    """When and how to rewrite a turn's thinking.

    ``over_tokens``: rewrite thinking longer than this many tokens (None: the option is off);
    ``closed_by_loop``: also rewrite thinking the loop had to close (the reference's forced stop);
    ``ratio``: target length as a fraction of the original; ``kinds``: the calls to rewrite (the
    reference's mix kept PreThink calls original).
    """

    over_tokens: int | None = None
    closed_by_loop: bool = True
    ratio: float = 0.33
    kinds: tuple[str, ...] = ("write", "answer")

    @property
    def enabled(self) -> bool:
        return self.over_tokens is not None

    def validate(self) -> ShortenConfig:
        if self.over_tokens is not None and (isinstance(self.over_tokens, bool) or self.over_tokens < 1):
            raise ValueError(f"shorten.over_tokens: expected an integer >= 1 or None, got {self.over_tokens!r}")
        if not 0 < self.ratio < 1:
            raise ValueError(f"shorten.ratio: expected a number in (0, 1), got {self.ratio!r}")
        unknown = [k for k in self.kinds if k not in TURN_KINDS]
        if unknown or not self.kinds:
            raise ValueError(f"shorten.kinds: expected some of {list(TURN_KINDS)}, got {list(self.kinds)}")
        return self


@dataclass
class ShortenOutcome:
    """What happened to one turn: rewritten, or why not."""

    shortened: bool
    reason: str = ""


class ThinkingShortener:
    """Rewrites the thinking of distilled turns through a policy (see the module docstring)."""

    def __init__(self, tokenizer, cfg: ShortenConfig) -> None:
        self.tokenizer = tokenizer
        self.cfg = cfg.validate()
        think_end = think_end_token_id(tokenizer)
        if think_end is None:
            raise ValueError("shorten: the tokenizer has no '</think>' token; shortening needs a thinking model")
        self.think_end_id = think_end

    def thinking_end(self, turn: TurnRecord) -> int | None:
        """Index of the first ``</think>`` token of the response, None when thinking never closed."""
        hits = np.flatnonzero(turn.response_ids == self.think_end_id)
        return int(hits[0]) if len(hits) else None

    def wants(self, turn: TurnRecord) -> bool:
        """Whether ``turn`` is one the configuration rewrites."""
        end = self.thinking_end(turn)
        if not self.cfg.enabled or turn.kind not in self.cfg.kinds or end is None:
            return False
        forced = self.cfg.closed_by_loop and FLAG_THINK_CLOSED_BY_LOOP in turn.flags
        return forced or end > self.cfg.over_tokens

    async def shorten(self, policy: Policy, turn: TurnRecord) -> ShortenOutcome:
        """Rewrite ``turn``'s thinking in place (``short_response_ids``) when the rewrite is usable."""
        end = self.thinking_end(turn)
        thinking = self.tokenizer.decode(turn.response_ids[:end].tolist(), skip_special_tokens=True)
        thinking = thinking.strip().removeprefix(THINK_START).strip()
        if not thinking:
            return ShortenOutcome(False, "empty thinking")
        budget = max(_MIN_BUDGET, math.ceil(end * self.cfg.ratio * 1.5))
        generation = await policy.generate(self._prompt(thinking), SamplingParams(max_tokens=budget, temperature=0.0))
        if generation.finish_reason != "stop":
            return ShortenOutcome(False, f"rewrite not finished ({generation.finish_reason})")
        text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=True).strip()
        if not text or THINK_START in text or THINK_END in text:
            return ShortenOutcome(False, "rewrite empty or holds think tags")
        head = encode_text(self.tokenizer, f"{THINK_START}\n{text}\n")
        if len(head) + 1 >= end:
            return ShortenOutcome(False, "rewrite not shorter than the original")
        tail = turn.response_ids[end:]  # the original </think> and everything after it
        turn.short_response_ids = np.concatenate([head, tail]).astype(np.int32)
        return ShortenOutcome(True)

    def _prompt(self, thinking: str) -> np.ndarray:
        words = max(10, int(len(thinking.split()) * self.cfg.ratio))
        request = (
            "Below is the reasoning a model wrote before its reply. Rewrite it to about "
            f"{words} words: keep every fact, name, number and date it uses, and the steps that lead "
            "to its decision; drop repetition, hesitation and restatements of the task. Write in the "
            "same voice, as the reasoning itself, and reply with the shortened reasoning only.\n\n"
            f"<reasoning>\n{thinking}\n</reasoning>"
        )
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": request}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        return encode_text(self.tokenizer, text)
