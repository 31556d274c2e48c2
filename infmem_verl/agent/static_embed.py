"""A cheap dense stage: static word-piece vectors distilled once from MiniLM.

Running MiniLM over every unit of a 1M-token document costs minutes of CPU (:mod:`.rerank`
embeds only BM25's candidates, at query time, for that reason). Here every word piece of
MiniLM's vocabulary is run through the model once, alone (``[CLS] piece [SEP]``), and its output
vector kept: a table of 30,522 x 384 floats, distilled in about 1.5 minutes of CPU and cached on
disk. The table is centred (its mean vector subtracted), because the raw outputs share a large
common direction that would make every unit look alike.

A unit is then the idf-weighted sum of its word pieces' vectors (sublinear term frequency, idf
over the document's units, as BM25 weights its terms), L2-normalised: a whole 1M-token document
embeds in a few seconds, once, and the n rollouts of a document share the result through its
:class:`~infmem_verl.agent.retrieval.BM25Index`. A query is embedded the same way (well under a
millisecond) and compared with BM25's candidates by cosine.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import scipy.sparse

from .offline_cache import cache_root

# Distilled once per machine, into the offline cache (agent/offline_cache.py).
TABLE_FILE = "minilm-l6-static-v1.npy"
# Word pieces run through MiniLM per batch while distilling (3 positions each).
_DISTILL_BATCH = 1024
# Units whose word pieces are counted per batch while embedding a document.
_EMBED_UNITS = 512


def table_path() -> Path:
    """Where the distilled table is cached."""
    return cache_root() / TABLE_FILE


def distill_table() -> np.ndarray:
    """Every word piece's MiniLM output vector when run alone, centred; float32 [vocab, 384]."""
    import torch

    from .rerank import _load_minilm

    tokenizer, model = _load_minilm()
    ids = torch.arange(tokenizer.vocab_size)
    table = np.empty((len(ids), model.config.hidden_size), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(ids), _DISTILL_BATCH):
            pieces = ids[start : start + _DISTILL_BATCH]
            batch = torch.stack(
                [torch.full_like(pieces, tokenizer.cls_token_id), pieces, torch.full_like(pieces, tokenizer.sep_token_id)], 1
            )
            hidden = model(input_ids=batch, attention_mask=torch.ones_like(batch)).last_hidden_state
            table[start : start + len(pieces)] = hidden[:, 1].float().numpy()
    return table - table.mean(0, keepdims=True)


@functools.lru_cache(maxsize=1)
def load_table() -> np.ndarray:
    """The distilled table, read from the cache or distilled and cached (atomic write)."""
    path = table_path()
    if path.exists():
        return np.load(path)
    table = distill_table()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.npy")
    np.save(tmp, table)
    os.replace(tmp, path)
    return table


@functools.lru_cache(maxsize=1)
def _piece_tokenizer():
    """MiniLM's Rust tokenizer without the padding and truncation its file sets (to 128 pieces):
    a unit's every piece counts, and no padding does. With its vocabulary size, which the
    tokenizer recomputes (milliseconds) on every ask."""
    from tokenizers import Tokenizer

    from .rerank import _load_minilm

    tokenizer = Tokenizer.from_str(_load_minilm()[0].backend_tokenizer.to_str())
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer, tokenizer.get_vocab_size()


def piece_counts(texts: Sequence[str]) -> scipy.sparse.csr_matrix:
    """MiniLM word-piece counts of ``texts`` (no special tokens), float32 [len(texts), vocab]."""
    tokenizer, vocab_size = _piece_tokenizer()
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    ids = [np.asarray(e.ids, dtype=np.int64) for e in encode(list(texts), add_special_tokens=False)]
    rows = np.repeat(np.arange(len(ids)), [len(x) for x in ids])
    cols = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    counts = scipy.sparse.csr_matrix(
        (np.ones(len(cols), dtype=np.float32), (rows, cols)), shape=(len(ids), vocab_size)
    )
    counts.sum_duplicates()
    return counts


def _sublinear(counts: scipy.sparse.csr_matrix) -> scipy.sparse.csr_matrix:
    """``1 + ln(tf)`` on the non-zero counts: a repeated piece adds less each time."""
    counts = counts.copy()
    counts.data = 1.0 + np.log(counts.data)
    return counts


class StaticEmbeddings:
    """Static-vector embeddings of every retrieval unit of one document, computed on first use.

    Same interface as :class:`~infmem_verl.agent.rerank.UnitEmbeddings`: it lives in the
    document's index, so its n rollouts and all their queries share one embedding pass (the
    lock makes concurrent first searches wait for that pass rather than run their own).
    """

    def __init__(self, unit_texts: Sequence[str]) -> None:
        self.unit_texts = unit_texts
        self._vectors: np.ndarray | None = None  # [units, 384], unit-norm
        self._idf: np.ndarray | None = None  # per word piece, over this document's units
        self._lock = threading.Lock()
        self.passes = 0  # whole-document embedding passes run (at most 1)

    @property
    def num_embedded(self) -> int:
        return 0 if self._vectors is None else len(self._vectors)

    def similarities(self, query: str, units: np.ndarray) -> np.ndarray:
        """Cosine similarity of ``query`` to each of ``units`` (float64, given order)."""
        vectors, idf = self._ensure()
        q = np.asarray(_sublinear(piece_counts([query])).multiply(idf[None, :]) @ load_table()).ravel()
        norm = float(np.linalg.norm(q))
        if norm == 0.0:
            return np.zeros(len(units), dtype=np.float64)
        return (vectors[np.asarray(units, dtype=np.int64)] @ (q / norm)).astype(np.float64)

    def _ensure(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if self._vectors is None:
                self._vectors, self._idf = self._embed_all()
                self.passes += 1
            return self._vectors, self._idf

    def _embed_all(self) -> tuple[np.ndarray, np.ndarray]:
        """All unit vectors and the document's word-piece idf, one pass over the unit texts."""
        table = load_table()
        n = len(self.unit_texts)
        texts = iter(self.unit_texts)
        blocks = [piece_counts([next(texts) for _ in range(min(_EMBED_UNITS, n - s))]) for s in range(0, n, _EMBED_UNITS)]
        counts = _sublinear(scipy.sparse.vstack(blocks, format="csr"))
        df = np.bincount(counts.indices, minlength=table.shape[0])
        # BM25's idf form: positive for every piece, larger for rarer ones.
        idf = np.log1p((n - df + 0.5) / (df + 0.5)).astype(np.float32)
        vectors = np.asarray(counts.multiply(idf[None, :]).tocsr() @ table, dtype=np.float32)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return vectors, idf
