"""Data preparation on small files in each official format, built from real Wikipedia text:
readers, composition under the real Qwen3 tokenizer, the published format's two variants, the
training parquet, atomic and resumable outputs, and the bad-input errors."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data_prep import io as dio
from data_prep.build import BuildSpec, build, compose_samples, main as build_main, output_name, parse_args
from data_prep.compose import PoolCounter, Target, parse_size, render_context
from data_prep.io import DataError, JsonArrayWriter, ParquetRowWriter, iter_json_records
from data_prep.published import PublishedWriter, published_record, read_published
from data_prep.sources import load_extra_pool, load_pool, load_source
from data_prep.training import STORE_SCHEMA, read_training_set, store_path
from infmem_verl.agent.document import tokenize_document
from infmem_verl.assets import wiki_paragraphs
from infmem_verl.data.documents import resolve

# Fixture sizes: enough paragraphs per split (~60k tokens) to fill 32K-token contexts.
HOTPOT_QUESTIONS = 60
MUSIQUE_QUESTIONS = 30
SQUAD_ARTICLES = 120


# ------------------------------------------------------------------------- official-format files


def _sentences(text: str) -> list[str]:
    """Sentences of a Wikipedia paragraph, split at '. ' before a capital letter."""
    return re.split(r"(?<=[.!?]) (?=[A-Z])", text)


def _paragraphs(start: int, count: int) -> list[dict]:
    paragraphs = wiki_paragraphs()[start : start + count]
    assert len(paragraphs) == count
    return list(paragraphs)


def hotpot_records(start: int, n: int, leading_spaces: bool = True) -> list[dict]:
    """HotpotQA-format records (2Wiki's when ``leading_spaces`` is False): 10 titled paragraphs
    each, the 1st and 4th supporting, the answer the 1st one's title."""
    records = []
    paragraphs = _paragraphs(start, 10 * n)
    for i in range(n):
        context = []
        for p in paragraphs[10 * i : 10 * i + 10]:
            sentences = _sentences(p["text"])
            if leading_spaces:
                sentences = sentences[:1] + [" " + s for s in sentences[1:]]
            context.append([p["title"], sentences])
        records.append(
            {
                "_id": f"h{start}-{i}",
                "question": f"Which subject is described together with {context[3][0]}?",
                "answer": context[0][0],
                "supporting_facts": [[context[0][0], 0], [context[3][0], 0]],
                "context": context,
                "type": "bridge",
                "level": "hard",
            }
        )
    return records


def musique_records(start: int, n: int) -> list[dict]:
    """MuSiQue answerable-format records: 20 paragraphs, 2 supporting, aliases; plus one
    unanswerable record at the end."""
    records = []
    paragraphs = _paragraphs(start, 20 * (n + 1))
    for i in range(n + 1):
        block = paragraphs[20 * i : 20 * i + 20]
        records.append(
            {
                "id": f"2hop__{start}_{i}",
                "paragraphs": [
                    {"idx": j, "title": p["title"], "paragraph_text": p["text"], "is_supporting": j in (2, 11)}
                    for j, p in enumerate(block)
                ],
                "question": f"What links {block[2]['title']} and {block[11]['title']}?",
                "question_decomposition": [{"id": 1, "question": "q", "answer": "a", "paragraph_support_idx": 2}],
                "answer": block[11]["title"],
                "answer_aliases": [block[11]["title"].upper(), block[11]["title"]],
                "answerable": i < n,
            }
        )
    return records


def squad_document(start: int, articles: int, v2: bool) -> dict:
    """SQuAD-format document: articles of 5 paragraphs with one question each; v2 adds one
    impossible question."""
    paragraphs = _paragraphs(start, 5 * articles)
    data = []
    for a in range(articles):
        block = paragraphs[5 * a : 5 * a + 5]
        entries = []
        for p, para in enumerate(block):
            words = para["text"].split()
            qa = {
                "id": f"sq{start}-{a}-{p}",
                "question": f"What is said first about {para['title']}?",
                "answers": [{"text": " ".join(words[:2]), "answer_start": 0}] * 2,
            }
            if v2:
                qa["is_impossible"] = False
            entries.append({"context": para["text"], "qas": [qa]})
        data.append({"title": f"article {a}", "paragraphs": entries})
    if v2:
        impossible = {"id": "impossible", "question": "Unanswerable?", "answers": [], "is_impossible": True}
        data[0]["paragraphs"][0]["qas"].append(impossible)
    return {"version": "v2.0" if v2 else "1.1", "data": data}


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value, ensure_ascii=False), encoding="utf-8")
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Official-format files per source; HotpotQA's train split shares 20 paragraphs with dev."""
    root = tmp_path_factory.mktemp("official")
    return {
        "hotpotqa": write_json(root / "hotpot_dev.json", hotpot_records(0, HOTPOT_QUESTIONS)),
        "hotpotqa_train": write_json(root / "hotpot_train.json", hotpot_records(580, HOTPOT_QUESTIONS)),
        "2wiki": write_json(root / "2wiki_dev.json", hotpot_records(1200, HOTPOT_QUESTIONS, leading_spaces=False)),
        "musique": write_jsonl(root / "musique_dev.jsonl", musique_records(1800, MUSIQUE_QUESTIONS)),
        "squad": write_json(root / "squad_dev.json", squad_document(2440, SQUAD_ARTICLES, v2=True)),
        "squad1": write_json(root / "squad_v1.json", squad_document(3040, 4, v2=False)),
    }


