"""The answer-call copy probe (bench/copy_probe.py) on real components: the demo recipe's protocol,
the small-vocabulary tokenizer, the oracle's distillation and a real tiny Qwen3."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from bench.copy_probe import AnswerSamples, ProbeConfig, asked, distilled_calls, run_probe
from infmem_verl.assets import load_tokenizer
from infmem_verl.data.synthetic import NAME_LIST, Chain, chain, make_dataset
from infmem_verl.distill import DistillConfig, distill
from infmem_verl.policy.source import ModelSource
from infmem_verl.small_vocab import small_vocab_dir
from infmem_verl.sft.samples import sft_paths


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """Two oracle trajectories of the demo protocol over 1K-token documents, small vocabulary."""
    vocab = small_vocab_dir()
    cfg = DistillConfig(
        out=tmp_path_factory.mktemp("distill"), recipe="demo", samples=3, synthetic_length="1024", teacher="oracle",
        source=ModelSource(tokenizer=vocab), seed=3, keep="all", drop_flags=(), progress=False,
    )  # fmt: skip
    asyncio.run(distill(cfg))
    return sft_paths(cfg.out)["train"]


def test_the_probes_answer_samples_are_the_distilled_answer_samples(distilled):
    """Built from a chain without its haystack, the probe's answer call is token for token the
    one the oracle's distillation writes for the sample that hides the same chain."""
    tokenizer = load_tokenizer(str(small_vocab_dir()))
    answers = {row["sample_id"]: row for row in pq.read_table(distilled).to_pylist() if row["kind"] == "answer"}
    probe = AnswerSamples(tokenizer, "demo")
    for sample in make_dataset(2, 1024, tokenizer, seed=3):
        row = answers[sample.id]
        item = Chain(sample.meta["template"], sample.question, tuple(f["text"] for f in sample.meta["facts"]), sample.meta["bridge"], sample.answers[0])
        ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
        prompt, response = probe.pair(item)
        assert ids.tolist() == np.concatenate([prompt, response]).tolist()
        assert mask[len(prompt) :].all() and not mask[: len(prompt)].any()


def test_the_write_probe_trains_on_distilled_writes_once_each(distilled):
    writes = distilled_calls(str(distilled), "write")
    assert len(writes) >= 4 and all(len(p) > 200 and len(r) > 5 for p, r in writes)
    cfg = ProbeConfig(call="write", train_data=str(distilled), heldout_data=str(distilled), steps=2, eval_every=2, heldout=4, batch_size=2)
    result = run_probe(cfg, say=lambda _: None)
    assert result.distinct_samples == 4 and 0 <= result.points[-1].exact <= 1
    with pytest.raises(ValueError, match="needed"):
        run_probe(dataclasses.replace(cfg, steps=len(writes)), say=lambda _: None)


def test_fresh_chains_never_repeat_and_a_few_steps_lower_the_loss():
    items = [chain(i, 1) for i in range(200)]
    assert len({item.question for item in items}) == 200
    assert all(item.answer in item.facts[1] and item.bridge in item.facts[0] for item in items)
    result = run_probe(ProbeConfig(steps=6, eval_every=3, heldout=4, batch_size=4, lr=3e-3), say=lambda _: None)
    assert result.distinct_samples == 24 and [p.step for p in result.points] == [3, 6]
    assert result.points[-1].train_loss < result.points[0].train_loss
    assert all(0 <= p.exact <= 1 and 0 <= p.sub_em <= 1 for p in result.points)
    pooled = run_probe(ProbeConfig(steps=3, eval_every=3, heldout=2, batch_size=4, pool=8), say=lambda _: None)
    assert pooled.distinct_samples == 8


def test_the_fresh_probe_trains_on_every_call_kind_of_new_trajectories(tmp_path):
    """--call fresh: the oracle's calls of fresh trajectories (infmem_verl/sft/fresh.py), the
    student saved where --check can run it through the real loop."""
    cfg = ProbeConfig(call="fresh", steps=2, eval_every=2, heldout=6, batch_size=2, extra_answers=1, save=str(tmp_path))
    result = run_probe(cfg, say=lambda _: None)
    assert result.distinct_samples == 4 and [p.step for p in result.points] == [2]
    assert (tmp_path / "config.json").is_file() and (tmp_path / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="never repeated"):
        run_probe(dataclasses.replace(cfg, pool=4), say=lambda _: None)


