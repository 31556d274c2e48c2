"""The answer call's copy, alone: does a tiny student learn to read the answer off its memory?

    python -m bench.copy_probe                          # fresh chains in every batch (default)
    python -m bench.copy_probe --pool 256               # a fixed pool of 256 chains, repeated
    python -m bench.copy_probe --heads 8 --lr 3e-3 --steps 800 --eval-every 100

The demo's warmed students follow the protocol but copy no fact (issue 30). This bench isolates
the smallest copy the task asks for: the final answer call, whose prompt holds the question and a
memory of the chain's two fact sentences (what the oracle's Writes leave there) and whose target
is the oracle's ``<think>\\nChecking.\\n</think>\\n\\n\\boxed{ <answer>}``. Samples are built by
the agent core's own :class:`~infmem_verl.agent.protocol.PromptBuilder` under the demo recipe's
protocol, from haystack-free chains (:func:`infmem_verl.data.synthetic.chain`), so they are the
distilled answer samples without the distillation (tests/test_copy_probe.py checks they are
token for token the same) and an unlimited supply of distinct questions costs nothing.

With ``--pool 0`` every batch draws chains never seen before, so memorising a question's answer
cannot lower the loss: only reading it off the memory does. The held-out chains come from another
seed. Printed every ``--eval-every`` steps: the training loss (answer tokens), the held-out share
of answers whose greedy decoding is the oracle's response token for token (``exact``), and the
held-out sub-EM of the parsed greedy answer (the metric issue 30's target is stated in), with
CPU-seconds (``time.process_time``) and the load average, since the machine may be shared.

Levers (issue 30's order of cost): ``--heads`` / ``--hidden`` / ``--layers`` (the copy needs an
induction-style circuit), ``--lr``, ``--names`` (the chains' names: ``syllables``, several tokens
each; ``list`` or ``roles``, one token each of the small vocabulary, ``roles`` drawing the entity,
the bridge and the answer from three disjoint thirds of the list), ``--memory-pad N`` (N tokens of
Wikipedia around the facts in the answer call's memory: a longer context to copy out of),
``--overrides`` (the recipe's agent settings, e.g. ``infmem.agent.document.chunk_tokens=64``) and
``--init DIR`` (start from a student ``--save DIR`` kept: a curriculum's next stage).

``--induction-steps N`` first trains the same student N steps on a copy pre-task
(:class:`InductionTask`): short windows of Wikipedia token ids (or random ids) in which a random
span appears twice, only the second occurrence scored. Copying a fact is mostly copying invented
names, i.e. an induction circuit (attend to the token after the earlier occurrence of the current
token, copy it); a 2-layer student trained from scratch must form that circuit before any copy
lowers the protocol's loss. The pre-task asks for nothing else, at a fraction of a protocol step's
cost, so it tests whether forming the circuit first is what the slow onset of copying waits for.
It prints its own held-out copy accuracy (the share of the repeats' tokens predicted greedily
after the true prefix); the probe then continues on the same weights with a fresh optimizer.
The defaults are the setting measured in docs/experiments/2026-12-05-copying-student.md (text,
64 tokens, spans 8-32, lr 1e-2: 39% held-out copy after 1,500 steps, ~120 CPU-s). Keep the
spans' positions free: a fixed offset (e.g. span 32 in 64 tokens) is learnt in 100 steps by a
head attending a fixed distance back, which is no induction circuit.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from infmem_verl.agent.protocol import PromptBuilder, parse_answer
from infmem_verl.data.synthetic import Chain, chain
from infmem_verl.reward.metrics import sub_em
from infmem_verl.sft.curriculum import answer_call, asked, exact_share, padded_pairs, response_logits

# Held-out chains are drawn from this seed; training chains from --seed (0 is the tokenizer's
# own training text, so the default training seed is 1).
HELDOUT_SEED = 7919


@dataclass
class ProbeConfig:
    """One probe run (see ``--help``)."""

    vocab_size: int = 4096  # 0: Qwen3's own vocabulary
    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.1  # the cosine's floor, a share of lr (1: constant after the warm-up)
    clip_grad: float = 1.0
    batch_size: int = 16
    steps: int = 400
    eval_every: int = 50
    heldout: int = 64
    pool: int = 0  # 0: fresh chains in every batch; N: a fixed pool of N chains, reshuffled
    # answer: the chain's own two-hop question, or "all": chain i asks its question, its bridge
    # or its entity in turn (Chain.one_hop), so the answer is each of the three names in turn;
    # fresh: "all" draws the extra answer calls that way (haystack-free) instead of from trajectories
    questions: str = "chain"
    memory_pad: int = 0  # answer: this many tokens of Wikipedia around the facts in the memory (raise memory_tokens with --overrides)
    recipe: str = "demo"
    names: str = "syllables"  # the chains' names: syllables, list or roles (synthetic.NameStyle; single tokens of the small vocabulary)
    overrides: str = ""  # Hydra overrides of the recipe's agent, comma-separated (e.g. infmem.agent.document.chunk_tokens=64)
    # answer: the answer call from haystack-free chains; write: the Writes of distilled SFT
    # parquets (train_data, one pass unless pool; heldout_data from another distillation seed);
    # fresh: the oracle's calls of fresh symbolic trajectories (infmem_verl/sft/fresh.py) of
    # `agent`, the kinds in `kinds`, plus `extra_answers` fresh answer calls in every batch.
    call: str = "answer"
    agent: str = "infmem"
    kinds: str = "prethink,write,answer"
    extra_answers: int = 0
    save: str = ""  # save the student (model + tokenizer) here at every evaluation
    clean_chunks: bool = False  # fresh: chunks of the facts alone, no Wikipedia around them
    init: str = ""  # start from this saved student instead of a random one (a curriculum's next stage)
    train_data: str = ""
    heldout_data: str = ""
    seed: int = 1
    model_seed: int = 0
    # the copy pre-task (InductionTask), run before the probe on the same weights; 0 steps: none
    induction_steps: int = 0
    induction_length: int = 64  # tokens a sequence
    induction_min_span: int = 8  # the repeated span's length, drawn uniformly in [min, max]
    induction_max_span: int = 32
    induction_source: str = "text"  # text: Wikipedia paragraphs' ids; random: uniform ids
    induction_batch: int = 16
    induction_lr: float = 1e-2  # 0: --lr
    induction_eval_every: int = 100


def agent_overrides(cfg: ProbeConfig) -> list[str]:
    """``cfg.overrides`` as the list of Hydra overrides it holds."""
    return [o for o in cfg.overrides.split(",") if o]


def _pool_stream(tokenizer) -> np.ndarray:
    """The Wikipedia pool's paragraphs that fresh chunks are cut from, as one stream of ids."""
    from infmem_verl.sft.fresh import _pool_ids

    return np.concatenate(_pool_ids(tokenizer)[1])


