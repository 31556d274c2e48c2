"""The oracle's calls without the agent loop: fresh SFT samples for every batch (issue 30).

A tiny student trained for hundreds of steps on a few hundred distilled trajectories memorises
their answers instead of learning to copy facts (docs/experiments/2026-12-04-copying-student.md:
the answer call copies once every batch brings questions never seen, 73% held out after 40,000).
The distillation cannot supply that many (0.2-0.4 s a trajectory with its document); this module
can, at about a millisecond a call.

A trajectory of the oracle (:func:`infmem_verl.policy.scripted.oracle_policy`) is played
symbolically over a document that is never built whole: each fact of a haystack-free chain
(:func:`infmem_verl.data.synthetic.chain`) sits in one of the document's chunks, the controller's
query asks for the missing fact (the question, then the bridge once fact A is in memory), and a
retrieval finds the unit holding the fact asked for with :attr:`FreshOdds.hit`. Only what each
call shows is built, from token ids, by the agent core's own :class:`PromptBuilder`: a chunk is
``chunk_tokens`` tokens of real Wikipedia paragraphs (spliced with the facts it holds, between
two sentences, as the synthetic documents splice them), a retrieved passage a ``unit_tokens``
window of one. Each response is the oracle's, decided as the oracle decides it, from the prompt's
decoded text (a fact counts as seen only if it is there whole), and memories pass from call to
call as the loop passes them (:func:`infmem_verl.agent.memory.update_memory`). So the samples
have the protocol's exact format; what differs from a distilled trajectory is only the haystack
around the facts and the ranks of the retrieved passages.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from infmem_verl.agent.config import AgentConfig
from infmem_verl.agent.memory import Memory, update_memory
from infmem_verl.agent.protocol import HistoryEntry, PromptBuilder
from infmem_verl.data.synthetic import Chain, NameStyle, _rendered_pool, _sentence_ends, chain
from infmem_verl.policy.scripted import ORACLE_THINK, oracle_answer

NOTHING = "Nothing relevant yet."
_SEPARATOR = "\n\n"
# Paragraphs of the pool pre-tokenized per process (enough that no two chunks look alike).
POOL_PARAGRAPHS = 3000
# A clean chunk without a fact: a Wikipedia window of about one fact sentence's length (a fact
# is ~15-20 tokens), so the clean curriculum's chunks stay short either way.
CLEAN_FILLER_TOKENS = 16


@dataclass(frozen=True)
class Call:
    """One oracle call: its prompt ids and the trained response ids (the end token included)."""

    kind: str  # "prethink", "write" or "answer"
    prompt: np.ndarray
    response: np.ndarray


@dataclass(frozen=True)
class FreshOdds:
    """The symbolic trajectory's chances (what a distilled one shows, roughly)."""

    hit: float = 0.85  # a retrieval's passages hold the fact its query asks for
    also_a: float = 0.5  # the bridge query's passages hold fact A too (both name the bridge)
    first_rank: float = 0.7  # the asked-for passage is ranked first (else at a random rank)


