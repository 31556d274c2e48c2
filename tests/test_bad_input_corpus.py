"""The bad-input corpus: malformed files, built at test time, for every reader of external files.

Each case is (reader, malformation) with its expected outcome: a refusal whose one line names the
file (and the line or field where there is one), or a documented acceptance whose result is
checked. Readers: the official QA files (HotpotQA / 2Wiki JSON array, MuSiQue JSON lines, SQuAD
JSON document), the published evaluation JSON, the dataset command line's JSON-lines records, the
training parquet and the prompt-template files (YAML and JSON). The table of outcomes is in
``docs/experiments/2026-12-03-bad-input.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.io import DataError
from data_prep.published import read_published
from data_prep.sources import load_source
from data_prep.training import read_training_set
from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.templates import load_templates
from infmem_verl.evaluation.data import LoadFailure, file_source
from infmem_verl.verl_plugin import dataset as dataset_cli

BIDI = "\u202e\u2066"  # right-to-left override, left-to-right isolate
CONTROL = "\x00\x07\x1b"
HUGE = 4_000_000  # characters of one field (a 1M-token context is about this size)


def hotpot(question: str = "Which city?", answer="Paris", **extra) -> dict:
    return {"_id": "h1", "question": question, "answer": answer, "supporting_facts": [["Paris", 0]],
            "context": [["Paris", ["Paris is a city."]], ["Rome", ["Rome is old."]]]} | extra  # fmt: skip


def musique(question: str = "Which city?", answer="Paris", **extra) -> dict:
    paragraphs = [{"idx": 0, "title": "Paris", "paragraph_text": "Paris is a city.", "is_supporting": True},
                  {"idx": 1, "title": "Rome", "paragraph_text": "Rome is old.", "is_supporting": False}]  # fmt: skip
    return {"id": "m1", "paragraphs": paragraphs, "question": question, "answer": answer, "answer_aliases": [],
            "answerable": True} | extra  # fmt: skip


def squad(question: str = "Which city?", answer="Paris") -> dict:
    qa = {"id": "s1", "question": question, "answers": [{"text": answer, "answer_start": 0}]}
    return {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "Paris is a city.", "qas": [qa]}]}]}


def published(question: str = "Which city?", answer="Paris", **extra) -> dict:
    return {"context": "Document 1:\nParis is a city.", "input": question, "answers": [answer], "index": 0} | extra


def record(question: str = "Which city?", answer="Paris", **extra) -> dict:
    return {"id": "r1", "question": question, "answers": [answer], "context": "Paris is a city."} | extra


# reader -> (record builder, file suffix, JSON lines?, read(path) -> list of (question, answers))
def _read_source(source: str) -> Callable[[Path], list]:
    return lambda path: [(q.question, list(q.answers)) for q in load_source(source, path).questions]


def _read_records(path: Path) -> list:
    return [(s.question, s.answers) for s in dataset_cli._read_records(path)]


def _read_evaluation_file(path: Path) -> list:
    """The evaluation's reader: a record it cannot use becomes a failure with its reason (the run
    goes on), raised here; a file it cannot read raises itself."""
    items = list(file_source("hotpotqa", "1k", path, lambda: None, None).items())
    for item in items:
        if isinstance(item, LoadFailure):
            raise DataError(item.reason)
    assert [s.question for s in items] == [s.question for s in read_published(path)]  # data_prep's reader agrees
    return [(s.question, s.answers) for s in items]


READERS = {
    "hotpotqa": (hotpot, ".json", False, _read_source("hotpotqa")),
    "musique": (musique, ".jsonl", True, _read_source("musique")),
    "squad": (squad, ".json", None, _read_source("squad")),
    "published": (published, ".json", False, _read_evaluation_file),
    "records": (record, ".jsonl", True, _read_records),
}


def _text(reader: str, values: list[dict]) -> str:
    build, _, lines, _ = READERS[reader]
    if lines is None:  # SQuAD: one JSON document
        return json.dumps(values[0], ensure_ascii=False)
    if lines:
        return "".join(json.dumps(v, ensure_ascii=False) + "\n" for v in values)
    return "[\n" + ",\n".join(json.dumps(v, ensure_ascii=False) for v in values) + "\n]"


def _case(reader: str, case: str) -> tuple[bytes, str | None]:
    """The file's bytes and the refusal expected (a regex), or None: accepted."""
    build, _, lines, _ = READERS[reader]
    good = _text(reader, [build()])
    if case == "empty":
        return b"", {"records": "no records", "squad": "malformed or truncated JSON"}.get(reader, "no answerable|no records")
    if case == "truncated":
        return good[: len(good) // 2].encode(), r":1: malformed or truncated JSON|:2: record #0: malformed or truncated JSON"
    if case == "latin-1":
        return _text(reader, [build(question="Which café?")]).encode("latin-1"), r"not UTF-8 text \(invalid continuation byte, byte 0xe9\)"
    if case == "utf-16":
        return good.encode("utf-16"), r"not UTF-8 text \(invalid start byte, byte 0xff\)"
    if case == "utf-8 with BOM":
        return ("\ufeff" + good).encode(), None
    if case == "duplicate key":
        key = '"input": ' if reader == "published" else '"question": '
        text = good.replace(key, f'{key}"Which other city?", {key}', 1)
        return text.encode(), r"key '(question|input)' appears twice in one object"
    if case == "wrong type":
        return _text(reader, [build(question=42)]).encode(), r"field 'question'|field 'input'|expected a non-empty string"
    if case == "NaN answer":
        return _text(reader, [build(answer=float("nan"))]).replace("NaN", "NaN").encode(), r"answer|expected a (non-empty )?string"
    if case == "Infinity answer":
        return _text(reader, [build(answer=float("inf"))]).encode(), r"answer|expected a (non-empty )?string"
    if case == "huge question":
        return _text(reader, [build(question="Which city? " + "x" * HUGE)]).encode(), None
    assert case == "control and bidi characters"
    return _text(reader, [build(question=f"Which {BIDI}city{CONTROL}?")]).encode(), None


CASES = ["empty", "truncated", "latin-1", "utf-16", "utf-8 with BOM", "duplicate key", "wrong type", "NaN answer",
         "Infinity answer", "huge question", "control and bidi characters"]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("reader", list(READERS))
def test_each_reader_refuses_a_malformed_file_in_one_line_naming_it_or_accepts_it_as_documented(reader, case, tmp_path):
    _, suffix, _, read = READERS[reader]
    path = tmp_path / f"input{suffix}"
    data, refusal = _case(reader, case)
    path.write_bytes(data)
    if refusal is None:
        (question, answers), *_ = read(path)
        assert answers == ["Paris"]
        assert question.startswith("Which")  # kept as written: BIDI and control characters are text
        if case == "control and bidi characters":
            assert BIDI in question and CONTROL in question
        return
    with pytest.raises((DataError, ValueError)) as refused:
        read(path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message, message
    assert refused.match(refusal), message


def _parquet(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def test_training_parquet_refusals_name_the_file_and_row(tmp_path):
    not_parquet = tmp_path / "text.parquet"
    not_parquet.write_text("id,question\n1,q\n")
    with pytest.raises(Exception, match="Parquet magic bytes not found"):
        list(read_training_set(not_parquet))  # pyarrow's own refusal, before any row is read
    row = {"data_source": "d", "prompt": [{"role": "user", "content": "q"}], "context": "c",
           "reward_model": {"style": "rule", "ground_truth": []}, "extra_info": {"id": "a"}}  # fmt: skip
    empty_answers = _parquet(tmp_path / "empty.parquet", [row])
    with pytest.raises(ValueError, match=rf"{empty_answers} row group 0 row 0 id='a': field 'answers': expected a non-empty list"):
        list(read_training_set(empty_answers))


TEMPLATE = "{question} {chunk}"


@pytest.mark.parametrize(
    ("name", "data", "refusal"),
    [
        ("t.yaml", b"", "expected a mapping of prompt kinds"),
        ("t.yaml", b"write: {user: 'x'\n", "not valid YAML"),
        ("t.json", b'{"write": ', "not valid JSON"),
        ("t.yaml", "answer: 'caf\xe9'\n".encode("latin-1"), "not UTF-8 text"),
        ("t.yaml", b"answer: 'a'\nanswer: 'b'\n", "key 'answer' appears twice"),
        ("t.json", b'{"answer": "a", "answer": "b"}', "key 'answer' appears twice"),
        ("t.yaml", b"answer: 42\n", "expected a string or a mapping"),
        ("t.yaml", b"answr: 'x'\n", "unknown prompt kind 'answr'"),
    ],
)
def test_prompt_template_files_refuse_malformed_input_in_one_line(name, data, refusal, tmp_path):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=refusal) as refused:
        load_templates(path)
    assert "\n" not in str(refused.value) and str(path.name) in str(refused.value)