def spec(files, out: Path, source: str = "hotpotqa", **kw) -> BuildSpec:
    kw.setdefault("split", "dev")
    if kw["split"] != "train":
        kw.setdefault("shared_pool", True)
    return BuildSpec(source=source, input=files[source], targets=kw.pop("targets", (Target("tokens", 8192),)), out_dir=out, **kw)


# ------------------------------------------------------------------------------------- readers


def test_hotpotqa_reader_renders_like_the_reference_and_finds_gold(files):
    raw = json.loads(files["hotpotqa"].read_text())
    data = load_source("hotpotqa", files["hotpotqa"])
    # The reference's pool: every "title\n" + "".join(sentences), de-duplicated and sorted.
    assert data.pool == sorted({f"{t}\n{''.join(s)}" for r in raw for t, s in r["context"]})
    assert len(data.questions) == HOTPOT_QUESTIONS and data.skipped == 0
    q = data.questions[7]
    record = raw[7]
    assert (q.id, q.index, q.question, q.answers) == (record["_id"], 7, record["question"], (record["answer"],))
    rendered = [f"{t}\n{''.join(s)}" for t, s in record["context"]]
    assert [data.pool[i] for i in q.gold] == [rendered[0], rendered[3]]
    assert [data.pool[i] for i in q.distractors] == [p for j, p in enumerate(rendered) if j not in (0, 3)]


def test_2wiki_sentences_are_joined_with_spaces(files):
    data = load_source("2wiki", files["2wiki"])
    record = json.loads(files["2wiki"].read_text())[0]
    title, sentences = record["context"][0]
    assert len(sentences) > 1 and not sentences[1].startswith(" ")
    assert data.pool[data.questions[0].gold[0]] == f"{title}\n{' '.join(sentences)}"


def test_musique_reader_keeps_aliases_and_skips_unanswerable(files):
    data = load_source("musique", files["musique"])
    assert len(data.questions) == MUSIQUE_QUESTIONS and data.skipped == 1
    record = json.loads(files["musique"].read_text().splitlines()[0])
    q = data.questions[0]
    title = record["paragraphs"][11]["title"]
    assert q.answers == (title, title.upper())  # the main answer first, duplicates dropped
    assert [data.pool[i] for i in q.gold] == [
        f"{p['title']}\n{p['paragraph_text']}" for p in record["paragraphs"] if p["is_supporting"]
    ]
    assert len(q.distractors) == 18


@pytest.mark.parametrize("key", ["squad", "squad1"])
def test_squad_reader_uses_same_article_paragraphs_as_distractors(files, key):
    document = json.loads(files[key].read_text())
    data = load_source("squad", files[key])
    articles = len(document["data"])
    assert len(data.questions) == 5 * articles and data.skipped == (1 if key == "squad" else 0)
    q = data.questions[6]  # article 1, paragraph 1
    article = [p["context"] for p in document["data"][1]["paragraphs"]]
    assert data.pool[q.gold[0]] == article[1]
    assert sorted(data.pool[i] for i in q.distractors) == sorted(article[:1] + article[2:])
    assert q.answers == (" ".join(article[1].split()[:2]),)  # the repeated answer kept once


def test_json_lines_and_multiline_arrays_read_the_same(files, tmp_path):
    raw = json.loads(files["hotpotqa"].read_text())
    as_lines = write_jsonl(tmp_path / "hotpot.jsonl", raw)
    indented = write_json(tmp_path / "hotpot_indented.json", raw)
    indented.write_text(json.dumps(raw, indent=4))
    expected = load_source("hotpotqa", files["hotpotqa"]).questions
    assert load_source("hotpotqa", as_lines).questions == expected
    assert load_source("hotpotqa", indented).questions == expected


def test_streaming_array_reader_survives_tiny_reads_and_reports_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(dio, "_READ_CHARS", 5)  # every record straddles many refills
    values = [{"id": i, "text": "line\n" * i, "n": [1.5, None, True]} for i in range(12)] + [12345, "tail"]
    path = tmp_path / "array.json"
    path.write_text(json.dumps(values, indent=1))
    records = list(iter_json_records(path))
    assert [r.value for r in records] == values and [r.number for r in records] == list(range(14))
    lines = path.read_text().splitlines()
    assert all(lines[r.line - 1].strip().rstrip(",") in ("{", "12345", '"tail"') for r in records)


# ----------------------------------------------------------------------------------- bad input


