"""The MiniLM stage's cost levers at 1M tokens: CPU seconds per cold query and recall@4.

Run ``python -m bench.rerank_cost`` (both real-question sets: about 4 minutes of CPU a set with
one torch thread, ``--threads 1``; ``--defaults-only`` about 1) or ``--sets boolq``. It prints
one table and asserts nothing.

A cold query is one whose candidates are all new to the document's embedding cache: MiniLM then
embeds every one of them. Its cost is linear in the word pieces it reads, so the levers are the
ways to read fewer: fewer candidates (``retrieval.rerank_candidates``), only each unit's first
windows (``rerank_windows``), shorter windows (``rerank_window_tokens``: 64, 48 and 32 pieces),
the static stage (:mod:`infmem_verl.agent.static_embed`, the whole document embedded once)
choosing which of BM25's candidates MiniLM reads, and one pass for the pending queries of the n
rollouts instead of one each; or to read them for less: MiniLM with int8 Linear layers
(dynamic quantization, weights per channel) instead of the stage's bfloat16, or only the first
of its six transformer layers (:func:`encoder`).

One haystack per set, as ``bench.retrieval`` builds its real-question haystacks (the seed's
draw at 1M tokens, ``--questions`` queries). Recall of every lever comes from one embedding pass:
every window of every unit in some query's top 50, plus each one's first window at every shorter
length, precision and depth a lever reads, embedded as the stage embeds them; each lever then ranks
exactly as ``BM25Index.search`` would (score fusion over its pool at the default weight). The
cold cost of each lever is measured on its own, on ``--cold`` queries: a fresh
``UnitEmbeddings`` embeds the lever's candidates and the query, in process CPU seconds (all
threads) and wall seconds, word pieces beside it; ``--levers`` runs only the levers named.
Last, the retriever's defaults at 1M (``RetrievalConfig()``: rerank "auto") run through
``BM25Index.search`` over every query in order, the embedding cache shared as rollouts share it:
its recall@4 and its CPU per query, where later queries reuse earlier ones' candidates
(``--precision int8``: that run with MiniLM's int8 Linear layers instead of the stage's own;
``--layers k``: with only its first k layers).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import random
import time
import typing
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bench.retrieval import REAL_SETS, SEED, Clock, LengthPlan, article_token_counts, real_document, real_queries
from infmem_verl.agent.config import DocumentConfig, RetrievalConfig
from infmem_verl.agent.rerank import WINDOW_TOKENS, Precision, UnitEmbeddings, _encode, _encoder, embed, fuse, window_encoding
from infmem_verl.agent.rerank import warm_up as rerank_warm_up
from infmem_verl.agent.retrieval import BM25Index, Hit
from infmem_verl.assets import load_tokenizer, wiki_paragraphs

POOL = 50  # the largest pool a lever reranks (the default's)
SHORT_WINDOW = 64  # the short first window measured beside MiniLM's 128
ROLLOUTS = 4  # queries batched into one pass (the RL recipes' n)


@dataclass(frozen=True)
class Lever:
    """One way to run the dense stage: BM25's best ``candidates``; of them, with ``prefilter`` >
    0, only the static stage's best ``prefilter`` go to MiniLM; each unit's first ``windows``
    windows (0: all) of ``window_tokens`` pieces; MiniLM at the ``precision`` of
    :func:`~infmem_verl.agent.rerank._encoder` ("auto": as the stage runs it), with only its
    first ``layers`` transformer layers (0: all six; :func:`encoder`)."""

    name: str
    candidates: int = POOL
    windows: int = 0
    window_tokens: int = 128
    prefilter: int = 0
    precision: Precision = "auto"
    layers: int = 0
    compiled: bool = False

    @property
    def vectors_key(self) -> tuple[int, int, str, int, bool]:
        """Which embedding pass the lever's recall reads: every 128-piece window (levers that keep
        the first of them slice it), or each unit's first window of a shorter length; at the
        lever's precision and depth, compiled or not."""
        return self.window_tokens, 0 if self.window_tokens == WINDOW_TOKENS else 1, self.precision, self.layers, self.compiled

    @property
    def model_key(self) -> tuple[str, int, bool]:
        """The MiniLM that embeds the lever's windows and queries (:func:`encoder`'s arguments)."""
        return self.precision, self.layers, self.compiled


