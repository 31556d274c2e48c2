"""Compose one long context per question: its gold paragraphs, its own distractors, then
paragraphs drawn from the split's pool, to a token count or a document count.

A pool too small for the target is an error, unless the caller asks for the reference's
behaviour (``cap_at_pool``): the whole usable pool, the composition marked ``capped`` and its
real size recorded.

Rendering follows the MemAgent / InfMem files exactly: ``"Document {i}:\\n{paragraph}"`` blocks
joined by blank lines, numbered from 1. What differs is the order. The reference shuffled every
sample with ``random.Random(4)`` after placing the question's own paragraphs first, so they landed
at the same positions in every sample (spec 8.2 item 6); here each sample has its own RNG, seeded
from the run seed, the source, the split, the question id and the target, so gold positions are
spread uniformly and a run is reproducible from the seed recorded with it.

Token counts are exact for Qwen-family tokenizers (Qwen2/2.5/3, Llama 3) without tokenizing the
context: their pre-tokenizer always splits right after a line break that is followed by a
non-space character, which is where every block and every paragraph starts, so the count of a
context is the sum of the counts of its pieces. :class:`PoolCounter` caches each paragraph's
count with its trailing blank line (and without, for the last block) and the count of each
``Document {i}:`` header.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from typing import Iterator, Literal, Sequence

import numpy as np

from .io import DataError
from .sources import SourceQuestion

SEPARATOR = "\n\n"
# Fill to within this fraction below a token target; well inside the 1% promise.
FILL_TOLERANCE = 0.005
# Give up looking for a paragraph that fits the last gap after this many misses in a row.
_MAX_MISSES = 2000
_SIZE = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")


def document_header(number: int) -> str:
    """The header of document ``number`` (1-based), as in the reference files."""
    return f"Document {number}:\n"


def render_context(pool: Sequence[str], docs: Sequence[int]) -> str:
    """The context text of pool paragraphs ``docs``, in order."""
    return SEPARATOR.join(document_header(i) + pool[d] for i, d in enumerate(docs, 1))


@dataclass(frozen=True)
class Target:
    """How large a context is: ``tokens`` (context tokens, at most ``value`` and within
    :data:`FILL_TOLERANCE` of it) or ``docs`` (exactly ``value`` documents)."""

    kind: Literal["tokens", "docs"]
    value: int

    def __post_init__(self) -> None:
        if self.kind not in ("tokens", "docs"):
            raise ValueError(f"target kind: expected 'tokens' or 'docs', got {self.kind!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, int) or self.value < 1:
            raise ValueError(f"target {self.kind}: expected a positive integer, got {self.value!r}")

    @property
    def option(self) -> str:
        """The command-line option that sets this kind of target (named in errors)."""
        return "--tokens" if self.kind == "tokens" else "--num-docs"

    @property
    def label(self) -> str:
        """Short name used in file names and seeds: ``32k``, ``1m``, ``12345`` or ``200docs``."""
        if self.kind == "docs":
            return f"{self.value}docs"
        for suffix, unit in (("m", 1 << 20), ("k", 1 << 10)):
            if self.value % unit == 0:
                return f"{self.value // unit}{suffix}"
        return str(self.value)

    @classmethod
    def from_label(cls, label: str) -> "Target":
        """The target a :attr:`label` names (``"200docs"``, ``"32k"``, ``"12345"``)."""
        if label.endswith("docs") and label[: -len("docs")].isdigit():
            return cls("docs", int(label[: -len("docs")]))
        return cls("tokens", parse_size(label, "target label"))


def parse_size(text: str, name: str) -> int:
    """``"32k"`` -> 32768, ``"1m"`` -> 1048576, ``"5000"`` -> 5000 (binary units, as the
    reference's 32768 ... 1048576 lengths)."""
    match = _SIZE.match(text)
    if match is None or int(match.group(1)) < 1:
        raise ValueError(f"{name}: expected a positive integer with an optional k or m suffix, got {text!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20}[match.group(2).lower()]
    return int(match.group(1)) * scale


class PoolCounter:
    """Token counts of a pool's paragraphs and of document headers under one tokenizer.

    Counts are computed lazily, in batches, the first time a paragraph is drawn: a training set
    over HotpotQA's 500k-paragraph pool touches most of it, an evaluation set only a part.
    """

    def __init__(self, pool: Sequence[str], tokenizer) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self._with_separator = np.full(len(pool), -1, dtype=np.int64)
        self._alone = np.full(len(pool), -1, dtype=np.int64)
        self._headers = np.zeros(0, dtype=np.int64)

    def count_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Token counts of ``texts`` (one batch call; the Rust tokenizer runs it in parallel)."""
        if not texts:
            return np.zeros(0, dtype=np.int64)
        ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))

    def with_separator(self, docs: Sequence[int] | np.ndarray) -> np.ndarray:
        """Counts of ``paragraph + "\\n\\n"`` (a block that is not the last one)."""
        return self._cached(self._with_separator, np.asarray(docs, dtype=np.int64), SEPARATOR)

    def alone(self, docs: Sequence[int] | np.ndarray) -> np.ndarray:
        """Counts of the paragraphs on their own (the last block has no separator after it)."""
        return self._cached(self._alone, np.asarray(docs, dtype=np.int64), "")

    def headers(self, n: int) -> np.ndarray:
        """Counts of the headers of documents ``1..n``."""
        have = self._headers.size
        if n > have:
            extra = self.count_texts([document_header(i) for i in range(have + 1, max(n, 2 * have) + 1)])
            self._headers = np.concatenate([self._headers, extra])
        return self._headers[:n]

    def _cached(self, cache: np.ndarray, docs: np.ndarray, suffix: str) -> np.ndarray:
        missing = np.unique(docs[cache[docs] < 0])
        if missing.size:
            cache[missing] = self.count_texts([self.pool[i] + suffix for i in missing.tolist()])
        return cache[docs]


@dataclass(frozen=True)
class Composition:
    """A composed context: pool paragraphs in document order and where the gold ones sit.

    ``gold_positions[j]`` is the 1-based document number of the question's ``gold[j]`` and
    ``gold_token_starts[j]`` the token offset where that document (its header) starts.
    ``capped``: the pool ran out before the target was reached (only with ``cap_at_pool``).
    """

    docs: tuple[int, ...]
    gold_positions: tuple[int, ...]
    gold_token_starts: tuple[int, ...]
    num_tokens: int
    capped: bool = False


def sample_rng(seed: int, source: str, split: str, question_id: str, target: Target) -> random.Random:
    """The RNG of one sample: independent per question and target, reproducible from ``seed``.

    Seeding from a string hashes it with SHA-512, which does not depend on the process.
    """
    return random.Random(f"infmem-data:{seed}:{source}:{split}:{question_id}:{target.label}")


def compose(
    question: SourceQuestion,
    counter: PoolCounter,
    target: Target,
    rng: random.Random,
    blocked: np.ndarray | None = None,
    cap_at_pool: bool = False,
) -> Composition:
    """Choose and order the documents of ``question``'s context.

    Gold paragraphs always go in; then the question's own distractors in random order, then
    random pool paragraphs, except blocked ones (held out) and the question's own, while they fit.
    ``blocked`` is a boolean mask over the pool. Raises :class:`DataError` naming the question
    and the option when the target cannot hold the gold paragraphs, or when the pool cannot fill
    it and ``cap_at_pool`` is off; with it on, such a context takes every usable paragraph and
    comes back ``capped``.
    """
    own = set(question.gold) | set(question.distractors)
    chooser = _TokenChooser(counter, target.value) if target.kind == "tokens" else _DocChooser(target.value)
    where = f"question id={question.id!r} (index {question.index})"
    if not chooser.take_all(question.gold):
        raise DataError(
            f"{where}: {target.option} {target.value} is too small for its {len(question.gold)} gold paragraph(s) "
            f"({chooser.describe(question.gold)})"
        )
    distractors = list(question.distractors)
    rng.shuffle(distractors)
    if isinstance(chooser, _TokenChooser):
        counter.with_separator(distractors)  # count them in one batch
    for doc in distractors:
        if chooser.full():
            break
        chooser.offer(doc)
    usable = np.ones(len(counter.pool), dtype=bool) if blocked is None else ~np.asarray(blocked, dtype=bool)
    usable[list(own)] = False
    if not chooser.full():
        chooser.fill(d for d in _random_order(rng, len(counter.pool)) if usable[d])
    capped = not chooser.full()
    if capped and not cap_at_pool:
        raise DataError(
            f"{where}: the pool cannot fill {target.option} {target.value}: of its {len(counter.pool)} paragraphs "
            f"{int(usable.sum())} are usable as distractors (not held out, not its own), and the context reached "
            f"{chooser.describe(None)} (--extra-pool adds distractors from another file of the source; "
            f"--cap-at-pool takes the whole pool, as the reference did)"
        )
    docs = chooser.chosen
    rng.shuffle(docs)
    docs = _fit_last_block(docs, counter, target, set(question.gold))
    return replace(_measure(docs, counter, question.gold), capped=capped)


def _random_order(rng: random.Random, size: int) -> Iterator[int]:
    """A lazy random permutation of ``range(size)``.

    Rejection sampling while less than half is drawn (a sample usually needs a few hundred of a
    pool's hundreds of thousands of paragraphs), then a shuffle of what is left.
    """
    seen: set[int] = set()
    while len(seen) < size // 2:
        draw = rng.randrange(size)
        if draw not in seen:
            seen.add(draw)
            yield draw
    rest = [i for i in range(size) if i not in seen]
    rng.shuffle(rest)
    yield from rest


class _DocChooser:
    """Takes paragraphs until there are exactly ``count`` documents."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.chosen: list[int] = []

    def take_all(self, docs: Sequence[int]) -> bool:
        if len(docs) > self.count:
            return False
        self.chosen.extend(docs)
        return True

    def offer(self, doc: int) -> None:
        self.chosen.append(doc)

    def full(self) -> bool:
        return len(self.chosen) >= self.count

    def fill(self, candidates: Iterator[int]) -> None:
        for doc in candidates:
            self.chosen.append(doc)
            if self.full():
                return

    def describe(self, docs: Sequence[int] | None) -> str:
        return f"{len(self.chosen if docs is None else docs)} documents"


class _TokenChooser:
    """Takes paragraphs while the context stays within ``budget`` tokens.

    The running total counts every block with its separator; the last block's separator is
    corrected when the order is known (:func:`_fit_last_block`).
    """

    def __init__(self, counter: PoolCounter, budget: int) -> None:
        self.counter = counter
        self.budget = budget
        self.tolerance = max(1, int(budget * FILL_TOLERANCE))
        self.chosen: list[int] = []
        self.total = 0

    def _cost(self, docs: Sequence[int]) -> int:
        """Tokens that appending ``docs`` (with headers and separators) adds."""
        n = len(self.chosen)
        headers = self.counter.headers(n + len(docs))[n:]
        return int(headers.sum() + self.counter.with_separator(docs).sum())

    def take_all(self, docs: Sequence[int]) -> bool:
        cost = self._cost(docs)
        if self.total + cost > self.budget:
            return False
        self.chosen.extend(docs)
        self.total += cost
        return True

    def offer(self, doc: int) -> None:
        self.take_all([doc])

    def full(self) -> bool:
        return self.budget - self.total <= self.tolerance

    def fill(self, candidates: Iterator[int]) -> None:
        misses = 0
        while not self.full() and misses < _MAX_MISSES:
            # Look ahead about as many paragraphs as the remaining budget needs (~100 tokens
            # each) and count them in one batch.
            size = int(np.clip((self.budget - self.total) // 80, 16, 4096))
            block = [d for _, d in zip(range(size), candidates)]
            if not block:
                return
            self.counter.with_separator(block)
            for doc in block:
                if self.take_all([doc]):
                    misses = 0
                else:
                    misses += 1
                if self.full() or misses >= _MAX_MISSES:
                    return

    def describe(self, docs: Sequence[int] | None) -> str:
        if docs is None:
            return f"{self.total} tokens"
        return f"they need {self._cost(docs)} tokens with their headers"


def _fit_last_block(docs: list[int], counter: PoolCounter, target: Target, gold: set[int]) -> list[int]:
    """Drop non-gold documents from the end while the exact count exceeds a token target.

    The running total assumed a separator after every block; the last block has none, which can
    only lower the count with the tokenizers this module supports, so this loop normally does
    nothing. It keeps "at most the target" true for any tokenizer.
    """
    if target.kind != "tokens":
        return docs
    while _measure(docs, counter, ()).num_tokens > target.value:
        drop = max(i for i, d in enumerate(docs) if d not in gold)
        docs = docs[:drop] + docs[drop + 1 :]
    return docs


def _measure(docs: Sequence[int], counter: PoolCounter, gold: Sequence[int]) -> Composition:
    """Exact token count of the rendered ``docs`` and the positions of the ``gold`` paragraphs."""
    blocks = counter.headers(len(docs)) + counter.with_separator(docs)
    blocks[-1] += int(counter.alone([docs[-1]])[0]) - int(counter.with_separator([docs[-1]])[0])
    starts = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    where = {doc: i for i, doc in enumerate(docs)}
    positions = [where[g] for g in gold]
    return Composition(
        docs=tuple(int(d) for d in docs),
        gold_positions=tuple(p + 1 for p in positions),
        gold_token_starts=tuple(int(starts[p]) for p in positions),
        num_tokens=int(blocks.sum()),
    )