def _mutated(files, tmp_path, source, mutate) -> Path:
    original = files[source]
    path = tmp_path / original.name
    if original.suffix == ".jsonl":
        records = [json.loads(line) for line in original.read_text().splitlines()]
        mutate(records)
        return write_jsonl(path, records)
    value = json.loads(original.read_text())
    mutate(value)
    return write_json(path, value)


def _set(index, key, value):
    def mutate(records):
        if value is KeyError:
            del records[index][key]
        else:
            records[index][key] = value

    return mutate


BAD_RECORDS = [
    ("hotpotqa", _set(2, "answer", KeyError), r"hotpot_dev\.json:1: record #2 id='h0-2': field 'answer': missing \(the test split"),
    ("hotpotqa", _set(3, "answer", 42), r"record #3 id='h0-3': field 'answer': expected a non-empty string, got int 42"),
    ("hotpotqa", _set(4, "answer", ["a", "b"]), r"record #4 id='h0-4': field 'answer': expected a non-empty string, got list"),
    ("hotpotqa", _set(5, "supporting_facts", [["Nowhere", 0]]), r"record #5 id='h0-5': field 'supporting_facts\[0\]': title 'Nowhere' is not in 'context'"),
    ("hotpotqa", _set(6, "context", [["title only"]]), r"record #6 id='h0-6': field 'context\[0\]': expected \[title, \[sentences...\]\]"),
    ("hotpotqa", _set(7, "_id", "h0-1"), r"record #7 id='h0-1': field 'id': 'h0-1' repeats the id of .*record #1"),
    ("musique", _set(1, "answer_aliases", [7]), r"musique_dev\.jsonl:2: record #1 id='2hop__1800_1': field 'answer_aliases\[0\]': expected a string, got int 7"),
    ("musique", _set(2, "question", KeyError), r"musique_dev\.jsonl:3: record #2 id='2hop__1800_2': field 'question': missing"),
]


@pytest.mark.parametrize("source, mutate, message", BAD_RECORDS)
def test_bad_records_name_file_line_record_and_field(files, tmp_path, source, mutate, message):
    path = _mutated(files, tmp_path, source, mutate)
    with pytest.raises(DataError, match=message):
        load_source(source, path)


def test_skip_invalid_leaves_bad_questions_out_and_their_paragraphs_in_the_pool(files, tmp_path, capsys):
    def noisy(records):
        records[5]["supporting_facts"] = [["Nowhere", 0]]  # the noise real splits carry
        del records[3]["answer"]
        records[7]["_id"] = "h0-1"  # a repeated id

    path = _mutated(files, tmp_path, "hotpotqa", noisy)
    with pytest.raises(DataError, match=r"record #3 id='h0-3': field 'answer': missing.*\(--skip-invalid leaves such"):
        load_source("hotpotqa", path)
    clean, data = load_source("hotpotqa", files["hotpotqa"]), load_source("hotpotqa", path, skip_invalid=True)
    assert [q.id for q in data.questions] == [q.id for q in clean.questions if q.id not in {"h0-3", "h0-5", "h0-7"}]
    assert [re.search(r"record #\d+ id='[^']+'", reason).group() for reason in data.invalid] == [
        "record #3 id='h0-3'", "record #5 id='h0-5'", "record #7 id='h0-1'",
    ]  # fmt: skip
    assert data.pool == clean.pool == load_pool("hotpotqa", path)  # index contexts still match the reference's
    # A MuSiQue question without its question text, a SQuAD answer without text: left out the same way.
    musique = _mutated(files, tmp_path, "musique", _set(2, "question", KeyError))
    assert len(load_source("musique", musique, skip_invalid=True).questions) == MUSIQUE_QUESTIONS - 1
    assert load_pool("musique", musique) == load_source("musique", files["musique"]).pool

    def bad_answer(document):
        document["data"][1]["paragraphs"][2]["qas"][0]["answers"] = [{"text": ["Two", "words"]}]

    squad, clean_squad = _mutated(files, tmp_path, "squad", bad_answer), load_source("squad", files["squad"])
    assert len(load_source("squad", squad, skip_invalid=True).questions) == len(clean_squad.questions) - 1
    assert load_pool("squad", squad) == clean_squad.pool

    out = tmp_path / "built"
    argv = ["--source", "hotpotqa", "--input", str(path), "--split", "dev", "--tokens", "8k", "--no-exclude-pool"]
    (result,) = build_main(argv + ["--out", str(out), "--limit", "4", "--skip-invalid"])
    manifest = json.loads(dio.manifest_path(result.path).read_text())
    assert manifest["results"]["skipped_invalid"] == 3 and manifest["params"]["skip_invalid"] is True
    assert [s.id for s in read_published(result.path)] == ["h0-0", "h0-1", "h0-2", "h0-4"]
    assert "--skip-invalid: left out 3 invalid question(s)" in capsys.readouterr().err


def test_bad_squad_answer_names_its_path_and_id(files, tmp_path):
    def mutate(document):
        document["data"][1]["paragraphs"][2]["qas"][0]["answers"] = [{"text": ["Two", "words"]}]

    with pytest.raises(DataError, match=r"squad_dev\.json: data\[1\]\.paragraphs\[2\]\.qas\[0\] id='sq2440-1-2': field 'answers\[0\]\.text'"):
        load_source("squad", _mutated(files, tmp_path, "squad", mutate))


