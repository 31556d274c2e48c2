"""BM25 retrieval over the retrieval units of one document.

The reference RL code passed raw strings to ``rank_bm25.BM25Okapi``, which indexed *characters*
while queries were split into words, so every query scored 0 and "retrieval" returned the first
units of the document (spec 2.4, 8.1 item 1). Here one :class:`Analyzer` turns both the units and
the query into terms, and the default ``"sparse"`` backend scores with a non-negative idf, so a
query word present in the document always contributes a positive score. It also scores the
query's adjacent term pairs (``retrieval.bigram_weight``), which real queries often share with
their evidence in order ("1968 film by Stanley Kubrick"), and the title line over each unit's
paragraph as a field of its own (``retrieval.heading_weight``), so a question that names an
article's subject ("What is the population of Italy?") finds that article among the many whose
text mentions it.

The index is built once per document and shared by every rollout that reads it; a search returns
at most ``top_k`` units with a positive score, best first, ties broken by unit position so results
do not depend on sort stability. Scope rules (read prefix only, current chunk excluded) are the
caller's: it passes them as a boolean ``allowed`` mask over units.
"""

from __future__ import annotations

import array
import collections
import functools
import itertools
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Mapping, Protocol

import numpy as np
import scipy.sparse

from infmem_verl.agent.config import RetrievalConfig
from infmem_verl.agent.document import Document
from infmem_verl.agent.whitespace import WhitespaceAnalyzer

# Words: runs of letters/digits of any script, except CJK (handled below); anything else
# (punctuation, underscore, whitespace) separates words, so "Paris," and "paris" match.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_TOKEN_RE = re.compile(rf"[{_CJK}]+|[^\W_{_CJK}]+")
_CJK_RE = re.compile(rf"[{_CJK}]")
# The same split for ASCII text, without the regex engine: every ASCII character that is not a
# letter or digit becomes a space, then str.split(). About 7 in 10 units of a Wikipedia
# document are pure ASCII, and this is where the regex spent most of a 1M-token build's analysis.
_ASCII_SEPARATORS = str.maketrans({i: " " for i in range(128) if not chr(i).isalnum()})

# Most words an analyzer keeps stemmed. The analyzers are process-wide, so whatever the cache
# holds stays for the process: the first document to fill it carries it in its peak memory. It
# starts over when full. A 1M-token Wikipedia document has ~43K distinct words; analysing all its
# units took 0.47 / 0.48 / 0.50 s of CPU with room for 65,536 / 16,384 / 8,192 words, the cache
# holding 43,144 / 15,525 / 1,062 words at the end, ~110 bytes a word (4.5 / 1.7 / 0.1 MiB; see
# docs/experiments/2026-12-04-retrieval-cost.md).
STEM_CACHE_WORDS = 1 << 14
# Units whose terms SparseBM25 turns into matrix entries at a time (~3K terms of Wikipedia text).
# At 1M tokens 256 built 6% faster than 64 but raised a first sample's peak memory from
# 4.3-4.4x to 4.6x its text (bench.agent_core, target 5x).
_INGEST_UNITS = 64
# BM25 weights are computed this many matrix entries at a time, bounding float64 temporaries.
_WEIGHT_BLOCK = 1 << 16
# numpy type of each array typecode SparseBM25 collects term counts in.
_COUNT_TYPES = {"H": np.uint16, "I": np.uint32}

# Compact English stopword list: function words that carry no topic. Single letters left by
# apostrophes ("Seurat's" -> "seurat", "s"; "don't" -> "don", "t") are included.
STOPWORDS: frozenset[str] = frozenset(
    """
    a about above after again against all also am an and any are as at be because been before
    being below between both but by can could d did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is it
    its itself just ll m me more most my myself no nor not now of off on once only or other our
    ours ourselves out over own re s same she should so some such t than that the their theirs
    them themselves then there these they this those through to too under until up ve very was
    we were what when where which while who whom whose why will with would you your yours
    yourself yourselves
    """.split()
)