LEVERS = (
    Lever("default before: top 50, every 128-piece window"),
    Lever("top 30", candidates=30),
    Lever("top 20", candidates=20),
    Lever("top 10", candidates=10),
    Lever("top 50, first 128-piece window", windows=1),
    Lever("top 20, first 128-piece window", candidates=20, windows=1),
    Lever("top 50, first 64-piece window", windows=1, window_tokens=SHORT_WINDOW),
    Lever("top 30, first 64-piece window", candidates=30, windows=1, window_tokens=SHORT_WINDOW),
    Lever("top 20, first 64-piece window", candidates=20, windows=1, window_tokens=SHORT_WINDOW),
    Lever("top 10, first 64-piece window", candidates=10, windows=1, window_tokens=SHORT_WINDOW),
    Lever("top 30, first 64-piece window, torch.compile (the stage's)", candidates=30, windows=1, window_tokens=SHORT_WINDOW, compiled=True),
    Lever("top 30, first 64-piece window, int8 Linear layers", candidates=30, windows=1, window_tokens=SHORT_WINDOW, precision="int8"),
    Lever("top 30, first 64-piece window, MiniLM's first 5 of 6 layers", candidates=30, windows=1, window_tokens=SHORT_WINDOW, layers=5),
    Lever("top 30, first 64-piece window, MiniLM's first 4 of 6 layers", candidates=30, windows=1, window_tokens=SHORT_WINDOW, layers=4),
    Lever("top 30, first 64-piece window, MiniLM's first 3 of 6 layers", candidates=30, windows=1, window_tokens=SHORT_WINDOW, layers=3),
    Lever("top 50, first 48-piece window", windows=1, window_tokens=48),
    Lever("top 40, first 48-piece window", candidates=40, windows=1, window_tokens=48),
    Lever("top 30, first 48-piece window", candidates=30, windows=1, window_tokens=48),
    Lever("top 50, first 32-piece window", windows=1, window_tokens=32),
    Lever("top 40, first 32-piece window", candidates=40, windows=1, window_tokens=32),
    Lever("top 30, first 32-piece window", candidates=30, windows=1, window_tokens=32),
    Lever("top 50, static stage keeps 20", prefilter=20),
    Lever("top 50, static stage keeps 10", prefilter=10),
    Lever("top 50, static keeps 20, first 64-piece window", prefilter=20, windows=1, window_tokens=SHORT_WINDOW),
    Lever("top 50, static keeps 10, first 64-piece window", prefilter=10, windows=1, window_tokens=SHORT_WINDOW),
)


@functools.lru_cache(maxsize=4)
def encoder(precision: Precision = "auto", layers: int = 0, compiled: bool = False):
    """MiniLM at ``precision`` (:func:`~infmem_verl.agent.rerank._encoder`), compiled as
    ``retrieval.rerank_compile`` compiles it or eager, keeping only its first ``layers``
    transformer layers when 0 < ``layers`` < 6 (eager): the sentence embedding is then the same
    mean pooling over the truncated stack's output.

    Why a lever: the Linear layers are 76% of a pass's CPU and attention 15%, all of it per layer
    (docs/experiments/2026-12-04-retrieval-cost.md, section 5), so k of 6 layers read the same
    word pieces for about k/6 of the CPU, where shorter windows and fewer candidates lose what
    the question names. all-MiniLM-L6-v2 was trained for its last layer's output only, so what
    an earlier layer's pooled output is worth for retrieval is what this measures. A copy: the
    stage's own model (and the float32 one the static stage distils from) stays whole.
    """
    model = _encoder(precision, compiled)
    if model is None or compiled or layers <= 0 or layers >= model.config.num_hidden_layers:
        return model
    model = copy.deepcopy(model)
    model.encoder.layer = model.encoder.layer[:layers]
    model.config.num_hidden_layers = layers
    return model


@dataclass
class Haystack:
    """One set's 1M-token haystack: its units, queries, the units holding each query's article,
    and BM25's top :data:`POOL` of each query (with headings, the retriever's defaults)."""

    name: str
    num_tokens: int
    doc: object
    units: list[str]
    queries: list[str]
    gold: list[np.ndarray]
    pools: list[list[Hit]]


