"""Agent-core benchmark: CPU cost of everything around the LLM calls, on one long document.

Run ``python -m bench.agent_core`` (a 1M-token document, a few minutes on 2 cores) or
``--quick`` (a 32K-token document). It prints one table and asserts nothing.

The document is a synthetic two-hop QA sample (``data.synthetic``: real Wikipedia paragraphs).
Rows: tokenization throughput, the preparation beyond tokenization (cut, unit decode, BM25
build), BM25 milliseconds per query, the loop's own overhead per LLM call with an instant
scripted policy (InfMem and MemAgent), peak RSS per in-flight sample, and a GRPO group of 4
rollouts sharing one prepared document against the reference's per-rollout rank_bm25 rebuild.

Memory is measured in fresh subprocesses (``--probe``, internal) so nothing else inflates it:
before each measured step the process collects garbage, hands free heap pages back
(``malloc_trim``) and resets the kernel's peak-RSS mark (``/proc/self/clear_refs``); the peak is
VmHWM, printed beside ``ru_maxrss`` (which can also keep a peak from before the reset). A
per-stage breakdown says where the memory goes. glibc serves each thread from its own arena
(preparation runs in a worker thread, the tokenizer in its own threads); the agent core hands
free pages back after each preparation stage, and the two single-sample rows are measured again
in a probe process started with ``MALLOC_ARENA_MAX=1`` (set for that process only) to show what
arenas still cost.

Wall times on a shared machine are noisy; tokenization is therefore also given per CPU-second.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import itertools
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bench.retrieval import STYLES, ask, facts, ms_per_query, reference_whitespace, timed
from infmem_verl.agent.cache import DocumentCache
from infmem_verl.agent.config import AgentConfig, RetrievalConfig
from infmem_verl.agent.document import Document, tokenize_document, tokenize_paragraphs
from infmem_verl.agent.loops import AgentLoop, InfMemAgent, MemAgent
from infmem_verl.agent.policy import Generation, SamplingParams
from infmem_verl.agent.retrieval import BM25Index, get_analyzer
from infmem_verl.assets import load_tokenizer, wiki_paragraphs
from infmem_verl.data.synthetic import make_sample
from infmem_verl.policy.scripted import ScriptedPolicy

SEED = 20240601
NUM_QUERIES = 50
GROUP_SIZE = 4
MEMORY_TOKENS = 900  # the writer's fixed memory: near the 1024 cap, so Writes take two calls
MiB = 2**20
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# The table


@dataclass
class Row:
    """One line of the result table; ``reference`` is the reference approach's figure, if any."""

    metric: str
    ours: str
    target: str = ""
    reference: str = ""
    note: str = ""


def print_table(title: str, rows: Sequence[Row]) -> None:
    """Aligned columns; the note, often long, runs on at the end of its line."""
    cols = ("metric", "ours", "target", "reference")
    header = Row("metric", "ours", "target", "reference", "note")
    widths = [max(len(getattr(r, c)) for r in (header, *rows)) for c in cols]
    print(f"\n== {title} ==")
    for i, row in enumerate((header, *rows)):
        print(" | ".join([getattr(row, c).ljust(w) for c, w in zip(cols, widths)] + [row.note]).rstrip(" |"))
        if i == 0:
            print("-+-".join("-" * w for w in [*widths, 4]))


# ---------------------------------------------------------------------------------------------
# Inputs: document, realistic queries, a fixed memory


def paragraphs_of(context: str) -> list[tuple[str, str]]:
    """(title, text) of every paragraph of a synthetic context (``title\\ntext`` blocks)."""
    out = []
    for block in context.split("\n\n"):
        title, _, text = block.partition("\n")
        out.append((title, text) if text else ("", title))
    return out


