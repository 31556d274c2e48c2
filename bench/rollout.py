"""Rollout-efficiency benchmark: agent rollout throughput against raw generation of the same calls.

Run ``python -m bench.rollout`` (small shapes: 2 documents x n=4 of 32K tokens at 8 in flight,
three pairs; 2 documents of 1M tokens at 2, one rollout each, one pair; about 35 minutes on 2
cores, 27 of them at 1M) or ``--full`` (the recipes' shapes: 16 documents x n=4 of 32K at 64 in
flight, the RL step of one agent-loop worker; 8 documents of 1M tokens at 8, the evaluation; hours
on 2 cores). It prints one table per agent and shape, then
the last line ``agent rollout throughput / raw generation: R`` (the lowest R).

Against a real CPU vLLM server (``.venv-vllm``, started by the tests' launcher
``tests/vllm_server.py``) serving the tiny random Qwen3, InfMem and MemAgent run over the
documents as a training step or an evaluation runs them: one
:class:`~infmem_verl.agent.cache.DocumentCache` shared by the n rollouts, all trajectories at once
on one event loop, the HTTP policy capped at the concurrency. Every generate call is recorded
(prompt ids, sampling, tokens generated, start and end). Then exactly those calls are replayed raw
to the same server: each trajectory's calls one after another (a call depends on the one before
it), all trajectories at once, at the same cap, the request bodies serialized before the clock
starts, and a call that stopped early sent with ``min_tokens`` so that the server generates as
many tokens again. The prefix cache is emptied before each run (``/reset_prefix_cache``, the
server's dev mode), so the replay does not find the agent's prompts cached. R = agent tokens/s
over replay tokens/s (the same tokens: the replay's wall time over the agent's). What R misses is
what our code costs: preparing documents, retrieval, prompt building, parsing, the HTTP client,
and the server idling while the loop works. Agent run and replay alternate ``--repeats`` times
and R pools them, so a change of load on shared cores hits both (one pair's R moved by +-20%
within minutes at the RL shape, docs/experiments/2026-12-06-rollout-1m.md).

The random tiny model never emits its end token, so every call spends its whole budget; the
budgets are small (``--thinking-tokens``, ``--output-tokens``) so that a call costs the server
little and our per-call costs weigh more than they would beside a 4B model on a GPU. The server
and this process share the machine's cores: our CPU time slows the server too.

The breakdown adds up, over trajectories, the wall time in generate calls (server time as the
client sees it), before the first call (document preparation), in retrieval, and the rest of
the loop between calls (prompts, parsing, memory, waiting for the event loop); and the CPU
seconds per call by stage (document preparation and searches in their worker threads, the
event-loop thread, other threads). The "per-step estimate" row is ``infmem/rollout/efficiency``
as a training step logs it (generate time over trajectory time,
:func:`infmem_verl.metrics.rollout_efficiency`), computed on this run's trajectories: unlike R it
needs no replay, and both sides of it are taken under the same load.
"""


from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import aiohttp
import numpy as np

from bench.agent_core import REPO, Row, print_table
from infmem_verl.agent.cache import DocumentCache
from infmem_verl.agent.config import AgentConfig, CallBudget
from infmem_verl.agent.document import Document
from infmem_verl.agent.facts import turn_facts
from infmem_verl.agent.loops import build_agent
from infmem_verl.agent.policy import Generation, SamplingParams
from infmem_verl.agent.retrieval import BM25Index
from infmem_verl.agent.rerank import warm_up as rerank_warm_up
from infmem_verl.agent.trajectory import Trajectory
from infmem_verl.assets import load_tokenizer, tiny_qwen3_dir
from infmem_verl.data.synthetic import make_dataset
from infmem_verl.metrics import rollout_efficiency
from infmem_verl.policy.openai import OpenAIPolicy
from infmem_verl.policy.transformers import end_token_ids

SEED = 11


@dataclass(frozen=True)
class Shape:
    """One workload: ``docs`` documents of ``tokens`` tokens, ``n`` rollouts each, ``concurrency``
    requests in flight at most (all trajectories run at once)."""

    name: str
    docs: int
    tokens: int
    n: int
    concurrency: int
    repeats: int  # (agent run, replay) pairs by default: a pair's R moves by +-20% on shared cores

    def describe(self) -> str:
        return f"{self.docs} docs x n={self.n} of {self.tokens // 1024}K tokens, {self.concurrency} in flight"