class FreshCalls:
    """Oracle trajectories of ``agent`` ("infmem" or "memagent") under ``agent_cfg``, as calls.

    ``trajectory(i)`` is deterministic in ``(seed, i)``; ``calls()`` streams trajectories
    ``0, 1, ...`` call by call, so a run that needs N calls sees N calls never seen before.
    """

    def __init__(self, tokenizer, agent_cfg: AgentConfig, agent: str = "infmem", seed: int = 1, num_chunks: int = 4,
                 odds: FreshOdds = FreshOdds(), names: NameStyle = "syllables", clean: bool = False):  # fmt: skip
        if agent not in ("infmem", "memagent"):
            raise ValueError(f"agent: expected 'infmem' or 'memagent', got {agent!r}")
        self.builder = PromptBuilder(tokenizer, agent_cfg)
        self.cfg = agent_cfg
        self.agent = agent
        self.seed = seed
        self.num_chunks = num_chunks
        self.odds = odds
        self.names = names
        # Chunks of the facts alone, without the Wikipedia around them (a curriculum's first stage:
        # a copy learnt from a short clean context carries over to a long one, the reverse not).
        self.clean = clean
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._pool = _pool_ids(tokenizer)
        self._tokenizer = tokenizer

    # -- what a call shows ---------------------------------------------------------------------

    def _paragraph(self, rng: random.Random, facts: tuple[str, ...] = ()) -> np.ndarray:
        """A random pool paragraph (with its separator), with ``facts`` spliced in when given."""
        pool_texts, pool_ids = self._pool
        while True:
            index = rng.randrange(len(pool_ids))
            if not facts:
                return pool_ids[index]
            text = pool_texts[index]
            cuts = _sentence_ends(text)
            if cuts:
                break
        for fact in facts:  # each after its own sentence end (the later fact after the earlier)
            cut = rng.choice(_sentence_ends(text) or [len(text)])
            text = text[:cut] + " " + fact + text[cut:]
        return self.builder.encode(text + _SEPARATOR)

    def _window(self, rng: random.Random, size: int, facts: tuple[str, ...]) -> np.ndarray:
        """``size`` tokens of consecutive paragraphs, holding ``facts`` whole where they fit."""
        host = rng.randrange(3) if facts else -1
        parts = [self._paragraph(rng, facts if i == host else ()) for i in range(3)]
        stream = np.concatenate(parts)
        while len(stream) < size:
            stream = np.concatenate([stream, self._paragraph(rng)])
        if not facts:
            start = rng.randrange(len(stream) - size + 1)
            return stream[start : start + size]
        # The facts' span in the stream: the host paragraph, narrowed to the spliced sentences.
        begin = sum(len(p) for p in parts[:host])
        spans = [_find(parts[host], self.builder.encode(" " + fact)) for fact in facts]
        spans = [(begin + s, begin + e) for s, e in spans if s >= 0]
        low = min((s for s, _ in spans), default=begin)
        high = max((e for _, e in spans), default=begin + len(parts[host]))
        first = max(0, min(high - size, len(stream) - size))
        last = max(first, min(low, len(stream) - size))
        start = rng.randint(first, last)
        return stream[start : start + size]

    def _evidence(self, rng: random.Random, wanted: str | None, also: str | None) -> list[np.ndarray]:
        """The retrieved units: ``top_k_default`` passages, the one holding ``wanted`` (and
        ``also``) among them when the retrieval finds it."""
        size = self.cfg.document.unit_tokens
        units = [self._window(rng, size, ()) for _ in range(self.cfg.retrieval.top_k_default)]
        found = [f for f, p in ((wanted, self.odds.hit), (also, self.odds.also_a)) if f and rng.random() < p]
        for n, fact in enumerate(found):
            rank = n if rng.random() < self.odds.first_rank else rng.randrange(len(units))
            units[rank] = self._window(rng, size, (fact,))
        return units

    # -- the oracle's responses ----------------------------------------------------------------

    def _response(self, text: str, budget) -> np.ndarray:
        """The oracle's ``text`` as the loop records it under ``budget``: the end token appended,
        or the output cut at ``output_tokens`` after the thinking's end (the scripted policy's
        cut, two-stage thinking: the end token counts within the budget)."""
        ids = self.builder.encode(text)
        think_end = int(np.flatnonzero(ids == self.builder.think_end_id)[0]) + 1
        if len(ids) - think_end >= budget.output_tokens:
            return ids[: think_end + budget.output_tokens]
        return np.append(ids, self.end_id).astype(np.int32)

    def _seen(self, prompt: np.ndarray, item: Chain) -> list[str]:
        text = self.builder.decode(prompt.tolist())
        return [fact for fact in item.facts if fact in text]

    def trajectory(self, index: int) -> list[Call]:
        """The oracle's calls on trajectory ``index``: as the loop makes them, in order."""
        rng = random.Random(f"infmem-fresh:{self.seed}:{index}")
        item = chain(index, self.seed, self.names)
        question = self.builder.encode(item.question)
        holder = [rng.randrange(self.num_chunks) for _ in item.facts]  # the chunk of each fact
        memory, history, calls = Memory.empty(), [], []
        for step in range(self.num_chunks):
            evidence = None
            if self.agent == "infmem":
                prompt = self.builder.prethink(question, memory.ids, history, step, self.num_chunks).ids
                seen = self._seen(prompt, item)
                if len(seen) == 2:
                    action = {"name": "stop", "arguments": {}}
                    calls.append(Call("prethink", prompt, self._response(ORACLE_THINK + _tool_call(action), self.cfg.prethink)))
                    break
                query = item.bridge if item.facts[0] in seen else item.question
                action = {"name": "retrieve", "arguments": {"query": query, "top_k": self.cfg.retrieval.top_k_default}}
                calls.append(Call("prethink", prompt, self._response(ORACLE_THINK + _tool_call(action), self.cfg.prethink)))
                history.append(HistoryEntry(query=query, top_k=self.cfg.retrieval.top_k_default))
                wanted = item.facts[1] if item.facts[0] in seen else item.facts[0]
                also = item.facts[0] if wanted == item.facts[1] else None
                evidence = self._evidence(rng, wanted, also)
            here = tuple(f for f, h in zip(item.facts, holder) if h == step)
            if self.clean:
                chunk = self.builder.encode(" ".join(here)) if here else self._window(rng, CLEAN_FILLER_TOKENS, ())
            else:
                chunk = self._window(rng, self.cfg.document.chunk_tokens, here)
            prompt = self.builder.write(question, memory.ids, chunk, evidence).ids
            text = ORACLE_THINK + (" ".join(self._seen(prompt, item)) or NOTHING)
            response = self._response(text, self.cfg.write)
            calls.append(Call("write", prompt, response))
            after = self.builder.decode(response).split("</think>", 1)[1]
            finished = bool(response[-1] == self.end_id)
            update = update_memory(memory, after, True, finished, self.cfg.memory_tokens, self.builder.encode, self.builder.decode)
            memory = update.memory
        prompt = self.builder.answer(question, memory.ids).ids
        answer = item.answer if item.facts[1] in self._seen(prompt, item) else "unknown"
        calls.append(Call("answer", prompt, self._response(oracle_answer(answer), self.cfg.answer)))
        return calls

    def calls(self, start: int = 0) -> Iterator[tuple[int, Call]]:
        """(trajectory index, call) for trajectories ``start, start + 1, ...``, call by call."""
        index = start
        while True:
            for call in self.trajectory(index):
                yield index, call
            index += 1


def _tool_call(action: dict) -> str:
    return f"<tool_call>\n{json.dumps(action)}\n</tool_call>"


def _find(seq: np.ndarray, part: np.ndarray) -> tuple[int, int]:
    """The first span of ``part`` in ``seq`` ((-1, -1) when absent)."""
    n = len(part)
    for i in range(len(seq) - n + 1):
        if seq[i] == part[0] and np.array_equal(seq[i : i + n], part):
            return i, i + n
    return -1, -1


_POOLS: dict[tuple[str, int], tuple[tuple[str, ...], list[np.ndarray]]] = {}


def _pool_ids(tokenizer) -> tuple[tuple[str, ...], list[np.ndarray]]:
    """The first POOL_PARAGRAPHS pool paragraphs and their ids (separator included), once per
    tokenizer and process."""
    key = (str(getattr(tokenizer, "name_or_path", "")), len(tokenizer))
    if key not in _POOLS:
        texts = _rendered_pool()[:POOL_PARAGRAPHS]
        ids = tokenizer([t + _SEPARATOR for t in texts], add_special_tokens=False)["input_ids"]
        _POOLS[key] = texts, [np.asarray(x, dtype=np.int32) for x in ids]
    return _POOLS[key]