def make_queries(context: str, n: int, seed: int) -> list[str]:
    """``n`` perturbed factoid questions about paragraphs of ``context``, in bench.retrieval's
    "entity" style (names kept, other words dropped or stemmed, like a controller's query)."""
    rng = random.Random(seed)
    paragraphs = paragraphs_of(context)
    queries: list[str] = []
    for _ in range(50 * n):
        if len(queries) == n:
            break
        candidates = facts(*rng.choice(paragraphs), rng)
        question = ask(candidates[0], STYLES[0], rng) if candidates else None
        if question is not None:
            queries.append(question)
    return queries


def fixed_memory(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of real Wikipedia text: what an instant writer always returns."""
    text = "\n".join(p["text"] for p in wiki_paragraphs()[:40])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids).strip()


# ---------------------------------------------------------------------------------------------
# An instant policy and a timer around it


def instant_policy(tokenizer, queries: Sequence[str], memory: str, offset: int = 0) -> ScriptedPolicy:
    """A scripted policy whose controller always retrieves (next query of ``queries``), never
    stops, and whose writer always returns ``memory``; the call kind is read off the prompt."""
    step = iter(range(offset, 10**12))
    write_reply = f"<think>\nKeep the notes.\n</think>\n\n{memory}"
    answer_reply = "<think>\nFrom memory.\n</think>\n\n\\boxed{unknown}"

    def respond(prompt: np.ndarray, params: SamplingParams) -> str:
        if "</current_chunk>" in tokenizer.decode(prompt[-16:].tolist()):
            return write_reply
        if "# Tools" in tokenizer.decode(prompt[:6].tolist()):
            call = {"name": "retrieve", "arguments": {"query": queries[next(step) % len(queries)], "top_k": 4}}
            return f"<think>\nSearch.\n</think>\n\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return answer_reply

    return ScriptedPolicy(tokenizer, respond, record=False)


@dataclass
class TimedPolicy:
    """Wraps a policy to count its generate calls and the wall time spent inside them."""

    inner: ScriptedPolicy
    calls: int = 0
    seconds: float = 0.0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        start = time.perf_counter()
        try:
            return await self.inner.generate(prompt_ids, params)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


@dataclass
class TimedSearch:
    """Wraps ``BM25Index.search`` of one index to time the searches the loop makes."""

    index: BM25Index
    seconds: float = 0.0
    original: Callable = field(init=False)

    def __post_init__(self) -> None:
        self.original = self.index.search
        self.index.search = self  # instance attribute: only this index is affected

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.original(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def remove(self) -> None:
        del self.index.search


def agent_config() -> AgentConfig:
    # BM25 alone: past retrieval.rerank_auto_tokens the default turns the MiniLM stage on, whose
    # per-query cost bench.retrieval (--curve) and bench.rollout (--rerank) measure; these rows
    # keep measuring the loop and the index around it.
    return AgentConfig(record_token_ids=False, retrieval=RetrievalConfig(rerank=False))


# ---------------------------------------------------------------------------------------------
# Measurements


def cpu_timed(fn: Callable[[], object]) -> tuple[object, float, float]:
    """``fn()``, its wall seconds and the process CPU seconds (all threads) it used."""
    cpu = time.process_time()
    out, wall = timed(fn)
    return out, wall, time.process_time() - cpu


def bench_tokenization(text: str, tokenizer, repeats: int) -> tuple[tuple[np.ndarray, np.ndarray], list[Row]]:
    """Tokenization as a prepared document pays it: ids and paragraph starts."""
    cores = len(os.sched_getaffinity(0))
    tokenize_document(text[:100_000], tokenizer)  # start the tokenizer's thread pool
    runs = [cpu_timed(lambda: tokenize_paragraphs(text, tokenizer)) for _ in range(repeats)]
    (ids, starts), wall, cpu = min(runs, key=lambda r: r[1])
    _, ref_wall, ref_cpu = cpu_timed(lambda: tokenizer(text, add_special_tokens=False)["input_ids"])
    n = ids.size
    rows = [
        Row(
            "tokenize_paragraphs, tokens/s (wall)",
            f"{n / wall:,.0f}",
            f">= {100_000 * cores:,}",
            f"{n / ref_wall:,.0f}",
            f"{n:,} tokens, {cores} cores, best of {repeats}; ref: tokenizer(text) in one call",
        ),
        Row(
            "  per core: tokens/s/core (wall/cores; per CPU-s)",
            f"{n / wall / cores:,.0f}; {n / cpu:,.0f}",
            ">= 100,000",
            f"{n / ref_wall:,.0f}; {n / ref_cpu:,.0f}",
            "ref uses one core",
        ),
    ]
    return (ids, starts), rows


def bench_build(tokens: tuple[np.ndarray, np.ndarray], tokenizer, cfg: AgentConfig) -> tuple[Document, BM25Index, list[Row]]:
    """Preparation beyond tokenization with a cold analyzer (its stem cache empty): paragraph
    units and their headings, as ``DocumentCache.prepare`` builds them."""
    get_analyzer.cache_clear()
    ids, starts = tokens
    document, cut_s = timed(lambda: Document.from_ids(ids, tokenizer, cfg.document, paragraph_starts=starts))
    # The index decodes the units (and the paragraphs' headings) itself, batch by batch.
    index, index_s = timed(lambda: BM25Index.of_document(document, cfg.retrieval))
    units, decode_s = timed(lambda: list(document.unit_texts()))
    _, ref_s = timed(lambda: reference_whitespace(units))
    rows = [
        Row(
            "build beyond tokenization, s",
            f"{cut_s + index_s:.2f}",
            "<= 2",
            f"{cut_s + decode_s + ref_s:.2f}",
            f"{document.num_chunks} chunks, {document.num_units} units; ref: same cut/decode + whitespace BM25Okapi",
        ),
        Row(
            "  cut (Document.from_ids) / BM25 build incl. unit and heading decode / of it decode alone, s",
            f"{cut_s:.3f} / {index_s:.2f} / {decode_s:.2f}",
            note="BM25 with a cold stem cache; decode alone: list(document.unit_texts())",
        ),
    ]
    return document, index, rows


def bench_retrieval(index: BM25Index, queries: Sequence[str]) -> list[Row]:
    ours = ms_per_query(lambda q, k: [h.unit for h in index.search(q, k)], queries)
    ref = ms_per_query(reference_whitespace(index.unit_texts), queries)
    note = f"{len(queries)} questions; ref: whitespace BM25Okapi"
    return [Row("retrieval, ms/query (top 4)", f"{ours:.2f}", "<= 10", f"{ref:.2f}", note)]


async def _run_prepared(agent: AgentLoop, policy, question: str, text: str) -> tuple[float, int]:
    """Wall seconds of one run of a document already in the agent's cache, and its chunks."""
    start = time.perf_counter()
    trajectory = await agent.run(policy, question, text)
    return time.perf_counter() - start, trajectory.num_chunks


def bench_loop(agent: AgentLoop, tokenizer, question: str, text: str, queries, memory: str) -> Row:
    """Loop wall time minus time inside the policy, per LLM call; document prepared first."""
    prepared = asyncio.run(agent.cache.get(text, with_index=agent.uses_retrieval))
    policy = TimedPolicy(instant_policy(tokenizer, queries, memory))
    search = TimedSearch(prepared.index) if prepared.index is not None else None
    wall, chunks = asyncio.run(_run_prepared(agent, policy, question, text))
    overhead_ms = 1000 * (wall - policy.seconds) / policy.calls
    note = f"{policy.calls} calls over {chunks} chunks; loop {wall:.2f} s, policy {policy.seconds:.2f} s"
    if search is not None:
        search.remove()
        note += f"; BM25 search {1000 * search.seconds / policy.calls:.2f} ms/call of it"
    return Row(f"{agent.name} loop overhead, ms/LLM call", f"{overhead_ms:.2f}", "<= 2", note=note)


def bench_group(tokenizer, cfg: AgentConfig, question: str, text: str, queries, memory: str, units) -> list[Row]:
    """n concurrent InfMem rollouts of one document with a fresh cache vs n reference rebuilds."""
    agent = InfMemAgent(cfg, tokenizer, DocumentCache(tokenizer, cfg.document, cfg.retrieval))
    get_analyzer.cache_clear()
    policies = [instant_policy(tokenizer, queries, memory, offset=7 * i) for i in range(GROUP_SIZE)]

    async def group() -> None:
        await asyncio.gather(*(agent.run(p, question, text) for p in policies))

    _, wall = timed(lambda: asyncio.run(group()))
    get_analyzer.cache_clear()
    _, index_s = timed(lambda: BM25Index.build(units, cfg.retrieval))
    _, ref_s = timed(lambda: [reference_whitespace(units) for _ in range(GROUP_SIZE)])
    return [
        Row(
            f"group of {GROUP_SIZE} rollouts: index builds, build s",
            f"{agent.cache.builds}, {index_s:.2f}",
            "1",
            f"{GROUP_SIZE}, {ref_s:.2f}",
            "builds: DocumentCache.builds over the runs below; s: BM25 build alone, cold stems; "
            "ref: whitespace BM25Okapi rebuilt per rollout",
        ),
        Row(
            f"  group wall: prepare once + {GROUP_SIZE} concurrent runs, s",
            f"{wall:.2f}",
            note="instant policy, fresh cache, cold stem cache",
        ),
    ]


# ---------------------------------------------------------------------------------------------
# Memory: measured in fresh subprocesses (``--probe``), so nothing else inflates the peak


def rss_mib() -> dict[str, float]:
    """This process's VmRSS (now), VmHWM (peak since the last reset) and ru_maxrss, in MiB."""
    status = Path("/proc/self/status").read_text()
    vm = {k: int(re.search(rf"^{k}:\s+(\d+) kB", status, re.M).group(1)) / 1024 for k in ("VmRSS", "VmHWM")}
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rss": vm["VmRSS"], "peak": vm["VmHWM"], "ru_maxrss": maxrss}


def trimmed_rss() -> float:
    """RSS in MiB after garbage collection and after malloc returned its free pages: what is
    still held, not what the allocator keeps for reuse."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_mib()["rss"]


def measured(fn: Callable[[], object]) -> dict[str, float]:
    """RSS before ``fn()``, the peak during it and what stays held after it (MiB)."""
    start = trimmed_rss()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM and ru_maxrss to the RSS now
    fn()
    during = rss_mib()
    return {"start": start, "peak": during["peak"], "ru_maxrss": during["ru_maxrss"], "end": trimmed_rss()}


def probe(rounds: Sequence[Sequence[str]], stages: str | None) -> dict:
    """RSS of preparing and running samples (JSON files: question, context, queries).

    Each round runs its samples concurrently and is measured on its own, in order, so a round
    after another measures a process whose caches (tokenizer, stemmer) are already warm.
    ``stages`` then measures that sample stage by stage. Baseline: tokenizer, every text, agent
    and prompts loaded, and a small warm-up run done (thread pools, lazy imports).
    """
    tokenizer = load_tokenizer()
    samples = {p: json.loads(Path(p).read_text()) for p in {*itertools.chain(*rounds), *([stages] if stages else [])}}
    agent = InfMemAgent(agent_config(), tokenizer)
    memory = fixed_memory(tokenizer, MEMORY_TOKENS)
    warm_text = next(iter(samples.values()))["context"][:30_000]
    asyncio.run(agent.run(instant_policy(tokenizer, ["warm up"], memory), "Warm up?", warm_text))

    async def run_all(batch: list[dict]) -> None:
        policies = [instant_policy(tokenizer, s["queries"], memory) for s in batch]
        runs = (run_dropping_result(agent, p, s["question"], s["context"]) for p, s in zip(policies, batch))
        await asyncio.gather(*runs)

    result: dict = {"rounds": []}
    for paths in rounds:
        batch = [samples[p] for p in paths]
        text_mib = float(np.mean([len(s["context"].encode()) / MiB for s in batch]))
        rss = measured(lambda: asyncio.run(run_all(batch)))
        result["rounds"].append({"text_mib": text_mib, "count": len(batch), **rss})
    if stages:
        sample = samples[stages]
        result["text_mib"] = len(sample["context"].encode()) / MiB
        policy = instant_policy(tokenizer, sample["queries"], memory)
        result["stages"], result["sizes"] = stage_breakdown(agent, policy, sample)
    return result


def stage_breakdown(agent: AgentLoop, policy, sample: dict) -> tuple[list[tuple[str, dict]], dict[str, float]]:
    """Peak and held RSS of each preparation stage, then of the cached preparation and the loop
    itself; and the sizes of what a prepared document keeps."""
    text, tokenizer, cfg = sample["context"], agent.tokenizer, agent.cfg
    state: dict = {}

    def cut() -> None:
        ids, starts = state.pop("tokens")
        state["doc"] = Document.from_ids(ids, tokenizer, cfg.document, paragraph_starts=starts)

    def index() -> None:
        state["index"] = BM25Index.of_document(state["doc"], cfg.retrieval)

    steps = [
        ("tokenize_paragraphs", lambda: state.update(tokens=tokenize_paragraphs(text, tokenizer))),
        ("Document.from_ids (cut)", cut),
        ("BM25Index.of_document (units and headings decoded on the fly, warm stems)", index),
    ]
    result = [(name, measured(fn)) for name, fn in steps]
    doc, weights = state["doc"], state["index"].scorer.weights
    sizes = {
        "ids": doc.ids.nbytes / MiB,
        "unit_texts_decoded": sum(sys.getsizeof(u) for u in doc.unit_texts()) / MiB,
        "bm25_arrays": (weights.data.nbytes + weights.indices.nbytes + weights.indptr.nbytes) / MiB,
        "bm25_vocab_terms": len(state["index"].scorer.vocab),
    }
    state.clear()
    # .index waits for the index, which DocumentCache.get leaves building behind the first calls
    result.append(("all of the above via DocumentCache.get", measured(lambda: asyncio.run(agent.cache.get(text)).index)))
    loop = measured(lambda: asyncio.run(run_dropping_result(agent, policy, sample["question"], text)))
    result.append(("InfMem loop, document prepared", loop))
    return result, sizes


async def run_dropping_result(agent: AgentLoop, policy, question: str, text: str) -> None:
    """One run whose trajectory is dropped at once. ``asyncio.run`` (Python 3.11) formats the repr
    of its finished main task, result included, when it restores the SIGINT handler; the repr of
    a 200-chunk trajectory is megabytes, which would be measured as the loop's memory."""
    await agent.run(policy, question, text)


def run_probe(spec: dict, module: str = "bench.agent_core", env: dict[str, str] | None = None) -> dict:
    """Run ``python -m module --probe SPEC`` (a measurement, by default :func:`probe`) in a fresh
    process and return the JSON it prints last; ``env`` adds variables to that process only."""
    command = [sys.executable, "-m", module, "--probe", json.dumps(spec)]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})}
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory_row(metric: str, m: dict, text_mib: float, count: int = 1, headline: bool = False) -> Row:
    """Peak and held RSS over the start per sample, in multiples of the text and in MiB."""
    peak, held = (m["peak"] - m["start"]) / count, (m["end"] - m["start"]) / count
    note = f"+{peak:.1f} MiB peak, +{held:.1f} MiB held after"
    if headline:
        note += f" (VmRSS before {m['start']:.0f}, VmHWM {m['peak']:.0f}, ru_maxrss {m['ru_maxrss']:.0f})"
    return Row(metric, f"{peak / text_mib:.1f}x", "<= 5x" if headline else "", note=note)


