"""Evaluation benchmark: harness CPU per LLM call over HTTP, tokens InfMem vs MemAgent, memory.

Run ``python -m bench.eval`` (about 10 minutes on 2 cores: builds 1M-token documents, starts the
CPU vLLM server from ``.venv-vllm``) or ``--quick`` (smaller documents, fewer samples). It prints
one table and asserts nothing.

- Harness CPU per LLM call: this process's CPU time (all its threads) while an evaluation of
  InfMem and MemAgent runs against the CPU vLLM server, divided by the calls made. The server is
  another process, so its time is not in the figure; the wall time per call is shown beside it.
  It includes preparing the documents (tokenization, BM25); a second row isolates the HTTP
  policy (request building, JSON, response checks).
- Tokens per question: every generate call's prompt + completion tokens, with a scripted
  controller that stops once both facts of the synthetic two-hop question are in the memory (the
  compute that early stopping saves; the InfMem paper reports 3.9x less time at 1M tokens).
- Peak memory per concurrent 1M-token sample: a fresh process runs the evaluation runner on
  several 1M-token synthetic samples at once (scripted policy), peak RSS over its warm start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from bench.agent_core import REPO, Row, measured, print_table, run_probe
from infmem_verl.agent.config import agent_config
from infmem_verl.agent.policy import SamplingParams
from infmem_verl.assets import load_tokenizer, tiny_qwen3_dir
from infmem_verl.data.sample import QASample
from infmem_verl.data.synthetic import make_dataset, make_sample
from infmem_verl.evaluation.config import PRESETS
from infmem_verl.evaluation.data import CellSource, length_tokens
from infmem_verl.evaluation.methods import build_methods
from infmem_verl.evaluation.runner import Runner
from infmem_verl.evaluation.store import ResultStore
from infmem_verl.policy.scripted import oracle_policy

SEED = 7


def default_cfg():
    return agent_config(PRESETS["default"].agent)


def bench_tokens(tokenizer, lengths: Sequence[str], samples: int) -> list[Row]:
    """InfMem (1-stop) vs MemAgent tokens per question with the oracle controller."""
    rows = []
    for label in lengths:
        data = make_dataset(samples, length_tokens(label), tokenizer, seed=SEED)
        methods = build_methods(["infmem", "memagent"], default_cfg(), tokenizer, window=32768)
        policy = oracle_policy(tokenizer, data)
        result = {name: [asyncio.run(method.run(policy, s)) for s in data] for name, method in methods.items()}
        infmem, memagent = result["infmem"], result["memagent"]
        per_q = {n: np.mean([o.prompt_tokens + o.completion_tokens for o in outcomes]) for n, outcomes in result.items()}
        correct = sum(o.prediction == s.answers[0] for o, s in zip(infmem, data))
        stops = [o.stop_step for o in infmem]
        rows.append(
            Row(
                f"tokens/question at {label}: InfMem vs MemAgent",
                f"{per_q['infmem'] / 1e3:,.0f}k vs {per_q['memagent'] / 1e3:,.0f}k ({per_q['memagent'] / per_q['infmem']:.1f}x less)",
                reference="3.9x less time at 1M (paper)" if label == "1m" else "",
                note=f"{samples} samples, {infmem[0].num_chunks} chunks; InfMem stop steps {stops}, {correct}/{samples} answered; "
                f"calls {np.mean([o.llm_calls for o in infmem]):.0f} vs {np.mean([o.llm_calls for o in memagent]):.0f}",
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------
# Harness CPU per call against the CPU vLLM server


def bench_harness_cpu(tokenizer, samples: int, tokens: int) -> list[Row]:
    sys.path.insert(0, str(REPO / "tests"))
    from vllm_server import VLLMServer  # the tests' helper: one way to start the server

    from infmem_verl.policy.openai import OpenAIPolicy
    from infmem_verl.policy.transformers import end_token_ids

    with tempfile.TemporaryDirectory() as tmp:
        server = VLLMServer(tiny_qwen3_dir(), Path(tmp) / "server.log")
        started = time.perf_counter()
        server.start()
        ready_s = time.perf_counter() - started
        try:
            data = make_dataset(samples, tokens, tokenizer, seed=SEED)
            cfg = agent_config(PRESETS["embedded"].agent)
            methods = build_methods(["infmem", "memagent"], cfg, tokenizer, window=16384)

            async def run_all(policy) -> int:
                outcomes = await asyncio.gather(*(m.run(policy, s) for m in methods.values() for s in data))
                return sum(o.llm_calls for o in outcomes)

            async def eval_run():
                policy, _ = await OpenAIPolicy.connect("bench.eval", [server.url], end_token_ids(tokenizer), max_concurrency=8)
                async with policy:
                    cpu, wall = time.process_time(), time.perf_counter()
                    calls = await run_all(policy)
                    return calls, time.process_time() - cpu, time.perf_counter() - wall

            calls, cpu, wall = asyncio.run(eval_run())
            policy_cpu, policy_calls = asyncio.run(_policy_only(server.url, tokenizer))
        finally:
            server.stop()
    return [
        Row(
            "harness CPU per LLM call over HTTP, ms",
            f"{1000 * cpu / calls:.2f}",
            "<= 5",
            note=f"{calls} calls, InfMem + MemAgent on {samples} x {tokens // 1024}k docs, 8 concurrent; "
            f"wall {1000 * wall / calls:.1f} ms/call (server-bound); server ready in {ready_s:.0f} s",
        ),
        Row(
            "  of which the HTTP policy alone, ms/call",
            f"{1000 * policy_cpu / policy_calls:.2f}",
            note=f"{policy_calls} calls of a 5000-token prompt, 1 new token, 8 concurrent",
        ),
    ]


async def _policy_only(url: str, tokenizer) -> tuple[float, int]:
    from infmem_verl.policy.openai import OpenAIPolicy
    from infmem_verl.policy.transformers import end_token_ids

    prompt = tokenizer.encode(" ".join(["history"] * 5000))[:5000]
    calls = 64
    async with OpenAIPolicy([url], end_token_ids(tokenizer), max_concurrency=8) as policy:
        await policy.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        cpu = time.process_time()
        await asyncio.gather(*(policy.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0)) for _ in range(calls)))
        return time.process_time() - cpu, calls


# ---------------------------------------------------------------------------------------------
# Peak memory of concurrent 1M-token samples in the evaluation runner (fresh process)


def probe_memory(count: int, tokens: int) -> dict:
    tokenizer = load_tokenizer()
    cfg = agent_config(PRESETS["default"].agent)
    warm = make_sample(10_000, 20_000, tokenizer, seed=SEED)
    samples = [make_sample(i, tokens, tokenizer, seed=SEED) for i in range(count)]
    policy = oracle_policy(tokenizer, [warm, *samples])

    def run(label: str, items: Sequence[QASample], concurrency: int) -> None:
        methods = build_methods(["infmem"], cfg, tokenizer, window=32768)
        with tempfile.TemporaryDirectory() as tmp:
            store = ResultStore(tmp, {"bench": label})
            source = CellSource("synthetic", "1m", lambda: iter(items))
            asyncio.run(Runner(policy, methods, store, concurrency, progress=False).run([source]))

    run("warm", [warm], 1)
    text_mib = float(np.mean([len(s.context.encode()) / 2**20 for s in samples]))
    result = measured(lambda: run("measured", samples, count))
    return {"count": count, "text_mib": text_mib, **result}


def bench_memory(count: int, tokens: int) -> list[Row]:
    m = run_probe({"count": count, "tokens": tokens}, module="bench.eval")
    per_sample = (m["peak"] - m["start"]) / m["count"]
    return [
        Row(
            f"peak RSS per concurrent {tokens // 1024}k-token sample, MiB",
            f"{per_sample:.0f}",
            reference=f"{m['text_mib']:.1f} MiB of text each",
            note=f"{m['count']} samples at once in the evaluation runner (InfMem, scripted policy); "
            f"RSS before {m['start']:.0f} MiB, peak {m['peak']:.0f}, held after {m['end']:.0f}",
        )
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32K/128K documents, 4 concurrent samples")
    parser.add_argument("--no-server", action="store_true", help="skip the rows that need the vLLM server")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # JSON spec of a memory subprocess
    args = parser.parse_args(argv)
    if args.probe:
        spec = json.loads(args.probe)
        print(json.dumps(probe_memory(spec["count"], spec["tokens"])))
        return
    started = time.perf_counter()
    tokenizer = load_tokenizer()
    rows: list[Row] = []
    if not args.no_server:
        rows += bench_harness_cpu(tokenizer, samples=4, tokens=8192)
    rows += bench_tokens(tokenizer, ["32k", "128k"] if args.quick else ["32k", "128k", "1m"], samples=2 if args.quick else 3)
    rows += bench_memory(4 if args.quick else 8, (128 if args.quick else 1024) * 1024)
    print_table("Evaluation harness (2-core CPU)", rows)
    print(f"\ntotal bench time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