class Analyzer:
    """Text to BM25 terms; one instance serves units and queries alike.

    Lowercased word tokens (CJK runs become unigrams plus bigrams, since CJK has no spaces),
    optional stopword removal, optional Snowball English stemming. Stems are cached per distinct
    word, so a 1M-token document stems only its vocabulary, not every occurrence; the cache holds
    at most ``max_stems`` words and starts over when full.
    """

    def __init__(self, stem: bool, stopwords: bool, max_stems: int = STEM_CACHE_WORDS) -> None:
        if isinstance(max_stems, bool) or not isinstance(max_stems, int) or max_stems < 1:
            raise ValueError(f"max_stems: expected an integer >= 1, got {max_stems!r}")
        self.stem = stem
        self.stopwords = stopwords
        self.max_stems = max_stems
        # Replaced by a new dict when full, never cleared in place: a reader holding the old one
        # still finds every word it checked (see _stems_of).
        self._stems: dict[str, str] = {}
        self._stemmer = _snowball_english() if stem else None
        # PyStemmer objects must not be used by two threads at once.
        self._lock = threading.Lock()

    def words(self, text: str) -> list[str]:
        """Lowercased word tokens of ``text``, before stopwords and stemming."""
        text = text.lower()
        if text.isascii():
            return text.translate(_ASCII_SEPARATORS).split()
        out: list[str] = []
        for token in _TOKEN_RE.findall(text):
            if _CJK_RE.match(token):
                out.extend(token)
                out.extend(token[i : i + 2] for i in range(len(token) - 1))
            else:
                out.append(token)
        return out

    def analyze(self, text: str) -> list[str]:
        """The terms of ``text``: words, without stopwords if enabled, stemmed if enabled."""
        words = self.words(text)
        if self._stemmer is None:
            return [w for w in words if w not in STOPWORDS] if self.stopwords else words
        stems = self._stems_of(words)
        if self.stopwords:
            return [stems[w] for w in words if w not in STOPWORDS]
        return [stems[w] for w in words]

    @property
    def num_cached_stems(self) -> int:
        """Words whose stems are cached now (at most ``max_stems``)."""
        return len(self._stems)

    def _stems_of(self, words: list[str]) -> Mapping[str, str]:
        """A mapping holding the stem of each of ``words``, stemming and caching unknown ones."""
        known = self._stems
        unknown = list(set(words).difference(known))
        if not unknown:
            return known
        with self._lock:
            # A word that is its own stem (about half of a document's words) maps to itself, and
            # words of one stem share its string: the cache then holds little beyond its keys.
            canonical: dict[str, str] = {}
            stemmed = [w if s == w else canonical.setdefault(s, s) for w, s in zip(unknown, self._stemmer.stemWords(unknown))]
            cache = self._stems
            if len(cache) + len(unknown) > self.max_stems:
                cache = self._stems = {}
            if len(unknown) <= self.max_stems:
                cache.update(zip(unknown, stemmed))
        # The cache may have started over since `known` was read; `known` itself is never
        # emptied, so it still holds every word that was not unknown.
        return known if cache is known else collections.ChainMap(dict(zip(unknown, stemmed)), known)


def _snowball_english():
    import Stemmer  # PyStemmer

    # Its own cache off (size 0): the analyzer stems each distinct word once and caches it
    # itself, so PyStemmer's 10,000-word cache would only hold a second copy.
    return Stemmer.Stemmer("english", 0)


@functools.lru_cache(maxsize=None)
def get_analyzer(stem: bool, stopwords: bool) -> Analyzer:
    """The shared analyzer for these flags (its stem cache then serves every index)."""
    return Analyzer(stem=stem, stopwords=stopwords)


@dataclass(frozen=True)
class Hit:
    """One retrieved unit: its position in the document and the score it was ranked by."""

    unit: int
    score: float


class _Scorer(Protocol):
    """A BM25 backend: scores of every unit for a list of query terms."""

    def scores(self, terms: list[str]) -> np.ndarray: ...