# The RL recipes: 128 prompts x n=4 over 8 agent-loop workers = 64 trajectories per worker's event
# loop, 32K-token documents. The evaluation: one rollout per 1M-token document, 8 samples in flight.
# A 1M-token pair takes ~14 minutes (InfMem) on 2 cores, a small RL pair ~1.
FULL = (Shape("rl", 16, 32 * 1024, 4, 64, 1), Shape("eval", 8, 1024 * 1024, 1, 8, 1))
SMALL = (Shape("rl", 2, 32 * 1024, 4, 8, 3), Shape("eval", 2, 1024 * 1024, 1, 2, 1))


# ---------------------------------------------------------------------------------------------
# Recording the agent's calls


@dataclass
class CallRecord:
    """One generate call as the agent made it."""

    chain: int  # the trajectory it belongs to
    prompt: list[int]
    params: SamplingParams
    generated: int
    started: float
    ended: float


class RecordingPolicy:
    """The policy of one trajectory: forwards to the shared HTTP policy and records each call."""

    def __init__(self, inner: OpenAIPolicy, chain: int, records: list[CallRecord]):
        self.inner, self.chain, self.records = inner, chain, records

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        started = time.perf_counter()
        generation = await self.inner.generate(prompt_ids, params)
        ended = time.perf_counter()
        prompt = prompt_ids.tolist() if isinstance(prompt_ids, np.ndarray) else list(prompt_ids)
        self.records.append(CallRecord(self.chain, prompt, params, len(generation.token_ids), started, ended))
        return generation


@dataclass
class StageCPU:
    """CPU seconds of the stages that run in worker threads (each measured on its own thread)."""

    build: float = 0.0
    search: float = 0.0
    searches: int = 0
    cold: int = 0  # searches that embedded new candidates (the dense stage's cold queries)
    cold_search: float = 0.0  # their CPU seconds
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, stage: str, seconds: float) -> None:
        with self.lock:
            setattr(self, stage, getattr(self, stage) + seconds)

    def searched(self, seconds: float, cold: bool) -> None:
        with self.lock:
            self.search += seconds
            self.searches += 1
            self.cold += cold
            self.cold_search += seconds if cold else 0.0


class TimedCache(DocumentCache):
    """The agents' document cache, with the CPU time of each build and each search recorded."""

    def __init__(self, *args, cpu: StageCPU, index_first: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.cpu, self.index_first = cpu, index_first

    async def get(self, text: str, with_index: bool = True):
        prepared = await super().get(text, with_index)
        if self.index_first and with_index:  # as before the index built behind the first calls
            await prepared.ready_index()
        return prepared

    def prepare_document(self, text: str) -> Document:
        started = time.thread_time()
        try:
            return super().prepare_document(text)
        finally:
            self.cpu.add("build", time.thread_time() - started)

    def build_index(self, document: Document) -> BM25Index:
        started = time.thread_time()
        index = super().build_index(document)
        self.cpu.add("build", time.thread_time() - started)  # its own thread, behind the first calls
        search, cpu = index.search, self.cpu

        def timed_search(*args, **kwargs):
            begun, embedded = time.thread_time(), index.num_embedded
            try:
                return search(*args, **kwargs)
            finally:
                cpu.searched(time.thread_time() - begun, index.num_embedded > embedded)

        index.search = timed_search  # this index only (an instance attribute)
        return index


# ---------------------------------------------------------------------------------------------
# Runs


@dataclass
class Run:
    """One run's wall time and calls; ``trajectories`` only for the agent run."""

    wall_s: float
    calls: list[CallRecord]
    trajectories: list[Trajectory] = field(default_factory=list)
    starts: dict[int, float] = field(default_factory=dict)  # each trajectory's start (perf_counter)
    cpu_s: float = 0.0  # process CPU, all threads
    loop_cpu_s: float = 0.0  # the event-loop thread's CPU
    stages: StageCPU | None = None

    @property
    def generated(self) -> int:
        return sum(c.generated for c in self.calls)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt) for c in self.calls)


def reset_prefix_cache(url: str) -> None:
    request = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        if not json.loads(response.read()).get("success", False):
            raise RuntimeError(f"{url}: the prefix cache could not be reset")