@dataclass
class Windows:
    """Window vectors of units (float32, as the stage compares them) and their word pieces."""

    vectors: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    pieces: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    cpu: float = 0.0

    def add(self, units: Sequence[int], texts: Sequence[str], window_tokens: int, max_windows: int, model=None) -> None:
        """Embed ``texts`` (of ``units``) as the stage would, batch by batch, timing the passes."""
        for start in range(0, len(units), 256):
            encoding, owner = window_encoding(texts[start : start + 256], window_tokens, max_windows)
            pieces = encoding["attention_mask"].sum(1).numpy()
            cpu = time.process_time()
            vectors = _encode(encoding, model)
            self.cpu += time.process_time() - cpu
            for i, unit in enumerate(units[start : start + 256]):
                self.vectors[unit] = vectors[owner == i]
                self.pieces[unit] = pieces[owner == i]


def build(tokenizer, paragraphs, counts: np.ndarray, name: str, questions: int, seed: int) -> Haystack:
    qset = REAL_SETS[name](paragraphs, tokenizer)
    rq = real_queries(paragraphs, counts, qset, LengthPlan("1M", 1_000_000, 1, questions), random.Random(seed))
    doc, gold = real_document(tokenizer, rq, DocumentConfig())
    units = list(doc.unit_texts())
    index = BM25Index.of_document(doc, RetrievalConfig(rerank=False), units)
    pools = [index.search(q, POOL) for q in rq.queries]
    return Haystack(name, doc.num_tokens, doc, units, rq.queries, gold, pools)


