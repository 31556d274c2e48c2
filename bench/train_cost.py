"""Training cost of one RL step at the recipes' shape, counted (``python -m bench.train_cost``).

Prints the cost ledger (:mod:`infmem_verl.cost`) of one RL step of ``infmem_4b`` and of
``memagent_4b`` (128 prompts x n=4, 32K-token documents, one node of 8 GPUs: batches padded to
``lcm(8, n) * 16`` rows) for the reference pipeline, today's defaults, each lever alone and all
together, and ends with ``trainer tokens per loss token: reference R, ours O, ratio O/R``.
Nothing is asserted.

Trajectory lengths come from running the real agent loops (the recipe's agent settings, the real
Qwen3 tokenizer, real-length synthetic documents of real Wikipedia text) with a scripted policy,
a stated model of Qwen3-4B's behaviour:

* every call thinks past its 504-token thinking budget (audit W2), so every call is two-stage;
* the controller retrieves with the question (top-4) and stops after half of the document;
* the writer's memory is ``--memory-tokens`` tokens of text, the answer a short boxed one;
* the n rollouts of a document differ: each thinks, writes and queries its own text (the query is
  the question plus the first words of its memory), so their prompts share only what the layout
  makes common. What each call slot's n prompts share is read off their token ids.

Reward groups: the first ``--zero-groups`` fraction of the 128 GRPO groups got the same reward
for all n rollouts (zero advantage); with a binary reward and accuracy p that fraction is
p^n + (1-p)^n (0.25 at p = 0.3, n = 4).

Levers: a = score inside the agent loop (no reward tensors shipped), b = rollout log-probs as
old log-probs (``algorithm.rollout_correction.bypass_mode``), c = drop zero-advantage rows from
the update, d = no reference pass at KL coefficient 0. c and d need ``kl_loss_coef=0`` (the
reference trains with 0.001): their rows say so, and so does b (the rollout's log-probs are not the
trainer's). g = a prefix-grouped forward in every pass (:func:`infmem_verl.cost.pass_tokens`, under
the recipe's micro-batch token caps): the reference objective unchanged, fewer tokens; verl 0.9.1's
FSDP engine does not run it (README). The last lines compare, to the reference pipeline, "a+g" (the
reference objective: KL loss 0.001, the trainer's old log-probs) and "a+b+c+d" (KL loss off,
rollout log-probs standing in).

Lever e (``infmem.agent.write_layout``) is measured, not modelled: the real CPU vLLM server
(``.venv-vllm``, the tiny model) serves MemAgent and InfMem rollouts of both layouts, and its
prefix-cache counters (``/metrics``) say how many prompt tokens came from the cache
(``--no-vllm`` skips it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from infmem_verl.agent.cache import DocumentCache
from infmem_verl.agent.config import AgentConfig
from infmem_verl.agent.loops import build_agent
from infmem_verl.agent.policy import SamplingParams
from infmem_verl.assets import load_tokenizer, wiki_paragraphs
from infmem_verl.cost import (
    Call,
    Pipeline,
    PrefixCache,
    StepLedger,
    estimate_step,
    pipeline_of,
    prefix_cache_counters,
    token_caps,
)
from infmem_verl.data.synthetic import make_sample
from infmem_verl.policy.scripted import ScriptedPolicy

PROMPTS = 128
GPUS = 8
DOC_TOKENS = 32768
THINK_TOKENS = 600  # longer than the 504-token thinking budget: every call is two-stage
MiB = 2**20

REFERENCE = Pipeline("reference")
LEVERS = {
    "a: score in agent loop": Pipeline("a", reward_remote=False),
    "b: rollout log-probs as old": Pipeline("b", old_log_prob=False),
    "c: drop zero-advantage rows (kl 0)": Pipeline("c", drop_zero_advantage=True),
    "d: no reference pass (kl 0)": Pipeline("d", reference=False),
    "g: prefix-grouped forward": Pipeline("g", prefix_grouped=True),
}
AT_REFERENCE = Pipeline("a+g", reward_remote=False, prefix_grouped=True)
OURS = Pipeline("ours", old_log_prob=False, reference=False, reward_remote=False, drop_zero_advantage=True)


def compose(recipe: str):
    from hydra import compose as hydra_compose
    from infmem_verl import conf_dir
    from hydra import initialize_config_dir

    from infmem_verl.main import prepare_config

    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = hydra_compose("infmem_trainer", overrides=[f"+recipe={recipe}"])
    prepare_config(config)
    return config


def text_of(tokenizer, tokens: int, offset: int) -> str:
    """About ``tokens`` tokens of real Wikipedia text."""
    text = "\n".join(p["text"] for p in wiki_paragraphs()[offset : offset + 60])
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]).strip()


def scripted_model(tokenizer, question: str, memory_tokens: int, stop_after: int, rollout: int = 0) -> ScriptedPolicy:
    """The stated model of the module docstring for rollout ``rollout`` of a group; the call kind is
    read off the prompt."""
    thought = text_of(tokenizer, THINK_TOKENS, 7 * rollout)
    memory = text_of(tokenizer, memory_tokens, 100 + 7 * rollout)
    query = f"{question} {' '.join(memory.split()[:3])}"
    writes = [0]

    def respond(prompt: np.ndarray, params: SamplingParams) -> str:
        text = tokenizer.decode(prompt.tolist())
        continuation = text.endswith("</think>\n\n")
        if "<current_chunk>" in text:
            output = memory
            if not continuation:
                writes[0] += 1
        elif "<search_history>" in text:
            stop = writes[0] >= stop_after
            call = '{"name": "stop", "arguments": {}}' if stop else (
                '{"name": "retrieve", "arguments": {"query": %s, "top_k": 4}}' % json.dumps(query)
            )
            output = f"<tool_call>\n{call}\n</tool_call>"
        else:
            output = "\\boxed{unknown}"
        return output if continuation else f"<think>\n{thought}\n</think>\n\n{output}"

    return ScriptedPolicy(tokenizer, respond, record=False)


def shared_prefix(prompts: Sequence[np.ndarray]) -> int:
    """Leading tokens every one of ``prompts`` has in common."""
    width = min(len(p) for p in prompts)
    same = np.all(np.stack([p[:width] for p in prompts]) == prompts[0][:width], axis=0)
    return int(width if same.all() else np.argmin(same))


def group_rows(agent: str, cfg: AgentConfig, tokenizer, samples: int, memory_tokens: int, n: int) -> list[tuple[list, list]]:
    """Per sample, its group of ``n`` trajectories from the real loop: each trajectory's rows
    ``(prompt, response, loss_tokens, Call)``, and per trajectory and row the prompt tokens the row
    shares with the same row of the group's other trajectories."""
    cache = DocumentCache(tokenizer, cfg.document, cfg.retrieval, cfg.retrieval.cache_size)
    loop = build_agent(agent, cfg, tokenizer, cache)
    chunks = math.ceil(DOC_TOKENS / cfg.document.chunk_tokens)
    out = []
    for index in range(samples):
        sample = make_sample(index, DOC_TOKENS, tokenizer, seed=11)
        turns = []
        for rollout in range(n):
            policy = scripted_model(tokenizer, sample.question, memory_tokens, chunks // 2, rollout)
            trajectory = asyncio.run(loop.run(policy, sample.question, sample.context))
            turns.append([t for t in trajectory.turns if t.response_tokens > 0])
        rows = [
            [(t.prompt_tokens, t.response_tokens, t.generated_tokens, Call(t.llm_calls, t.prefill_tokens, t.generated_tokens)) for t in ts]
            for ts in turns
        ]
        slots = min(len(ts) for ts in turns)
        common = [shared_prefix([ts[i].prompt_ids for ts in turns]) for i in range(slots)]
        out.append((rows, [common + [0] * (len(ts) - slots) for ts in turns]))
    return out


def figures(ledger: StepLedger) -> str:
    return (
        f"rows {ledger.rows:>6,} | old-lp {ledger.old_log_prob_tokens / 1e6:6.1f}M | ref {ledger.reference_tokens / 1e6:6.1f}M"
        f" | update {ledger.update_tokens / 1e6:6.1f}M | trainer {ledger.trainer_tokens / 1e6:6.1f}M"
        f" ({ledger.forward_equivalents / 1e6:6.1f}M fwd-eq) | per loss token {ledger.tokens_per_loss_token:5.2f}"
        f" | reward {ledger.reward_bytes / MiB:8.1f} MiB | TQ put {ledger.rollout_bytes / MiB:7.1f} MiB"
    )


def bench(recipe: str, tokenizer, samples: int, zero_groups: float, memory_tokens: int) -> tuple[StepLedger, StepLedger]:
    config = compose(recipe)
    from infmem_verl.settings import agent_settings

    cfg = agent_settings(config)  # token ids recorded: the shared prefixes are read off them
    agent = "memagent" if "memagent" in config.actor_rollout_ref.rollout.agent.default_agent_loop else "infmem"
    n = int(config.actor_rollout_ref.rollout.n)
    steps = int(config.infmem.train.optimizer_steps_per_rl_step)
    multiple = math.lcm(GPUS, n) * steps
    groups = group_rows(agent, cfg, tokenizer, samples, memory_tokens, n)
    # 128 prompts x n: sample s's group stands for every prompt p with p % samples == s.
    trajectories = [groups[(t // n) % samples][0][t % n] for t in range(PROMPTS * n)]
    shared = [groups[(t // n) % samples][1][t % n] for t in range(PROMPTS * n)]
    zero = [g < round(zero_groups * PROMPTS) for g in range(PROMPTS)]
    caps = token_caps(config)

    def ledger(pipeline: Pipeline) -> StepLedger:
        return estimate_step(trajectories, pipeline, multiple, zero, n=n, shared_prefixes=shared, caps=caps)

    reference = ledger(REFERENCE)
    first = reference
    print(f"\n== {recipe}: one RL step, {PROMPTS} prompts x n={n}, {DOC_TOKENS // 1024}K-token documents ({agent}) ==")
    print(
        f"rollout: {first.llm_calls:,} LLM calls, {first.prefill_tokens / 1e6:.1f}M prompt tokens prefilled, "
        f"{first.decode_tokens / 1e6:.1f}M decoded; {first.loss_tokens / 1e6:.1f}M loss tokens; "
        f"{first.rows - first.padding_rows:,} sequences (+{first.padding_rows} padding); "
        f"zero-advantage groups {sum(zero)}/{PROMPTS}"
    )
    width = 36
    print(f"{'reference pipeline':<{width}} {figures(reference)}")
    defaults = ledger(replace(pipeline_of(config, "defaults"), name="defaults"))
    print(f"{'defaults (this config)':<{width}} {figures(defaults)}")
    for label, pipeline in LEVERS.items():
        print(f"{label:<{width}} {figures(ledger(pipeline))}")
    at_reference = ledger(AT_REFERENCE)
    print(f"{'ours at the reference objective: a+g':<{width}} {figures(at_reference)}")
    ours = ledger(OURS)
    print(f"{'ours: a+b+c+d (kl 0)':<{width}} {figures(ours)}")
    print(f"{'a+b+c+d+g (kl 0)':<{width}} {figures(ledger(replace(OURS, prefix_grouped=True)))}")
    write_rows = [(p, s) for t, ss in zip(trajectories, shared, strict=True) for (p, *_), s in zip(t, ss, strict=True)]
    print(
        f"prompt tokens shared within a group, by call slot: {sum(s for _, s in write_rows) / sum(p for p, _ in write_rows):.0%} "
        f"of all prompt tokens (micro-batch caps: old-lp {caps.old_log_prob}, ref {caps.reference}, update {caps.update})"
    )
    print(
        f"bytes moved per step (reward call + TransferQueue puts): reference {reference.transport_bytes / MiB:,.0f} MiB, "
        f"ours {ours.transport_bytes / MiB:,.0f} MiB ({ours.transport_bytes / reference.transport_bytes:.0%}); "
        f"the reward call alone {reference.reward_bytes / MiB:,.0f} -> {ours.reward_bytes / MiB:,.0f} MiB "
        "(the TransferQueue puts are the training rows themselves)"
    )
    return reference, at_reference, ours


# ------------------------------------------------------- lever e, measured on a real vLLM server


def server_counters(url: str) -> PrefixCache:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return prefix_cache_counters(response.read().decode())


def measure_prefix_cache(
    url: str, tokenizer, write_layout: str, agent: str = "memagent", samples: int = 2, n: int = 4,
    doc_tokens: int = 6000, seed: int = 0, concurrent: bool = True,
) -> PrefixCache:  # fmt: skip
    """The server's prefix-cache counters over ``samples`` documents x ``n`` rollouts of ``agent``
    with ``write_layout`` (small budgets: the tiny random model). ``concurrent``: the n rollouts of
    a document run at once, as verl starts a GRPO group; else one after another. Each call gets
    its own samples (``seed``), so nothing is cached from an earlier measurement."""
    from infmem_verl.agent.config import CallBudget, DocumentConfig
    from infmem_verl.policy.openai import OpenAIPolicy
    from infmem_verl.policy.transformers import end_token_ids

    budget = CallBudget(prompt_tokens=4096, thinking_tokens=16, output_tokens=64)
    cfg = AgentConfig(
        document=DocumentConfig(chunk_tokens=2000, unit_tokens=400, unit_overlap=80),
        memory_tokens=64,
        write_layout=write_layout,
        prethink=budget,
        write=replace(budget, prompt_tokens=8192),
        answer=budget,
        record_token_ids=False,
    )
    loop = build_agent(agent, cfg, tokenizer)
    data = [make_sample(i, doc_tokens, tokenizer, seed=seed) for i in range(samples)]

    async def run() -> None:
        async with OpenAIPolicy([url], end_token_ids(tokenizer), max_concurrency=n) as policy:
            for sample in data:
                rollouts = [loop.run(policy, sample.question, sample.context) for _ in range(n)]
                if concurrent:
                    await asyncio.gather(*rollouts)
                else:
                    for rollout in rollouts:
                        await rollout

    before = server_counters(url)
    asyncio.run(run())
    return server_counters(url) - before


def bench_prefix_cache(tokenizer) -> None:
    """Prompt tokens served from vLLM's prefix cache, memory-first vs chunk-first Writes."""
    import sys
    import tempfile
    from pathlib import Path

    from infmem_verl.assets import tiny_qwen3_dir

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from vllm_server import VLLMServer  # the tests' helper: one way to start the server

    with tempfile.TemporaryDirectory() as tmp:
        server = VLLMServer(tiny_qwen3_dir(), Path(tmp) / "server.log").start()
        try:
            print("\n== prefix cache (real CPU vLLM server, tiny model): 2 documents x n=4, 6K tokens, 2K chunks ==")
            seed = 100
            for agent in ("memagent", "infmem"):
                for concurrent in (True, False):
                    for write_layout in ("memory_first", "chunk_first"):
                        seed += 1
                        cache = measure_prefix_cache(server.url, tokenizer, write_layout, agent, seed=seed, concurrent=concurrent)
                        print(
                            f"{agent:<9} {'n at once ' if concurrent else 'one by one'} {write_layout:<13} "
                            f"prompt tokens {cache.queries:>8,.0f} | from cache {cache.hits:>8,.0f} ({cache.hit_rate:.0%})"
                        )
        finally:
            server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4, help="distinct documents whose trajectories are tiled")
    parser.add_argument("--zero-groups", type=float, default=0.25, help="fraction of GRPO groups of equal reward")
    parser.add_argument("--memory-tokens", type=int, default=700, help="tokens of memory each Write returns")
    parser.add_argument("--no-vllm", action="store_true", help="skip the prefix-cache measurement")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer()
    if not args.no_vllm:
        bench_prefix_cache(tokenizer)
    results = {}
    for recipe in ("memagent_4b", "infmem_4b"):
        results[recipe] = bench(recipe, tokenizer, args.samples, args.zero_groups, args.memory_tokens)
    for recipe in ("memagent_4b", "infmem_4b"):
        print(f"{recipe if recipe != 'infmem_4b' else ''} {summary(*results[recipe])}".strip())


def summary(reference: StepLedger, at_reference: StepLedger, ours: StepLedger) -> str:
    """Both objectives' trainer tokens per loss token, each next to the reference pipeline's."""
    r = reference.tokens_per_loss_token
    return (
        f"trainer tokens per loss token: reference {r:.2f}; at the reference objective (kl_loss_coef 0.001, "
        f"the trainer's old log-probs) a+g {at_reference.tokens_per_loss_token:.2f}, ratio "
        f"{at_reference.tokens_per_loss_token / r:.2f}; with the KL loss off and rollout log-probs as old "
        f"a+b+c+d {ours.tokens_per_loss_token:.2f}, ratio {ours.tokens_per_loss_token / r:.2f}"
    )


if __name__ == "__main__":
    main()