class SparseBM25:
    """BM25 as a precomputed sparse term-by-unit weight matrix; a query is a weighted row sum.

    idf = ln(1 + (N - df + 0.5) / (df + 0.5)) (Lucene's form) is positive for every term, even
    one present in every unit, unlike BM25Okapi's ln((N - df + 0.5) / (df + 0.5)).

    With ``bigram_weight > 0`` a unit's score adds ``bigram_weight`` times the same BM25 over the
    pairs of adjacent terms (after stopword removal: "species of fruit tree" pairs "speci fruit"
    and "fruit tree"; normalised by the unit's length in terms), so of two units holding the
    query's words the one holding them in the query's order ranks first. Pairs are not indexed:
    a 1M-token document has ~0.5M distinct ones, and their matrix more than doubled the peak
    memory of preparing a document. The index keeps the document's term ids in order instead
    (4 bytes a term, units separated by -1), and a search reads there only the units that hold
    both terms of a query pair (the term matrix's rows say which), so a pair's document
    frequency and counts are exact.

    With ``heading_weight > 0`` and ``heading_terms`` (one list per unit: the analysed heading of
    its paragraph), a unit's score adds ``heading_weight`` times BM25 over its heading's terms
    (:meth:`_heading_matrix`): one more field, as BM25F has a title field, kept apart from the
    body so that the title counts for every unit of a long article, not only its first.
    """

    def __init__(
        self,
        unit_terms: Iterable[Sequence[str]],
        k1: float,
        b: float,
        bigram_weight: float = 0.0,
        heading_terms: Sequence[Sequence[str]] | None = None,
        heading_weight: float = 0.0,
    ) -> None:
        # Streamed: a block of units' terms at a time become each unit's distinct term ids and
        # their counts, so memory grows with the matrix, not with the document's tokens.
        self.vocab: dict[str, int] = {}
        self.k1 = k1
        self.bigram_weight = float(bigram_weight)
        # The entries go into growing flat buffers, not one array per unit: at 1M tokens ~9,000
        # units x 3 arrays of ~100 bytes of header each were ~3 MiB of the build's peak.
        # Counts as 16-bit integers while the matrix is converted (two copies of the entries
        # exist then, and this was its peak: 12 bytes an entry instead of 16); a unit of more
        # than 65,535 terms, which no document config cuts, widens them to 32 bits.
        term_ids, counts, sequence = array.array("i"), array.array("H"), array.array("i")
        lengths, widths = array.array("q"), array.array("q")
        units = iter(unit_terms)
        while block := list(itertools.islice(units, _INGEST_UNITS)):
            # Python touches each of the block's distinct terms once; the rest runs in C. Term ids
            # are given in order of first occurrence, as a unit-by-unit walk would give them.
            sizes = np.fromiter(map(len, block), dtype=np.int64, count=len(block))
            flat = list(itertools.chain.from_iterable(block))
            ids_of = dict.fromkeys(flat)
            for term in ids_of:
                ids_of[term] = self.vocab.setdefault(term, len(self.vocab))
            ids = np.fromiter(map(ids_of.__getitem__, flat), dtype=np.int32, count=len(flat))
            # (unit, term) pairs as one sortable key: unit in the high 32 bits.
            keys, count = np.unique(np.repeat(np.arange(len(block), dtype=np.int64), sizes) << 32 | ids, return_counts=True)
            term_ids.frombytes((keys & 0xFFFFFFFF).astype(np.int32).tobytes())
            if sizes.max() > 0xFFFF and counts.typecode == "H":
                counts = array.array("I", counts)
            counts.frombytes(count.astype(_COUNT_TYPES[counts.typecode]).tobytes())
            if self.bigram_weight > 0:
                sequence.frombytes(np.insert(ids, np.cumsum(sizes), _UNIT_END).astype(np.int32).tobytes())
            lengths.frombytes(sizes.tobytes())
            widths.frombytes(np.bincount(keys >> 32, minlength=len(block)).astype(np.int64).tobytes())
        n_units = len(lengths)
        # Unit by unit the entries form the columns of the term-by-unit matrix; tocsr() gives
        # the term rows a query selects, column indices sorted. The buffers are freed as soon as
        # the conversion is done, so at most two copies of the entries exist at any time.
        indptr = np.concatenate([[0], np.cumsum(_view(widths, np.int64))])
        tf = scipy.sparse.csc_matrix(
            (_view(counts, _COUNT_TYPES[counts.typecode]), _view(term_ids, np.int32), indptr), shape=(len(self.vocab), n_units)
        )
        tf = tf.tocsr()
        del term_ids, counts
        tf.data = tf.data.astype(np.float32)  # the weights' type (_bm25_weights fills it in place)
        unit_lengths = _view(lengths, np.int64)
        avgdl = max(float(unit_lengths.mean()), 1.0) if n_units else 1.0
        self.norm = k1 * (1.0 - b + b * unit_lengths / avgdl)
        self.idf = _idf(tf)
        _bm25_weights(tf, self.idf, self.norm, k1)
        self.weights = tf
        self.n_units = n_units
        self.heading_weight = float(heading_weight)
        self.headings = None
        if self.heading_weight > 0 and heading_terms is not None:
            self.headings = self._heading_matrix(heading_terms, k1)
        self.term_sequence = _view(sequence, np.int32)  # shares the buffer: no copy
        self.unit_lengths = unit_lengths
        # Position in term_sequence of each unit's first term (each unit's terms, then -1).
        self.unit_starts = np.cumsum(unit_lengths + 1) - (unit_lengths + 1)

    def scores(self, terms: list[str]) -> np.ndarray:
        ids = np.array([self.vocab.get(t, -1) for t in terms], dtype=np.int64)
        scores = np.zeros(self.n_units, dtype=np.float64)
        present = ids[ids >= 0]
        if len(present):
            uniq, counts = np.unique(present, return_counts=True)
            # Repeated query terms count once per occurrence, as in BM25Okapi.
            scores += np.asarray(self.weights[uniq].T @ counts.astype(np.float32), dtype=np.float64)
            if self.headings is not None:
                scores += self.heading_weight * np.asarray(self.headings[uniq].T @ counts.astype(np.float32), dtype=np.float64)
        if self.bigram_weight > 0:
            scores += self.bigram_weight * self._pair_scores(ids)
        return scores

    def _heading_matrix(self, heading_terms: Sequence[Sequence[str]], k1: float) -> scipy.sparse.csr_matrix:
        """BM25 weights of each unit's heading terms, term by unit, as one more field of the unit.

        The idf is the body's (a heading word common in the document's text, "Season" or "Law",
        earns little), and heading lengths are normalised with :data:`HEADING_B`. A heading
        term absent from every unit's text (impossible for headings read from the text) counts
        in its heading's length and scores nothing.
        """
        if len(heading_terms) != self.n_units:
            raise ValueError(f"heading_terms: expected one entry per unit ({self.n_units}), got {len(heading_terms)}")
        # Flat buffers, not lists of Python ints (36 bytes an entry instead of 8 or 4).
        rows, cols, counts = array.array("q"), array.array("q"), array.array("f")
        lengths = np.zeros(self.n_units, dtype=np.int64)
        for unit, terms in enumerate(heading_terms):
            ids = [self.vocab[t] for t in terms if t in self.vocab]
            lengths[unit] = len(terms)
            for term, count in collections.Counter(ids).items():
                rows.append(term)
                cols.append(unit)
                counts.append(count)
        tf = scipy.sparse.csr_matrix(
            (_view(counts, np.float32), (_view(rows, np.int64), _view(cols, np.int64))), shape=(len(self.vocab), self.n_units)
        )
        del rows, cols, counts
        tf.sort_indices()
        avg = max(float(lengths[lengths > 0].mean()), 1.0) if lengths.any() else 1.0
        _bm25_weights(tf, self.idf, k1 * (1.0 - HEADING_B + HEADING_B * lengths / avg), k1)
        return tf

    def _pair_scores(self, ids: np.ndarray) -> np.ndarray:
        """BM25 of the query's adjacent pairs of known terms, counted in the units holding both.

        One pass for all pairs: the term positions of every unit holding both terms of some pair
        are read once, and each position followed by the term that completes a query pair counts
        for that pair and unit.
        """
        out = np.zeros(self.n_units, dtype=np.float64)
        repeats = collections.Counter((int(a), int(b)) for a, b in zip(ids[:-1], ids[1:]) if a >= 0 and b >= 0)
        holding = {p: self._units_holding_both(*p) for p in repeats}
        pairs = sorted(p for p, both in holding.items() if len(both))
        if not pairs:
            return out
        units = np.unique(np.concatenate([holding[p] for p in pairs]))
        lengths = self.unit_lengths[units]
        owner = np.repeat(np.arange(len(units)), lengths)
        positions = np.repeat(self.unit_starts[units] - (np.cumsum(lengths) - lengths), lengths) + np.arange(lengths.sum())
        # A pair as first * V + second (V = vocabulary size; sorted as ``pairs`` is); -1 ends a
        # unit, so no pair spans two.
        vocab = len(self.vocab)
        keys = np.array([a * vocab + b for a, b in pairs], dtype=np.int64)
        seq = self.term_sequence
        found = seq[positions].astype(np.int64) * vocab + seq[positions + 1]
        pair_of = np.minimum(np.searchsorted(keys, found), len(keys) - 1)
        hit = keys[pair_of] == found
        # Distinct (pair, unit) cells and their counts: tf of the pair in the unit.
        cells, tf = np.unique(pair_of[hit] * len(units) + owner[hit], return_counts=True)
        pair, unit = np.divmod(cells, len(units))
        df = np.bincount(pair, minlength=len(pairs))
        idf = np.log1p((self.n_units - df + 0.5) / (df + 0.5))
        weight = np.array([repeats[p] for p in pairs], dtype=np.float64)[pair] * idf[pair]
        np.add.at(out, units[unit], weight * tf * (self.k1 + 1.0) / (tf + self.norm[units[unit]]))
        return out

    def _units_holding_both(self, first: int, second: int) -> np.ndarray:
        """The units holding both term ids, ascending."""
        return np.intersect1d(self._units_holding(first), self._units_holding(second), assume_unique=True)

    def _units_holding(self, term: int) -> np.ndarray:
        """The units holding term id ``term``, ascending (its row of the weight matrix)."""
        return self.weights.indices[self.weights.indptr[term] : self.weights.indptr[term + 1]]


