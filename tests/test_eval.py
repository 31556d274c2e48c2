"""Evaluation on CPU: the CLI with the in-process tiny Qwen3, data sources, the resumable store,
aggregation with confidence intervals, the report, the baselines, and bad input.

The vLLM stage (HTTP end to end, killing the server) is in ``test_eval_vllm.py``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from data_prep.compose import render_context
from data_prep.published import PublishedWriter
from infmem_verl import distill as distill_cli
from infmem_verl import eval as eval_cli
from infmem_verl.agent.cache import DocumentCache
from infmem_verl.agent.errors import ConfigError
from infmem_verl.data.synthetic import make_dataset
from infmem_verl.evaluation.aggregate import aggregate, repeat_spread, wilson_interval
from infmem_verl.evaluation.config import EvalConfig
from infmem_verl.evaluation.data import CellSource
from infmem_verl.evaluation.methods import BaselineMethod, build_methods, cut_middle
from infmem_verl.evaluation.published import lookup
from infmem_verl.evaluation.runner import Runner
from infmem_verl.evaluation.store import Key, ResultStore
from infmem_verl.policy.scripted import ScriptedPolicy
from infmem_verl.policy.source import ModelSource

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REQUIRED = {
    "prediction", "answers", "acc", "acc_ref", "em", "f1", "latency_s", "llm_calls", "prompt_tokens",
    "completion_tokens", "tokens", "chunks_read", "stop_step", "retrieval_queries", "run_id", "started_at",
}  # fmt: skip


def read_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def samples(tokenizer):
    return make_dataset(3, 1024, tokenizer, seed=5)


def test_cli_runs_every_method_writes_a_report_and_resumes_without_redoing(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--model-dir", str(tiny_model_dir), "--lengths", "1k", "--samples", "2", "--out", str(out), "--no-progress"]
    assert eval_cli.main(args) == 0
    records = read_records(out)
    assert len(records) == 10 and {r["status"] for r in records} == {"ok"}
    assert {r["method"] for r in records} == {"infmem", "infmem3", "memagent", "full_context", "bm25"}
    for record in records:
        assert REQUIRED <= set(record), REQUIRED - set(record)
        assert record["tokens"] == record["prompt_tokens"] + record["completion_tokens"] > record["doc_tokens"] * 0.5
    agents = [r for r in records if r["method"] in ("infmem", "memagent")]
    assert all(r["chunks_read"] == r["num_chunks"] >= 1 for r in agents)  # a random model never stops
    report = (out / "report.md").read_text()
    for label in ("InfMem (1-stop)", "InfMem (3-stop)", "MemAgent", "Full context (truncated)", "BM25 top-k + answer"):
        assert label in report
    assert "Preset **embedded**" in report and "95% Wilson" in report
    for plot in ("accuracy_vs_length.png", "accuracy_vs_time.png"):
        assert (out / plot).read_bytes()[:8] == PNG_MAGIC
    first = (out / "results.jsonl").read_bytes()
    capsys.readouterr()

    assert eval_cli.main(args) == 0
    assert (out / "results.jsonl").read_bytes() == first, "a finished run must redo nothing"
    assert "0 samples run (0 failed), 10 already done" in capsys.readouterr().out


def test_broken_records_and_missing_lengths_fail_alone_with_their_reason(tiny_model_dir, samples, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with (data / "eval_qa_2_1024.json").open("w") as handle:
        writer = PublishedWriter(handle)
        for sample in samples:
            writer.write(sample)
        writer.close()
    records = json.loads((data / "eval_qa_2_1024.json").read_text())
    del records[1]["input"]
    (data / "eval_qa_2_1024.json").write_text(json.dumps(records))
    out = tmp_path / "run"
    args = ["--model-dir", str(tiny_model_dir), "--data-dir", str(data), "--datasets", "hotpotqa",
            "--lengths", "1k,2k", "--methods", "memagent,bm25", "--out", str(out), "--no-progress"]  # fmt: skip
    assert eval_cli.main(args) == 0
    by_key = {(r["length"], r["method"], r["sample_id"]): r for r in read_records(out)}
    for method in ("memagent", "bm25"):
        assert by_key[("1k", method, samples[0].id)]["status"] == "ok"
        assert by_key[("1k", method, samples[2].id)]["status"] == "ok"
        broken = by_key[("1k", method, samples[1].id)]
        assert broken["status"] == "failed" and "'input'" in broken["reason"] and not broken["transient"]
        missing = by_key[("2k", method, "__cell__")]
        assert missing["status"] == "failed" and "length 2k of hotpotqa is not present" in missing["reason"]
        assert "eval_qa_2_2048.json" in missing["reason"]
    stats = {(s.length, s.method): s for s in aggregate(read_records(out), "qwen3-4b")}
    assert (stats[("1k", "bm25")].n, stats[("1k", "bm25")].failed) == (2, 1)
    assert "## Failures" in (out / "report.md").read_text()


def test_repeats_sample_each_question_k_times_and_the_report_states_metrics_decoding_and_documents(
    tiny_model_dir, samples, tmp_path, capsys
):
    # A RULER-HotpotQA-style file: each context is documents rendered as the reference renders them.
    path = tmp_path / "eval_3.json"
    path.write_text(json.dumps([
        {"context": render_context(s.context.split("\n\n"), range(3)), "input": s.question, "answers": s.answers,
         "num_docs": 3, "index": i} for i, s in enumerate(samples[:2])
    ]))  # fmt: skip
    out = tmp_path / "run"
    args = ["--model-dir", str(tiny_model_dir), "--data", f"hotpotqa:1k={path}", "--methods", "memagent",
            "--repeats", "3", "--temperature", "0.8", "--out", str(out), "--no-progress"]  # fmt: skip
    assert eval_cli.main(args) == 0
    records = read_records(out)
    assert sorted((r["sample_id"], r["repeat"]) for r in records) == [(f"eval_3-{i}", r) for i in range(2) for r in range(3)]
    assert {r["status"] for r in records} == {"ok"} and {r["num_docs"] for r in records} == {3}
    # The tiny random model samples at 0.8: the repeats of a question differ.
    assert len({r["answer_text"] for r in records if r["sample_id"] == "eval_3-0"}) > 1
    (cell,) = aggregate(records, "qwen3-4b")
    assert cell.n == 6 and len(cell.acc_by_repeat) == 3
    report = (out / "report.md").read_text()
    assert "Decoding: temperature 0.8, top-p 1, top-k -1; 3 sample(s) per question and method." in report
    assert "mean ± std over repeats" in report and "scored runs (questions × repeats)" in report
    assert "acc (ours: gold in prediction as whole words, any gold)" in report
    assert "**EM %**: exact match" in report and "**F1 %**: token F1" in report
    tokens = sorted(r["doc_tokens"] for r in records)
    mapping = f"| hotpotqa | 1k (1,024) | {path} | 3 | {np.mean(tokens):,.0f} ≈ "
    assert mapping in report and f"({tokens[0]:,}-{tokens[-1]:,}) |" in report
    capsys.readouterr()
    assert eval_cli.main(args + ["--repeats", "4"]) == 0  # one more repeat: only it runs
    assert "2 samples run (0 failed), 6 already done" in capsys.readouterr().out


def test_repeat_spread_is_the_mean_and_sample_std_of_per_repeat_accuracy():
    def row(sid, repeat, acc):
        return {"dataset": "d", "length": "1k", "method": "memagent", "sample_id": sid, "repeat": repeat,
                "status": "ok", "acc": acc, "acc_ref": 1.0, "run_id": "r"}  # fmt: skip

    rows = [row(s, r, acc) for r, accs in enumerate([(1, 1, 0, 0), (1, 0, 0, 0), (1, 1, 1, 0)]) for s, acc in zip("abcd", accs)]
    (cell,) = aggregate(rows, "qwen3-4b")
    assert cell.acc_by_repeat == [0.5, 0.25, 0.75] and cell.acc_ref_by_repeat == [1.0, 1.0, 1.0]
    assert repeat_spread(cell.acc_by_repeat) == pytest.approx((0.5, 0.25))
    assert cell.acc == pytest.approx(6 / 12) and cell.acc_ci == pytest.approx(wilson_interval(6, 12))
    assert repeat_spread([0.5]) is None


def test_unreachable_endpoint_stops_with_a_clear_message(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    args = ["--endpoint", f"http://127.0.0.1:{port}", "--retries", "0", "--out", str(tmp_path / "x"), "--no-progress"]
    with pytest.raises(SystemExit, match=r"cannot reach the model server .*unreachable.*nothing was run"):
        eval_cli.main(args)
    assert not (tmp_path / "x" / "results.jsonl").exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--methods", "infmem,oracle"], "methods: unknown method 'oracle'"),
        (["--data", "hotpotqa=x.json"], "--data: expected DATASET:LENGTH=PATH"),
        (["--data-dir", "d"], "datasets: expected at least one dataset"),
        (["--set", "memory_tokens=0"], "memory_tokens: expected an integer >= 1"),
        (["--set", "document.chunk_size=10"], "document.chunk_size: unknown key"),
        (["--concurrency", "0"], "concurrency: expected an integer >= 1"),
        (["--repeats", "0"], "repeats: expected an integer >= 1"),
    ],
)
def test_bad_settings_exit_2_naming_the_field(args, words, capsys):
    assert eval_cli.main(args + ["--no-progress"]) == 2
    assert words in capsys.readouterr().err


def test_store_drops_a_cut_last_line_keeps_the_latest_record_and_refuses_another_protocol(tmp_path):
    store = ResultStore(tmp_path, {"preset": "default", "agent": {"memory_tokens": 1024}})
    base = {"dataset": "d", "length": "1k", "method": "infmem", "run_id": "r1"}
    store.append({**base, "sample_id": "a", "status": "ok"})
    store.append({**base, "sample_id": "b", "status": "failed", "reason": "HTTP 503", "transient": True})
    store.append({**base, "sample_id": "c", "status": "failed", "reason": "bad record", "transient": False})
    with (tmp_path / "results.jsonl").open("a") as handle:
        handle.write('{"v": 1, "dataset": "d", "len')  # a kill in the middle of a write
    reopened = ResultStore(tmp_path, {"preset": "default", "agent": {"memory_tokens": 1024}})
    assert reopened.dropped_tail and len(reopened.latest()) == 3
    key = lambda sid: Key("d", "1k", "infmem", sid)  # noqa: E731
    assert [reopened.should_run(key(s), "transient") for s in "abcd"] == [False, True, False, True]
    assert [reopened.should_run(key(s), "all") for s in "abc"] == [False, True, True]
    assert [reopened.should_run(key(s), "none") for s in "abc"] == [False, False, False]
    reopened.append({**base, "sample_id": "b", "status": "ok", "run_id": "r2"})
    assert ResultStore(tmp_path, {"preset": "default", "agent": {"memory_tokens": 1024}}).records[key("b")]["run_id"] == "r2"
    assert (tmp_path / "results.jsonl").read_text().endswith("}\n")
    with pytest.raises(ConfigError, match=r"agent.memory_tokens: 1024 before, 512 now"):
        ResultStore(tmp_path, {"preset": "default", "agent": {"memory_tokens": 512}})


def test_wilson_interval_matches_its_closed_forms():
    z2 = 1.959963984540054**2
    assert wilson_interval(0, 2) == pytest.approx((0.0, z2 / (2 + z2)))
    assert wilson_interval(10, 10)[0] == pytest.approx(10 / (10 + z2))
    low, high = wilson_interval(50, 100)
    assert (low + high) / 2 == pytest.approx(0.5) and high - low == pytest.approx(0.1922, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_aggregate_scores_only_what_ran_and_sums_wall_time_over_runs():
    def record(sid, status, acc=None, latency=1.0, run="r1", start=0.0):
        fields = {"acc": acc, "acc_ref": acc, "em": acc, "f1": acc, "latency_s": latency, "tokens": 100,
                  "llm_calls": 4, "chunks_read": 2} if status == "ok" else {"reason": "HTTP 503"}  # fmt: skip
        return {"dataset": "hotpotqa", "length": "128k", "method": "infmem3", "sample_id": sid, "status": status,
                "run_id": run, "started_at": start, "finished_at": start + latency, **fields}  # fmt: skip

    records = [record(str(i), "ok", float(i % 2), latency=float(i + 1), start=float(i)) for i in range(20)]
    records += [record("f", "failed", start=3.0), record("late", "ok", 1.0, latency=5.0, run="r2", start=100.0)]
    (cell,) = aggregate(records, "qwen3-4b")
    assert (cell.n, cell.failed) == (21, 1)
    assert cell.acc == pytest.approx(11 / 21) and cell.acc_ci == pytest.approx(wilson_interval(11, 21))
    latencies = [float(i + 1) for i in range(20)] + [5.0]
    assert cell.latency_p95_s == pytest.approx(np.percentile(latencies, 95))
    assert cell.wall_s == pytest.approx((19 + 20) - 0 + 5.0)  # run r1 spans 0..39, run r2 5 s
    assert cell.failure_reasons == ["HTTP 503"]
    assert cell.published is not None and cell.published.accuracy == pytest.approx(71.2)


def test_published_numbers_match_cells_by_token_length():
    assert lookup("qwen3-4b", "hotpotqa", "131072", "infmem3").accuracy == pytest.approx(71.2)
    at_1m = lookup("qwen3-4b", "2wiki", "1m", "infmem")
    assert (at_1m.accuracy, at_1m.minutes) == (67.7, 9.8)
    assert lookup("qwen2.5-7b", "hotpotqa", "896k", "memagent").accuracy == pytest.approx(76.56)
    assert lookup("qwen3-4b", "synthetic", "64k", "infmem3") is None


def test_cut_middle_keeps_head_and_tail():
    ids = np.arange(10, dtype=np.int32)
    assert cut_middle(ids, 20).tolist() == ids.tolist()
    assert cut_middle(ids, 5).tolist() == [0, 1, 7, 8, 9]


def test_baselines_fit_the_window_and_bm25_finds_the_facts(tokenizer, samples):
    cfg = EvalConfig(preset="embedded").agent_config()
    policy = ScriptedPolicy(tokenizer, lambda prompt, params: "<think>\nok\n</think>\n\n\\boxed{Paris}")
    sample = samples[0]
    window = 600
    full = BaselineMethod("full_context", cfg, tokenizer, window)
    outcome = asyncio.run(full.run(policy, sample))
    assert outcome.prediction == "Paris" and outcome.llm_calls == 1
    prompt = policy.calls[-1].prompt_ids
    assert len(prompt) + cfg.answer.response_tokens(cfg.thinking) <= window
    text = tokenizer.decode(prompt.tolist())
    ids = tokenizer.encode(sample.context)
    assert tokenizer.decode(ids[:50]) in text and tokenizer.decode(ids[-50:]) in text  # head and tail kept
    assert sample.question in text

    bm25 = BaselineMethod("bm25", cfg, tokenizer, window=8192)
    outcome = asyncio.run(bm25.run(policy, sample))
    text = tokenizer.decode(policy.calls[-1].prompt_ids.tolist())
    assert outcome.retrieval_queries == [sample.question]
    assert sample.meta["facts"][0]["text"] in text, "the question names fact A's entity; BM25 must find it"
    with pytest.raises(ValueError, match="context_window"):
        asyncio.run(BaselineMethod("full_context", cfg, tokenizer, window=64).run(policy, sample))


def test_eval_and_distillation_read_the_same_model_options_the_same_way(tmp_path):
    flags = [
        "--endpoint", "http://h1:8000", "--endpoint", "http://h2:8000", "--model", "m", "--tokenizer", str(tmp_path),
        "--concurrency", "3", "--timeout", "9", "--retries", "1", "--backoff", "0.1", "--seed", "5",
    ]  # fmt: skip
    evaluation = eval_cli.parse_args(flags)
    distillation = distill_cli.parse_args(["--out", str(tmp_path / "out"), *flags])
    expected = ModelSource(("http://h1:8000", "http://h2:8000"), "m", None, tmp_path, 3, 9.0, 1, 0.1)
    assert evaluation.source == distillation.source == expected and evaluation.seed == distillation.seed == 5
    assert expected.describe() == "http://h1:8000, http://h2:8000"
    assert eval_cli.parse_args([]).source.describe() == "in-process transformers"


class CountingCache(DocumentCache):
    """A real cache that counts the documents it has prepared (read from any thread)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prepared = threading.Semaphore(0)

    def prepare_document(self, text):
        document = super().prepare_document(text)
        self.prepared.release()
        return document