def choose(lever: Lever, pool: list[Hit], static_sims: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The units MiniLM reranks for ``lever`` (pool order) and their BM25 scores."""
    pool = pool[: lever.candidates]
    units = np.array([h.unit for h in pool], dtype=np.int64)
    scores = np.array([h.score for h in pool])
    if lever.prefilter and len(units) > lever.prefilter:
        fused = fuse("score", scores, static_sims[: len(units)], RetrievalConfig().fusion_weight)
        keep = np.sort(np.lexsort((units, -fused))[: lever.prefilter])  # back in BM25's order
        units, scores = units[keep], scores[keep]
    return units, scores


def recall_at_4(lever: Lever, hay: Haystack, windows: Windows, queries: np.ndarray, static: list[np.ndarray]) -> float:
    """Recall@4 of ``lever``, ranking as ``BM25Index.search`` does, from precomputed vectors
    (``windows`` and ``queries`` embedded at the lever's precision)."""
    weight = RetrievalConfig().fusion_weight
    hits = 0
    for i, pool in enumerate(hay.pools):
        units, scores = choose(lever, pool, static[i])
        if len(units):
            limit = lever.windows or None
            sims = np.array([float((windows.vectors[int(u)][:limit] @ queries[i]).max()) for u in units])
            fused = fuse("score", scores, sims, weight)
            units = units[np.lexsort((units, -fused))]
        hits += bool(np.isin(units[:4], hay.gold[i]).any())
    return hits / len(hay.pools)


def cold_cost(lever: Lever, hay: Haystack, static: list[np.ndarray], n: int) -> tuple[float, float, float]:
    """Mean process CPU seconds, wall seconds and word pieces of a query whose candidates are
    all new, over the first ``n`` queries BM25 finds candidates for."""
    cpu = wall = 0.0
    pieces = 0
    model = encoder(*lever.model_key)
    timed = [i for i, pool in enumerate(hay.pools) if pool][:n]
    for i in timed:
        units, _ = choose(lever, hay.pools[i], static[i])
        encoding, _ = window_encoding([hay.units[u] for u in units], lever.window_tokens, lever.windows)
        pieces += int(encoding["attention_mask"].sum())
        fresh = UnitEmbeddings(hay.units, lever.window_tokens, lever.windows, model)
        with Clock() as clock:
            fresh.similarities(hay.queries[i], units)
        cpu += clock.cpu
        wall += clock.wall
    return cpu / len(timed), wall / len(timed), pieces / len(timed)


def batched_cost(hay: Haystack, n: int, candidates: int = 20) -> tuple[float, float]:
    """CPU seconds per query of :data:`ROLLOUTS` cold queries' candidates in one pass, and one
    pass each (the same units: the union, each embedded once)."""
    groups = [hay.queries[i : i + ROLLOUTS] for i in range(0, n, ROLLOUTS)]
    one = each = 0.0
    for g, group in enumerate(groups):
        start = g * ROLLOUTS
        per_query = [np.array([h.unit for h in hay.pools[start + j][:candidates]]) for j in range(len(group))]
        fresh = UnitEmbeddings(hay.units)
        with Clock() as clock:
            fresh._ensure(np.unique(np.concatenate(per_query)))
            for q, units in zip(group, per_query):
                fresh.similarities(q, units)
        one += clock.cpu
        fresh = UnitEmbeddings(hay.units)
        with Clock() as clock:
            for q, units in zip(group, per_query):
                fresh.similarities(q, units)
        each += clock.cpu
    count = sum(len(g) for g in groups)
    return one / count, each / count


def defaults_in_order(
    hay: Haystack, cfg: RetrievalConfig, precision: Precision = "auto", layers: int = 0
) -> tuple[float, float, int, float]:
    """Recall@4, CPU seconds per query and units embedded of ``cfg`` (the defaults, unless
    ``--set``) through ``BM25Index.search``, every query in order over one shared cache, MiniLM
    at ``precision`` with its first ``layers`` layers (0: all); and the CPU seconds of compiling
    MiniLM (``cfg.rerank_compile``), paid before the clock starts, once a process."""
    index = BM25Index.of_document(hay.doc, cfg, hay.units)
    assert index.rerank, "the defaults rerank at 1M tokens"
    warm_up = 0.0
    if precision != "auto" or layers:  # the index's own cache, created before its first search would
        index._embeddings = UnitEmbeddings(hay.units, cfg.rerank_window_tokens, cfg.rerank_windows, encoder(precision, layers))
    elif cfg.rerank_compile:
        warm_up = rerank_warm_up(cfg.rerank_window_tokens, cfg.rerank_candidates, compiled=True, threads=cfg.rerank_threads)
    with Clock() as clock:
        tops = [np.array([h.unit for h in index.search(q, 4)], dtype=np.int64) for q in hay.queries]
    hits = sum(bool(np.isin(top, g).any()) for top, g in zip(tops, hay.gold))
    return hits / len(tops), clock.cpu / len(tops), index.num_embedded, warm_up


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="boolq,fanoutqa", help="comma-separated real-question sets")
    parser.add_argument("--questions", type=int, default=150, help="queries per haystack")
    parser.add_argument("--cold", type=int, default=8, help="queries timed cold per lever")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--levers",
        default="",
        help="only the levers whose names contain one of these ';'-separated strings, or equal one that starts with '=' (default: all)",
    )
    parser.add_argument(
        "--precision", default="auto", choices=typing.get_args(Precision), help="MiniLM's precision in the defaults' run"
    )
    parser.add_argument("--layers", type=int, default=0, help="MiniLM's first layers in the defaults' run (0: all six)")
    parser.add_argument("--no-defaults", action="store_true", help="skip the defaults' run through BM25Index.search")
    parser.add_argument("--defaults-only", action="store_true", help="only the defaults' run through BM25Index.search")
    parser.add_argument(
        "--set", default="", help="the defaults' run with these retrieval fields changed, e.g. rerank_candidates=50,rerank_windows=0"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default). On loaded cores a second thread spins while it waits for a core, "
        "which process CPU time counts: 1 measures the work alone",
    )
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, {len(os.sched_getaffinity(0))} cores; load {os.getloadavg()}", flush=True)
    tokenizer, paragraphs = load_tokenizer(), wiki_paragraphs()
    counts = article_token_counts(tokenizer, paragraphs)
    table: dict[str, dict[str, tuple]] = {}
    extra: list[str] = []
    for name in args.sets.split(","):
        hay = build(tokenizer, paragraphs, counts, name, args.questions, args.seed)
        bm25 = sum(bool(np.isin([h.unit for h in p[:4]], g).any()) for p, g in zip(hay.pools, hay.gold)) / len(hay.pools)
        table.setdefault("BM25 with headings alone (stage off)", {})[name] = (bm25, 0.0, 0.0, 0.0)
        if not args.defaults_only:
            parts = args.levers.split(";")
            chosen = [lever for lever in LEVERS if not args.levers or any(picks(part, lever.name) for part in parts)]
            extra += levers(hay, table, args.cold, chosen)
        if not args.no_defaults:
            changes = {k: int(v) for k, v in (pair.split("=") for pair in args.set.split(",") if pair)}
            config = dataclasses.replace(RetrievalConfig(), **changes)
            recall, cpu, embedded, warm_up = defaults_in_order(hay, config, args.precision, args.layers)
            depth = f"MiniLM's first {args.layers} layers" if args.layers else ""
            changed = ", ".join(filter(None, [args.set, "" if args.precision == "auto" else args.precision, depth]))
            label = f"the defaults{' with ' + changed if changed else ''}, BM25Index.search, queries in order"
            table.setdefault(label, {})[name] = (recall, cpu, float("nan"), float("nan"))
            compiled = f"; MiniLM compiled first ({warm_up:.0f} CPU-s, untimed)" if warm_up else ""
            extra.append(f"{name}: defaults in order: {embedded} units embedded for {len(hay.queries)} queries{compiled}; load {os.getloadavg()[0]:.1f}")
    sets = args.sets.split(",")
    print(f"\n== The dense stage's levers at 1M tokens (seed {args.seed}, {args.questions} queries a set; cold: {args.cold} queries) ==")
    print(f"{'lever':58s}" + "".join(f" {s + ' R@4':>13s} {'cold CPU s':>10s} {'wall s':>7s} {'pieces':>7s}" for s in sets))
    for lever, cells in table.items():
        row = "".join(f" {r:13.3f} {c:10.3f} {w:7.3f} {p:7.0f}" for r, c, w, p in (cells.get(s, (np.nan,) * 4) for s in sets))
        print(f"{lever:58s}{row}")
    for line in extra:
        print(line)


