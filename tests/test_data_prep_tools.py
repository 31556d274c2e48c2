"""The tools around data preparation: the closed-book filter (scripted policy and the tiny
model), the statistics command, and verl's own dataset class reading our training parquet."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_prep.build import BuildSpec, ClosedBookFilter, build
from data_prep.closed_book import ClosedBookSettings, is_correct, keep_unanswered, load_policy
from data_prep.compose import Target
from data_prep.io import manifest_path
from data_prep.published import read_published
from data_prep.sources import load_source
from data_prep.stats import answer_type, main as stats_main
from infmem_verl.policy.scripted import ScriptedPolicy
from infmem_verl.data.documents import resolve

from test_data_prep import hotpot_records, write_json

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def dev_file(tmp_path_factory) -> Path:
    return write_json(tmp_path_factory.mktemp("official") / "hotpot_dev.json", hotpot_records(0, 40))


@pytest.fixture(scope="module")
def data(dev_file):
    return load_source("hotpotqa", dev_file)


# -------------------------------------------------------------------------- closed-book filter


def test_correctness_uses_boxed_exact_match_or_whole_word_answers():
    assert is_correct("I think it is \\boxed{The Eiffel Tower}.", ["Eiffel Tower"])
    assert is_correct("It was built in Paris, so \\boxed{France}", ["Paris"])  # the gold appears in the text
    assert not is_correct("That is not right: \\boxed{maybe}", ["no"])  # "no" is not a word of "not"
    assert not is_correct("<think>Paris or London?</think> \\boxed{London}", ["Paris"])  # thinking ignored
    assert not is_correct("no boxed answer here", ["Paris"])


def _scripted_answering(tokenizer, data, answered: set[str]) -> ScriptedPolicy:
    """A policy that answers correctly exactly the questions of ``answered`` (by id)."""
    by_question = {q.question: q for q in data.questions}

    def respond(prompt_ids, params) -> str:
        text = tokenizer.decode(prompt_ids)
        (question,) = [q for s, q in by_question.items() if s in text]
        return f"\\boxed{{{question.answers[0]}}}" if question.id in answered else "\\boxed{I do not know}"

    return ScriptedPolicy(tokenizer, respond)


def test_filter_drops_questions_answered_without_the_document(tokenizer, data):
    questions = data.questions[:12]
    answered = {q.id for q in questions[::3]}
    policy = _scripted_answering(tokenizer, data, answered)
    settings = ClosedBookSettings(samples=2, max_tokens=64, concurrency=4)
    kept, dropped = asyncio.run(keep_unanswered(policy, tokenizer, questions, settings))
    assert [q.id for q in kept] == [q.id for q in questions if q.id not in answered] and dropped == len(answered)
    assert len(policy.calls) == 2 * len(questions)
    prompt = tokenizer.decode(policy.calls[0].prompt_ids)
    assert questions[0].question in prompt and "\\boxed{}" in prompt
    assert data.pool[questions[0].gold[1]] not in prompt  # closed book: no document in the prompt
    assert policy.calls[0].params.temperature == 1.0 and policy.calls[0].params.top_p == 0.7
    # With a limit, batches stop as soon as enough questions are kept.
    policy.calls.clear()
    limited, _ = asyncio.run(keep_unanswered(policy, tokenizer, data.questions, ClosedBookSettings(concurrency=1), limit=2))
    assert len(limited) == 2 and len(policy.calls) == 2 * 4  # one batch of 4 questions, 2 samples each


def test_build_applies_the_filter_before_the_limit(tokenizer, data, dev_file, tmp_path):
    answered = {q.id for q in data.questions[:3]}
    policy = _scripted_answering(tokenizer, data, answered)
    spec = BuildSpec(
        "hotpotqa", dev_file, "dev", (Target("tokens", 4096),), tmp_path, limit=4, shared_pool=True,
        closed_book=ClosedBookFilter("unused:factory", settings=ClosedBookSettings(samples=1, concurrency=2)),
    )
    (result,) = build(spec, tokenizer, policy=policy)
    assert [s.id for s in read_published(result.path)] == [q.id for q in data.questions[3:7]]
    manifest = json.loads(manifest_path(result.path).read_text())
    assert manifest["results"]["filtered"] == 3 and manifest["params"]["closed_book"]["settings"]["samples"] == 1


def test_filter_runs_a_real_model_loaded_from_a_spec(tokenizer, data, tiny_model_dir):
    policy = load_policy("infmem_verl.policy.transformers:TransformersPolicy.from_pretrained", str(tiny_model_dir))

    async def run():
        try:
            return await keep_unanswered(policy, tokenizer, data.questions[:3], ClosedBookSettings(samples=1, max_tokens=6))
        finally:
            await policy.close()

    kept, dropped = asyncio.run(run())
    # Six random tokens never contain a Wikipedia title as whole words.
    assert [q.id for q in kept] == [q.id for q in data.questions[:3]] and dropped == 0
    with pytest.raises(ValueError, match=r"--filter-policy: expected 'module:callable', got 'nocolon'"):
        load_policy("nocolon")
    with pytest.raises(ValueError, match=r"infmem_verl.policy.scripted has no attribute 'Missing'"):
        load_policy("infmem_verl.policy.scripted:Missing")


# ---------------------------------------------------------------------------------- statistics


def test_answer_types():
    cases = {"yes": "yes/no", "No": "yes/no", "1990": "date", "March 3, 1990": "date", "42": "number",
             "3.5 million": "number", "Duke of York": "entity", "the city council": "phrase"}
    assert {a: answer_type(a) for a in cases} == cases


def test_stats_report_png_and_table_for_our_files(tokenizer, dev_file, tmp_path, capsys):
    spec = BuildSpec("hotpotqa", dev_file, "train", (Target("tokens", 4096),), tmp_path, limit=10)
    (train,) = build(spec, tokenizer)
    report = stats_main([str(train.path), "--out", str(tmp_path / "report")])
    assert (tmp_path / "report.png").read_bytes().startswith(PNG_SIGNATURE)
    assert (tmp_path / "report.md").read_text().endswith(report) and report in capsys.readouterr().out
    rows = dict([cell.strip() for cell in line.strip("|").split("|")] for line in report.splitlines()[2:])
    assert rows["samples"] == "10" and rows["gold documents per sample"] == "2.00"
    assert int(rows["distinct gold document numbers"].split()[0]) > 10  # the reference: at most 10 slots
    low, median, mean, high = (int(x) for x in rows["tokens min / median / mean / max"].split(" / "))
    assert 0.99 * 4096 <= low <= high <= 4096
    assert rows["answer types"].startswith("yes/no 0 (0%)")


def test_stats_of_reference_files_count_tokens_and_expand_indices(tokenizer, data, dev_file, tmp_path, capsys):
    text = "\n\n".join(f"Document {i + 1}:\n{data.pool[d]}" for i, d in enumerate([4, 9]))
    theirs = tmp_path / "eval_2.json"
    theirs.write_text(json.dumps([{"context": [4, 9], "input": "Q?", "answers": ["yes"], "num_docs": 2, "index": 0}], indent=4))
    with pytest.raises(SystemExit):
        stats_main([str(theirs)])
    assert "field 'context' holds document indices" in capsys.readouterr().err
    report = stats_main([str(theirs), "--source", "hotpotqa", "--pool", str(dev_file)])
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert f"| tokens min / median / mean / max | {tokens} / {tokens} / {tokens} / {tokens} |" in report
    assert "| gold positions | not recorded in this file |" in report and "yes/no 1 (100%)" in report
    assert theirs.with_name("eval_2.json.stats.png").read_bytes().startswith(PNG_SIGNATURE)


def _table(text: str) -> list[list[str]]:
    """The body rows of a markdown table, as cells."""
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.strip().splitlines()[2:]]


def test_stats_set_each_files_real_size_against_its_label(tokenizer, data, dev_file, tmp_path, capsys):
    base = dict(source="hotpotqa", input=dev_file, split="dev", out_dir=tmp_path, limit=2, shared_pool=True)
    (full,) = build(BuildSpec(targets=(Target("tokens", 8192),), **base), tokenizer)
    (capped,) = build(BuildSpec(targets=(Target("tokens", 1 << 17),), cap_at_pool=True, **base), tokenizer)
    # A reference-style file (no meta): the label comes from its name, the tokens from its text.
    theirs = tmp_path / "eval_qa_2_65536.json"
    records = json.loads(full.path.read_text())
    theirs.write_text(json.dumps([{k: r[k] for k in ("context", "input", "answers", "index")} for r in records], indent=4))
    report = stats_main([str(full.path), str(capped.path), str(theirs)])
    assert report in capsys.readouterr().out
    whole_pool = next(read_published(capped.path)).meta["num_tokens"]  # every sample holds the whole pool
    assert whole_pool < 1 << 17
    full_tokens = [s.meta["num_tokens"] for s in read_published(full.path)]
    summary = _table(report.split("## label against real size")[1])
    assert summary == [
        ["eval_qa_2_8192.json", "8k", "2", f"{min(full_tokens)} / {sum(full_tokens) / 2:.0f} / {max(full_tokens)}",
         f"{100 * sum(full_tokens) / 2 / 8192:.1f}%", "0"],
        ["eval_qa_2_131072.json", "128k", "2", f"{whole_pool} / {whole_pool} / {whole_pool}", f"{100 * whole_pool / (1 << 17):.1f}%", "2"],
        ["eval_qa_2_65536.json", "64k", "2", f"{min(full_tokens)} / {sum(full_tokens) / 2:.0f} / {max(full_tokens)}",
         f"{100 * sum(full_tokens) / 2 / 65536:.1f}%", "2"],
    ]  # fmt: skip
    rows = dict(_table(capped.path.with_name(capped.path.name + ".stats.md").read_text().split("\n\n", 1)[1]))
    assert rows["label"] == "128k (131072 tokens)" and rows["samples short of the label (< 99%)"] == "2 of 2"
    assert rows["real tokens / label min / median / max"] == " / ".join([f"{100 * whole_pool / (1 << 17):.1f}%"] * 3)
    with pytest.raises(SystemExit):
        stats_main([str(full.path), str(theirs), "--out", str(tmp_path / "one")])
    assert "--out: a prefix for one file" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- verl reads it


def test_verl_dataset_reads_the_training_parquet(tokenizer, dev_file, tmp_path, data):
    from hydra import compose, initialize_config_dir
    from infmem_verl import conf_dir
    from verl.trainer.ppo.utils import create_rl_dataset

    from infmem_verl.main import prepare_config

    spec = BuildSpec("hotpotqa", dev_file, "train", (Target("tokens", 4096),), tmp_path, limit=3)
    (result,) = build(spec, tokenizer)
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose("infmem_trainer", overrides=[f"data.train_files={result.path}", f"data.val_files={result.path}"])
    prepared = prepare_config(config)
    assert (prepared.checked_files, prepared.missing_files) == ([str(result.path)] * 2, [])
    dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, None, is_train=True)
    assert len(dataset) == 3
    for i, question in enumerate(data.questions[:3]):
        row = dataset[i]
        assert row["raw_prompt"] == [{"role": "user", "content": question.question}]
        assert list(row["reward_model"]["ground_truth"]) == list(question.answers)
        # No agent_name column unless asked: verl then runs the configured default_agent_loop.
        assert row["index"] == question.index and "agent_name" not in row
        assert data.pool[question.gold[0]] in resolve(row["document_ref"])


def test_synthetic_dataset_command_writes_agent_name_only_when_asked(tmp_path, capsys):
    from infmem_verl.verl_plugin.dataset import main as dataset_main

    argv = ["--synthetic", "2", "--tokens", "1500"]
    dataset_main(argv + ["--out", str(tmp_path / "plain.parquet")])
    assert "agent_name" not in pq.read_schema(tmp_path / "plain.parquet").names
    dataset_main(argv + ["--out", str(tmp_path / "named.parquet"), "--agent-loop", "memagent_agent"])
    assert pq.read_table(tmp_path / "named.parquet", columns=["agent_name"]).column(0).to_pylist() == ["memagent_agent"] * 2
    with pytest.raises(SystemExit):
        dataset_main(argv + ["--out", str(tmp_path / "bad.parquet"), "--agent-loop", "memagent"])
    assert "--agent-loop: invalid choice: 'memagent'" in capsys.readouterr().err
