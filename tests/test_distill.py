"""Distillation with a scripted teacher: keep and drop decisions, bad teacher output, privileged
hints, thinking shortening, answer up-weighting, bad training rows, records with missing turns,
resuming; all through the real agent core, the real Qwen3 tokenizer and real Wikipedia text.

The scripted teacher (``ScriptedPolicy``) writes protocol text chosen per test: the random tiny
model cannot be made to answer right or to break the grammar on purpose. The real-server path is
``test_distill_vllm.py``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow.parquet as pq
import pytest

from data_prep.training import TrainingWriter
from infmem_verl.agent.errors import ConfigError
from infmem_verl.data.synthetic import make_dataset
from infmem_verl.distill import DistillConfig, distill, parse_args, recipe_agent
from infmem_verl.policy.scripted import ScriptedPolicy
from infmem_verl.policy.source import ModelSource, OpenedModel
from infmem_verl.sft.samples import answer_copy_count, sft_paths
from infmem_verl.sft.shorten import ShortenConfig

# The smoke recipe's protocol with 1000-token chunks (3 per 2K document) and output budgets wide
# enough for a scripted tool call.
OVERRIDES = [
    "infmem.agent.document.chunk_tokens=1000",
    "infmem.agent.document.unit_tokens=200",
    "infmem.agent.document.unit_overlap=40",
    "infmem.agent.prethink.output_tokens=96",
    "infmem.agent.prethink.thinking_tokens=24",
    "infmem.agent.write.thinking_tokens=48",
    "infmem.agent.answer.thinking_tokens=24",
]
RETRIEVE = '<tool_call>\n{"name": "retrieve", "arguments": {"query": "sculptor master town", "top_k": 2}}\n</tool_call>'
MALFORMED = '<tool_call>\n{"name": "retrieve", "arguments": {"query": "sculptor"\n</tool_call>'


@pytest.fixture(scope="module")
def samples(tokenizer):
    return make_dataset(3, 2048, tokenizer, seed=5)


@pytest.fixture(scope="module")
def train_file(samples, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "train.parquet"
    writer = TrainingWriter(out, out.with_name("docs.parquet"), out.with_name("docs.parquet"), "infmem_agent", inline_context=True)
    for sample in samples:
        writer.write(sample)
    writer.close()
    return out


def call_kind(text: str) -> str:
    """Which call a rendered prompt is (or the shortening request)."""
    if "<reasoning>" in text:
        return "rewrite"
    if "<search_history>" in text:
        return "prethink"
    if "<current_chunk>" in text:
        return "write"
    return "answer"


def scripted_teacher(tokenizer, samples, *, answers: dict[str, str] | None = None,
                     special: Callable[[str, str], str | None] | None = None) -> OpenedModel:  # fmt: skip
    """A teacher that retrieves once per chunk, writes a short memory and answers ``answers``
    (default: every gold); ``special(kind, prompt_text)`` may replace any reply."""
    answers = answers or {s.question: s.answers[0] for s in samples}

    def respond(prompt: np.ndarray, params) -> str:
        text = tokenizer.decode(prompt.tolist())
        kind = call_kind(text)
        replaced = special(kind, text) if special else None
        if replaced is not None:
            return replaced
        if kind == "prethink":
            return f"<think>\nThe memory lacks the master.\n</think>\n\n{RETRIEVE}"
        if kind == "write":
            return "<think>\nKeep the names that link the sculptor to a town.\n</think>\n\nThe sculptor trained under a master."
        if kind == "answer":
            answer = next(a for q, a in answers.items() if q in text)
            return f"<think>\nThe memory names the town.\n</think>\n\n\\boxed{{{answer}}}"
        return "Short reasoning."

    return OpenedModel(ScriptedPolicy(tokenizer, respond), tokenizer, "scripted")


def config(out: Path, data: Path, **kw) -> DistillConfig:
    kw.setdefault("overrides", OVERRIDES)
    return DistillConfig(out=out, data=data, recipe="smoke", source=ModelSource(concurrency=2), progress=False, **kw)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def test_keeps_correct_trajectories_and_reports_why_others_were_dropped(tokenizer, samples, train_file, tmp_path):
    wrong = {samples[0].question: samples[0].answers[0], samples[1].question: "Nowhere", samples[2].question: samples[2].answers[0]}
    teacher = scripted_teacher(tokenizer, samples, answers=wrong)
    report = asyncio.run(distill(config(tmp_path, train_file), teacher))

    assert (report.finished, report.kept, report.dropped) == (3, 2, {"wrong_answer": 1})
    assert report.keep_rate == pytest.approx(2 / 3)
    by_id = {r["sample_id"]: r for r in records(tmp_path)}
    assert by_id[samples[1].id]["drop_reason"] == "wrong_answer" and "Nowhere" in by_id[samples[1].id]["drop_detail"]
    assert "turns_ref" not in by_id[samples[1].id], "dropped trajectories keep no token ids"
    stored = [json.loads(line)["sample_id"] for line in (tmp_path / "turns.jsonl").read_text().splitlines()]
    assert sorted(stored) == sorted([samples[0].id, samples[2].id])
    written = rows(sft_paths(tmp_path)["train"])
    kept_turns = sum(r["num_turns"] for r in by_id.values() if r["kept"])
    assert len(written) == kept_turns == report.sft.samples["train"]  # one sample per LLM call
    assert {r["sample_id"] for r in written} == {samples[0].id, samples[2].id}
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["keep_rate"] == pytest.approx(2 / 3) and saved["dropped"] == {"wrong_answer": 1}


def test_malformed_and_truncated_teacher_output_is_dropped_with_its_reason(tokenizer, samples, train_file, tmp_path):
    bad_action, long_memory = samples[0].question, samples[1].question

    def special(kind: str, text: str) -> str | None:
        if kind == "prethink" and bad_action in text:
            return f"<think>\nSearch.\n</think>\n\n{MALFORMED}"
        if kind == "write" and long_memory in text:
            return "<think>\nKeep it all.\n</think>\n\n" + "The sculptor and the town and the master. " * 40
        return None

    report = asyncio.run(distill(config(tmp_path, train_file), scripted_teacher(tokenizer, samples, special=special)))
    by_id = {r["sample_id"]: r for r in records(tmp_path)}
    assert by_id[samples[0].id]["drop_reason"] == "flag:invalid_action"
    assert "turn 0 (prethink)" in by_id[samples[0].id]["drop_detail"]
    assert by_id[samples[1].id]["drop_reason"] == "flag:output_truncated"
    assert by_id[samples[2].id]["kept"]
    assert report.dropped == {"flag:invalid_action": 1, "flag:output_truncated": 1} and report.kept == 1


def test_privileged_decomposition_reaches_the_teacher_but_no_sample(tokenizer, samples, train_file, tmp_path):
    hinted = samples[1]
    steps = [{"question": "Who trained the sculptor?", "answer": "a master"}, {"question": "Where was #1 born?", "answer": hinted.answers[0]}]
    decomposition = tmp_path / "musique.jsonl"
    decomposition.write_text(json.dumps({"id": hinted.id, "question_decomposition": steps}) + "\n")
    teacher = scripted_teacher(tokenizer, samples)
    report = asyncio.run(distill(config(tmp_path / "out", train_file, decomposition=decomposition), teacher))

    assert report.privileged == 1 and report.kept == 3
    seen = [tokenizer.decode(call.prompt_ids.tolist()) for call in teacher.policy.calls]
    hinted_prompts = [text for text in seen if "Where was #1 born?" in text]
    assert hinted_prompts and all(text.startswith("<|im_start|>system\nPrivate guidance") for text in hinted_prompts)
    assert all(hinted.question in text for text in hinted_prompts), "only the hinted question's calls carry the hint"
    written = rows(sft_paths(tmp_path / "out")["train"])
    assert not any("Private guidance" in tokenizer.decode(r["input_ids"]) for r in written)
    assert not any("Private guidance" in m["content"] for r in written for m in r["messages"])


def test_shortening_rewrites_long_thinking_and_keeps_the_output_tokens(tokenizer, samples, train_file, tmp_path):
    long_thinking = "<think>\n" + "I check the sculptor, the master and the town again. " * 3 + "\n</think>\n\nThe sculptor trained under a master."

    def special(kind: str, text: str) -> str | None:
        if kind == "write":
            return long_thinking
        if kind == "rewrite":
            return "Check sculptor, master, town."
        return None

    cfg = config(tmp_path, train_file, shorten=ShortenConfig(over_tokens=20), samples=1)
    report = asyncio.run(distill(cfg, scripted_teacher(tokenizer, samples, special=special)))
    assert report.shortened_turns == 3  # the three Writes; PreThink and Answer are short or not chosen
    memory_ids = tokenizer.encode("\n\nThe sculptor trained under a master.<|im_end|>", add_special_tokens=False)
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    for row in rows(sft_paths(tmp_path)["train"]):
        ids, mask = np.array(row["input_ids"]), np.array(row["loss_mask"])
        response = ids[mask == 1]
        if row["kind"] == "write":
            assert row["shortened"]
            assert tokenizer.decode(response.tolist()).startswith("<think>\nCheck sculptor, master, town.\n</think>")
            after = response[list(response).index(think_end) + 1 :]
            assert after.tolist() == memory_ids, "the tokens after </think> are the teacher's, unchanged"
        else:
            assert not row["shortened"]


def test_answer_up_weighting_writes_the_reference_number_of_copies(tokenizer, samples, train_file, tmp_path):
    report = asyncio.run(distill(config(tmp_path, train_file, answer_copies="reference"), scripted_teacher(tokenizer, samples)))
    written = rows(sft_paths(tmp_path)["train"])
    for record in records(tmp_path):
        answers = [r for r in written if r["sample_id"] == record["sample_id"] and r["kind"] == "answer"]
        assert len(answers) == answer_copy_count("reference", record["num_turns"]) == 1 + (record["num_turns"] - 1) // 2
        assert sorted(r["copy"] for r in answers) == list(range(len(answers)))
        assert len({tuple(r["input_ids"]) for r in answers}) == 1
    assert report.sft.by_kind["answer"] == sum(1 + (r["num_turns"] - 1) // 2 for r in records(tmp_path))


def test_bad_training_row_and_records_with_missing_turns_are_dropped_with_reasons(tokenizer, samples, train_file, tmp_path):
    table = pq.read_table(train_file).to_pylist()
    table[1]["prompt"] = [{"role": "user", "content": "   "}]  # an empty question
    broken_file = tmp_path / "broken.parquet"
    pq.write_table(pq.read_table(train_file).from_pylist(table, schema=pq.read_schema(train_file)), broken_file)
    out = tmp_path / "out"
    report = asyncio.run(distill(config(out, broken_file), scripted_teacher(tokenizer, samples)))
    assert report.failed == {"unreadable training row": 1} and report.kept == 2, "the run goes on past the bad row"
    failure = next(r for r in records(out) if r["status"] == "failed")
    assert failure["sample_id"] == samples[1].id and "question" in failure["reason"] and not failure["transient"]

    # A trajectory whose stored turns were cut (a hand edit, a damaged copy): the SFT build
    # drops it alone, with the reason.
    lines = (out / "turns.jsonl").read_text().splitlines()
    entry = json.loads(lines[0])
    kept = next(r for r in records(out) if r.get("turns_ref") == entry["ref"])
    lines[0] = json.dumps(entry | {"turns": entry["turns"][:-2]})
    (out / "turns.jsonl").write_text("\n".join(lines) + "\n")
    before = (out / "results.jsonl").read_text()
    rebuilt = asyncio.run(distill(config(out, broken_file, run_teacher=False)))
    assert (out / "results.jsonl").read_text() == before, "rebuilding never rewrites records"
    assert len(rebuilt.sft.broken) == 1 and "missing turns" in rebuilt.sft.broken[0] and kept["sample_id"] in rebuilt.sft.broken[0]
    assert {r["sample_id"] for r in rows(sft_paths(out)["train"])} == {s.id for s in samples} - {samples[1].id, kept["sample_id"]}


def test_the_sft_file_follows_sample_order_not_the_order_rollouts_finished(tokenizer, samples, train_file, tmp_path):
    asyncio.run(distill(config(tmp_path, train_file), scripted_teacher(tokenizer, samples)))
    first = rows(sft_paths(tmp_path)["train"])
    assert [r["sample_id"] for r in first] == sorted(r["sample_id"] for r in first)
    # The same trajectories stored in the other order (as concurrent rollouts may finish them):
    # the same file, row for row.
    for name in ("turns.jsonl", "results.jsonl"):
        lines = (tmp_path / name).read_text().splitlines()
        (tmp_path / name).write_text("\n".join(reversed(lines)) + "\n")
    asyncio.run(distill(config(tmp_path, train_file, run_teacher=False)))
    assert rows(sft_paths(tmp_path)["train"]) == first


def test_a_second_run_resumes_and_redoes_nothing(tokenizer, samples, train_file, tmp_path):
    first = scripted_teacher(tokenizer, samples)
    asyncio.run(distill(config(tmp_path, train_file, samples=2), first))
    before = (tmp_path / "results.jsonl").read_text()
    second = scripted_teacher(tokenizer, samples)
    report = asyncio.run(distill(config(tmp_path, train_file), second))  # now all three rows
    after = (tmp_path / "results.jsonl").read_text()
    assert after.startswith(before) and len(after.splitlines()) == 3
    asked = {tokenizer.decode(c.prompt_ids.tolist()) for c in second.policy.calls}
    assert all(samples[2].question in text for text in asked), "only the new sample was run"
    assert report.kept == 3

    with pytest.raises(ConfigError, match="another protocol"):
        asyncio.run(distill(config(tmp_path, train_file, metric="f1"), scripted_teacher(tokenizer, samples)))


def test_teacher_protocol_is_the_rl_recipes():
    agent, cfg = recipe_agent("smoke", [*OVERRIDES, "infmem.agent.memory_tokens=64"])
    assert agent == "infmem" and cfg.document.chunk_tokens == 1000 and cfg.memory_tokens == 64
    assert cfg.write_layout == "chunk_first"  # the SFT data's Writes are laid out as RL's
    assert recipe_agent("infmem_qwen25_7b", [])[1].thinking is False  # the Qwen2.5 student never thinks
    assert recipe_agent("infmem_4b", ["agent=memagent"])[0] == "memagent"
    with pytest.raises(ConfigError, match="recipe"):
        recipe_agent("no_such_recipe", [])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--keep", "some"], None),
        (["--drop-flags", "invalid_action,made_up"], "drop_flags: unknown flag 'made_up'"),
        (["--answer-copies", "0"], "answer_copies"),
        (["--answer-copies", "many"], "--answer-copies"),
        (["--val-fraction", "1.5"], "val_fraction"),
        (["--shorten-over", "100", "--shorten-kinds", "chunk"], "shorten.kinds"),
        (["--data", "/no/such/train.parquet"], "data: /no/such/train.parquet not found"),
        (["--concurrency", "0"], "concurrency: expected an integer >= 1"),
        (["--timeout", "0"], "request_timeout_s: expected a number > 0"),
        (["--backoff", "-1"], "backoff_s: expected a number >= 0"),
    ],
)
def test_bad_options_name_the_field(argv, match, tmp_path):
    if match is None:
        with pytest.raises(SystemExit):  # argparse rejects a value outside its choices
            parse_args(["--out", str(tmp_path), *argv])
        return
    with pytest.raises(ConfigError, match=match):
        parse_args(["--out", str(tmp_path), *argv])