@dataclass
class InductionPoint:
    """The copy pre-task at one evaluation."""

    step: int
    train_loss: float
    copy_acc: float  # held-out share of the repeats' scored tokens predicted greedily
    cpu_s: float
    load: float


@dataclass
class ProbePoint:
    """The figures at one evaluation."""

    step: int
    train_loss: float
    exact: float
    sub_em: float  # the answer call's sub-EM; for the Writes: exact share of those that copy a fact
    cpu_s: float
    load: float


@dataclass
class ProbeResult:
    config: ProbeConfig
    points: list[ProbePoint] = field(default_factory=list)
    prompt_tokens: float = 0.0  # mean answer-prompt length
    distinct_samples: int = 0  # training samples, each seen once unless pool
    induction: list[InductionPoint] = field(default_factory=list)  # the pre-task's curve, if run

    def best_sub_em(self) -> float:
        return max((p.sub_em for p in self.points), default=0.0)


class AnswerSamples:
    """The answer call's (prompt ids, response ids) for haystack-free chains, under one protocol."""

    def __init__(self, tokenizer, recipe: str = "demo", overrides: Sequence[str] = (), pad: int = 0):
        from infmem_verl.distill import recipe_agent

        _, self.agent_cfg = recipe_agent(recipe, list(overrides))
        self.builder = PromptBuilder(tokenizer, self.agent_cfg)
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad = pad
        if pad:
            self.stream = _pool_stream(tokenizer)

    def memory(self, item: Chain) -> np.ndarray:
        """The memory the oracle's Writes leave once both facts are read (the Write's text after
        its thinking, stripped, capped at the recipe's memory_tokens); with ``pad``, that many
        tokens of Wikipedia split around the facts (a longer context to copy out of)."""
        facts = self.builder.encode(" ".join(item.facts))
        if self.pad:
            rng = random.Random(item.question)
            start, cut = rng.randrange(len(self.stream) - self.pad), rng.randint(0, self.pad)
            filler = self.stream[start : start + self.pad]
            facts = np.concatenate([filler[:cut], facts, filler[cut:]])
        return facts[: self.agent_cfg.memory_tokens]

    def pair(self, item: Chain) -> tuple[np.ndarray, np.ndarray]:
        """The answer call's (prompt ids, response ids) over :meth:`memory` (the curriculum's own
        :func:`~infmem_verl.sft.curriculum.answer_call`)."""
        call = answer_call(self.builder, item, self.memory(item))
        return call.prompt, call.response


