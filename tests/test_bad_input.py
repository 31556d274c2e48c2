"""Nothing silently lost: ids are checked wherever samples enter, a run's counts add up to the
records read, and bad input at every command line ends in one line and exit status 2.

The bad-input corpus (malformed files for every reader) is in ``test_bad_input_corpus.py``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.io import DataError
from data_prep.published import PublishedWriter
from data_prep.training import TrainingWriter, store_path
from infmem_verl import distill as distill_cli
from infmem_verl import eval as eval_cli
from infmem_verl import export as export_cli
from infmem_verl import inspect as inspect_cli
from infmem_verl.data.identity import DuplicateIdError, IdLedger
from infmem_verl.data.sample import QASample
from infmem_verl.data.synthetic import make_dataset
from infmem_verl.evaluation.aggregate import aggregate
from infmem_verl.evaluation.config import EvalConfig
from infmem_verl.evaluation.data import file_source, find_file, synthetic_sources
from infmem_verl.evaluation.methods import BaselineMethod
from infmem_verl.evaluation.runner import Runner
from infmem_verl.evaluation.store import ResultStore
from infmem_verl.policy.scripted import ScriptedPolicy
from infmem_verl.verl_plugin import dataset as dataset_cli

REPO = Path(__file__).resolve().parents[1]
REPEATS = 2


@pytest.fixture(scope="module")
def samples(tokenizer):
    return make_dataset(4, 600, tokenizer, seed=11)


def _published(sample: QASample, **fields) -> dict:
    """A record as the reference publishes it (no 'id': the id derives from 'index')."""
    return {"context": sample.context, "input": sample.question, "answers": sample.answers, "index": 0} | fields


def _run(sources, tokenizer, out: Path):
    """One cheap method (one call per sample) over ``sources``; the store and the counts."""
    cfg = EvalConfig(preset="embedded").agent_config()
    policy = ScriptedPolicy(tokenizer, lambda prompt, params: "<think>\nok\n</think>\n\n\\boxed{x}", record=False)
    store = ResultStore(out, {"test": 1})
    methods = {"full_context": BaselineMethod("full_context", cfg, tokenizer, 4096)}
    runner = Runner(policy, methods, store, concurrency=3, progress=False, repeats=REPEATS)
    return store, asyncio.run(runner.run(sources))


def _training_parquet(path: Path, samples: list[QASample]) -> Path:
    """A training parquet holding ``samples`` as given, repeats included: two files written by
    our writer (which refuses a repeated id) concatenated, as a hand-made merge would be."""
    parts = []
    for number, sample in enumerate(samples):
        part = path.with_name(f"part{number}.parquet")
        writer = TrainingWriter(part, store_path(part), store_path(part), None)
        writer.write(sample)
        writer.close()
        parts.append(pq.read_table(part))
    pq.write_table(pa.concat_tables(parts), path)
    return path


def _loaders(name: str, samples: list[QASample], tokenizer, tmp: Path):
    """(sources, records in them, refusals expected) for each way samples enter an evaluation."""
    a, b, c, d = samples
    if name == "synthetic":
        return synthetic_sources(["1k"], 3, tokenizer, 0), 3, []
    if name == "published, ids from index":
        # Two questions under index 0 (a concatenated file), a broken record, a repeat of its index.
        records = [_published(a), _published(b), _published(c, index=1, input=""), _published(d, index=1)]
        path = tmp / "eval_dup.json"
        path.write_text(json.dumps(records))
        firsts = ["eval_dup.json:1: record #0", "eval_dup.json:1: record #2"]
        return [file_source("hotpotqa", "1k", path, lambda: None, None)], 4, firsts
    if name == "published, own ids":
        path = tmp / "eval_ids.jsonl"
        lines = [_published(a, id="q1"), _published(b, id="q2", index=1), _published(c, id="q1", index=2)]
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        return [file_source("squad", "1k", path, lambda: None, None)], 3, ["eval_ids.jsonl:1: record #0"]
    if name == "published, index contexts":
        pool = ["Document text one.", "Document text two.", "Document text three."]
        path = tmp / "eval_idx.json"
        path.write_text(json.dumps([_published(a, context=[0, 1]), _published(b, context=[2], index=0)]))
        return [file_source("hotpotqa", "1k", path, lambda: pool, None)], 2, ["eval_idx.json:1: record #0"]
    if name == "data folder":
        data = tmp / "data"
        data.mkdir()
        with (data / "eval_qa_1_1024.json").open("w") as handle:
            writer = PublishedWriter(handle)
            for number, sample in enumerate(samples[:3]):
                writer.write(QASample(sample.id, sample.question, sample.answers, sample.context, meta={"index": number}))
            writer.close()
        return [file_source("squad", "1k", find_file(data, "squad", "1k"), lambda: None, None)], 3, []
    assert name == "training parquet"
    path = _training_parquet(tmp / "train.parquet", [a, b, a, c])
    return [distill_cli.training_source(path, None)], 4, ["train.parquet row group 0 row 0"]


LOADERS = ["synthetic", "published, ids from index", "published, own ids", "published, index contexts", "data folder", "training parquet"]


@pytest.mark.parametrize("loader", LOADERS)
def test_every_record_read_ends_in_exactly_one_result_and_the_counts_add_up(loader, samples, tokenizer, tmp_path):
    sources, records, first_places = _loaders(loader, samples, tokenizer, tmp_path)
    store, counts = _run(sources, tokenizer, tmp_path / "out")
    assert counts.read == records and counts.ran + counts.skipped == records * REPEATS and counts.unread == 0
    if loader == "training parquet":  # distillation's report
        report = distill_cli.summarize(store.latest(), distill_cli.SFTBuild())
        scored, failed = report.finished, sum(report.failed.values())
    else:
        (cell,) = aggregate(store.latest(), "qwen3-4b")
        scored, failed = cell.n, cell.failed
    assert scored + failed == records * REPEATS, "a record vanished from the report"
    assert len({r["sample_id"] for r in store.latest()}) == records
    repeats = [r["reason"] for r in store.latest() if "repeats the id of" in r.get("reason", "")]
    assert len(repeats) == len(first_places) * REPEATS
    for reason, place in zip(sorted(repeats), sorted(first_places * REPEATS)):
        assert place in reason  # both places are named: the repeat's (it leads) and the first one's
    # A resume reads the same records and runs nothing again: every one of them was recorded.
    store, again = _run(sources, tokenizer, tmp_path / "out")
    assert (again.read, again.ran, again.skipped) == (records, 0, records * REPEATS)


def test_the_report_names_a_repeated_index_and_a_file_cut_short(samples, tokenizer, tmp_path):
    a, b, c, _ = samples
    path = tmp_path / "eval_cut.json"
    text = json.dumps([_published(a), _published(b), _published(c, index=1)])
    path.write_text(text[: text.rindex("{")])  # the third record is cut off
    store, counts = _run([file_source("hotpotqa", "1k", path, lambda: None, None)], tokenizer, tmp_path / "out")
    assert (counts.read, counts.unread) == (2, 1)
    (cell,) = aggregate(store.latest(), "qwen3-4b")
    assert (cell.n, cell.failed) == (REPEATS, REPEATS) and "truncated" in cell.unread
    path.write_text(text)  # the file repaired: the resume reads it to its end and clears the cell's failure
    store, counts = _run([file_source("hotpotqa", "1k", path, lambda: None, None)], tokenizer, tmp_path / "out")
    (cell,) = aggregate(store.latest(), "qwen3-4b")
    assert (counts.read, counts.unread, cell.unread, cell.n + cell.failed) == (3, 0, None, 3 * REPEATS)


def test_writers_refuse_a_second_sample_with_an_id_already_written(samples, tmp_path):
    a, b = samples[:2]
    twin = QASample(a.id, b.question, b.answers, b.context, meta={"index": 1})
    writer = TrainingWriter(tmp_path / "t.parquet", tmp_path / "t_docs.parquet", tmp_path / "t_docs.parquet", None)
    writer.write(a)
    with pytest.raises(DuplicateIdError, match=rf"row 1: field 'id': '{a.id}' repeats the id of t_docs.parquet: row 0"):
        writer.write(twin)
    with (tmp_path / "p.json").open("w") as handle:
        published = PublishedWriter(handle)
        published.write(QASample(a.id, a.question, a.answers, a.context, meta={"index": 0}))
        with pytest.raises(DuplicateIdError, match="record #1: field 'id'"):
            published.write(twin)
    ledger = IdLedger()
    assert ledger.repeat("x", "here") is None and "repeats the id of here" in ledger.repeat("x", "there")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_dataset_cli_refuses_repeated_ids_and_bad_lines_in_one_line_writing_nothing(samples, tmp_path, capsys):
    a, b = samples[:2]
    records = tmp_path / "set.jsonl"
    rows = [a.to_record(), b.to_record(), QASample(a.id, b.question, b.answers, b.context).to_record()]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "train.parquet"
    assert dataset_cli.main(["--records", str(records), "--out", str(out)]) == 2
    assert _one_line(capsys) == f"[dataset] record {records}:3: field 'id': '{a.id}' repeats the id of record {records}:1"
    assert not out.exists()
    records.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1])[:40] + "\n")
    assert dataset_cli.main(["--records", str(records), "--out", str(out)]) == 2
    assert _one_line(capsys).startswith(f"[dataset] {records}:2: malformed or truncated JSON line")
    records.write_text(json.dumps({**rows[0], "context": ""}) + "\n")
    assert dataset_cli.main(["--records", str(records), "--out", str(out)]) == 2
    assert "field 'context': expected a non-empty string" in _one_line(capsys)


def test_every_command_line_reports_bad_input_in_one_line_with_status_2(tmp_path, capsys):
    missing = tmp_path / "nowhere.json"
    cut = tmp_path / "musique.jsonl"
    cut.write_text('{"id": "q1", "question": "q"}\n{"id": "q2", "question_decomp')
    cases = [
        (eval_cli.main, ["--concurrency", "0", "--no-progress"], "[eval] concurrency: expected an integer >= 1"),
        (eval_cli.main, ["--pool", "hotpotqa", "--no-progress"], "[eval] --pool: expected NAME=PATH, got 'hotpotqa'"),
        (eval_cli.main, ["--data", f"squad:1k={missing}"], f"[eval] data: squad:1k={missing}: file not found"),
        (distill_cli.main, ["--out", str(tmp_path / "d"), "--data", str(missing)], f"[distill] data: {missing} not found"),
        (distill_cli.main, ["--out", str(tmp_path / "d"), "--teacher", "oracle", "--decomposition", str(cut), "--no-progress"],
         f"[distill] {cut}:2: malformed or truncated JSON line"),
        (inspect_cli.main, [str(missing)], "[inspect] "),
        (export_cli.main, [str(missing), str(tmp_path / "x")], f"[export] {missing}: no such file or folder"),
    ]  # fmt: skip
    for main, argv, expected in cases:
        assert main(argv) == 2, argv
        line = _one_line(capsys)
        assert line.startswith(expected), line


def test_data_prep_exits_2_in_one_line_and_the_traceback_shows_on_request(tmp_path, capsys, monkeypatch):
    from data_prep.build import main as build_main

    bad = tmp_path / "hotpot.json"
    bad.write_bytes('[{"_id": "a", "question": "caf\xe9"}]'.encode("latin-1"))
    argv = ["--source", "hotpotqa", "--input", str(bad), "--split", "dev", "--no-exclude-pool", "--tokens", "1k",
            "--out", str(tmp_path / "out"), "--tokenizer", str(REPO / "tests" / "missing-tokenizer")]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        build_main(argv[:-2])
    assert stopped.value.code == 2
    assert _one_line(capsys) == f"[data_prep.build] {bad}: not UTF-8 text (invalid continuation byte, byte 0xe9); save it as UTF-8"
    monkeypatch.setenv("INFMEM_TRACEBACK", "0")  # off, and restored after the flag turns it on
    assert dataset_cli.main(["--records", str(bad), "--out", str(tmp_path / "t.parquet"), "--traceback"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1].startswith(f"[dataset] {bad}: not UTF-8")


def test_the_hydra_entry_points_exit_2_with_one_line(tmp_path):
    """Separate processes (a Hydra main exits its process); ~35 s, most of it verl's import."""
    missing = tmp_path / "none.parquet"
    cases = [
        # Our own check, inside the run.
        (["infmem_verl.sft", "+recipe=sft_smoke", f"data.train_files={missing}"], f"[sft] data.train_files: {missing} not found"),
        # Hydra's: a recipe that does not exist, with the ones that do.
        (["infmem_verl.main", "+recipe=smok"], "[infmem] In 'infmem_trainer': Could not find 'recipe/smok'; available options in 'recipe': demo, "),
    ]  # fmt: skip
    for argv, expected in cases:
        done = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and lines[-1].startswith(expected), done.stderr[-2000:]
        assert not any("Traceback" in line for line in lines), done.stderr[-2000:]


def test_preflight_refuses_a_training_file_whose_rows_name_one_document_for_two_questions(samples, tmp_path):
    from infmem_verl.preflight import Preflight, read_dataset

    a, b = samples[:2]
    path = tmp_path / "train.parquet"
    writer = TrainingWriter(path, store_path(path), store_path(path), None)
    writer.write(a)
    writer.write(b)
    writer.close()
    table = pq.read_table(path)
    rows = table.to_pylist()
    rows.append(dict(rows[0]))  # the same row twice: a question repeated on purpose
    rows.append({**rows[1], "document_ref": rows[0]["document_ref"]})  # another question on a's document
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    report = Preflight()
    read_dataset("data.train_files", str(path), ["prompt", "reward_model", "document_ref"], "document_ref", "infmem_agent", False, report)
    (failure,) = report.failures
    assert failure.key == "data.train_files" and failure.name == "one document per question"
    assert failure.detail.startswith(f"{path} row 3: field 'document_ref': '{rows[0]['document_ref']}' repeats the id of {path} row 0 with another question")