def bench_memory(samples: Sequence[dict], tmp: Path) -> list[Row]:
    """Four fresh processes: one sample then another (twice, the second time with
    ``MALLOC_ARENA_MAX=1``); a warm-up sample then a concurrent group; a warm-up sample then the
    stage breakdown. Needs ``GROUP_SIZE + 1`` samples."""
    paths = []
    for i, sample in enumerate(samples):
        paths.append(str(tmp / f"sample{i}.json"))
        Path(paths[-1]).write_text(json.dumps(sample))
    single = run_probe({"rounds": [paths[:1], paths[1:2]]})
    one_arena = run_probe({"rounds": [paths[:1], paths[1:2]]}, env={"MALLOC_ARENA_MAX": "1"})
    group = run_probe({"rounds": [paths[-1:], paths[:GROUP_SIZE]]})
    stages = run_probe({"rounds": [paths[1:2]], "stages": paths[0]})
    first, warm = single["rounds"]
    concurrent = group["rounds"][1]
    rows = [
        memory_row(
            f"peak RSS per in-flight sample, first in a fresh process ({first['text_mib']:.1f} MiB text)",
            first,
            first["text_mib"],
            headline=True,
        ),
        memory_row("  next sample (tokenizer and stem caches warm)", warm, warm["text_mib"], headline=True),
        memory_row(
            f"  {GROUP_SIZE} concurrent samples after a warm-up sample, per sample",
            concurrent,
            concurrent["text_mib"],
            GROUP_SIZE,
            headline=True,
        ),
    ]
    rows += [
        memory_row(f"  {name} with MALLOC_ARENA_MAX=1 (that probe process only)", m, m["text_mib"])
        for name, m in zip(("first sample", "next sample"), one_arena["rounds"])
    ]
    rows += [memory_row(f"  warm stage: {name}", m, stages["text_mib"]) for name, m in stages["stages"]]
    s = stages["sizes"]
    rows.append(
        Row(
            "  a prepared document holds, MiB",
            f"{s['ids'] + s['bm25_arrays']:.1f}",
            note=f"ids {s['ids']:.1f}, BM25 arrays {s['bm25_arrays']:.1f}, plus a vocab dict of "
            f"{s['bm25_vocab_terms']:,} terms; unit texts are decoded on demand, not held "
            f"({s['unit_texts_decoded']:.1f} as str objects if they were)",
        )
    )
    return rows


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 32K-token document instead of 1M")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # JSON spec of a memory subprocess
    args = parser.parse_args(argv)
    if args.probe:
        spec = json.loads(args.probe)
        print(json.dumps(probe(spec["rounds"], spec.get("stages"))))
        return

    started = time.perf_counter()
    tokens = 32_000 if args.quick else 1_000_000
    tokenizer = load_tokenizer()
    cfg = agent_config()
    samples = []
    for i in range(GROUP_SIZE + 1):
        sample = make_sample(i, tokens, tokenizer, seed=SEED)
        queries = make_queries(sample.context, NUM_QUERIES, SEED + i)
        samples.append({"question": sample.question, "context": sample.context, "queries": queries})
    text, question, queries = samples[0]["context"], samples[0]["question"], samples[0]["queries"]
    memory = fixed_memory(tokenizer, MEMORY_TOKENS)
    print(f"document: {len(text.encode()) / MiB:.1f} MiB UTF-8, target {tokens:,} tokens; {len(queries)} queries")

    tokens, rows = bench_tokenization(text, tokenizer, repeats=3 if args.quick else 2)
    document, index, build_rows = bench_build(tokens, tokenizer, cfg)
    rows += build_rows + bench_retrieval(index, queries)
    for agent_cls in (InfMemAgent, MemAgent):
        rows.append(bench_loop(agent_cls(cfg, tokenizer), tokenizer, question, text, queries, memory))
    with tempfile.TemporaryDirectory() as tmp:
        rows += bench_memory(samples, Path(tmp))
    rows += bench_group(tokenizer, cfg, question, text, queries, memory, list(document.unit_texts()))
    print_table(f"Agent core on a {document.num_tokens:,}-token document ({len(os.sched_getaffinity(0))} cores)", rows)
    print(f"\ntotal bench time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