def asked_chain(index: int, seed: int, cfg: ProbeConfig) -> Chain:
    """Chain ``index`` of ``seed`` with ``cfg``'s names, asking what ``cfg.questions`` has it ask."""
    return asked(chain(index, seed, cfg.names), index, cfg.questions)


def build_model(tokenizer, cfg: ProbeConfig) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from infmem_verl.assets import tiny_qwen3_config

    if cfg.init:
        return AutoModelForCausalLM.from_pretrained(cfg.init, dtype=torch.float32)
    config = tiny_qwen3_config(tokenizer, cfg.hidden_size, cfg.layers, cfg.heads, qwen3_vocab=not cfg.vocab_size)
    torch.manual_seed(cfg.model_seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def greedy_answers(model, samples: AnswerSamples, items: Sequence[Chain], max_tokens: int = 48) -> list[str | None]:
    """Parsed greedy answers of the answer call (left-padded batch generation)."""
    tok = samples.builder.tokenizer
    prompts = [samples.pair(item)[0] for item in items]
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.from_numpy(prompt.astype(np.int64))
        mask[row, width - len(prompt) :] = 1
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=samples.end_id, pad_token_id=pad,
        )  # fmt: skip
    model.train()
    answers = []
    for row in out[:, width:].tolist():
        text = samples.builder.decode(row)
        split = text.split("</think>", 1)
        answers.append(parse_answer(split[1], samples.agent_cfg.answer_format) if len(split) == 2 else None)
    return answers


