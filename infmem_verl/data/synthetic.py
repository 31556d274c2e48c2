"""Synthetic two-hop QA over long documents of real Wikipedia text.

Each sample hides two one-sentence facts in a haystack of real Wikipedia lead paragraphs:
fact A links an entity X to a bridge entity Y, fact B links Y to the answer Z, and the question
names only X. All three are invented names (built from syllables, or drawn from a closed list of
single-token words, :data:`NameStyle`), so world knowledge cannot answer and the answer never
appears in the question. The facts are spliced between two sentences of
randomly chosen paragraphs, at positions drawn per sample: the reference's data put the gold
paragraphs at the same slots in every sample (spec 8.2 item 6), which this avoids.

Lengths are counted exactly under the given tokenizer from cached per-paragraph counts: a
rendered paragraph followed by its blank-line separator tokenizes independently of its
neighbours (the next paragraph starts right after a line break, where Qwen's pre-tokenizer
always splits), so a context's token count is a sum of cached counts plus a few recounts.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from dataclasses import dataclass
from typing import Iterator, Literal, Sequence

import numpy as np

from ..assets import wiki_paragraphs
from .sample import QASample

_SEPARATOR = "\n\n"
_MIN_TARGET = 512
# Stop filling once the remaining budget is within this fraction of the target (well inside
# the promised 1%: splicing in the facts can move the count by a token or two).
_FILL_TOLERANCE = 0.005
# Give up looking for a paragraph that fits the last gap after this many misses in a row.
_MAX_MISSES = 1000
# Sentence ends safe to splice after: a word of 3+ lowercase letters/digits (so not "Dr." or
# "U.S."), end punctuation, then a space and a capital letter.
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)]{3}[.!?])(?= [A-Z])")

_ONSETS = (
    "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "th", "tr", "vr", "sk", "qu"
)
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou", "ia")
_CODAS = ("", "", "", "n", "r", "l", "s", "th", "m", "nd")


# How the chains' names are made. "syllables": each name built afresh from syllables (a person
# has two words), so a name is several tokens of any tokenizer and never repeats across samples.
# "list": every name one word of NAME_LIST, which the small vocabulary (infmem_verl/small_vocab.py)
# keeps as single tokens - a fact is then copied a name at a time, not a syllable at a time, which
# is what the CPU demo's 2-layer student can learn (docs/experiments/2026-12-06-copying-names.md).
# "roles": the same list, the entity, the bridge and the answer each from its own third, so a
# name's kind tells its role (that student learns to fetch each kind of name separately).
# Questions stay unseen: a chain's three names are drawn anew, so its pairing is new.
NameStyle = Literal["syllables", "list", "roles"]
NAME_LIST_SIZE = 256


@dataclass(frozen=True)
class _Template:
    """A two-hop chain: fact A (X -> Y), fact B (Y -> Z), a question about X answered by Z."""

    name: str
    kinds: tuple[str, str, str]  # name kinds of X, Y, Z
    fact_a: str
    fact_b: str
    question: str
    # One-hop questions over fact A (copy curricula only, never in the documents' set): the
    # bridge asked from the entity, and the entity asked from the bridge.
    bridge_question: str
    entity_question: str


_TEMPLATES = (
    _Template(
        "mentor_birthplace",
        ("person", "person", "place"),
        "The sculptor {x} spent eleven years as an apprentice in the workshop of {y}.",
        "{y} was born in the hill town of {z}, where the family kept an orchard.",
        "In which town was the master who trained the sculptor {x} born?",
        "In whose workshop did the sculptor {x} serve as an apprentice?",
        "Which sculptor was an apprentice in the workshop of {y}?",
    ),
    _Template(
        "maker_final_home",
        ("word", "person", "place"),
        "The brass astrolabe known as the {x} was built by the instrument maker {y}.",
        "In old age, {y} settled in the harbour city of {z} and never travelled again.",
        "In which city did the maker of the {x} astrolabe settle in old age?",
        "Which instrument maker built the {x} astrolabe?",
        "Which astrolabe did the instrument maker {y} build?",
    ),
    _Template(
        "founder_spouse",
        ("place", "person", "person"),
        "The fortress of {x} was founded by the military engineer {y}.",
        "The engineer {y} married the poet {z} after the siege was lifted.",
        "Whom did the founder of the fortress of {x} marry?",
        "Which military engineer founded the fortress of {x}?",
        "Which fortress did the military engineer {y} found?",
    ),
    _Template(
        "ship_captain",
        ("person", "word", "person"),
        "The cartographer {x} reached the southern archipelago aboard the {y}.",
        "The {y} was commanded on all of its voyages by captain {z}.",
        "Who commanded the ship that carried the cartographer {x} to the southern archipelago?",
        "Aboard which ship did the cartographer {x} reach the southern archipelago?",
        "Which cartographer reached the southern archipelago aboard the {y}?",
    ),
    _Template(
        "river_lake_surveyor",
        ("word", "word", "person"),
        "The {x} River empties into Lake {y} after a long course through the lowlands.",
        "Lake {y} was first charted by the surveyor {z}.",
        "Which surveyor first charted the lake into which the {x} River empties?",
        "Into which lake does the {x} River empty?",
        "Which river empties into Lake {y}?",
    ),
    _Template(
        "student_conservatory_director",
        ("person", "place", "person"),
        "The composer {x} received a full scholarship to the conservatory of {y}.",
        "The conservatory of {y} was directed for three decades by {z}.",
        "Who directed the conservatory where the composer {x} studied on a scholarship?",
        "To which conservatory did the composer {x} receive a full scholarship?",
        "Which composer received a full scholarship to the conservatory of {y}?",
    ),
)


def make_sample(index: int, target_tokens: int, tokenizer, seed: int = 0, names: NameStyle = "syllables") -> QASample:
    """Sample ``index`` of the synthetic set ``seed``: a two-hop question over ~``target_tokens``.

    Deterministic in ``(index, target_tokens, seed, names)`` and the tokenizer. ``meta`` records the
    template, entity, bridge, both facts (text, char offset, token position and length in the
    context) and the target and actual token counts. ``names``: see :data:`NameStyle`.
    """
    _check_int(index, "index", 0)
    _check_int(target_tokens, "target_tokens", _MIN_TARGET)
    _check_int(seed, "seed", None)
    style = _check_style(names)
    rng = random.Random(f"infmem-synthetic:{seed}:{index}" + _style_suffix(style))
    counter = _counter(tokenizer)
    template = rng.choice(_TEMPLATES)
    names = _draw_names(rng, template.kinds, style)
    facts = _render_facts(template, names)
    reserve = int(sum(counter.count_texts([" " + fact for fact in facts])))
    chosen = _fill(rng, counter, target_tokens - reserve, target_tokens)
    parts = [counter.pool[i] for i in chosen]
    filler = _SEPARATOR.join(parts)
    # Invented names must not already occur in the haystack, or the chain would be ambiguous.
    while any(name in filler for name in names):
        names = _draw_names(rng, template.kinds, style)
        facts = _render_facts(template, names)
    return _assemble(rng, counter, template, names, facts, chosen, parts, index, target_tokens, seed)


def make_dataset(n: int, target_tokens: int, tokenizer, seed: int = 0, names: NameStyle = "syllables") -> list[QASample]:
    """Samples ``0..n-1`` of the synthetic set ``seed``, each of ~``target_tokens`` tokens."""
    _check_int(n, "n", 0)
    return [make_sample(i, target_tokens, tokenizer, seed, names) for i in range(n)]


@dataclass(frozen=True)
class Chain:
    """One two-hop chain without its haystack: what the memory of a perfect reader holds."""

    template: str
    question: str
    facts: tuple[str, str]
    bridge: str
    answer: str
    entity: str = ""
    # (question, answer) pairs of one hop: the bridge asked from the entity, the entity from the
    # bridge (what a copy curriculum asks besides the chain's own question).
    one_hop: tuple[tuple[str, str], ...] = ()


def chain(index: int, seed: int = 0, names: NameStyle = "syllables") -> Chain:
    """Chain ``index`` of the haystack-free set ``seed``, drawn as the samples draw theirs (an
    unlimited supply of distinct questions for tokenizer text and copy probes, bench/copy_probe.py)."""
    _check_int(index, "index", 0)
    _check_int(seed, "seed", None)
    style = _check_style(names)
    rng = random.Random(f"infmem-synthetic-text:{seed}:{index}" + _style_suffix(style))
    template = rng.choice(_TEMPLATES)
    names = _draw_names(rng, template.kinds, style)
    x, y, z = names
    one_hop = ((template.bridge_question.format(x=x), y), (template.entity_question.format(y=y), x))
    return Chain(template.name, template.question.format(x=x), _render_facts(template, names), y, z, x, one_hop)


def task_texts(n: int, seed: int = 0) -> Iterator[str]:
    """The facts and question of ``n`` chains (:func:`chain`), without the haystack (text to
    train a tokenizer on: the invented names' syllables and the templates)."""
    _check_int(n, "n", 0)
    for index in range(n):
        item = chain(index, seed)
        yield " ".join((*item.facts, item.question, item.answer))


def _check_style(names: object) -> NameStyle:
    if names not in ("syllables", "list", "roles"):
        raise ValueError(f"names: expected 'syllables', 'list' or 'roles', got {names!r}")
    return names  # type: ignore[return-value]


def _style_suffix(style: NameStyle) -> str:
    # The syllable sets keep the seeds they always had; the list sets draw from streams of their own.
    return "" if style == "syllables" else f":{style}"


def _name_list(size: int) -> tuple[str, ...]:
    """``size`` distinct invented words of 2-3 syllables and 5+ letters, the same on every machine."""
    rng = random.Random("infmem-synthetic-name-list")
    words: dict[str, str] = {}
    while len(words) < size:
        word = _word(rng, rng.choice((2, 3)))
        if len(word) >= 5:
            words.setdefault(word.lower(), word)
    return tuple(words.values())


def _check_int(value: object, name: str, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        expected = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _word(rng: random.Random, syllables: int) -> str:
    """An invented capitalised word of ``syllables`` onset-vowel-coda syllables."""
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
    return word.capitalize()


def _name(rng: random.Random, kind: str, style: NameStyle = "syllables", role: int = 0) -> str:
    if style == "list":
        return rng.choice(NAME_LIST)
    if style == "roles":
        return rng.choice(NAME_LIST[role::3])
    if kind == "person":
        return f"{_word(rng, 2)} {_word(rng, 2)}{rng.choice(('', 'ar', 'en', 'ov', 'ith'))}"
    if kind == "place":
        return _word(rng, 3) + rng.choice(("", "heim", "wick", "ora", "ith"))
    return _word(rng, 3)


def _draw_names(rng: random.Random, kinds: Sequence[str], style: NameStyle = "syllables") -> tuple[str, str, str]:
    """Three distinct names, none contained in another (so X's mention never reveals Y or Z)."""
    while True:
        names = tuple(_name(rng, kind, style, role) for role, kind in enumerate(kinds))
        lowered = [n.lower() for n in names]
        if all(a not in b for a, b in itertools.permutations(lowered, 2)):
            return names  # type: ignore[return-value]


def _render_facts(template: _Template, names: Sequence[str]) -> tuple[str, str]:
    x, y, z = names
    return template.fact_a.format(x=x, y=y, z=z), template.fact_b.format(x=x, y=y, z=z)


class _PoolCounter:
    """The rendered Wikipedia pool and lazily computed token counts under one tokenizer.

    ``counts[i]`` is the token count of paragraph ``i`` followed by the separator (-1 until
    needed); filling a 1M-token sample computes each paragraph's count once per process.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pool = _rendered_pool()
        self.counts = np.full(len(self.pool), -1, dtype=np.int64)

    def count_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Token counts of ``texts`` (one batch call; the Rust tokenizer runs it in parallel)."""
        if not texts:
            return np.zeros(0, dtype=np.int64)
        ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))

    def paragraph_counts(self, indices: np.ndarray) -> np.ndarray:
        missing = np.unique(indices[self.counts[indices] < 0])
        if missing.size:
            self.counts[missing] = self.count_texts([self.pool[i] + _SEPARATOR for i in missing])
        return self.counts[indices]