class WaitForDocumentsPolicy:
    """A scripted policy whose first call waits (up to ``timeout`` s, polling the loop) until the
    cache has prepared ``documents`` documents: with one slot, only a runner that reads and
    prepares the next sample while this one generates gets there before the timeout."""

    def __init__(self, inner, cache: CountingCache, documents: int, timeout: float = 30.0):
        self.inner, self.cache, self.documents, self.timeout = inner, cache, documents, timeout
        self.waited_out: bool | None = None

    async def generate(self, prompt_ids, params):
        if self.waited_out is None:
            deadline = time.monotonic() + self.timeout
            seen = 0
            while seen < self.documents and time.monotonic() < deadline:
                seen += self.cache.prepared.acquire(blocking=False)
                await asyncio.sleep(0.01)
            self.waited_out = seen < self.documents
        return await self.inner.generate(prompt_ids, params)


def test_the_runner_prepares_the_next_document_while_a_sample_generates(tokenizer, samples, tmp_path):
    cfg = EvalConfig(preset="embedded").agent_config()
    method = build_methods(["memagent"], cfg, tokenizer, window=8192, concurrency=1)["memagent"]
    cache = method.agent.cache = CountingCache(tokenizer, cfg.document, cfg.retrieval, size=method.agent.cache.size)
    answer = ScriptedPolicy(tokenizer, lambda prompt, params: "<think>\nok\n</think>\n\n\\boxed{Paris}")
    policy = WaitForDocumentsPolicy(answer, cache, documents=2)
    source = CellSource("synthetic", "1k", lambda: iter(samples[:2]))
    runner = Runner(policy, {"memagent": method}, ResultStore(tmp_path, {}), concurrency=1, progress=False)
    counts = asyncio.run(runner.run([source]))
    assert policy.waited_out is False, "the second document was not prepared while the first sample generated"
    assert counts.ran == 2 and counts.failed == 0
    assert cache.builds == 2  # the second sample's run found its read-ahead document in the cache
    assert [r["status"] for r in read_records(tmp_path)] == ["ok", "ok"]


