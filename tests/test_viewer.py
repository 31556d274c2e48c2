"""The trajectory viewer: ``--record-turns`` records, the loader, and the page in a real headless Chromium.

The evaluation folder is made by the real runner, methods and agent loops over the real Qwen3
tokenizer and synthetic two-hop samples (which record where their facts sit), with a scripted
controller that retrieves the first fact with the question's entity, then stops, so the page
has a gold unit to highlight. Training records come from real agent runs through the trainer's
own record builder (:func:`infmem_verl.verl_plugin.trainer.trajectory_rows`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from infmem_verl import eval as eval_cli
from infmem_verl import inspect as inspect_cli
from infmem_verl.agent.config import agent_config
from infmem_verl.agent.document import Document
from infmem_verl.data.sample import QASample
from infmem_verl.data.synthetic import make_dataset
from infmem_verl.evaluation.data import CellSource
from infmem_verl.evaluation.methods import build_methods
from infmem_verl.evaluation.runner import Runner
from infmem_verl.evaluation.store import ResultStore
from infmem_verl.evaluation.trajectories import TrajectoryWriter, gold_ranges, units_overlapping
from infmem_verl.policy.scripted import ScriptedPolicy
from infmem_verl.run_record import RunRecord
from infmem_verl.viewer.load import load

from browser import Browser

THINK = {"prethink": 30, "write": 40, "answer": 50}  # distinct budgets tell the script which call it serves
KIND_BY_BUDGET = {v: k for k, v in THINK.items()}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def viewer_cfg():
    budgets = {kind: {"prompt_tokens": 2048, "thinking_tokens": think, "output_tokens": 80} for kind, think in THINK.items()}
    return agent_config({
        "document": {"chunk_tokens": 400, "unit_tokens": 100, "unit_overlap": 20},
        "memory_tokens": 60, "record_token_ids": False, **budgets,
    })  # fmt: skip


class Controller:
    """Per sample: retrieve the entity (first fact), retrieve the bridge (second), then stop; the
    memory names the gold answer from the second Write on; sample 1 answers wrong, sample 2's
    first PreThink is garbage (an invalid, flagged action). Which step a call is comes from the
    memory in its prompt ("write N: ..."), so the script needs no state."""

    def __init__(self, tokenizer, samples):
        self.tokenizer = tokenizer
        self.samples = samples

    def __call__(self, prompt_ids, params) -> str:
        text = self.tokenizer.decode(prompt_ids.tolist())
        number, sample = next((i, s) for i, s in enumerate(self.samples) if s.question in text)
        kind = KIND_BY_BUDGET[params.max_tokens]
        written = re.findall(r"write (\d+):", text)
        step = int(written[-1]) + 1 if written else 0
        if kind == "prethink":
            if number == 2 and step == 0:
                return "<think>\nhm\n</think>\n\nno tool call here"
            queries = [sample.meta["entity"], sample.meta["bridge"]]
            call = {"name": "retrieve", "arguments": {"query": queries[step], "top_k": 2}} if step < 2 else {"name": "stop", "arguments": {}}
            return f"<think>\nplan\n</think>\n\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
        if kind == "write":
            note = f"The director is {sample.answers[0]}." if step >= 1 else f"{sample.meta['entity']} studied somewhere."
            return f"<think>\nnote\n</think>\n\nwrite {step}: {note}"
        answer = "Nobody" if number == 1 else sample.answers[0]
        return f"<think>\nanswer\n</think>\n\n\\boxed{{{answer}}}"


@pytest.fixture(scope="module")
def samples(tokenizer):
    return make_dataset(3, 2000, tokenizer, seed=7)


@pytest.fixture(scope="module")
def eval_dir(tokenizer, samples, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    cfg = viewer_cfg()
    store = ResultStore(out, {"preset": "test"})
    methods = build_methods(["infmem", "memagent", "bm25"], cfg, tokenizer, 8192)
    policy = ScriptedPolicy(tokenizer, Controller(tokenizer, samples), record=False)
    source = CellSource("synthetic", "2k", lambda: iter(samples))
    runner = Runner(policy, methods, store, 1, progress=False, trajectories=TrajectoryWriter(out))
    asyncio.run(runner.run([source]))
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_recorded_turns_hold_actions_memories_and_gold_units_with_texts_stored_once(eval_dir, samples):
    records = read_jsonl(eval_dir / "trajectories.jsonl")
    # The agents only (the bm25 baseline has no turns), one line per sample and method.
    assert Counter(r["method"] for r in records) == {"infmem": 3, "memagent": 3}
    docs = sorted(p.stem for p in (eval_dir / "documents").glob("*.json"))
    assert len(docs) == 3 and sorted({r["document"] for r in records}) == docs  # one per document, shared by the methods
    for record in records:
        sample = next(s for s in samples if s.id == record["sample_id"])
        chunks = json.loads((eval_dir / "documents" / f"{record['document']}.json").read_text())["chunks"]
        assert len(chunks) == record["num_chunks"] > 3 and "".join(chunks) == sample.context
        line = json.dumps(record)
        assert chunks[0][:200] not in line, "chunk text belongs in documents/, never in a turn record"
        facts = sample.meta["facts"]
        assert len(record["gold_ranges"]) == 2 and record["gold_units"]
        assert all(any(f["text"][:40] in record["units"][str(u)]["text"] for u in record["gold_units"]) for f in facts)
        writes = [t for t in record["turns"] if t["kind"] == "write"]
        assert all(t["memory"].startswith(f"write {i}:") for i, t in enumerate(writes))
        assert record["turns"][-1]["kind"] == "answer"
    infmem = {r["sample_id"]: r for r in records if r["method"] == "infmem"}
    good = infmem[samples[0].id]
    actions = [t["action"] for t in good["turns"] if t["kind"] == "prethink"]
    assert [a["kind"] for a in actions] == ["retrieve", "retrieve", "stop"] and actions[0]["query"] == samples[0].meta["entity"]
    first_hit = good["turns"][0]["retrieved_units"]
    assert set(first_hit) & set(good["gold_units"]), "the entity query finds the first fact"
    assert good["stop_step"] == 2 and len([t for t in good["turns"] if t["kind"] == "write"]) == 2
    bad = infmem[samples[2].id]["turns"][0]
    assert not bad["valid"] and "invalid_action" in bad["flags"] and bad["action"]["reason"]


def test_gold_units_of_built_samples_cover_the_gold_document(tokenizer):
    """data_prep.build records where each gold document starts; it runs to the next paragraph."""
    from data_prep.compose import render_context

    pool = [f"Paragraph {i} talks about topic {i} at some length. " * 12 for i in range(12)]
    context = render_context(pool, list(range(12)))
    gold_doc = 7  # 0-based pool index, document number 8
    start = len(tokenizer.encode(context[: context.index("Document 8:")], add_special_tokens=False))
    sample = QASample("b", "q?", ["a"], context, meta={"gold_positions": [8], "gold_token_starts": [start]})
    document = Document.from_text(context, tokenizer, viewer_cfg().document)
    ((begin, end),) = gold_ranges(sample, document)
    assert begin == start and tokenizer.decode(document.ids[begin:end].tolist()).strip() == f"Document 8:\n{pool[gold_doc]}".strip()
    texts = document.unit_texts()
    units = units_overlapping(document, [(begin, end)])
    assert all(f"topic {gold_doc}" in texts[u] or "Document 8" in texts[u] for u in units)
    assert not gold_ranges(QASample("c", "q?", ["a"], context), document)  # no positions, no gold


def test_eval_cli_records_turns_only_when_asked(tiny_model_dir, tmp_path):
    args = ["--model-dir", str(tiny_model_dir), "--lengths", "1k", "--samples", "1", "--methods", "memagent", "--no-progress"]
    assert eval_cli.parse_args([*args, "--out", str(tmp_path / "plain")]).record_turns is False  # off by default
    assert eval_cli.main([*args, "--out", str(tmp_path / "turns"), "--record-turns"]) == 0
    (record,) = read_jsonl(tmp_path / "turns" / "trajectories.jsonl")
    (result,) = read_jsonl(tmp_path / "turns" / "results.jsonl")
    assert record["sample_id"] == result["sample_id"] and record["num_chunks"] == result["num_chunks"]
    assert len([t for t in record["turns"] if t["kind"] == "write"]) == result["chunks_read"]


@pytest.fixture(scope="module")
def train_dir(tokenizer, samples, tmp_path_factory):
    """Step 3 of a run's trajectory records, built by the trainer's own code from real agent runs."""
    from infmem_verl.agent.loops import build_agent
    from infmem_verl.agent.facts import turn_facts
    from infmem_verl.verl_plugin.trainer import trajectory_rows

    agent = build_agent("infmem", viewer_cfg(), tokenizer)
    keys, extra, scores, prompts, responses = [], [], [], [], []
    for number, sample in enumerate(samples):
        policy = ScriptedPolicy(tokenizer, Controller(tokenizer, samples), record=False)
        trajectory = asyncio.run(agent.run(policy, sample.question, sample.context))
        for index, turn in enumerate(trajectory.turns):
            keys.append(f"uid{number}_0_{index}")
            facts = turn_facts(trajectory, index, turn).to_dict()
            facts["reward_extra_info"] = {"acc": float(trajectory.prediction == sample.answers[0]), "outcome": 0.6, "early_stop": 0.3}
            extra.append(facts)
            scores.append(0.9 if trajectory.prediction == sample.answers[0] else 0.0)
            prompts.append(turn.prompt_tokens)
            responses.append(turn.response_tokens)
    folder = tmp_path_factory.mktemp("records")
    RunRecord(folder).log_trajectories(3, trajectory_rows(keys, extra, scores, prompts, responses, with_turns=True))
    return folder


def test_loader_reads_evaluation_methods_and_training_steps(eval_dir, train_dir, samples):
    runs = load([eval_dir, train_dir])
    assert [r.name.split(" · ")[1] for r in runs.runs] == ["infmem", "memagent", "bm25", "step 3"]
    infmem, memagent, bm25, train = runs.runs
    assert [r.correct for r in infmem.samples] == [True, False, True]
    assert all(r.detail is not None for r in infmem.samples + memagent.samples) and all(r.detail is None for r in bm25.samples)
    assert "invalid_action" in infmem.samples[2].flags and infmem.samples[0].stopped_early
    assert len(runs.documents) == 3
    assert [r.reward for r in train.samples] == [0.9, 0.0, 0.9]
    assert train.samples[0].components == {"outcome": 0.6, "early_stop": 0.3}
    assert train.samples[0].chunks_read == 2 and train.samples[0].stopped_early
    first = runs.details[train.samples[0].detail]["turns"][0]
    assert first["action"] == {"kind": "retrieve", "query": samples[0].meta["entity"], "top_k": 2, "valid": True, "reason": ""}
    assert first["retrieved_units"] and "invalid_action" in train.samples[2].flags
    limited = load([eval_dir], limit=1)
    assert [len(r.samples) for r in limited.runs] == [1, 1, 1] and len(limited.documents) == 1


def test_page_in_headless_chromium_lists_filters_and_shows_the_timeline(eval_dir, train_dir, samples, tmp_path):
    page, train_page = tmp_path / "viewer.html", tmp_path / "train.html"
    assert inspect_cli.main([str(eval_dir), "--out", str(page)]) == 0
    assert inspect_cli.main([str(train_dir), "--out", str(train_page)]) == 0
    html = page.read_text()
    assert "http://" not in html and "https://" not in html  # nothing to fetch
    num_chunks = read_jsonl(eval_dir / "trajectories.jsonl")[0]["num_chunks"]
    shot = tmp_path / "viewer.png"

    async def drive():
        async with Browser(1400, 1000) as browser:
            keys = "[...document.querySelectorAll('#index tbody tr')].map(r => r.dataset.key)"
            await browser.open(page)
            ids = await browser.eval(keys)
            await browser.type("#f-text", samples[1].id)
            filtered = await browser.eval(keys)
            await browser.set_value("#f-text", "")
            await browser.set_value("#f-correct", "no")
            wrong = await browser.eval(keys)
            await browser.set_value("#f-correct", "")
            await browser.click("#index th[data-sort='correct']")
            by_correct = await browser.eval(keys)
            await browser.set_value("#run-b", "1")
            await browser.click(f"#index tbody tr[data-key='synthetic/2k/{samples[0].id}']")
            cells = await browser.eval("[...document.querySelectorAll('#detail .pane')].map(p => p.querySelectorAll('.timeline .chunk').length)")
            infmem = "document.querySelectorAll('#detail .pane')[0]"
            read = await browser.eval(f"{infmem}.querySelectorAll('.timeline .chunk.read').length")
            step = "#detail .pane .step[data-chunk='{}']"
            await browser.click_and_wait(f"{step.format(0)} summary", f"{step.format(0)} .body")
            gold = await browser.eval(f"[...{infmem}.querySelectorAll('.step .unit.gold')].map(u => u.dataset.unit)")
            await browser.click_and_wait(f"{step.format(0)} .show-chunk", "#detail .pane .chunk-text")
            chunk = await browser.eval("document.querySelector('#detail .pane .chunk-text').textContent")
            await browser.click_and_wait(f"{step.format(1)} summary", f"{step.format(1)} .body")
            added = await browser.eval(f"[...document.querySelectorAll(\"{step.format(1)} .memory ins\")].map(e => e.textContent).join('')")
            await browser.screenshot(shot)
            # Training records: facts without texts; the page shows what they hold.
            await browser.open(train_page)
            train_ids = await browser.eval(keys)
            await browser.click_and_wait("#index tbody tr", "#detail .pane .timeline")
            await browser.click_and_wait(f"{step.format(0)} summary", f"{step.format(0)} .body")
            train_step = await browser.eval(f"document.querySelector(\"{step.format(0)}\").textContent")
            return ids, filtered, wrong, by_correct, cells, read, gold, chunk, added, train_ids, train_step, browser.errors

    ids, filtered, wrong, by_correct, cells, read, gold, chunk, added, train_ids, train_step, errors = asyncio.run(drive())
    assert errors == []
    assert ids == [f"synthetic/2k/{s.id}" for s in samples]  # every sample, in order
    assert filtered == [f"synthetic/2k/{samples[1].id}"]
    assert wrong == [f"synthetic/2k/{samples[1].id}"]  # the one wrong answer
    assert by_correct == [f"synthetic/2k/{samples[i].id}" for i in (1, 0, 2)]  # wrong first, then in order
    assert cells == [num_chunks, num_chunks]  # InfMem beside MemAgent, one cell per chunk
    assert read == 2  # InfMem stopped before chunk 2
    record = next(r for r in read_jsonl(eval_dir / "trajectories.jsonl") if r["method"] == "infmem" and r["sample_id"] == samples[0].id)
    assert gold and {int(u) for u in gold} <= set(record["gold_units"]) & set(record["turns"][0]["retrieved_units"])
    assert chunk and chunk in samples[0].context
    assert samples[0].answers[0] in added  # the memory diff shows what the second Write added
    assert train_ids == ["uid0_0", "uid1_0", "uid2_0"]
    assert samples[0].meta["entity"] in train_step and "text not recorded" in train_step
    assert shot.read_bytes()[:8] == PNG_MAGIC


def test_inspect_names_a_path_it_cannot_read(tmp_path, capsys):
    assert inspect_cli.main([str(tmp_path)]) == 2
    assert "neither an evaluation folder" in capsys.readouterr().err
    assert inspect_cli.main([str(tmp_path / "missing")]) == 2
    assert re.search(r"missing: no such file or folder", capsys.readouterr().err)
