"""BM25 retrieval over the retrieval units of one document.

The reference RL code passed raw strings to ``rank_bm25.BM25Okapi``, which indexed *characters*
while queries were split into words, so every query scored 0 and "retrieval" returned the first
units of the document (spec 2.4, 8.1 item 1). Here one :class:`Analyzer` turns both the units and
the query into terms, and the default ``"sparse"`` backend scores with a non-negative idf, so a
query word present in the document always contributes a positive score.

The index is built once per document and shared by every rollout that reads it; a search returns
at most ``top_k`` units with a positive score, best first, ties broken by unit position so results
do not depend on sort stability. Scope rules (read prefix only, current chunk excluded) are the
caller's: it passes them as a boolean ``allowed`` mask over units.
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import scipy.sparse

from infmem_verl.agent.config import RetrievalConfig

# Words: runs of letters/digits of any script, except CJK (handled below); anything else
# (punctuation, underscore, whitespace) separates words, so "Paris," and "paris" match.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_TOKEN_RE = re.compile(rf"[{_CJK}]+|[^\W_{_CJK}]+")
_CJK_RE = re.compile(rf"[{_CJK}]")

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
    word, so a 1M-token document stems only its vocabulary, not every occurrence.
    """

    def __init__(self, stem: bool, stopwords: bool) -> None:
        self.stem = stem
        self.stopwords = stopwords
        self._stems: dict[str, str] = {}
        self._stemmer = _snowball_english() if stem else None
        # PyStemmer objects must not be used by two threads at once.
        self._lock = threading.Lock()

    def words(self, text: str) -> list[str]:
        """Lowercased word tokens of ``text``, before stopwords and stemming."""
        out: list[str] = []
        for token in _TOKEN_RE.findall(text.lower()):
            if _CJK_RE.match(token):
                out.extend(token)
                out.extend(token[i : i + 2] for i in range(len(token) - 1))
            else:
                out.append(token)
        return out

    def analyze(self, text: str) -> list[str]:
        """The terms of ``text``: words, without stopwords if enabled, stemmed if enabled."""
        words = self.words(text)
        if self.stopwords:
            words = [w for w in words if w not in STOPWORDS]
        if self._stemmer is None:
            return words
        stems = self._stems
        unknown = list({w for w in words if w not in stems})
        if unknown:
            with self._lock:
                stems.update(zip(unknown, self._stemmer.stemWords(unknown)))
        return [stems[w] for w in words]


