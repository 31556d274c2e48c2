"""One LLM call of the protocol, with its thinking budget, recorded as a :class:`Turn`.

With thinking on, a call has two budgets: thinking, and the output after ``</think>`` (action,
memory or answer). In ``two_stage`` mode the first generate call gets the thinking budget; if it
runs out before ``</think>``, the loop appends the closing tag itself (those tokens are marked as
not generated: response mask 0, log-prob 0) and a second call generates the output with its own
budget. If the model closed its thinking but the output was cut by the first budget, the second
call finishes the output. ``single_pass`` makes one call of both budgets together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .config import AgentConfig, CallBudget
from .policy import Generation, Policy, SamplingParams
from .protocol import BuiltPrompt, PromptBuilder, ThinkSplit, split_thinking
from .trajectory import FLAG_THINK_CLOSED_BY_LOOP, Turn, TurnKind


@dataclass
class CallResult:
    turn: Turn
    split: ThinkSplit
    finished: bool  # the output ended with the model's end token


class TurnRunner:
    """Runs protocol calls against a :class:`Policy` and records them."""

    def __init__(self, policy: Policy, builder: PromptBuilder, cfg: AgentConfig, think_end_id: int | None):
        self.policy = policy
        self.builder = builder
        self.cfg = cfg
        self.think_end_id = think_end_id

    def _params(self, max_tokens: int) -> SamplingParams:
        cfg = self.cfg
        return SamplingParams(max_tokens=max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)

    async def _generate(self, prompt_ids: np.ndarray, params: SamplingParams) -> Generation:
        started = time.perf_counter()
        try:
            return await self.policy.generate(prompt_ids, params)
        finally:
            self.generate_s += time.perf_counter() - started

    async def call(self, kind: TurnKind, budget: CallBudget, prompt: BuiltPrompt, chunk_index: int) -> CallResult:
        started = time.perf_counter()
        # This turn's time awaiting the policy (a runner serves one trajectory, one call at a time).
        self.generate_s = 0.0
        stages: list[Generation] = []
        prefill = len(prompt.ids)  # prompt tokens sent, over all generate calls of the turn
        injected = np.zeros(0, dtype=np.int32)
        if not self.cfg.thinking:
            stages.append(await self._generate(prompt.ids, self._params(budget.output_tokens)))
        elif self.cfg.thinking_mode == "single_pass":
            max_tokens = budget.thinking_tokens + budget.output_tokens
            stages.append(await self._generate(prompt.ids, self._params(max_tokens)))
        else:
            first = await self._generate(prompt.ids, self._params(budget.thinking_tokens))
            stages.append(first)
            if first.finish_reason == "length":
                ids = first.token_ids
                if self.think_end_id in ids:
                    remaining = budget.output_tokens - (len(ids) - ids.index(self.think_end_id) - 1)
                else:
                    injected = self.builder.close_think_ids
                    remaining = budget.output_tokens
                if remaining > 0:
                    continuation = np.concatenate([prompt.ids, np.asarray(ids, dtype=np.int32), injected])
                    stages.append(await self._generate(continuation, self._params(remaining)))
                    prefill += len(continuation)
        return self._record(kind, prompt, chunk_index, stages, injected, started, prefill)

    def _record(
        self,
        kind: TurnKind,
        prompt: BuiltPrompt,
        chunk_index: int,
        stages: list[Generation],
        injected: np.ndarray,
        started: float,
        prefill: int,
    ) -> CallResult:
        first, last = stages[0], stages[-1]
        pieces = [np.asarray(first.token_ids, dtype=np.int32), injected]
        masks = [np.ones(len(first.token_ids), dtype=np.int8), np.zeros(len(injected), dtype=np.int8)]
        logps = [first.log_probs, [0.0] * len(injected)]
        for stage in stages[1:]:
            pieces.append(np.asarray(stage.token_ids, dtype=np.int32))
            masks.append(np.ones(len(stage.token_ids), dtype=np.int8))
            logps.append(stage.log_probs)
        response = np.concatenate(pieces)
        mask = np.concatenate(masks)
        have_logps = all(lp is not None for lp in logps)
        log_probs = np.concatenate([np.asarray(lp, dtype=np.float32) for lp in logps]) if have_logps else None
        text = self.builder.decode(response)
        split = split_thinking(text, self.cfg.thinking)
        flags = list(prompt.flags)
        if len(injected):
            flags.append(FLAG_THINK_CLOSED_BY_LOOP)
        # Backend facts of a two-stage turn: later calls win, except ``min_*`` values (e.g. verl's
        # min_global_steps, the weights version a turn started on), which the first call sets.
        extra: dict = dict(first.extra)
        for stage in stages[1:]:
            extra.update({k: v for k, v in stage.extra.items() if not k.startswith("min_") or k not in extra})
        keep = self.cfg.record_token_ids
        turn = Turn(
            kind=kind,
            chunk_index=chunk_index,
            prompt_ids=prompt.ids if keep else None,
            response_ids=response if keep else None,
            response_mask=mask if keep else None,
            log_probs=log_probs if keep else None,
            prompt_tokens=int(prompt.ids.shape[0]),
            response_tokens=int(response.shape[0]),
            generated_tokens=int(mask.sum()),
            finish_reason=last.finish_reason,
            llm_calls=len(stages),
            prefill_tokens=prefill,
            flags=flags,
            text=split.output,
            latency_s=time.perf_counter() - started,
            generate_s=self.generate_s,
            extra=extra,
        )
        return CallResult(turn=turn, split=split, finished=last.finish_reason == "stop")