# Length normalisation of the heading field: BM25's usual b, so of two headings holding a query's
# word the shorter ("Italy" against "Renaissance architecture in Italy") is the closer match.
HEADING_B = 0.75
# Ends each unit's terms in SparseBM25.term_sequence (never a term id).
_UNIT_END = -1


def _view(buffer: array.array, dtype) -> np.ndarray:
    """``buffer``'s items as an array sharing its memory (an empty one for an empty buffer)."""
    return np.frombuffer(buffer, dtype=dtype) if len(buffer) else np.zeros(0, dtype=dtype)


def _idf(tf: scipy.sparse.csr_matrix) -> np.ndarray:
    """Each term's idf over the units (columns) of a term-by-unit count matrix."""
    df = np.diff(tf.indptr)
    return np.log1p((tf.shape[1] - df + 0.5) / (df + 0.5))


def _bm25_weights(tf: scipy.sparse.csr_matrix, idf: np.ndarray, norm: np.ndarray, k1: float) -> None:
    """Turn the term counts of ``tf`` (float32) into BM25 weights, in place.

    ``idf[t]`` is term t's idf, ``norm[u]`` is ``k1 * (1 - b + b * len(u) / avgdl)``. Each
    block of entries is computed in float64 and rounded once to float32, so the weights do not
    depend on the block size.
    """
    data = tf.data
    for start in range(0, data.size, _WEIGHT_BLOCK):
        stop = min(start + _WEIGHT_BLOCK, data.size)
        rows = np.searchsorted(tf.indptr, np.arange(start, stop), side="right") - 1
        counts = data[start:stop].astype(np.float64)
        data[start:stop] = idf[rows] * counts * (k1 + 1.0) / (counts + norm[tf.indices[start:stop]])