class InductionTask:
    """The copy pre-task's sequences: ``length`` tokens in which a span of ``min_span`` to
    ``max_span`` tokens appears twice, the second occurrence overwriting the tokens at its place.

    Only the repeat is scored, and only from its second token on (its first token cannot be
    known before it is seen): :meth:`sample` returns the ids and the mask of positions whose
    next token is scored, in the convention of :func:`~infmem_verl.sft.curriculum.padded_pairs`. ``source`` "text" draws windows
    of consecutive Wikipedia paragraphs' ids (the pool :mod:`infmem_verl.sft.fresh` splices facts
    into; its last tenth is kept for held-out windows), "random" uniform ids of the learned
    vocabulary (no special tokens).
    """

    def __init__(self, tokenizer, length: int = 192, min_span: int = 10, max_span: int = 40, source: str = "text"):
        if not 2 <= min_span <= max_span or 2 * max_span > length:
            raise ValueError(f"spans {min_span}-{max_span}: need 2 <= min <= max and two spans within {length} tokens")
        if source not in ("text", "random"):
            raise ValueError(f"source: expected 'text' or 'random', got {source!r}")
        self.length, self.min_span, self.max_span, self.source = length, min_span, max_span, source
        self.vocab = tokenizer.vocab_size  # the learned tokens; the added (special) ones follow
        if source == "text":
            stream = _pool_stream(tokenizer)
            cut = len(stream) * 9 // 10
            self.streams = {False: stream[:cut], True: stream[cut:]}

    def sample(self, rng: random.Random, heldout: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's ids and its scored-position mask (``mask[i]``: ``ids[i + 1]`` is scored)."""
        if self.source == "text":
            stream = self.streams[heldout]
            start = rng.randrange(len(stream) - self.length)
            ids = stream[start : start + self.length].astype(np.int64)
        else:
            ids = np.array([rng.randrange(self.vocab) for _ in range(self.length)], dtype=np.int64)
        span = rng.randint(self.min_span, self.max_span)
        first = rng.randrange(self.length - 2 * span + 1)
        second = rng.randint(first + span, self.length - span)
        ids[second : second + span] = ids[first : first + span]
        mask = np.zeros(self.length, dtype=bool)
        mask[second : second + span - 1] = True
        return ids, mask

    def batch(self, rng: random.Random, size: int, heldout: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.sample(rng, heldout) for _ in range(size)]
        return torch.from_numpy(np.stack([r[0] for r in rows])), torch.from_numpy(np.stack([r[1] for r in rows]))


def _cosine(steps: int, warmup_ratio: float, floor: float = 0.1):
    """verl's SFT schedule as a LambdaLR factor: linear warm-up, cosine to ``floor``."""
    warm = max(1, int(steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, steps - warm)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train_step(model, optimizer, scheduler, ids: torch.Tensor, scored: torch.Tensor, clip_grad: float) -> float:
    """One AdamW step on the cross-entropy of the ``scored`` positions of ``ids``; its loss."""
    logits, targets = response_logits(model, ids, scored)
    loss = torch.nn.functional.cross_entropy(logits, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    optimizer.step()
    scheduler.step()
    return float(loss.detach())


def induction_pretrain(model, tokenizer, cfg: ProbeConfig, say=print) -> list[InductionPoint]:
    """Train ``model`` ``cfg.induction_steps`` steps on the copy pre-task (own AdamW at
    ``cfg.induction_lr or cfg.lr``, own warm-up and cosine); return its held-out copy-accuracy
    curve (256 held-out sequences)."""
    task = InductionTask(tokenizer, cfg.induction_length, cfg.induction_min_span, cfg.induction_max_span, cfg.induction_source)
    heldout = task.batch(random.Random(f"induction-heldout:{HELDOUT_SEED}"), 256, heldout=True)
    rng = random.Random(f"induction:{cfg.seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.induction_lr or cfg.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _cosine(cfg.induction_steps, cfg.warmup_ratio))
    points: list[InductionPoint] = []
    losses: list[float] = []
    started = time.process_time()
    for step in range(1, cfg.induction_steps + 1):
        losses.append(train_step(model, optimizer, scheduler, *task.batch(rng, cfg.induction_batch), cfg.clip_grad))
        if step % cfg.induction_eval_every == 0 or step == cfg.induction_steps:
            model.eval()
            with torch.no_grad():
                logits, targets = response_logits(model, *heldout)
            model.train()
            point = InductionPoint(
                step=step,
                train_loss=float(np.mean(losses[-cfg.induction_eval_every :])),
                copy_acc=float((logits.argmax(-1) == targets).float().mean()),
                cpu_s=time.process_time() - started,
                load=os.getloadavg()[0],
            )
            points.append(point)
            say(
                f"[induction] step {step:>5} | loss {point.train_loss:.3f} | held out copy {point.copy_acc:.1%} "
                f"| cpu {point.cpu_s:.0f} s | load {point.load:.1f}"
            )
    return points


def distilled_calls(path: str, kind: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (prompt, response) ids of every ``kind`` call in a distilled SFT parquet, in file
    order (the response: from the first trained token on)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["input_ids", "loss_mask", "kind"]).to_pylist()
    pairs = []
    for row in table:
        if row["kind"] == kind:
            ids, first = np.asarray(row["input_ids"], dtype=np.int32), row["loss_mask"].index(1)
            pairs.append((ids[:first], ids[first:]))
    if not pairs:
        raise ValueError(f"{path}: no {kind} calls")
    return pairs


def run_probe(cfg: ProbeConfig, say=print) -> ProbeResult:
    from infmem_verl.assets import load_tokenizer
    from infmem_verl.small_vocab import small_vocab_dir

    tokenizer = load_tokenizer(str(small_vocab_dir(cfg.vocab_size)) if cfg.vocab_size else None)
    samples = AnswerSamples(tokenizer, cfg.recipe, agent_overrides(cfg), cfg.memory_pad)
    model = build_model(tokenizer, cfg)
    pad_id = tokenizer.pad_token_id
    induction = induction_pretrain(model, tokenizer, cfg, say) if cfg.induction_steps else []
    induction_cpu = induction[-1].cpu_s if induction else 0.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _cosine(cfg.steps, cfg.warmup_ratio, cfg.min_lr_ratio))
    if cfg.call == "answer":
        heldout_chains = [asked_chain(i, HELDOUT_SEED, cfg) for i in range(cfg.heldout)]
        heldout = [samples.pair(i) for i in heldout_chains]
        supply = cfg.pool or cfg.steps * cfg.batch_size

        def train_pair(index: int) -> tuple[np.ndarray, np.ndarray]:
            item = asked_chain(index, cfg.seed, cfg)
            return samples.pair(item)
    elif cfg.call == "fresh":
        if cfg.pool:
            raise ValueError("pool: fresh calls are never repeated")
        kinds = set(cfg.kinds.split(","))
        heldout_calls = list(itertools.islice(_fresh_stream(tokenizer, samples, cfg, HELDOUT_SEED, kinds), cfg.heldout))
        heldout = [(c.prompt, c.response) for c in heldout_calls]
        stream = _fresh_stream(tokenizer, samples, cfg, cfg.seed, kinds)
        if cfg.questions == "all":  # haystack-free answer calls asking each of the chain's names in turn
            asks = (asked_chain(i, cfg.seed + 1, cfg) for i in itertools.count())
            answers = (samples.pair(item) for item in asks)
        else:
            answers = ((c.prompt, c.response) for c in _fresh_stream(tokenizer, samples, cfg, cfg.seed + 1, {"answer"}))
        supply = cfg.steps * cfg.batch_size

        def train_pair(index: int) -> tuple[np.ndarray, np.ndarray]:
            call = next(stream)
            return call.prompt, call.response
    else:  # the Writes of two oracle distillations (python -m infmem_verl.distill --teacher oracle)
        heldout = distilled_calls(cfg.heldout_data, "write")[: cfg.heldout]
        train = distilled_calls(cfg.train_data, "write")
        needed = cfg.pool or cfg.steps * cfg.batch_size
        if needed > len(train):
            raise ValueError(f"train_data: {len(train)} Writes, {needed} needed (steps x batch without repeats, or --pool)")
        supply = cfg.pool or len(train)
        train_pair = train.__getitem__
    nothing = samples.builder.encode("Nothing relevant yet.").tolist()
    carries = [not _contains(r.tolist(), nothing) for _, r in heldout]  # a Write that copies a fact
    rng = random.Random(cfg.seed)
    order: list[int] = []
    result = ProbeResult(cfg, prompt_tokens=float(np.mean([len(p) for p, _ in heldout])), induction=induction)
    losses: list[float] = []
    started = time.process_time() - induction_cpu  # the probe's CPU-s count the pre-task's too
    say(f"[copy-probe] {json.dumps(dataclasses.asdict(cfg))}; {cfg.call} prompt {result.prompt_tokens:.0f} tokens")
    for step in range(1, cfg.steps + 1):
        if not order:  # one pass over the supply (fresh: the supply is every sample the run needs)
            order = list(range(supply))
            if cfg.pool:
                rng.shuffle(order)
        indices, order = order[: cfg.batch_size], order[cfg.batch_size :]
        pairs = [train_pair(i) for i in indices]
        if cfg.call == "fresh":
            pairs += list(itertools.islice(answers, cfg.extra_answers))
        losses.append(train_step(model, optimizer, scheduler, *padded_pairs(pairs, pad_id), cfg.clip_grad))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            exact = exact_share(model, heldout, pad_id)
            if cfg.call == "answer":
                greedy = greedy_answers(model, samples, heldout_chains)
                score = float(np.mean([sub_em(a, [i.answer]) for a, i in zip(greedy, heldout_chains)]))
            elif cfg.call == "fresh":  # the Writes that copy a fact, reproduced exactly; each kind's exact share
                score = float(np.mean([e for e, c, call in zip(exact, carries, heldout_calls) if c and call.kind == "write"] or [np.nan]))
                by_kind = {k: float(np.mean([e for e, c in zip(exact, heldout_calls) if c.kind == k])) for k in sorted(kinds)}
                say(f"[copy-probe] step {step:>5} | held out exact by kind {json.dumps(by_kind)}")
            else:  # the Writes that copy a fact, reproduced exactly
                score = float(np.mean([e for e, c in zip(exact, carries) if c]))
            if cfg.save:
                model.save_pretrained(cfg.save)
                tokenizer.save_pretrained(cfg.save)
            point = ProbePoint(
                step=step,
                train_loss=float(np.mean(losses[-cfg.eval_every :])),
                exact=float(np.mean(exact)),
                sub_em=score,
                cpu_s=time.process_time() - started,
                load=os.getloadavg()[0],
            )
            result.points.append(point)
            label = "sub-EM" if cfg.call == "answer" else "fact Writes exact"
            say(
                f"[copy-probe] step {step:>5} | loss {point.train_loss:.3f} | held out exact {point.exact:.1%} "
                f"{label} {point.sub_em:.1%} | cpu {point.cpu_s:.0f} s | load {point.load:.1f}"
            )
    result.distinct_samples = min(supply, cfg.steps * cfg.batch_size)
    return result


def _fresh_stream(tokenizer, samples: AnswerSamples, cfg: ProbeConfig, seed: int, kinds: set[str]):
    """The calls of kinds ``kinds`` of fresh oracle trajectories of ``seed``, in order."""
    from infmem_verl.sft.fresh import FreshCalls

    fresh = FreshCalls(tokenizer, samples.agent_cfg, cfg.agent, seed, names=cfg.names, clean=cfg.clean_chunks)
    return (call for _, call in fresh.calls() if call.kind in kinds)


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def loop_check(model_dir: str, agent: str, docs: int, temperature: float, cfg: ProbeConfig, doc_tokens: int = 1024):
    """The warm-up's own held-out check (:func:`infmem_verl.cpu.warmup.heldout_check`) of the
    student at ``model_dir``: ``agent`` through the real loop on the first ``docs`` of the demo
    warm-up's held-out documents (its seed + 1000) of ``doc_tokens`` tokens, their names and the
    agent's settings as in ``cfg`` (``names``, ``recipe``, ``overrides``), sampled at
    ``temperature`` (0: greedy)."""
    from infmem_verl.cpu.warmup import WarmupSettings, check_sampling, heldout_check
    from infmem_verl.distill import recipe_agent

    _, agent_cfg = recipe_agent(cfg.recipe, agent_overrides(cfg))
    settings = WarmupSettings(heldout_samples=docs, doc_tokens=doc_tokens, check_temperature=temperature)
    return heldout_check(Path(model_dir), agent, check_sampling(settings, agent_cfg), settings, cfg.names)


def parse_args(argv: Sequence[str] | None = None) -> tuple[ProbeConfig, str | None, str | None, float, int]:
    """The run's settings, the file to append its result to (``--json``), and the student to
    check through the real loop instead of training one (``--check``, at ``--check-temperature``,
    on documents of ``--check-doc-tokens``)."""
    defaults = ProbeConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in dataclasses.asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true", help=f"default {value}")
        else:
            parser.add_argument(flag, type=type(value), default=value, help=f"default {value}")
    parser.add_argument("--json", help="append the result as one JSON line to this file")
    parser.add_argument("--check", help="a saved student: run --agent through the real loop on --heldout held-out documents")
    parser.add_argument("--check-temperature", type=float, default=0.0, help="the check's sampling (0: greedy)")
    parser.add_argument("--check-doc-tokens", type=int, default=1024, help="the check's document length (>= 512)")
    args = vars(parser.parse_args(argv))
    out, check, temperature, doc_tokens = args.pop("json"), args.pop("check"), args.pop("check_temperature"), args.pop("check_doc_tokens")
    return ProbeConfig(**args), out, check, temperature, doc_tokens


def main(argv: Sequence[str] | None = None) -> int:
    cfg, out, check, temperature, doc_tokens = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("PROBE_THREADS", "2")))
    if check:
        started = time.process_time()
        heldout = loop_check(check, cfg.agent, cfg.heldout, temperature, cfg, doc_tokens)
        print(f"[copy-probe] {cfg.agent} {check} at temperature {temperature}: {heldout.line()} | cpu {time.process_time() - started:.0f} s | load {os.getloadavg()[0]:.1f}")
        if out:
            with open(out, "a", encoding="utf-8") as file:
                file.write(json.dumps({"check": check, "agent": cfg.agent, "temperature": temperature, **dataclasses.asdict(heldout)}) + "\n")
        return 0
    result = run_probe(cfg)
    print(f"[copy-probe] best held-out score {result.best_sub_em():.1%} over {result.distinct_samples} distinct training samples")
    if out:
        with open(out, "a", encoding="utf-8") as file:
            file.write(json.dumps(dataclasses.asdict(result)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