async def agent_run(agent_name: str, cfg: AgentConfig, tokenizer, url: str, data, shape: Shape, index_first: bool = False) -> Run:
    stages = StageCPU()
    cache = TimedCache(tokenizer, cfg.document, cfg.retrieval, cfg.retrieval.cache_size, cpu=stages, index_first=index_first)
    agent = build_agent(agent_name, cfg, tokenizer, cache)
    records: list[CallRecord] = []
    starts: dict[int, float] = {}
    async with OpenAIPolicy([url], end_token_ids(tokenizer), max_concurrency=shape.concurrency) as http:
        await http.server_info()

        async def one(chain: int, sample) -> Trajectory:
            starts[chain] = time.perf_counter()
            return await agent.run(RecordingPolicy(http, chain, records), sample.question, sample.context)

        jobs = [(sample, rollout) for sample in data for rollout in range(shape.n)]
        cpu, loop_cpu, wall = time.process_time(), time.thread_time(), time.perf_counter()
        trajectories = await asyncio.gather(*(one(chain, sample) for chain, (sample, _) in enumerate(jobs)))
        wall = time.perf_counter() - wall
        cpu, loop_cpu = time.process_time() - cpu, time.thread_time() - loop_cpu
    return Run(wall, records, list(trajectories), starts, cpu, loop_cpu, stages)


def replay_body(call: CallRecord, model: str, stop_ids: list[int]) -> bytes:
    """The request of ``call``, raw: the same prompt and sampling, exactly its generated tokens."""
    params = call.params
    # A call that stopped early must generate as many tokens again: no stop before that count.
    early = {"min_tokens": call.generated, "ignore_eos": True} if call.generated < params.max_tokens else {}
    body = {
        "model": model,
        "prompt": call.prompt,
        "max_tokens": call.generated,
        **early,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stop_token_ids": stop_ids,
        "return_token_ids": True,
        "skip_special_tokens": False,
        **({"top_k": params.top_k} if params.top_k > 0 else {}),
        **({"logprobs": 0} if params.logprobs else {}),
    }
    return json.dumps(body, separators=(",", ":")).encode()


async def replay(calls: Sequence[CallRecord], url: str, stop_ids: list[int], concurrency: int) -> Run:
    """Send ``calls`` again, each trajectory's in their order and all trajectories at once, at
    most ``concurrency`` in flight; the bodies are built before the clock starts."""
    calls = sorted(calls, key=lambda c: c.started)
    bodies = [replay_body(c, "tiny", stop_ids) for c in calls]
    groups: dict[int, list[int]] = {}
    for i, call in enumerate(calls):
        groups.setdefault(call.chain, []).append(i)
    limit = asyncio.Semaphore(concurrency)
    done: list[CallRecord] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers={"Content-Type": "application/json"}) as session:

        async def send(i: int) -> None:
            async with limit:
                started = time.perf_counter()
                async with session.post(f"{url}/v1/completions", data=bodies[i]) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"replay: HTTP {response.status}")
                done.append(replace(calls[i], started=started, ended=time.perf_counter()))

        async def chain(indices: list[int]) -> None:
            for i in indices:
                await send(i)

        wall = time.perf_counter()
        await asyncio.gather(*(chain(indices) for indices in groups.values()))
        wall = time.perf_counter() - wall
    return Run(wall, done)


# ---------------------------------------------------------------------------------------------
# Figures


def busy_s(calls: Sequence[CallRecord]) -> float:
    """Wall time with at least one request in flight (the union of the calls' intervals)."""
    total, end = 0.0, -np.inf
    for call in sorted(calls, key=lambda c: c.started):
        if call.ended > end:
            total += call.ended - max(call.started, end)
            end = call.ended
    return total


def mean_call_s(run: Run) -> float:
    return sum(c.ended - c.started for c in run.calls) / len(run.calls)


def breakdown(run: Run) -> dict[str, float]:
    """Shares of the trajectories' summed wall time: in generate calls, before the first call
    (question, document preparation, first prompt), in retrieval, the rest of the loop."""
    by_chain: dict[int, list[CallRecord]] = {}
    for call in run.calls:
        by_chain.setdefault(call.chain, []).append(call)
    total = generate = prepare = 0.0
    for chain, trajectory in enumerate(run.trajectories):
        calls = sorted(by_chain[chain], key=lambda c: c.started)
        start = run.starts[chain]
        total += calls[-1].ended - start  # the answer call ends the trajectory
        generate += sum(c.ended - c.started for c in calls)
        prepare += calls[0].started - start
    retrieval = sum(t.retrieval_s for tr in run.trajectories for t in tr.turns)
    return {
        "generate": generate / total,
        "prepare": prepare / total,
        "retrieval": retrieval / total,
        "loop": (total - generate - prepare - retrieval) / total,
    }