def _snowball_english():
    import Stemmer  # PyStemmer

    return Stemmer.Stemmer("english")


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
    """

    def __init__(self, unit_terms: Sequence[list[str]], k1: float, b: float) -> None:
        self.vocab: dict[str, int] = {}
        n_units = len(unit_terms)
        lengths = np.fromiter((len(t) for t in unit_terms), dtype=np.int64, count=n_units)
        term_ids = np.fromiter(
            (self.vocab.setdefault(t, len(self.vocab)) for terms in unit_terms for t in terms),
            dtype=np.int32,
            count=int(lengths.sum()),
        )
        unit_ids = np.repeat(np.arange(n_units, dtype=np.int32), lengths)
        # Duplicate (term, unit) pairs are summed on conversion: the data becomes term counts.
        tf = scipy.sparse.csr_matrix(
            (np.ones(len(term_ids), dtype=np.float32), (term_ids, unit_ids)),
            shape=(len(self.vocab), n_units),
        )
        df = np.diff(tf.indptr)
        idf = np.log1p((n_units - df + 0.5) / (df + 0.5))
        avgdl = max(float(lengths.mean()), 1.0) if n_units else 1.0
        norm = k1 * (1.0 - b + b * lengths / avgdl)
        row_idf = np.repeat(idf, df)
        counts = tf.data.astype(np.float64)
        tf.data = (row_idf * counts * (k1 + 1.0) / (counts + norm[tf.indices])).astype(np.float32)
        self.weights = tf
        self.n_units = n_units

    def scores(self, terms: list[str]) -> np.ndarray:
        ids = [self.vocab[t] for t in terms if t in self.vocab]
        if not ids:
            return np.zeros(self.n_units, dtype=np.float64)
        uniq, counts = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
        # Repeated query terms count once per occurrence, as in BM25Okapi.
        return np.asarray(self.weights[uniq].T @ counts.astype(np.float32), dtype=np.float64)


class RankBM25:
    """``rank_bm25.BM25Okapi`` over the analyzer's terms: the reference's library, kept selectable.

    Its idf can be 0 or replaced by ``epsilon * mean idf`` for words in half the units or more,
    so a common query word may add nothing; the sparse backend has no such case.
    """

    def __init__(self, unit_terms: Sequence[list[str]], k1: float, b: float) -> None:
        from rank_bm25 import BM25Okapi

        self.n_units = len(unit_terms)
        # BM25Okapi divides by the vocabulary size: it cannot index a term-less document.
        has_terms = any(unit_terms)
        self._bm25 = BM25Okapi(list(unit_terms), k1=k1, b=b) if has_terms else None

    def scores(self, terms: list[str]) -> np.ndarray:
        if self._bm25 is None or not terms:
            return np.zeros(self.n_units, dtype=np.float64)
        return np.asarray(self._bm25.get_scores(terms), dtype=np.float64)


_BACKENDS: dict[str, type] = {"sparse": SparseBM25, "rank_bm25": RankBM25}


class BM25Index:
    """A BM25 index over the retrieval units of one document; build with :meth:`build`."""

    def __init__(self, unit_texts: Sequence[str], analyzer: Analyzer, scorer: _Scorer, cfg: RetrievalConfig) -> None:
        self.unit_texts = unit_texts
        self.analyzer = analyzer
        self.scorer = scorer
        self.cfg = cfg
        self._embeddings = None  # MiniLM unit embeddings, created on the first reranked search

    @classmethod
    def build(cls, unit_texts: Sequence[str], cfg: RetrievalConfig) -> "BM25Index":
        """Analyze every unit and build the backend named by ``cfg.backend``."""
        if len(unit_texts) == 0:
            raise ValueError("unit_texts: expected at least one retrieval unit, got an empty sequence")
        cfg.validate("retrieval")  # ConfigError naming the field (backend, k1, b, ...)
        analyzer = get_analyzer(cfg.stem, cfg.stopwords)
        unit_terms = [analyzer.analyze(text) for text in unit_texts]
        scorer = _BACKENDS[cfg.backend](unit_terms, k1=cfg.k1, b=cfg.b)
        return cls(unit_texts, analyzer, scorer, cfg)

    @property
    def num_units(self) -> int:
        return len(self.unit_texts)

    @property
    def num_embedded(self) -> int:
        """Units embedded so far by the reranker (0 until a reranked search needs them)."""
        return 0 if self._embeddings is None else self._embeddings.num_embedded

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every unit for ``query`` (float64, one per unit)."""
        return self.scorer.scores(self.analyzer.analyze(query))

    def search(self, query: str, top_k: int, allowed: np.ndarray | None = None) -> list[Hit]:
        """At most ``top_k`` allowed units with a positive BM25 score, best first.

        With ``cfg.rerank`` the best ``max(rerank_candidates, top_k)`` of them are reordered by
        reciprocal rank fusion of their BM25 rank and their MiniLM similarity rank
        (:mod:`infmem_verl.agent.rerank`), and ``Hit.score`` is the fused score.
        """
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise ValueError(f"top_k: expected an integer >= 1, got {top_k!r}")
        scores = self.scores(query)
        if allowed is not None:
            scores = np.where(self._check_mask(allowed), scores, 0.0)
        if not self.cfg.rerank:
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

    def _rerank(self, query: str, pool: list[Hit]) -> list[Hit]:
        """Reorder BM25's pool (best first) by fusing its ranks with MiniLM similarity ranks."""
        if not pool:
            return pool
        from infmem_verl.agent.rerank import UnitEmbeddings, reciprocal_rank_fusion

        if self._embeddings is None:
            self._embeddings = UnitEmbeddings(self.unit_texts)
        units = np.array([h.unit for h in pool], dtype=np.int64)
        sims = self._embeddings.similarities(query, units)
        fused = reciprocal_rank_fusion(np.arange(len(units)), _rank(sims, units))
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

