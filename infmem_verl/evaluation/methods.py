"""The evaluated methods: InfMem (stop rule 1 and 3), MemAgent, and two plain baselines.

Every method answers one :class:`~infmem_verl.data.sample.QASample` through a
:class:`~infmem_verl.agent.policy.Policy` and returns a :class:`MethodOutcome`. The agents run the
agent core unchanged (its one prompt builder); the baselines make a single answer call over a
document prompt of their own, through the same two-stage thinking runner:

- ``full_context``: the whole document in the prompt, cut in the middle (head and tail kept, as
  LongBench does) to fit the model's context window;
- ``bm25``: the question as a BM25 query over the document's retrieval units, the
  ``retrieval.top_k_default`` best units (best first, as InfMem's Write sees them), then the
  answer.

Token counts come from a per-sample counting wrapper around the policy, so they are the tokens
the server processed (every generate call's prompt and completion), the second stage of a
two-stage call included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from infmem_verl.agent.cache import DocumentCache
from infmem_verl.agent.config import AgentConfig
from infmem_verl.agent.document import Document
from infmem_verl.agent.loops import build_agent
from infmem_verl.agent.policy import Generation, Policy, SamplingParams
from infmem_verl.agent.protocol import BuiltPrompt, PromptBuilder, parse_answer
from infmem_verl.agent.trajectory import Trajectory
from infmem_verl.agent.turns import TurnRunner
from infmem_verl.data.sample import QASample

METHODS = ("infmem", "infmem3", "memagent", "full_context", "bm25")
METHOD_LABELS = {
    "infmem": "InfMem (1-stop)",
    "infmem3": "InfMem (3-stop)",
    "memagent": "MemAgent",
    "full_context": "Full context (truncated)",
    "bm25": "BM25 top-k + answer",
}


@dataclass
class MethodOutcome:
    """What one method did on one sample (the per-sample record's measured fields)."""

    prediction: str | None
    answer_text: str
    llm_calls: int
    prompt_tokens: int
    completion_tokens: int
    doc_tokens: int
    chunks_read: int | None = None  # agents only
    num_chunks: int | None = None
    stop_step: int | None = None
    retrieval_queries: list[str] = field(default_factory=list)
    invalid_turns: int = 0
    # Agents only, for ``--record-turns`` (evaluation.trajectories); not part of the record.
    trajectory: Trajectory | None = field(default=None, repr=False)
    document: Document | None = field(default=None, repr=False)


class CountingPolicy:
    """Wraps a policy to count the calls and tokens of one sample."""

    def __init__(self, inner: Policy):
        self.inner = inner
        self.calls = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        generation = await self.inner.generate(prompt_ids, params)
        self.calls += 1
        self.prompt_tokens += len(prompt_ids)
        self.completion_tokens += len(generation.token_ids)
        return generation


def _document_cache(tokenizer: Any, cfg: AgentConfig, in_flight: int) -> DocumentCache:
    """Evaluation reads each document once per method, so the cache holds only the documents in
    flight (``in_flight``: the runner's slots and the one sample it reads ahead) and 1M-token
    documents do not pile up. Not fewer: a method prepares the document, then its agent looks it
    up again, and with a smaller cache another sample's preparation in between evicts it and the
    agent prepares it a second time (at concurrency 4 every document was prepared twice)."""
    return DocumentCache(tokenizer, cfg.document, cfg.retrieval, size=in_flight)


class AgentMethod:
    """InfMem or MemAgent from the agent core."""

    def __init__(self, name: str, agent: str, cfg: AgentConfig, tokenizer: Any, in_flight: int = 2):
        self.name = name
        self.agent = build_agent(agent, cfg, tokenizer, _document_cache(tokenizer, cfg, in_flight))

    async def prepare(self, sample: QASample) -> None:
        """The sample's document into the cache, ahead of its run (the runner's read-ahead)."""
        await self.agent.cache.get(sample.context, with_index=self.agent.uses_retrieval)

    async def run(self, policy: Policy, sample: QASample) -> MethodOutcome:
        prepared = await self.agent.cache.get(sample.context, with_index=self.agent.uses_retrieval)
        counter = CountingPolicy(policy)
        trajectory = await self.agent.run(counter, sample.question, sample.context)
        summary = trajectory.summary()
        queries = [t.action.query for t in trajectory.turns if t.action is not None and t.action.kind == "retrieve"]
        return MethodOutcome(
            prediction=trajectory.prediction,
            answer_text=trajectory.answer_text,
            llm_calls=counter.calls,
            prompt_tokens=counter.prompt_tokens,
            completion_tokens=counter.completion_tokens,
            doc_tokens=prepared.document.num_tokens,
            chunks_read=summary.chunks_read,
            num_chunks=summary.num_chunks,
            stop_step=summary.stop_step,
            retrieval_queries=[q for q in queries if q],
            invalid_turns=summary.invalid_turns,
            trajectory=trajectory,
            document=prepared.document,
        )


class DocumentPrompt:
    """The baselines' prompt: instructions, a document block and the question, in one user turn.

    Rendered once through the chat template with sentinels in the two slots, like the agent
    core's prompts, so a call only concatenates token ids.
    """

    _DOC, _QUESTION = "@@EVAL_SLOT_DOCUMENTS@@", "@@EVAL_SLOT_QUESTION@@"

    def __init__(self, tokenizer: Any, cfg: AgentConfig, encode):
        rule = (
            "write it inside \\boxed{}."
            if cfg.answer_format == "boxed"
            else 'end with a line of the form "Therefore, the answer is <answer>".'
        )
        content = (
            "Answer the question using the documents below. Keep the final answer short (a name, "
            f"number, date, or yes/no) and {rule}\n\n<documents>\n{self._DOC}\n</documents>\n\n"
            f"<question>\n{self._QUESTION}\n</question>"
        )
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=cfg.thinking,
        )
        head, rest = rendered.split(self._DOC)
        middle, tail = rest.split(self._QUESTION)
        self.pieces = [encode(head), encode(middle), encode(tail)]
        self.static_tokens = sum(len(p) for p in self.pieces)

    def build(self, document_ids: np.ndarray, question_ids: np.ndarray) -> np.ndarray:
        head, middle, tail = self.pieces
        return np.concatenate([head, document_ids, middle, question_ids, tail]).astype(np.int32)