class SlowPolicy:
    """A scripted policy whose calls take ``seconds`` (a server's latency: samples overlap)."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds = inner, seconds

    async def generate(self, prompt_ids, params):
        await asyncio.sleep(self.seconds)
        return await self.inner.generate(prompt_ids, params)


@pytest.mark.parametrize("name", ["memagent", "bm25"])
def test_concurrent_samples_prepare_each_document_once(tokenizer, samples, tmp_path, name):
    # Before the caches were sized to the documents in flight, a sample's agent looked up its
    # document after other samples' preparations had evicted it: 8 builds for 4 samples at 4.
    cfg = EvalConfig(preset="embedded").agent_config()
    method = build_methods([name], cfg, tokenizer, window=8192, concurrency=3)[name]
    cache = method.agent.cache if name == "memagent" else method.cache
    answer = ScriptedPolicy(tokenizer, lambda prompt, params: "<think>\nok\n</think>\n\n\\boxed{Paris}")
    four = make_dataset(4, 1024, tokenizer, seed=6)
    source = CellSource("synthetic", "1k", lambda: iter(four))
    runner = Runner(SlowPolicy(answer, 0.02), {name: method}, ResultStore(tmp_path, {}), concurrency=3, progress=False)
    counts = asyncio.run(runner.run([source]))
    assert counts.ran == 4 and counts.failed == 0 and cache.builds == 4
