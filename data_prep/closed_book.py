"""Drop questions a model answers without the document (the reference's ``filter.py``).

Each question is asked with no context, ``samples`` times; a question counts as answered when
any response is correct: its last ``\\boxed{}`` matches a gold answer exactly (normalized), or a
gold answer appears in the response as whole words. The reference used plain substring
containment for the second test, which also drops questions whose answer is "no" whenever a
response contains "not"; :func:`~infmem_verl.reward.metrics.answer_in_text` matches whole words.

The model is any :class:`~infmem_verl.agent.policy.Policy`: an in-process transformers model,
or an OpenAI-compatible server through its policy adapter. :func:`load_policy` builds one from a
``module:callable`` spec so the command line can name either. Prompts are rendered with the
policy's own ``tokenizer`` attribute when it has one (the build passes it), since the filter model
need not be the model whose tokenizer counts the contexts.
"""

from __future__ import annotations

import asyncio
import importlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from infmem_verl.agent.policy import Policy, SamplingParams
from infmem_verl.agent.protocol import parse_answer
from infmem_verl.reward.metrics import answer_in_text, exact_match

from .sources import SourceQuestion

PROMPT = (
    "Answer the following question from your own knowledge. Think briefly, then give the final answer "
    "inside \\boxed{{}}.\n\nQuestion: {question}"
)


@dataclass(frozen=True)
class ClosedBookSettings:
    """Sampling of the closed-book check; the defaults are the reference's (2 samples, T 1.0,
    top-p 0.7, 512 tokens)."""

    samples: int = 2
    temperature: float = 1.0
    top_p: float = 0.7
    max_tokens: int = 512
    concurrency: int = 64

    def __post_init__(self) -> None:
        for name in ("samples", "max_tokens", "concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"closed-book filter {name}: expected an integer >= 1, got {value!r}")

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, logprobs=False
        )


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The chat prompt of the closed-book question (thinking off where the template allows)."""
    messages = [{"role": "user", "content": PROMPT.format(question=question)}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def is_correct(response: str, answers: Sequence[str]) -> bool:
    """Whether a closed-book response answers the question (boxed EM or a gold in the text)."""
    final = response.rsplit("</think>", 1)[-1]
    if exact_match(parse_answer(final, "boxed"), answers) == 1.0:
        return True
    return any(answer_in_text(answer, final) for answer in answers)


async def answered_without_document(
    policy: Policy, tokenizer, questions: Sequence[SourceQuestion], settings: ClosedBookSettings
) -> list[bool]:
    """For each question, whether any of its closed-book samples is correct."""
    params = settings.sampling()
    gate = asyncio.Semaphore(settings.concurrency)

    async def one(prompt: list[int], answers: Sequence[str]) -> bool:
        async with gate:
            generation = await policy.generate(prompt, params)
        return is_correct(tokenizer.decode(generation.token_ids, skip_special_tokens=True), answers)

    calls = []
    for question in questions:
        prompt = prompt_ids(tokenizer, question.question)
        calls.extend(one(prompt, question.answers) for _ in range(settings.samples))
    verdicts = await asyncio.gather(*calls)
    n = settings.samples
    return [any(verdicts[i * n : (i + 1) * n]) for i in range(len(questions))]


async def keep_unanswered(
    policy: Policy,
    tokenizer,
    questions: Iterable[SourceQuestion],
    settings: ClosedBookSettings,
    limit: int | None = None,
) -> tuple[list[SourceQuestion], int]:
    """The questions the model does not answer without the document, in order, and how many
    were dropped. With ``limit``, checks questions in batches only until ``limit`` are kept."""
    kept: list[SourceQuestion] = []
    dropped = 0
    pending = list(questions)
    batch = settings.concurrency * 4
    for start in range(0, len(pending), batch):
        if limit is not None and len(kept) >= limit:
            break
        chunk = pending[start : start + batch]
        for question, answered in zip(chunk, await answered_without_document(policy, tokenizer, chunk, settings)):
            if limit is not None and len(kept) >= limit:
                break
            if answered:
                dropped += 1
            else:
                kept.append(question)
    return kept, dropped


def load_policy(spec: str, argument: str | None = None) -> Any:
    """The policy built by ``spec`` = ``"module:callable"`` (dotted attributes allowed), called
    with ``argument`` when given, e.g.
    ``infmem_verl.policy.transformers:TransformersPolicy.from_pretrained`` with a model folder."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--filter-policy: expected 'module:callable', got {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--filter-policy: {module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    policy = target(argument) if argument is not None else target()
    if not callable(getattr(policy, "generate", None)):
        raise ValueError(f"--filter-policy: {spec} returned {type(policy).__name__}, which has no generate()")
    return policy