class BaselineMethod:
    """One answer call over the document (``full_context``) or BM25's top units (``bm25``).

    ``window`` is the model's context window: the prompt plus the answer call's largest response
    must fit in it, so the document (or passage block) is cut in the middle when too long.
    """

    def __init__(self, name: str, cfg: AgentConfig, tokenizer: Any, window: int, in_flight: int = 2):
        if name not in ("full_context", "bm25"):
            raise ValueError(f"method: expected full_context or bm25, got {name!r}")
        self.name = name
        self.cfg = cfg
        self.builder = PromptBuilder(tokenizer, cfg)
        self.prompt = DocumentPrompt(tokenizer, cfg, self.builder.encode)
        self.cache = _document_cache(tokenizer, cfg, in_flight)
        self.window = window
        self.think_end_id = self.builder.think_end_id if cfg.thinking else None

    async def prepare(self, sample: QASample) -> None:
        """The sample's document into the cache, ahead of its run (the runner's read-ahead)."""
        await self.cache.get(sample.context, with_index=self.name == "bm25")

    async def run(self, policy: Policy, sample: QASample) -> MethodOutcome:
        question_ids = self.builder.encode(sample.question.strip())
        prepared = await self.cache.get(sample.context, with_index=self.name == "bm25")
        document = prepared.document
        queries: list[str] = []
        if self.name == "bm25":
            index = await prepared.ready_index()
            hits = index.search(sample.question, self.cfg.retrieval.top_k_default)
            block = self._passages([document.unit_ids(hit.unit) for hit in hits])
            queries.append(sample.question)
        else:
            block = document.ids
        room = self.window - self.prompt.static_tokens - len(question_ids) - self.cfg.answer.response_tokens(self.cfg.thinking)
        if room < 1:
            raise ValueError(
                f"context_window: {self.window} tokens leave no room for the document beside the question "
                f"({len(question_ids)} tokens), the template and the answer budget"
            )
        counter = CountingPolicy(policy)
        runner = TurnRunner(counter, self.builder, self.cfg, self.think_end_id)
        ids = self.prompt.build(cut_middle(np.asarray(block, dtype=np.int32), room), question_ids)
        result = await runner.call("answer", self.cfg.answer, BuiltPrompt(ids=ids, flags=[]), 0)
        prediction = parse_answer(result.split.output, self.cfg.answer_format) if result.split.closed else None
        return MethodOutcome(
            prediction=prediction,
            answer_text=result.split.output,
            llm_calls=counter.calls,
            prompt_tokens=counter.prompt_tokens,
            completion_tokens=counter.completion_tokens,
            doc_tokens=document.num_tokens,
            retrieval_queries=queries,
            invalid_turns=int(prediction is None),
        )

    def _passages(self, units: list[np.ndarray]) -> np.ndarray:
        parts: list[np.ndarray] = []
        for rank, unit in enumerate(units, start=1):
            parts += [self.builder.encode(("\n\n" if rank > 1 else "") + f"[Passage {rank}] "), unit]
        return np.concatenate(parts) if parts else self.builder.encode("No passage matched the question")


def cut_middle(ids: np.ndarray, room: int) -> np.ndarray:
    """``ids`` if it fits in ``room`` tokens, else its first and last halves of ``room``."""
    if len(ids) <= room:
        return ids
    head = room // 2
    return np.concatenate([ids[:head], ids[len(ids) - (room - head) :]])


def build_methods(names: Sequence[str], cfg: AgentConfig, tokenizer: Any, window: int, concurrency: int = 1) -> dict[str, Any]:
    """The methods called ``names``; ``infmem3`` is InfMem with ``stop_votes=3``. ``concurrency``:
    the runner's, whose slots and one read-ahead sample are the documents a method holds."""
    in_flight = concurrency + 1
    methods: dict[str, Any] = {}
    for name in names:
        if name == "infmem":
            methods[name] = AgentMethod(name, "infmem", dataclasses.replace(cfg, stop_votes=1), tokenizer, in_flight)
        elif name == "infmem3":
            methods[name] = AgentMethod(name, "infmem", dataclasses.replace(cfg, stop_votes=3), tokenizer, in_flight)
        elif name == "memagent":
            methods[name] = AgentMethod(name, "memagent", cfg, tokenizer, in_flight)
        elif name in ("full_context", "bm25"):
            methods[name] = BaselineMethod(name, cfg, tokenizer, window, in_flight)
        else:
            raise ValueError(f"methods: unknown method {name!r}; expected some of {list(METHODS)}")
    return methods