def test_truncated_and_malformed_files_name_file_and_line(files, tmp_path):
    text = files["hotpotqa"].read_text()
    truncated = tmp_path / "hotpot_truncated.json"
    truncated.write_text(text[: len(text) // 2])
    with pytest.raises(DataError, match=r"hotpot_truncated\.json:1: record #\d+: malformed or truncated JSON"):
        load_source("hotpotqa", truncated)
    indented = tmp_path / "hotpot_indented.json"
    full = json.dumps(json.loads(text), indent=2)
    indented.write_text(full[: full.index('"_id": "h0-3"')])
    line = full[: full.index('"_id": "h0-3"')].count("\n") + 1
    with pytest.raises(DataError, match=rf"hotpot_indented\.json:{line}: record #3: malformed or truncated JSON"):
        load_source("hotpotqa", indented)
    lines = files["musique"].read_text().splitlines()
    broken = tmp_path / "musique_broken.jsonl"
    broken.write_text("\n".join(lines[:2] + [lines[2][:50]] + lines[3:]))
    with pytest.raises(DataError, match=r"musique_broken\.jsonl:3: malformed or truncated JSON line"):
        load_source("musique", broken)
    squad = tmp_path / "squad_cut.json"
    squad.write_text(files["squad"].read_text()[:-100])
    with pytest.raises(DataError, match=r"squad_cut\.json:1: malformed or truncated JSON"):
        load_source("squad", squad)


# --------------------------------------------------------------------------------- composition


@pytest.fixture(scope="module")
def sources(files):
    return {name: load_source(name, files[name]) for name in ("hotpotqa", "2wiki", "musique", "squad")}


def _block_start(pool, docs, position: int) -> int:
    """Char offset where document ``position`` (1-based) starts in the rendered context."""
    return 0 if position == 1 else len(render_context(pool, docs[: position - 1])) + 2


@pytest.mark.parametrize("source", ["hotpotqa", "2wiki", "musique", "squad"])
def test_token_targets_are_exact_and_within_one_percent(sources, tokenizer, source):
    data = sources[source]
    counter = PoolCounter(data.pool, tokenizer)
    for target in (8192, 16384, 32768):
        for sample in compose_samples(data, data.questions[:2], Target("tokens", target), counter, None, 0, "dev"):
            exact = tokenize_document(sample.context, tokenizer).size
            assert sample.meta["num_tokens"] == exact and 0.99 * target <= exact <= target
            docs = sample.meta["docs"]
            assert sample.context == render_context(data.pool, docs) and len(set(docs)) == len(docs)
            question = next(q for q in data.questions if q.id == sample.id)
            assert set(question.gold) | set(question.distractors) <= set(docs)  # own paragraphs all fit
            for gold, position, start in zip(
                question.gold, sample.meta["gold_positions"], sample.meta["gold_token_starts"]
            ):
                assert docs[position - 1] == gold
                char = _block_start(data.pool, docs, position)
                assert sample.context.startswith(f"Document {position}:\n{data.pool[gold]}", char)
                assert tokenize_document(sample.context[:char], tokenizer).size == start


def test_gold_positions_are_shuffled_per_sample_and_reproducible(sources, tokenizer):
    data = sources["hotpotqa"]
    counter = PoolCounter(data.pool, tokenizer)
    target = Target("docs", 50)

    def gold_sets(seed):
        samples = compose_samples(data, data.questions[:30], target, counter, None, seed, "dev")
        return [tuple(s.meta["gold_positions"]) for s in samples]

    first = gold_sets(0)
    # The reference's fixed shuffle gives every sample the same slots; here nearly all differ.
    assert len(set(first)) >= 27
    relative = np.asarray([p for pair in first for p in pair]) / 50
    assert relative.min() < 0.2 and relative.max() > 0.8
    assert gold_sets(0) == first and gold_sets(1) != first


def test_doc_count_targets_and_own_distractors(sources, tokenizer):
    data = sources["squad"]
    counter = PoolCounter(data.pool, tokenizer)
    (sample,) = compose_samples(data, data.questions[:1], Target("docs", 40), counter, None, 0, "dev")
    question = data.questions[0]
    docs = sample.meta["docs"]
    assert len(docs) == sample.meta["num_docs"] == 40
    assert set(question.gold) | set(question.distractors) <= set(docs)  # same-article paragraphs first
    assert sample.meta["num_tokens"] == tokenize_document(sample.context, tokenizer).size
    (small,) = compose_samples(data, data.questions[:1], Target("docs", 3), counter, None, 0, "dev")
    assert question.gold[0] in small.meta["docs"] and set(small.meta["docs"]) <= set(question.gold + question.distractors)


def test_evaluation_distractors_come_only_from_held_out_pool(files, tmp_path, tokenizer):
    train = set(load_source("hotpotqa", files["hotpotqa_train"]).pool)
    data = load_source("hotpotqa", files["hotpotqa"])
    shared = train & set(data.pool)
    assert len(shared) == 20  # the fixture's deliberate overlap
    target = (Target("docs", 300),)
    build(spec(files, tmp_path / "shared", targets=target, limit=6), tokenizer)
    build(
        spec(files, tmp_path / "held", targets=target, limit=6, shared_pool=False, exclude_pools=(files["hotpotqa_train"],)),
        tokenizer,
    )

    def leaked(folder):
        out = set()
        for sample in read_published(folder / "eval_300.json"):
            question = data.questions[sample.meta["index"]]
            own = set(question.gold) | set(question.distractors)
            out |= {data.pool[d] for d in sample.meta["docs"] if d not in own} & shared
        return out

    assert leaked(tmp_path / "shared")  # the reference's shared pool lets them in ...
    assert not leaked(tmp_path / "held")  # ... holding out the training file keeps them out
    with pytest.raises(ValueError, match=r"--exclude-pool: split 'dev' is not the training split"):
        build(spec(files, tmp_path / "x", shared_pool=False), tokenizer)


# ------------------------------------------------------------ atomic, resumable, failing outputs


def test_target_too_small_for_gold_fails_and_keeps_finished_outputs(files, tmp_path, tokenizer):
    out = tmp_path / "out"
    targets = (Target("tokens", 8192), Target("tokens", 120))
    with pytest.raises(DataError, match=r"question id='h0-0' \(index 0\): --tokens 120 is too small for its 2 gold paragraph\(s\)"):
        build(spec(files, out, targets=targets, limit=3), tokenizer)
    assert sorted(p.name for p in out.iterdir()) == ["eval_qa_2_8192.json", "eval_qa_2_8192.json.manifest.json"]
    assert len(list(read_published(out / "eval_qa_2_8192.json"))) == 3
    with pytest.raises(DataError, match=r"--num-docs 1 is too small for its 2 gold paragraph"):
        build(spec(files, out, targets=(Target("docs", 1),), limit=3), tokenizer)
    assert sorted(p.name for p in out.iterdir()) == ["eval_qa_2_8192.json", "eval_qa_2_8192.json.manifest.json"]


def test_rebuild_failing_midway_leaves_previous_output_intact(files, tmp_path, tokenizer):
    out = tmp_path / "out"
    (result,) = build(spec(files, out, limit=4), tokenizer)
    before = result.path.read_bytes()
    manifest = dio.manifest_path(result.path).read_bytes()
    with pytest.raises(DataError, match=r"--tokens 100 is too small"):
        build(spec(files, out, limit=4, targets=(Target("tokens", 100),)), tokenizer)
    broken = tmp_path / "hotpot_dev.json"
    broken.write_text(files["hotpotqa"].read_text()[:-500])
    with pytest.raises(DataError, match="malformed or truncated"):
        build(BuildSpec("hotpotqa", broken, "dev", (Target("tokens", 8192),), out, limit=4, shared_pool=True, overwrite=True), tokenizer)
    assert result.path.read_bytes() == before and dio.manifest_path(result.path).read_bytes() == manifest
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


def test_rerun_skips_finished_outputs_and_refuses_changed_parameters(files, tmp_path, tokenizer):
    out = tmp_path / "out"
    (first,) = build(spec(files, out, limit=3), tokenizer)
    stamp = first.path.stat().st_mtime_ns
    (again,) = build(spec(files, out, limit=3), tokenizer)
    assert again.skipped and first.path.stat().st_mtime_ns == stamp
    manifest = json.loads(dio.manifest_path(first.path).read_text())
    assert manifest["params"]["seed"] == 0 and manifest["results"]["samples"] == 3
    with pytest.raises(DataError, match=r"already built with other parameters \(differing: seed\); pass --overwrite"):
        build(spec(files, out, limit=3, seed=5), tokenizer)
    (rebuilt,) = build(spec(files, out, limit=3, seed=5, overwrite=True), tokenizer)
    assert not rebuilt.skipped and json.loads(dio.manifest_path(rebuilt.path).read_text())["params"]["seed"] == 5


def test_writers_stream_rows_to_disk_as_they_come(tmp_path):
    path = tmp_path / "store.parquet"
    writer = ParquetRowWriter(path, STORE_SCHEMA, row_group_size=4)
    sizes = []
    for i in range(12):
        writer.write({"doc_id": str(i), "text": "word " * 2000})
        sizes.append(path.stat().st_size)
    writer.close()
    # Each full row group reaches the file at once; nothing waits for close().
    assert sizes[3] > sizes[2] and sizes[7] > sizes[6] and sizes[11] > sizes[10]
    assert pq.ParquetFile(path).num_row_groups == 3
    with (tmp_path / "array.json").open("w") as handle:
        array = JsonArrayWriter(handle)
        for i in range(3):
            array.write({"i": i})
        array.close()
    assert json.loads((tmp_path / "array.json").read_text()) == [{"i": 0}, {"i": 1}, {"i": 2}]


# ----------------------------------------------------------------------------- published format


def test_published_round_trip_text_and_index_variants(files, tmp_path, tokenizer, sources):
    targets = (Target("docs", 60),)
    (text_result,) = build(spec(files, tmp_path / "text", targets=targets, limit=4, index_context="never"), tokenizer)
    (index_result,) = build(spec(files, tmp_path / "index", targets=targets, limit=4, index_context="always"), tokenizer)
    raw = json.loads(index_result.path.read_text())
    assert all(isinstance(r["context"], list) and r["num_docs"] == 60 for r in raw)
    assert set(raw[0]) == {"context", "input", "answers", "num_docs", "index", "id", "source", "meta"}
    pool = sources["hotpotqa"].pool
    from_text = list(read_published(text_result.path))
    from_index = list(read_published(index_result.path, pool))
    assert from_text == from_index and len(from_text) == 4
    assert from_text[0].meta["num_tokens"] == tokenize_document(from_text[0].context, tokenizer).size
    for variant, result, samples in (("never", text_result, from_text), ("always", index_result, from_index)):
        copy = tmp_path / f"copy_{variant}.json"
        with copy.open("w", encoding="utf-8") as handle:
            writer = PublishedWriter(handle, indices=variant == "always")
            for sample in samples:
                writer.write(sample)
            writer.close()
        assert copy.read_bytes() == result.path.read_bytes()
    with pytest.raises(DataError, match=r"record #0 index=0: field 'context' holds document indices; pass the split's paragraph pool"):
        next(read_published(index_result.path))
    bad = tmp_path / "bad_index.json"
    bad.write_text(json.dumps([raw[0] | {"context": [0, len(pool)]}]))
    with pytest.raises(DataError, match=rf"field 'context\[1\]': expected a pool index in \[0, {len(pool)}\)"):
        next(read_published(bad, pool))


def test_reads_the_reference_files_both_variants(files, tmp_path):
    """Files written the way the reference writes them (json.dump, indent 4), its loaders'
    rendering of index contexts computed independently from the raw file."""
    raw = json.loads(files["hotpotqa"].read_text())
    docs = sorted({f"{t}\n{''.join(p)}" for d in raw for t, p in d["context"]})
    picked = [5, 17, 3]
    text = "\n\n".join(f"Document {i + 1}:\n{docs[d]}" for i, d in enumerate(picked))
    theirs = [
        {"context": text, "input": raw[0]["question"], "answers": [raw[0]["answer"]], "num_docs": 3, "index": 0},
        {"context": picked, "input": raw[1]["question"], "answers": [raw[1]["answer"]], "num_docs": 3, "index": 1},
    ]
    path = tmp_path / "eval_3.json"
    path.write_text(json.dumps(theirs, ensure_ascii=False, indent=4))
    pool = load_source("hotpotqa", files["hotpotqa"]).pool
    first, second = read_published(path, pool, source="hotpotqa")
    assert (first.id, first.question, first.answers, first.context) == ("eval_3-0", raw[0]["question"], [raw[0]["answer"]], text)
    assert second.context == text and second.meta == {"index": 1, "num_docs": 3, "docs": picked}
    ruler = tmp_path / "eval_qa_2_4096.json"
    ruler.write_text(json.dumps([{"index": 0, "input": "Q?", "context": text, "outputs": ["a", "b"], "answer_prefix": ""}]))
    (sample,) = read_published(ruler)
    assert sample.answers == ["a", "b"] and "num_docs" not in sample.meta
    assert published_record(sample)["num_docs"] == 3  # counted from the headers when unknown
    ruler.write_text(json.dumps([{"index": 0, "input": "Q?", "context": text, "outputs": [3]}]))
    with pytest.raises(DataError, match=r"eval_qa_2_4096\.json:1: record #0 index=0.*field 'outputs\[0\]'"):
        next(read_published(ruler))


# ----------------------------------------------------------------------------- training parquet


def test_training_parquet_columns_store_and_round_trip(files, tmp_path, tokenizer):
    out = tmp_path / "train"
    (result,) = build(
        spec(files, out, source="musique", split="train", limit=3, agent_name="memagent_agent", inline_context=True),
        tokenizer,
    )
    assert result.path.name == "musique_train_8k.parquet"
    table = pq.read_table(result.path)
    assert table.column_names == ["data_source", "prompt", "context", "document_ref", "reward_model", "extra_info", "agent_name"]
    rows = table.to_pylist()
    data = load_source("musique", files["musique"])
    for row, question in zip(rows, data.questions):
        assert row["prompt"] == [{"role": "user", "content": question.question}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": list(question.answers)}
        assert len(question.answers) == 2 and row["data_source"] == "musique" and row["agent_name"] == "memagent_agent"
        info = row["extra_info"]
        assert (info["id"], info["index"], info["seed"], info["split"], info["target"]) == (question.id, question.index, 0, "train", "8k")
        assert len(info["gold_positions"]) == len(info["gold_token_starts"]) == 2
        assert resolve(row["document_ref"]) == row["context"]
        assert row["document_ref"] == f"{store_path(result.path).resolve()}#{question.id}"
        assert tokenize_document(row["context"], tokenizer).size == info["num_tokens"]
    samples = list(read_training_set(result.path))
    assert [s.id for s in samples] == [q.id for q in data.questions[:3]]
    (lean,) = build(spec(files, tmp_path / "lean", source="musique", split="train", limit=3), tokenizer)
    # No agent_name unless asked: verl runs the loop a row names, whatever the recipe configures.
    assert pq.read_schema(lean.path).names == ["data_source", "prompt", "document_ref", "reward_model", "extra_info"]
    assert [s.context for s in read_training_set(lean.path)] == [s.context for s in samples]


def test_command_line_builds_and_rejects_bad_options(files, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["--source", "squad", "--input", str(files["squad"]), "--split", "dev", "--tokens", "8k", "--num-docs", "20"]
    results = build_main(argv + ["--out", str(out), "--limit", "2", "--no-exclude-pool"])
    assert [r.path.name for r in results] == ["eval_qa_1_8192.json", "eval_qa_1_20docs.json"]
    assert [len(list(read_published(r.path))) for r in results] == [2, 2]
    with pytest.raises(SystemExit):
        build_main(argv + ["--out", str(out)])
    assert "--exclude-pool: split 'dev' is not the training split" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_main(["--source", "squad", "--input", "x", "--split", "dev", "--tokens", "lots", "--out", str(out)])
    assert "--tokens: expected a positive integer with an optional k or m suffix, got 'lots'" in capsys.readouterr().err
    assert parse_size("1m", "--tokens") == 1 << 20 and Target("tokens", 1 << 20).label == "1m"
    assert [Target.from_label(t.label) for t in (Target("tokens", 1 << 20), Target("tokens", 5000), Target("docs", 200))] == [
        Target("tokens", 1 << 20), Target("tokens", 5000), Target("docs", 200),
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        build_main(argv + ["--out", str(out), "--no-exclude-pool", "--agent", "memagent_agent"])
    assert "--agent: only the training parquet has an agent_name column" in capsys.readouterr().err
    train = ["--source", "musique", "--input", str(files["musique"]), "--split", "train", "--tokens", "8k", "--limit", "2"]
    (named,) = build_main(train + ["--out", str(tmp_path / "named"), "--agent", "memagent_agent"])
    assert pq.read_table(named.path, columns=["agent_name"]).column(0).to_pylist() == ["memagent_agent"] * 2
    (plain,) = build_main(train + ["--out", str(tmp_path / "plain")])
    assert "agent_name" not in pq.read_schema(plain.path).names


# ------------------------------------------------------------- pools too small: extra or capped


def small_squad(files, out: Path, **kw) -> BuildSpec:
    """A SQuAD build over the 20-paragraph file: too small for 8k tokens."""
    return replace(spec(files, out, source="squad", **kw), input=files["squad1"])


def test_a_pool_too_small_fails_naming_both_remedies(files, tmp_path, tokenizer):
    small = load_source("squad", files["squad1"])  # 4 articles: 20 paragraphs, ~3K tokens
    with pytest.raises(DataError, match=r"the pool cannot fill --tokens 8192: of its 20 paragraphs 15 are usable.*--extra-pool.*--cap-at-pool"):
        build(small_squad(files, tmp_path, limit=2), tokenizer)
    assert not list(tmp_path.iterdir())
    assert len(small.pool) == 20


def test_extra_pool_fills_the_target_with_its_paragraphs_as_distractors_only(files, tmp_path, tokenizer):
    own, extra = load_source("squad", files["squad1"]), load_source("squad", files["squad"])
    (result,) = build(small_squad(files, tmp_path, limit=4, extra_pools=(files["squad"],)), tokenizer)
    samples = list(read_published(result.path))
    pool = own.pool + sorted(extra.pool)  # the split's own indices first, unchanged
    for sample, question in zip(samples, own.questions):
        assert 0.99 * 8192 <= sample.meta["num_tokens"] == tokenize_document(sample.context, tokenizer).size <= 8192
        assert sample.context == render_context(pool, sample.meta["docs"]) and not sample.meta["capped"]
        assert [sample.meta["docs"][p - 1] for p in sample.meta["gold_positions"]] == list(question.gold)
        assert sum(d >= len(own.pool) for d in sample.meta["docs"]) > 20  # most distractors come from the extra file
    manifest = json.loads(dio.manifest_path(result.path).read_text())
    assert manifest["results"]["pool"] == {"split": 20, "extra": len(extra.pool)} and manifest["results"]["capped"] == 0
    assert manifest["params"]["extra_pools"] == [{"path": str(files["squad"].resolve()), "bytes": files["squad"].stat().st_size}]
    # Only distractors: questions still come from the input alone.
    assert [s.id for s in samples] == [q.id for q in own.questions[:4]]


def test_extra_pool_must_be_a_file_of_the_same_source_checked_up_front(files, tmp_path, tokenizer):
    out = tmp_path / "out"
    cases = [
        (files["musique"], DataError, r"--extra-pool .*musique_dev\.jsonl: expected an official squad file"),
        (files["hotpotqa"], DataError, r"--extra-pool .*hotpot_dev\.json: expected an official squad file"),
        (tmp_path / "missing.json", FileNotFoundError, r"--extra-pool .*missing\.json: file not found"),
        (files["squad1"], ValueError, r"--extra-pool .*squad_v1\.json: is the --input file itself"),
    ]
    for path, error, message in cases:
        with pytest.raises(error, match=message):
            build(small_squad(files, out, limit=2, extra_pools=(path,)), tokenizer)
    # Any file of the source: a test split (no answers, no supporting facts) gives its paragraphs.
    unanswered = _mutated(files, tmp_path, "hotpotqa", lambda records: [(r.pop("answer"), r.pop("supporting_facts")) for r in records])
    assert sorted(load_extra_pool("hotpotqa", unanswered)) == load_pool("hotpotqa", files["hotpotqa"])
    with pytest.raises(DataError, match=r"--extra-pool .*squad_dev\.json: expected an official musique file"):
        build(spec(files, out, source="musique", limit=2, extra_pools=(files["squad"],)), tokenizer)
    with pytest.raises(ValueError, match=r"--extra-pool .*squad_dev\.json: is also an --exclude-pool file"):
        build(small_squad(files, out, shared_pool=False, exclude_pools=(files["squad"],), extra_pools=(files["squad"],)), tokenizer)
    with pytest.raises(ValueError, match=r"--extra-pool: the index contexts of 20000docs would point past the split's own pool"):
        build(small_squad(files, out, targets=(Target("docs", 20000),), extra_pools=(files["squad"],)), tokenizer)
    assert not out.exists()  # nothing was written


def test_cap_at_pool_takes_the_whole_usable_pool_and_records_the_real_size(files, tmp_path, tokenizer):
    own, extra = load_source("squad", files["squad1"]), load_source("squad", files["squad"])
    # The first 10 articles of the extra file are held out: its 50 paragraphs must never appear.
    held_out = write_json(tmp_path / "squad_train.json", squad_document(2440, 10, v2=False))
    blocked = set(load_pool("squad", held_out))
    kw = dict(limit=3, cap_at_pool=True, shared_pool=False, exclude_pools=(held_out,))
    (capped,) = build(small_squad(files, tmp_path / "alone", **kw), tokenizer)
    (docs,) = build(small_squad(files, tmp_path / "extra", targets=(Target("docs", 5000),), extra_pools=(files["squad"],), **kw), tokenizer)
    for sample in read_published(capped.path):  # the reference's behaviour: all 20 paragraphs, under the 8k label
        assert sample.meta["capped"] and sorted(sample.meta["docs"]) == list(range(20))
        assert sample.meta["num_tokens"] == tokenize_document(sample.context, tokenizer).size < 0.5 * 8192
    pool = own.pool + sorted(extra.pool)
    usable = 20 + len(extra.pool) - len(blocked)
    for sample in read_published(docs.path):
        assert sample.meta["capped"] and sample.meta["num_docs"] == len(set(sample.meta["docs"])) == usable
        assert not {pool[d] for d in sample.meta["docs"]} & blocked
    manifest = json.loads(dio.manifest_path(capped.path).read_text())
    assert manifest["params"]["cap_at_pool"] is True and manifest["results"]["capped"] == 3 == capped.capped
    assert manifest["results"]["docs"] == {"min": 20, "mean": 20.0, "max": 20}
    assert manifest["results"]["tokens"]["max"] < 0.5 * 8192


# ------------------------------------------------------------------ README commands and recipes

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPES = ("infmem_4b", "memagent_4b", "infmem_1p7b", "memagent_1p7b", "infmem_qwen25_7b", "memagent_qwen25_7b")


def readme_build_command(marker: str) -> list[str]:
    """The arguments of the ``data_prep.build`` command that data_prep/README.md introduces with a
    comment naming ``marker``."""
    block = (REPO / "data_prep" / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and marker in line)
    command = next(line for line in lines[start:] if line.startswith("python -m data_prep.build "))
    return shlex.split(command)[3:]


def test_readme_commands_write_the_files_the_recipes_read():
    from hydra import compose, initialize_config_dir
    from infmem_verl import conf_dir

    written = {}
    for key in ("train_files", "val_files"):
        spec = parse_args(readme_build_command(f"(data.{key})"))
        (target,) = spec.targets
        assert spec.output_format == "parquet", key
        written[key] = str(spec.out_dir / output_name(spec, target))
    with initialize_config_dir(str(conf_dir()), version_base=None):
        for recipe in GPU_RECIPES:
            config = compose("infmem_trainer", overrides=[f"+recipe={recipe}"])
            launch = (conf_dir() / "recipe" / f"{recipe}.yaml").read_text().replace("\n", " ")
            for key, path in written.items():
                assert config.data[key] == path, (recipe, key, path)
                assert f"data.{key}={path} " in launch, f"{recipe}.yaml: launch comment, data.{key}"