def picks(part: str, name: str) -> bool:
    """Whether ``--levers``'s ``part`` names the lever ``name``: "=name" exactly, else any part of it."""
    return part[1:] == name if part.startswith("=") else part in name


def levers(hay: Haystack, table: dict[str, dict[str, tuple]], cold: int, chosen: Sequence[Lever] = LEVERS) -> list[str]:
    """Recall@4 and cold cost of every lever of ``chosen`` on ``hay`` into ``table``; the
    batching figure as a line."""
    from infmem_verl.agent.static_embed import StaticEmbeddings

    name = hay.name
    wanted = sorted({h.unit for pool in hay.pools for h in pool})
    texts = [hay.units[u] for u in wanted]
    windows: dict[tuple[int, int, str, int], Windows] = {}
    queries: dict[tuple[str, int], np.ndarray] = {}
    for lever in chosen:
        if lever.vectors_key not in windows:
            window_tokens, max_windows, *_ = lever.vectors_key
            windows[lever.vectors_key] = passes = Windows()
            passes.add(wanted, texts, window_tokens, max_windows, encoder(*lever.model_key))
        if lever.model_key not in queries:
            queries[lever.model_key] = embed(hay.queries, encoder(*lever.model_key))
    static: list[np.ndarray | None] = [None] * len(hay.queries)
    build_cpu = 0.0
    if any(lever.prefilter for lever in chosen):
        static_embeddings = StaticEmbeddings(hay.units)
        with Clock() as static_build:
            static_embeddings.similarities(hay.queries[0], np.zeros(1, dtype=np.int64))
        build_cpu = static_build.cpu
        static = [static_embeddings.similarities(q, np.array([h.unit for h in p], dtype=np.int64)) for q, p in zip(hay.queries, hay.pools)]
    passes = ", ".join(
        f"{k[0]}-piece {'every window' if k[1] == 0 else 'first window'} {k[2]}{f' {k[3]} layers' if k[3] else ''}{' compiled' if k[4] else ''} {w.cpu:.0f} s"
        for k, w in windows.items()
    )
    print(
        f"{name}: {hay.num_tokens:,} tokens, {len(hay.units)} units, {len(hay.queries)} queries; "
        f"{len(wanted)} pooled units embedded (CPU: {passes}); static stage over the document {build_cpu:.1f} s CPU; "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    for lever in chosen:
        recall = recall_at_4(lever, hay, windows[lever.vectors_key], queries[lever.model_key], static)
        cpu, wall, pieces = cold_cost(lever, hay, static, cold)
        table.setdefault(lever.name, {})[name] = (recall, cpu, wall, pieces)
        print(
            f"  {lever.name}: recall@4 {recall:.3f}, cold {cpu:.3f} s CPU {wall:.3f} s wall, {pieces:.0f} pieces; load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    if not any(lever == LEVERS[0] for lever in chosen):
        return []
    one, each = batched_cost(hay, cold)
    return [f"{name}: {ROLLOUTS} cold queries' top 20 in one pass {one:.2f} s CPU a query, one pass each {each:.2f}"]


if __name__ == "__main__":
    main()
