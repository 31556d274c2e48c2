"""A Policy whose outputs come from a Python function: scripted controllers, tests, benchmarks.

The function sees the prompt ids and the sampling params and returns the model text; the policy
tokenizes it (once per distinct text), cuts it at ``max_tokens`` like a real server
(``finish_reason="length"``) or appends the end token (``"stop"``). Like a real model, a call
whose prompt is an earlier prompt plus the tokens that call returned continues the cut text
instead of asking the function again. Every call is recorded, so tests can assert the exact
call sequence the loops made.

:func:`oracle_policy` is the scripted teacher of the synthetic two-hop set: it knows where the
facts are, so it shows the protocol used well (retrieve what is missing, stop once both facts
are in memory, answer from memory). ``python -m infmem_verl.distill --teacher oracle`` distils
it, and the benchmarks use it to count the tokens early stopping saves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..agent.policy import Generation, SamplingParams
from ..data.sample import QASample

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


# The oracle's thinking: short, so that a student learns to close it well inside any budget.
ORACLE_THINK = "<think>\nChecking.\n</think>\n\n"


def oracle_answer(answer: str) -> str:
    """The oracle's answer call: the answer boxed with a space before it. Qwen3's pre-tokenizer
    glues a word to the punctuation before it, so ``{Name`` is tokenized unlike the memory's
    `` Name``, and a tiny student must then learn a second spelling of every name instead of
    copying the memory's tokens; with the space it copies them (held-out sub-EM 18.8% against
    12.5% after 1,000 fresh answer calls, docs/experiments/2026-12-04-copying-student.md).
    Answers are parsed stripped, so both spellings score the same."""
    return ORACLE_THINK + f"\\boxed{{ {answer}}}"


def oracle_policy(tokenizer, samples: Sequence[QASample]) -> ScriptedPolicy:
    """The synthetic set's oracle: the writer keeps every fact it has seen; the controller
    retrieves for the missing fact and stops once both facts are in the memory; the answer comes
    from the memory. The call kind, the sample and what the prompt holds are read off the prompt
    text; ``samples`` must carry the synthetic ``meta["facts"]`` (:mod:`infmem_verl.data.synthetic`).
    """
    for sample in samples:
        if len(sample.meta.get("facts") or ()) != 2:
            raise ValueError(f"samples: {sample.id} has no synthetic meta.facts; the oracle knows only synthetic two-hop samples")
    by_question = {s.question: s for s in samples}

    def respond(prompt: np.ndarray, params: SamplingParams) -> str:
        text = tokenizer.decode(prompt.tolist())
        sample = next(s for q, s in by_question.items() if q in text)
        fact_a, fact_b = (f["text"] for f in sample.meta["facts"])
        seen = [fact for fact in (fact_a, fact_b) if fact in text]
        if "</current_chunk>" in text:
            return ORACLE_THINK + (" ".join(seen) or "Nothing relevant yet.")
        if "# Tools" in text:
            if len(seen) == 2:
                call = {"name": "stop", "arguments": {}}
            else:
                query = sample.meta["bridge"] if fact_a in seen else sample.question
                call = {"name": "retrieve", "arguments": {"query": query, "top_k": 4}}
            return ORACLE_THINK + f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return oracle_answer(sample.answers[0] if fact_b in seen else "unknown")

    return ScriptedPolicy(tokenizer, respond, record=False)