def test_the_curriculum_options_ask_every_name_and_pad_the_memory(tmp_path):
    """--questions all asks the chain's question, its bridge and its entity in turn; --memory-pad
    puts Wikipedia around the facts; --init continues from a saved student."""
    tokenizer = load_tokenizer(str(small_vocab_dir()))
    items = [asked(chain(i, 1, "roles"), i, "all") for i in range(3)]
    originals = [chain(i, 1, "roles") for i in range(3)]
    assert [it.answer for it in items] == [originals[0].answer, originals[1].bridge, originals[2].entity]
    assert all(it.answer not in it.question for it in items)
    padded = AnswerSamples(tokenizer, "demo", ["infmem.agent.memory_tokens=160", "infmem.agent.write.output_tokens=160"], pad=64)
    memory = tokenizer.decode(padded.memory(items[1]).tolist())
    assert all(fact in memory for fact in items[1].facts) and len(padded.memory(items[1])) >= 64 + 20
    cfg = ProbeConfig(steps=2, eval_every=2, heldout=3, batch_size=2, names="roles", questions="all", save=str(tmp_path))
    run_probe(cfg, say=lambda _: None)
    again = run_probe(dataclasses.replace(cfg, init=str(tmp_path), save=""), say=lambda _: None)
    assert again.points[-1].train_loss < 20
    with pytest.raises(ValueError, match="^questions: "):
        asked(originals[0], 1, "some")


def test_check_runs_a_saved_student_through_the_real_loop_on_documents_of_the_probes_names(tmp_path):
    """--check: the warm-up's held-out check, on documents whose names and agent settings are the
    probe's (here single-token role names and 128-token chunks)."""
    from bench.copy_probe import main
    from infmem_verl.cpu.warmup import HELDOUT_SEED_OFFSET, WarmupSettings

    student = tmp_path / "student"
    overrides = "infmem.agent.document.chunk_tokens=128"
    run_probe(ProbeConfig(call="fresh", agent="memagent", kinds="write", steps=1, eval_every=1, heldout=2, batch_size=2,
                          names="roles", overrides=overrides, save=str(student)), say=lambda _: None)  # fmt: skip
    out = tmp_path / "check.jsonl"
    flags = ["--check", str(student), "--agent", "memagent", "--names", "roles", "--heldout", "2", "--check-doc-tokens", "768"]
    assert main([*flags, "--overrides", overrides, "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["samples"] == 2 and row["chunks_read"] == 6 and row["write_valid"] >= 0
    # The documents checked are the held-out set with role names.
    docs = make_dataset(2, 768, load_tokenizer(str(student)), seed=WarmupSettings().seed + HELDOUT_SEED_OFFSET, names="roles")
    assert all(d.answers[0] in NAME_LIST for d in docs)


@pytest.mark.parametrize("source", ["random", "text"])
def test_the_induction_pretask_scores_only_the_repeated_span(source):
    """--induction-steps: each sequence holds one span twice; only the second occurrence's tokens
    after its first (the ones an induction circuit can predict) are scored."""
    import random

    from bench.copy_probe import InductionTask

    task = InductionTask(load_tokenizer(str(small_vocab_dir())), length=96, min_span=6, max_span=30, source=source)
    rng = random.Random(0)
    for _ in range(50):
        ids, mask = task.sample(rng)
        assert ids.shape == mask.shape == (96,) and ids.max() < task.vocab
        scored = np.flatnonzero(mask) + 1  # the positions of the scored (target) tokens
        span = len(scored) + 1
        assert 6 <= span <= 30 and (np.diff(scored) == 1).all()  # one block: the repeat after its first token
        second = scored[0] - 1
        assert any(
            (ids[first : first + span] == ids[second : second + span]).all() for first in range(0, second - span + 1)
        )  # the whole repeat occurred earlier, without overlapping it


def test_a_few_induction_steps_run_before_the_probe_on_the_same_student():
    cfg = ProbeConfig(
        steps=2, eval_every=2, heldout=2, batch_size=2, induction_steps=4, induction_eval_every=2,
        induction_source="random", induction_length=48, induction_min_span=4, induction_max_span=12, induction_batch=4,
    )  # fmt: skip
    result = run_probe(cfg, say=lambda _: None)
    assert [p.step for p in result.induction] == [2, 4] and all(0 <= p.copy_acc <= 1 for p in result.induction)
    assert [p.step for p in result.points] == [2] and result.points[0].cpu_s >= result.induction[-1].cpu_s
