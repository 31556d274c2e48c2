"""The warm-up's curriculum: SFT stages of the oracle's calls that teach a tiny student to copy.

A 2-layer student fine-tuned on whole distilled trajectories learns the protocol and copies no
fact (issue 30). What made it copy (docs/experiments/2026-12-06-copying-names.md) is this order:

1. ``answer``: the answer call alone, over a haystack-free memory of a chain's two facts, each
   chain asking its two-hop question, its bridge or its entity in turn (:func:`asked`). With
   role names (:data:`~infmem_verl.data.synthetic.NameStyle`) the student learns to fetch a name
   per kind of name, so all three kinds must be asked for, and it may learn one kind and never
   the others; answer chains whose names come from one list for every role (the warm-up's
   ``answer_names``) teach one copy that serves all three (docs/experiments/2026-12-06-copy-onset.md);
2. ``memagent``: MemAgent's Writes, with such answer calls in every batch (a kind of name the
   Writes need less often fades without them);
3. ``infmem``: InfMem's PreThinks and Writes, with the same answer calls. It starts from the
   MemAgent student: straight after stage 1 InfMem's Writes, twice as long, copied nothing in 800
   steps. MemAgent's Writes stay in its batches (without them the MemAgent reader fell from 86% to
   20% held out in 300 steps), so one student serves both agents, as one backbone does in the
   papers' comparison.

Every call is new (:class:`~infmem_verl.sft.fresh.FreshCalls`: the oracle's calls made without the
loop, about a millisecond each), so no step can lower its loss by remembering an answer. A stage is
written as an SFT parquet of ``steps x batch`` rows, one pass of the SFT command; rows come in
groups of one batch (the loader shuffles them anyway: the share of answer calls is what counts).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path
from typing import Iterator, Literal, Sequence

import numpy as np
import torch

from infmem_verl.agent.config import AgentConfig
from infmem_verl.agent.protocol import PromptBuilder
from infmem_verl.data.synthetic import Chain, NameStyle, chain
from infmem_verl.policy.scripted import oracle_answer
from infmem_verl.sft.fresh import Call, FreshCalls
from infmem_verl.sft.samples import SFTSample, SFTWriter

Stage = Literal["answer", "memagent", "infmem"]
# The stages in the order they run; a MemAgent warm-up stops before "infmem".
STAGES: tuple[Stage, ...] = ("answer", "memagent", "infmem")
# The calls each stage trains besides its answer calls: (agent, kinds) sources sharing a batch evenly.
STAGE_SOURCES = {"memagent": (("memagent", ("write",)),), "infmem": (("infmem", ("prethink", "write")), ("memagent", ("write",)))}


def asked(item: Chain, index: int, questions: str = "all") -> Chain:
    """``item`` asking what ``questions`` has chain ``index`` ask: ``"chain"`` its own two-hop
    question; ``"all"`` its question, its bridge or its entity as ``index % 3``
    (:attr:`Chain.one_hop`), so the answer is each of its three names in turn."""
    if questions == "chain":
        return item
    if questions != "all":
        raise ValueError(f"questions: expected 'chain' or 'all', got {questions!r}")
    turn = index % 3
    if turn == 0:
        return item
    question, answer = item.one_hop[turn - 1]
    return dataclasses.replace(item, question=question, answer=answer)


def answer_call(builder: PromptBuilder, item: Chain, memory: np.ndarray | None = None) -> Call:
    """The answer call over ``memory`` (default: the chain's two facts, what the oracle's Writes
    leave once both are read, capped at the memory budget), with the oracle's answer as target."""
    if memory is None:
        memory = builder.encode(" ".join(item.facts))[: builder.cfg.memory_tokens]
    prompt = builder.answer(builder.encode(item.question), memory).ids
    end = builder.tokenizer.convert_tokens_to_ids("<|im_end|>")
    return Call("answer", prompt, np.append(builder.encode(oracle_answer(item.answer)), end).astype(np.int32))


# What chain ``i`` asks as ``i % 3`` (:func:`asked` with ``"all"``): the name its answer is.
ASKED_KINDS = ("two-hop", "bridge", "entity")


def copied_kinds(model: torch.nn.Module, tokenizer, agent_cfg: AgentConfig, names: NameStyle, seed: int, per_kind: int = 32) -> dict[str, float]:
    """Per kind of question (:data:`ASKED_KINDS`), the share of haystack-free answer calls of
    chains of ``seed`` that ``model`` answers exactly as the oracle does (:func:`exact_share`).

    With role names the copy can form for one kind and not the others, differently on different
    machines (docs/experiments/2026-12-06-copy-onset.md): the answer stage's gate.
    """
    builder = PromptBuilder(tokenizer, agent_cfg)
    calls = [answer_call(builder, asked(chain(i, seed, names), i)) for i in range(3 * per_kind)]
    exact = exact_share(model, [(c.prompt, c.response) for c in calls], tokenizer.pad_token_id)
    return {kind: float(np.mean(exact[k::3])) for k, kind in enumerate(ASKED_KINDS)}


