"""The embedded default run: both agents on synthetic 32K-token documents, on CPU, no hub.

    python -m infmem_verl.smoke            # what `make smoke` runs
    python -m infmem_verl.smoke --samples 2 --tokens 16000

A tiny random Qwen3 (real Qwen3 tokenizer) drives InfMem and MemAgent over synthetic multi-hop
questions hidden in real Wikipedia text; each trajectory's summary and scores are printed. A
random model answers nothing correctly: this run proves the whole reader works end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from .agent.config import agent_config
from .agent.loops import build_agent
from .assets import load_tokenizer, tiny_qwen3_dir
from .data.synthetic import make_dataset
from .policy.transformers import TransformersPolicy
from .reward.metrics import score_answer

# Small budgets: the random model never ends a call by itself, so every budget is spent.
SMOKE_AGENT = {
    "memory_tokens": 64,
    "prethink": {"prompt_tokens": 4096, "thinking_tokens": 24, "output_tokens": 32},
    "write": {"prompt_tokens": 9216, "thinking_tokens": 24, "output_tokens": 64},
    "answer": {"prompt_tokens": 4096, "thinking_tokens": 24, "output_tokens": 32},
}


def _row(agent: str, sample, traj, seconds: float) -> str:
    s = traj.summary()
    scores = score_answer(traj.prediction, sample.answers)
    stop = "-" if s.stop_step is None else str(s.stop_step)
    return (
        f"{agent:9s} {sample.id:>10s} chunks {s.chunks_read}/{s.num_chunks} stop {stop:>2s} calls {s.llm_calls:3d} "
        f"retrievals {s.retrieval_calls:2d} invalid {s.invalid_turns:2d} tokens {s.prompt_tokens}+{s.response_tokens} "
        f"em {scores['em']:.0f} f1 {scores['f1']:.2f} pred {str(traj.prediction)[:24]!r} ({seconds:.1f}s)"
    )


async def _run(samples, agents, policy) -> None:
    async def one(agent, sample):
        started = time.perf_counter()
        traj = await agent.run(policy, sample.question, sample.context)
        return agent.name, sample, traj, time.perf_counter() - started

    results = await asyncio.gather(*(one(a, s) for a in agents for s in samples))
    for name, sample, traj, seconds in results:
        print(_row(name, sample, traj, seconds), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32_000, help="document length in tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    tokenizer = load_tokenizer()
    samples = make_dataset(args.samples, args.tokens, tokenizer, seed=args.seed)
    print(f"[smoke] {len(samples)} synthetic samples of ~{args.tokens} tokens ({time.perf_counter() - started:.1f}s)")
    policy = TransformersPolicy.from_pretrained(tiny_qwen3_dir(), seed=args.seed)
    cfg = agent_config(SMOKE_AGENT)
    agents = [build_agent(name, cfg, tokenizer) for name in ("infmem", "memagent")]
    asyncio.run(_run(samples, agents, policy))
    print(f"[smoke] done in {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