def estimate(run: Run) -> float:
    """``infmem/rollout/efficiency`` of the run's trajectories, as a training step computes it."""
    values = []
    for trajectory in run.trajectories:
        facts = [turn_facts(trajectory, i, turn) for i, turn in enumerate(trajectory.turns)]
        values.append({"generate_s": sum(f.generate_s for f in facts), "rollout_s": facts[-1].rollout_s})
    return rollout_efficiency(values)


def rows_of(pairs: Sequence[tuple[Run, Run]]) -> tuple[list[Row], float]:
    """The table of ``repeats`` (agent run, its replay) pairs; R pools them (the agent runs draw
    new samples, their token counts stay those of the random model: every call spends its budget)."""
    ratios = [replay.wall_s / agent.wall_s for agent, replay in pairs]  # same tokens: tokens/s agent over replay
    ratio = sum(r.wall_s for _, r in pairs) / sum(a.wall_s for a, _ in pairs)
    agent, chained = pairs[0]
    calls = len(agent.calls)
    share = breakdown(agent)
    stages = agent.stages
    other = agent.cpu_s - agent.loop_cpu_s - stages.build - stages.search

    def rate(run: Run) -> str:
        return f"{run.generated / run.wall_s:,.0f} gen tok/s, {run.prompt_tokens / run.wall_s:,.0f} prompt tok/s"

    rows = [
        Row("agent rollout throughput", rate(agent), note=f"{calls} calls, {agent.generated:,} tokens generated, {agent.wall_s:.1f} s"),
        Row("raw replay of its calls", rate(chained), note=f"{chained.wall_s:.1f} s"),
        Row(
            "R = agent / raw tokens per second",
            f"{ratio:.3f}",
            ">= 0.9",
            note=f"{len(pairs)} pairs: " + ", ".join(f"{r:.3f}" for r in ratios),
        ),
        Row("  per-step estimate (infmem/rollout/efficiency)", f"{estimate(agent):.3f}", note="generate time / trajectory time"),
        Row(
            "mean call time as the client sees it, agent / replay",
            f"{mean_call_s(agent) / mean_call_s(chained):.3f}",
            note=f"{1000 * mean_call_s(agent):.0f} / {1000 * mean_call_s(chained):.0f} ms: above 1, the server serves the "
            "agent's calls slower (a call sent late waits for the engine's next step)",
        ),
        Row(
            "server idle while the agent ran",
            f"{1 - busy_s(agent.calls) / agent.wall_s:.1%}",
            note=f"raw replay {1 - busy_s(chained.calls) / chained.wall_s:.1%}",
        ),
        Row(
            "trajectory wall time: generate / prepare / retrieve / loop",
            " / ".join(f"{share[k]:.1%}" for k in ("generate", "prepare", "retrieval", "loop")),
            note="summed over trajectories; prepare = before the first call (document build or wait)",
        ),
        Row(
            "searches: new candidates embedded (cold) / all; CPU ms per cold / warm search",
            f"{stages.cold} / {stages.searches}; "
            + " / ".join(f"{1000 * s / n:.1f}" if n else "-" for s, n in ((stages.cold_search, stages.cold), (stages.search - stages.cold_search, stages.searches - stages.cold))),
            note="the dense stage reranks past 128K tokens (retrieval.rerank auto); BM25 alone below",
        ),
        Row(
            "our CPU, ms per call: build / search / event loop / other",
            " / ".join(f"{1000 * s / calls:.2f}" for s in (stages.build, stages.search, agent.loop_cpu_s, other)),
            note=f"{agent.cpu_s:.1f} s CPU in all; event loop = HTTP client, prompts, parsing, memory; "
            "other = threads of our libraries (the tokenizer's, torch's)",
        ),
    ]
    return rows, ratio


def config(args) -> AgentConfig:
    budget = dict(thinking_tokens=args.thinking_tokens, output_tokens=args.output_tokens)
    cfg = AgentConfig(
        memory_tokens=args.output_tokens,
        invalid_action="retrieve_question",  # the random model never writes a valid action: retrieve every chunk
        prethink=CallBudget(prompt_tokens=4096, **budget),
        write=CallBudget(prompt_tokens=5000 + args.output_tokens + 2500 + 512, **budget),
        answer=CallBudget(prompt_tokens=4096, **budget),
    )
    cfg.retrieval.rerank = {"auto": "auto", "on": True, "off": False}[args.rerank]
    return cfg.validate()