class RankBM25:
    """``rank_bm25.BM25Okapi`` over the analyzer's terms: the reference's library, kept selectable.

    Its idf can be 0 or replaced by ``epsilon * mean idf`` for words in half the units or more,
    so a common query word may add nothing; the sparse backend has no such case.
    """

    def __init__(self, unit_terms: Iterable[Sequence[str]], k1: float, b: float) -> None:
        from rank_bm25 import BM25Okapi

        unit_terms = [list(terms) for terms in unit_terms]  # BM25Okapi keeps every unit's terms
        self.n_units = len(unit_terms)
        # BM25Okapi divides by the vocabulary size: it cannot index a term-less document.
        has_terms = any(unit_terms)
        self._bm25 = BM25Okapi(unit_terms, k1=k1, b=b) if has_terms else None

    def scores(self, terms: list[str]) -> np.ndarray:
        if self._bm25 is None or not terms:
            return np.zeros(self.n_units, dtype=np.float64)
        return np.asarray(self._bm25.get_scores(terms), dtype=np.float64)


class BM25Index:
    """A BM25 index over the retrieval units of one document; build with :meth:`build`."""

    def __init__(
        self, unit_texts: Sequence[str], analyzer: Analyzer, scorer: _Scorer, cfg: RetrievalConfig, rerank: bool = False
    ) -> None:
        self.unit_texts = unit_texts
        self.analyzer = analyzer
        self.scorer = scorer
        self.cfg = cfg
        self.rerank = rerank  # the dense stage on (``cfg.rerank_enabled`` at the document's length)
        self._embeddings = None  # MiniLM unit embeddings, created on the first reranked search
        self._embeddings_lock = threading.Lock()

    @classmethod
    def build(
        cls,
        unit_texts: Sequence[str],
        cfg: RetrievalConfig,
        unit_headings: Sequence[str] | None = None,
        num_tokens: int | None = None,
    ) -> "BM25Index":
        """Analyze every unit and build the backend named by ``cfg.backend``.

        ``unit_texts`` is iterated once, unit by unit (a lazy :class:`~.document.UnitTexts`
        decodes in batches), and kept for reranking, which reads a few units by index.
        ``unit_headings`` (``Document.unit_headings()``: the title over each unit) is scored as a
        field of its own with ``cfg.heading_weight``; without it no unit has a heading.
        ``num_tokens`` (the document's length) decides ``cfg.rerank="auto"``; unknown, the dense
        stage stays off under "auto".
        """
        if len(unit_texts) == 0:
            raise ValueError("unit_texts: expected at least one retrieval unit, got an empty sequence")
        if unit_headings is not None and len(unit_headings) != len(unit_texts):
            raise ValueError(f"unit_headings: expected one per unit ({len(unit_texts)}), got {len(unit_headings)}")
        cfg.validate("retrieval")  # ConfigError naming the field (backend, k1, b, ...)
        analyzer = WhitespaceAnalyzer() if cfg.analyzer == "whitespace" else get_analyzer(cfg.stem, cfg.stopwords)
        unit_terms = (analyzer.analyze(text) for text in unit_texts)
        if cfg.backend == "sparse":
            heading_terms = None
            if cfg.heading_weight > 0 and unit_headings is not None:
                terms_of = {h: analyzer.analyze(h) for h in set(unit_headings)}  # units of a paragraph share one
                heading_terms = [terms_of[h] for h in unit_headings]
            scorer = SparseBM25(
                unit_terms,
                k1=cfg.k1,
                b=cfg.b,
                bigram_weight=cfg.bigram_weight,
                heading_terms=heading_terms,
                heading_weight=cfg.heading_weight,
            )
        else:  # validate() refuses bigram and heading weights here
            scorer = RankBM25(unit_terms, k1=cfg.k1, b=cfg.b)
        return cls(unit_texts, analyzer, scorer, cfg, rerank=cfg.rerank_enabled(num_tokens))

    @classmethod
    def of_document(cls, document: Document, cfg: RetrievalConfig, unit_texts: Sequence[str] | None = None) -> "BM25Index":
        """The index of ``document``'s units, with their headings when ``cfg.heading_weight``
        scores them (decoded once here, not kept). ``unit_texts``: the units already decoded (a
        benchmark building many indexes decodes once); by default decoded lazily."""
        headings = document.unit_headings() if cfg.heading_weight > 0 else None
        return cls.build(document.unit_texts() if unit_texts is None else unit_texts, cfg, headings, document.num_tokens)

    @property
    def num_units(self) -> int:
        return len(self.unit_texts)

    @property
    def num_embedded(self) -> int:
        """Units embedded so far by the second stage (0 until a reranked search needs them)."""
        return 0 if self._embeddings is None else self._embeddings.num_embedded

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every unit for ``query`` (float64, one per unit)."""
        return self.scorer.scores(self.analyzer.analyze(query))

    def search(self, query: str, top_k: int, allowed: np.ndarray | None = None) -> list[Hit]:
        """At most ``top_k`` allowed units with a positive BM25 score, best first.

        With the dense stage on (:attr:`rerank`) the best ``max(rerank_candidates, top_k)`` of them are reordered by
        fusing their BM25 scores with their embedding similarities (``cfg.rerank_model``) as
        ``cfg.fusion`` says
        (:func:`infmem_verl.agent.rerank.fuse`), and ``Hit.score`` is the fused score.
        """
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise ValueError(f"top_k: expected an integer >= 1, got {top_k!r}")
        scores = self.scores(query)
        if allowed is not None:
            scores = np.where(self._check_mask(allowed), scores, 0.0)
        if not self.rerank:
            return _top(scores, int(top_k))
        pool = _top(scores, max(int(top_k), self.cfg.rerank_candidates))
        return self._rerank(query, pool)[: int(top_k)]

    def _check_mask(self, allowed: np.ndarray) -> np.ndarray:
        allowed = np.asarray(allowed)
        if allowed.dtype != np.bool_ or allowed.shape != (self.num_units,):
            raise ValueError(
                f"allowed: expected a boolean mask of shape ({self.num_units},), "
                f"got dtype {allowed.dtype} and shape {allowed.shape}"
            )
        return allowed

    @property
    def embeddings(self):
        """The document's unit embeddings, created on first use and shared by every search of
        this index: :class:`~.static_embed.StaticEmbeddings` (``rerank_model="static"``: every
        unit, one pass) or :class:`~.rerank.UnitEmbeddings` (``"minilm"``: candidates only)."""
        with self._embeddings_lock:
            if self._embeddings is None:
                if self.cfg.rerank_model == "static":
                    from infmem_verl.agent.static_embed import StaticEmbeddings

                    self._embeddings = StaticEmbeddings(self.unit_texts)
                else:
                    from infmem_verl.agent.rerank import UnitEmbeddings

                    self._embeddings = UnitEmbeddings(
                        self.unit_texts,
                        self.cfg.rerank_window_tokens,
                        self.cfg.rerank_windows,
                        threads=self.cfg.rerank_threads,
                        compiled=self.cfg.rerank_compile,
                    )
            return self._embeddings

    def _rerank(self, query: str, pool: list[Hit]) -> list[Hit]:
        """Reorder BM25's pool (best first) by fusing BM25 scores with embedding similarities."""
        if not pool:
            return pool
        from infmem_verl.agent.rerank import fuse

        units = np.array([h.unit for h in pool], dtype=np.int64)
        sims = self.embeddings.similarities(query, units)
        fused = fuse(self.cfg.fusion, np.array([h.score for h in pool]), sims, self.cfg.fusion_weight)
        return [Hit(int(units[i]), float(fused[i])) for i in _rank(fused, units)]


def _rank(scores: np.ndarray, units: np.ndarray) -> np.ndarray:
    """Order of ``scores`` from best to worst, equal scores by lower unit position first."""
    return np.lexsort((units, -scores))


def _top(scores: np.ndarray, k: int) -> list[Hit]:
    """The ``k`` best positive scores as hits, best first, ties by unit position."""
    units = np.flatnonzero(scores > 0)
    if len(units) > k:
        # Keep every unit tied with the k-th best so the tie-break below sees all of them.
        kth = np.partition(scores[units], len(units) - k)[len(units) - k]
        units = units[scores[units] >= kth]
    order = _rank(scores[units], units)[:k]
    return [Hit(int(units[i]), float(scores[units[i]])) for i in order]