def padded_pairs(pairs: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids of (prompt, response) pairs and the mask of positions whose next token
    is a response token."""
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    trained = torch.zeros((len(pairs), width), dtype=torch.bool)
    for row, (prompt, response) in enumerate(pairs):
        ids[row, : len(prompt) + len(response)] = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))
        trained[row, len(prompt) - 1 : len(prompt) + len(response) - 1] = True
    return ids, trained


def response_logits(model: torch.nn.Module, ids: torch.Tensor, trained: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at the ``trained`` positions only, with their targets (causal attention: right
    padding is never seen)."""
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    rows, cols = trained.nonzero(as_tuple=True)
    return model.get_output_embeddings()(hidden[rows, cols]).float(), ids[rows, cols + 1]


def exact_share(model: torch.nn.Module, pairs: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int) -> list[bool]:
    """For each (prompt, response): is every response token the argmax after the oracle's prefix
    (so greedy decoding reproduces the oracle's response exactly)?"""
    ids, trained = padded_pairs(pairs, pad_id)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits, targets = response_logits(model, ids, trained)
    model.train(was_training)
    hit = (logits.argmax(-1) == targets).tolist()
    out, start = [], 0
    for _, response in pairs:
        out.append(all(hit[start : start + len(response)]))
        start += len(response)
    return out


def answer_calls(builder: PromptBuilder, names: NameStyle, seed: int) -> Iterator[Call]:
    """Haystack-free answer calls of chains ``0, 1, ...`` of ``seed``, asking every name in turn."""
    for index in itertools.count():
        yield answer_call(builder, asked(chain(index, seed, names), index))


def stage_calls(
    stage: Stage, tokenizer, agent_cfg: AgentConfig, names: NameStyle, seed: int, batch: int, answers: int, answer_names: NameStyle | None = None
) -> Iterator[Call]:
    """Stage ``stage``'s calls, a batch at a time: answer calls only for ``"answer"``; else
    ``batch - answers`` calls of the stage's sources (:data:`STAGE_SOURCES`, an even share each)
    and ``answers`` answer calls. The trajectories' documents have ``names``, the answer calls'
    chains ``answer_names`` (default: the same)."""
    if stage not in STAGES:
        raise ValueError(f"stage: expected one of {STAGES}, got {stage!r}")
    builder = PromptBuilder(tokenizer, agent_cfg)
    # The answer calls draw chains of another seed than the trajectories', so no question repeats.
    asks = answer_calls(builder, answer_names or names, seed + 1)
    if stage == "answer":
        yield from asks
        return
    if not 0 <= answers < batch:
        raise ValueError(f"answers: expected an integer in [0, {batch}), got {answers!r}")
    sources = STAGE_SOURCES[stage]
    streams = [_calls(FreshCalls(tokenizer, agent_cfg, agent, seed, names=names), kinds) for agent, kinds in sources]
    shares = [(batch - answers) // len(sources) + (i < (batch - answers) % len(sources)) for i in range(len(sources))]
    while True:
        for stream, share in zip(streams, shares):
            yield from itertools.islice(stream, share)
        yield from itertools.islice(asks, answers)


def _calls(fresh: FreshCalls, kinds: tuple[str, ...]) -> Iterator[Call]:
    return (call for _, call in fresh.calls() if call.kind in kinds)


def write_stage(path: Path, stage: Stage, steps: int, batch: int, tokenizer, agent_cfg: AgentConfig, names: NameStyle,
                seed: int, answers: int, answer_names: NameStyle | None = None) -> Path:  # fmt: skip
    """Write ``steps x batch`` calls of ``stage`` (:func:`stage_calls`) to the SFT parquet ``path``
    (all or nothing: written aside, then renamed); returns ``path``."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    writer = SFTWriter(tmp, tokenizer, agent_cfg.thinking)
    calls = stage_calls(stage, tokenizer, agent_cfg, names, seed, batch, answers, answer_names)
    for row, call in enumerate(itertools.islice(calls, steps * batch)):
        sample = SFTSample(
            input_ids=np.concatenate([call.prompt, call.response]).astype(np.int32),
            loss_mask=np.concatenate([np.zeros(len(call.prompt), np.int8), np.ones(len(call.response), np.int8)]),
            prompt_tokens=len(call.prompt),
            kind=call.kind,
            turn=0,
        )
        writer.write(sample, f"{stage}-{seed}-{row}", f"curriculum:{stage}")
    writer.close()
    tmp.rename(path)
    return path
