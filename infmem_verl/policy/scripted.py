"""A Policy whose outputs come from a Python function: scripted controllers, tests, benchmarks.

The function sees the prompt ids and the sampling params and returns the model text; the policy
tokenizes it (once per distinct text), cuts it at ``max_tokens`` like a real server
(``finish_reason="length"``) or appends the end token (``"stop"``). Like a real model, a call
whose prompt is an earlier prompt plus the tokens that call returned continues the cut text
instead of asking the function again. Every call is recorded, so tests can assert the exact
call sequence the loops made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..agent.policy import Generation, SamplingParams

Respond = Callable[[np.ndarray, SamplingParams], str]


@dataclass
class RecordedCall:
    prompt_ids: np.ndarray
    params: SamplingParams
    output: str | None  # None when the call continued an earlier, cut output


class ScriptedPolicy:
    def __init__(self, tokenizer, respond: Respond, end_token: str = "<|im_end|>", record: bool = True):
        self.tokenizer = tokenizer
        self.respond = respond
        self.end_id = tokenizer.convert_tokens_to_ids(end_token)
        self.record = record
        self.calls: list[RecordedCall] = []
        self._encoded: dict[str, list[int]] = {}
        self._pending: dict[bytes, list[int]] = {}  # prompt+output so far -> rest of the text

    def _encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        ids = self._pending.pop(prompt.tobytes(), None)
        text = None
        if ids is None:
            text = self.respond(prompt, params)
            ids = self._encode(text)
        if self.record:
            self.calls.append(RecordedCall(prompt, params, text))
        if len(ids) >= params.max_tokens:
            out, finish = list(ids[: params.max_tokens]), "length"
            emitted = np.concatenate([prompt, np.asarray(out, dtype=np.int32)])
            self._pending[emitted.tobytes()] = ids[params.max_tokens :]
        else:
            out, finish = list(ids) + [self.end_id], "stop"
        return Generation(token_ids=out, log_probs=[0.0] * len(out), finish_reason=finish)