@functools.lru_cache(maxsize=1)
def _rendered_pool() -> tuple[str, ...]:
    """Every Wikipedia paragraph rendered as ``title\\ntext``."""
    return tuple(f"{p['title']}\n{p['text']}" if p["title"] else p["text"] for p in wiki_paragraphs())


# One counter per tokenizer (keyed by class, source and vocabulary size) and process.
_COUNTERS: dict[tuple[str, str, int], _PoolCounter] = {}


def _counter(tokenizer) -> _PoolCounter:
    """The shared :class:`_PoolCounter` of ``tokenizer``."""
    key = (type(tokenizer).__name__, str(getattr(tokenizer, "name_or_path", "")), len(tokenizer))
    if key not in _COUNTERS:
        _COUNTERS[key] = _PoolCounter(tokenizer)
    return _COUNTERS[key]


def _pool_order(rng: random.Random, size: int) -> Iterator[int]:
    """Pool indices in a per-sample random order, reshuffled (repeating paragraphs) when used up."""
    while True:
        order = list(range(size))
        rng.shuffle(order)
        yield from order


def _fill(rng: random.Random, counter: _PoolCounter, budget: int, target: int) -> list[int]:
    """Paragraph indices whose separated token counts sum to within tolerance below ``budget``.

    Greedy over the shuffled pool: a paragraph is taken when it fits, skipped otherwise, so the
    last gap is closed by a short paragraph instead of overshooting the target.
    """
    tolerance = max(1, int(target * _FILL_TOLERANCE))
    order = _pool_order(rng, len(counter.pool))
    chosen: list[int] = []
    total = misses = 0
    while budget - total > tolerance and misses < _MAX_MISSES:
        # Look ahead about as many paragraphs as the remaining budget needs (~100 tokens each).
        block = np.fromiter(itertools.islice(order, int(np.clip((budget - total) // 80, 32, 4096))), dtype=np.int64)
        for idx, count in zip(block.tolist(), counter.paragraph_counts(block).tolist()):
            if total + count <= budget:
                chosen.append(idx)
                total += count
                misses = 0
            else:
                misses += 1
            if budget - total <= tolerance or misses >= _MAX_MISSES:
                break
    return chosen


def _assemble(
    rng: random.Random,
    counter: _PoolCounter,
    template: _Template,
    names: tuple[str, str, str],
    facts: tuple[str, str],
    chosen: list[int],
    parts: list[str],
    index: int,
    target: int,
    seed: int,
) -> QASample:
    """Splice the facts into two random paragraphs and compute exact offsets and counts."""
    hosts = [i for i, part in enumerate(parts) if _sentence_ends(part)]
    if len(hosts) < 2:
        raise ValueError(f"target_tokens: {target} leaves fewer than two paragraphs to hide the facts in")
    host_parts = rng.sample(hosts, 2)
    cuts = [rng.choice(_sentence_ends(parts[p])) for p in host_parts]
    parts = list(parts)
    for part, cut, fact in zip(host_parts, cuts, facts):
        parts[part] = parts[part][:cut] + " " + fact + parts[part][cut:]
    last = len(parts) - 1
    # Recount what changed: the two host paragraphs, the prefix before each fact, and the last
    # paragraph, which has no separator after it.
    recount = counter.count_texts(
        [parts[p] + _SEPARATOR for p in host_parts]
        + [parts[p][:cut] for p, cut in zip(host_parts, cuts)]
        + [parts[last], " " + facts[0], " " + facts[1]]
    )
    counts = counter.counts[np.asarray(chosen, dtype=np.int64)].copy()
    counts[host_parts] = recount[:2]
    counts[last] = recount[4]
    token_starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    char_starts = np.concatenate([[0], np.cumsum([len(p) + len(_SEPARATOR) for p in parts])[:-1]])
    fact_meta = [
        {
            "text": fact,
            "paragraph": int(p),
            "char_offset": int(char_starts[p] + cut + 1),
            "token_position": int(token_starts[p] + prefix_tokens),
            "num_tokens": int(fact_tokens),
        }
        for fact, p, cut, prefix_tokens, fact_tokens in zip(facts, host_parts, cuts, recount[2:4], recount[5:7])
    ]
    x, y, z = names
    return QASample(
        id=f"synthetic-s{seed}-t{target}-{index}",
        question=template.question.format(x=x),
        answers=[z],
        context=_SEPARATOR.join(parts),
        source="synthetic",
        meta={
            "template": template.name,
            "entity": x,
            "bridge": y,
            "facts": fact_meta,
            "target_tokens": target,
            "num_tokens": int(counts.sum()),  # becomes the training file's extra_info.num_tokens
            "num_paragraphs": len(parts),
            "seed": seed,
            "index": index,
        },
    )


def _sentence_ends(part: str) -> list[int]:
    """Char offsets right after a sentence's end punctuation, in the text (not the title line)."""
    body = part.find("\n") + 1
    return [m.start() for m in _SENTENCE_END.finditer(part, body)]


NAME_LIST = _name_list(NAME_LIST_SIZE)