def bench_shape(shape: Shape, args, tokenizer, url: str) -> list[tuple[str, float]]:
    data = make_dataset(shape.docs, shape.tokens, tokenizer, seed=SEED)
    stop_ids = sorted(end_token_ids(tokenizer))
    retrieval = config(args).retrieval
    if "infmem" in args.agents and retrieval.rerank_enabled(shape.tokens) and retrieval.rerank_model == "minilm":
        # A process loads (and compiles) MiniLM once, at its first search; the pairs below
        # measure the rollouts after that, as a run of more than a few documents sees them.
        cpu = rerank_warm_up(retrieval.rerank_window_tokens, retrieval.rerank_candidates, retrieval.rerank_compile, retrieval.rerank_threads)
        print(f"MiniLM {'compiled' if retrieval.rerank_compile else 'loaded'} before the {shape.name} runs: {cpu:.0f} CPU-s", flush=True)
    results = []
    for agent_name in args.agents:
        # --index both: InfMem once with the index built before the first call (as before) and
        # once behind it, alternated in each repeat and their order swapped between repeats.
        variants = {"both": [True, False], "first": [True], "background": [False]}[args.index]
        variants = variants if agent_name == "infmem" else [False]  # MemAgent builds no index
        pairs: dict[bool, list[tuple[Run, Run]]] = {v: [] for v in variants}
        for repeat in range(args.repeats or shape.repeats):  # alternated, so that a load change on the shared cores hits both
            for index_first in variants if repeat % 2 == 0 else variants[::-1]:
                reset_prefix_cache(url)
                run = agent_run(agent_name, config(args), tokenizer, url, data, shape, index_first)
                agent = asyncio.run(run)
                reset_prefix_cache(url)
                pairs[index_first].append((agent, asyncio.run(replay(agent.calls, url, stop_ids, shape.concurrency))))
        for index_first, runs in pairs.items():
            rows, ratio = rows_of(runs)
            label = " (index built before the first call)" if index_first else ""
            print_table(f"{agent_name}{label} at the {shape.name} shape: {shape.describe()}", rows)
            results.append((f"{agent_name}{' index-first' if index_first else ''}/{shape.name}", ratio))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the recipes' shapes (16 x n=4 x 32K at 64; 8 x 1M at 8)")
    parser.add_argument("--shapes", default="rl,eval", help="which shapes: rl, eval or both")
    parser.add_argument("--agents", default="infmem,memagent", type=lambda s: s.split(","))
    parser.add_argument("--thinking-tokens", type=int, default=16, help="thinking budget of every call")
    parser.add_argument("--output-tokens", type=int, default=32, help="output budget of every call (and the memory cap)")
    parser.add_argument("--repeats", type=int, default=0, help="agent run + replay pairs per agent and shape (0: the shape's, 3 at the small RL shape, else 1)")
    parser.add_argument("--rerank", choices=("auto", "on", "off"), default="auto", help="the retriever's dense stage (auto: the default's length rule)")
    parser.add_argument(
        "--index",
        choices=("background", "first", "both"),
        default="background",
        help="InfMem's BM25 index: built behind the first call (as DocumentCache does), before it (as it did), or both alternated",
    )
    parser.add_argument("--server-log", type=Path, help="keep the vLLM server's log here (default: a temporary file)")
    args = parser.parse_args(argv)
    wanted = set(args.shapes.split(","))
    shapes = [s for s in (FULL if args.full else SMALL) if s.name in wanted]
    if not shapes:
        parser.error(f"--shapes: expected rl, eval or both, got {args.shapes!r}")
    sys.path.insert(0, str(REPO / "tests"))
    from vllm_server import VLLMServer  # the tests' helper: one way to start the server

    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache, between the runs
    tokenizer = load_tokenizer()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        max_len = 5000 + args.output_tokens + 2500 + 512 + args.thinking_tokens + args.output_tokens + 64
        log = args.server_log or Path(tmp) / "server.log"
        server = VLLMServer(tiny_qwen3_dir(), log, max_model_len=max(16384, max_len)).start()
        try:
            results = [r for shape in shapes for r in bench_shape(shape, args, tokenizer, server.url)]
        except Exception:
            print(f"vLLM server log tail:\n{server.log_tail()}", file=sys.stderr)
            raise
        finally:
            server.stop()
    print(f"\ntotal bench time {time.perf_counter() - started:.0f} s")
    for name, ratio in results:
        print(f"{name}: R = {ratio:.3f}")
    # The last line is the code's figure: an index-first run (--index) is only a comparison.
    print(f"agent rollout throughput / raw generation: {min(r for name, r in results if 'index-first' not in name):.2f}")


if __name__ == "__main__":
    main()
