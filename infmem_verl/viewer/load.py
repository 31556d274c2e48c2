"""Runs for the trajectory viewer, read from evaluation folders and training trajectory records.

A :class:`Run` is what one method (evaluation) or one training step did on a set of samples: an
index row per sample (:class:`SampleRow`) and, where the turns were recorded, a detail record per
sample (question, turns, retrieved and gold units) that the page parses only when the sample is
opened. Document texts are kept apart, once per document, whatever number of runs and samples
read it.

* An evaluation folder (``python -m infmem_verl.eval --out DIR``) gives one run per method, from
  ``results.jsonl``; with ``--record-turns`` also the turns (``trajectories.jsonl``) and the chunk
  texts (``documents/``) of :mod:`infmem_verl.evaluation.trajectories`.
* A training records folder (``infmem.records.trajectories=true``, :mod:`infmem_verl.run_record`)
  gives one run per step file ``trajectories/step_<N>.jsonl``: reward, its components and the
  per-turn facts (no texts: training records keep none).

Samples of two runs are the same sample when their ``key`` is equal: ``dataset/length/id`` in an
evaluation, the trajectory key in training.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from infmem_verl.agent.trajectory import TURN_KINDS
from infmem_verl.evaluation.store import MANIFEST, RESULTS
from infmem_verl.evaluation.trajectories import DOCUMENTS, TRAJECTORIES
from infmem_verl.metrics import trajectory_values
from infmem_verl.reward.components import TrajectoryRecord
from infmem_verl.reward.metrics import ANSWER_METRICS
from infmem_verl.agent.facts import TurnFacts
from infmem_verl.run_record import TRAJECTORIES_DIR

_STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")
# Scores an evaluation record carries beside its headline accuracy (the index's "correct").
_EVAL_SCORES = ("em", "f1", "sub_em")


class ViewerError(ValueError):
    """A path the viewer cannot read, with the reason and what was expected."""


@dataclass
class SampleRow:
    """One sample of a run, as the index lists it."""

    key: str
    dataset: str
    length: str
    sample_id: str
    status: str  # "ok" or "failed"
    reason: str = ""
    question: str | None = None
    answers: list[str] = field(default_factory=list)
    prediction: str | None = None
    correct: bool | None = None
    chunks_read: int | None = None
    num_chunks: int | None = None
    stopped_early: bool | None = None
    stop_step: int | None = None
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)  # every flag any turn carries, and "invalid_turn"
    detail: int | None = None  # index into Runs.details; None when no turns were recorded


@dataclass
class Run:
    name: str
    kind: str  # "eval" or "train"
    path: str
    samples: list[SampleRow] = field(default_factory=list)


@dataclass
class Runs:
    """Everything a page shows: the runs, their per-sample details and the documents' texts."""

    runs: list[Run] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)
    documents: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add_detail(self, detail: dict[str, Any]) -> int:
        self.details.append(detail)
        return len(self.details) - 1


def load(paths: list[Path], limit: int | None = None) -> Runs:
    """The runs found at ``paths`` (evaluation folders, training records folders or step files);
    ``limit`` keeps the first samples of each run (a page of 1M-token documents stays small)."""
    runs = Runs()
    for path in paths:
        if not path.exists():
            raise ViewerError(f"{path}: no such file or folder (expected an evaluation --out folder or training records)")
        if (path / RESULTS).is_file():
            _load_eval(path, runs, limit)
        else:
            files = _step_files(path)
            if not files:
                raise ViewerError(
                    f"{path}: neither an evaluation folder (no {RESULTS}) nor training records "
                    f"(no {TRAJECTORIES_DIR}/step_<N>.jsonl; train with infmem.records.trajectories=true)"
                )
            for step, file in files:
                runs.runs.append(_load_step(file, step, runs, limit))
    if not runs.runs:
        raise ViewerError(f"{', '.join(map(str, paths))}: no samples found")
    return runs


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of ``path``, one per line; a cut last line (a run killed while writing) is skipped."""
    with path.open(encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as err:
            if number == len(lines):
                continue
            raise ViewerError(f"{path}:{number}: not a JSON line ({err})") from None
        if not isinstance(value, dict):
            raise ViewerError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}")
        yield value


def _eval_key(record: Mapping[str, Any], where: str) -> tuple[str, str, str, str]:
    try:
        return str(record["dataset"]), str(record["length"]), str(record["method"]), str(record["sample_id"])
    except KeyError as err:
        raise ViewerError(f"{where}: record lacks field {err}; not written by python -m infmem_verl.eval?") from None


def _load_eval(folder: Path, runs: Runs, limit: int | None) -> None:
    """One run per method of an evaluation folder, in the order methods first appear."""
    headline = "acc"
    manifest = folder / MANIFEST
    if manifest.is_file() and json.loads(manifest.read_text(encoding="utf-8")).get("preset") == "reference":
        headline = "acc_ref"
    latest: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for record in _jsonl(folder / RESULTS):
        latest[_eval_key(record, f"{folder / RESULTS}")] = record
    turns: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    if (folder / TRAJECTORIES).is_file():
        for record in _jsonl(folder / TRAJECTORIES):
            turns[_eval_key(record, f"{folder / TRAJECTORIES}")] = record
    by_method: dict[str, Run] = {}
    for (dataset, length, method, sample_id), record in latest.items():
        run = by_method.get(method)
        if run is None:
            run = by_method[method] = Run(f"{folder.name} · {method}", "eval", str(folder))
            runs.runs.append(run)
        if limit is not None and len(run.samples) >= limit:
            continue
        row = SampleRow(
            key=f"{dataset}/{length}/{sample_id}",
            dataset=dataset,
            length=length,
            sample_id=sample_id,
            status=str(record.get("status")),
            reason=str(record.get("reason") or ""),
            answers=list(record.get("answers") or []),
            prediction=record.get("prediction"),
            chunks_read=record.get("chunks_read"),
            num_chunks=record.get("num_chunks"),
            stop_step=record.get("stop_step"),
            components={k: float(record[k]) for k in _EVAL_SCORES if isinstance(record.get(k), (int, float))},
        )
        if row.status == "ok":
            row.correct = bool(record.get(headline))
            if record.get("invalid_turns"):
                row.flags = ["invalid_turn"]
        if row.stop_step is not None and row.num_chunks is not None:
            row.stopped_early = row.stop_step < row.num_chunks
        elif row.num_chunks is not None:
            row.stopped_early = False
        detail = turns.get((dataset, length, method, sample_id))
        if detail is not None and row.status == "ok":
            row.question = detail.get("question")
            row.flags = _flags(detail.get("turns") or [])
            doc = detail.get("document")
            if isinstance(doc, str) and doc not in runs.documents:
                runs.documents[doc] = _document(folder, doc)
            row.detail = runs.add_detail(_eval_detail(detail))
        run.samples.append(row)


def _document(folder: Path, digest: str) -> dict[str, Any]:
    path = folder / DOCUMENTS / f"{digest}.json"
    if not path.is_file():
        return {"missing": f"{path} not found: the chunk texts were not recorded"}
    data = json.loads(path.read_text(encoding="utf-8"))
    return {"chunks": data.get("chunks", [])}


def _eval_detail(record: Mapping[str, Any]) -> dict[str, Any]:
    keep = ("agent", "question", "answers", "prediction", "document", "num_chunks", "stop_step", "gold_units", "units", "turns")
    return {k: record.get(k) for k in keep}


def _flags(turns: list[Mapping[str, Any]]) -> list[str]:
    flags = {flag for t in turns for flag in t.get("flags") or []}
    if any(not t.get("valid", True) for t in turns):
        flags.add("invalid_turn")
    return sorted(flags)


def _step_files(path: Path) -> list[tuple[int, Path]]:
    """``(step, file)`` of a step file, a trajectories folder or a records folder, by step."""
    if path.is_file():
        match = _STEP_FILE.search(path.name)
        if match is None:
            raise ViewerError(f"{path}: expected a training step file named step_<N>.jsonl")
        return [(int(match.group(1)), path)]
    folder = path / TRAJECTORIES_DIR if (path / TRAJECTORIES_DIR).is_dir() else path
    found = [(int(m.group(1)), f) for f in folder.glob("step_*.jsonl") if (m := _STEP_FILE.search(f.name))]
    return sorted(found)


def _figure_names() -> frozenset[str]:
    """The trajectory figures (:func:`~infmem_verl.metrics.trajectory_values`) a training record's
    values hold beside the reward's own entries; asked of the function so the two cannot drift."""
    answer = TurnFacts(agent="infmem", turn_index=0, turn_kind="answer", chunk_index=0, num_chunks=0, stop_step=None, valid=True)
    return frozenset(trajectory_values(TrajectoryRecord([answer], golds=[]), [0], [0]))


def _load_step(file: Path, step: int, runs: Runs, limit: int | None) -> Run:
    """A training step's trajectories: reward and components from their values, turns from their facts."""
    run = Run(f"{file.parent.parent.name or file.parent.name} · step {step}", "train", str(file))
    not_components = _figure_names() | set(ANSWER_METRICS) | {"reward", "acc"}
    for number, record in enumerate(_jsonl(file), start=1):
        if limit is not None and len(run.samples) >= limit:
            break
        where = f"{file}:{number}"
        values = record.get("values")
        if not isinstance(values, Mapping) or "key" not in record:
            raise ViewerError(f"{where}: expected a trajectory record with 'key' and 'values' (infmem_verl.run_record)")
        facts = record.get("turns") or []
        turns = [_train_turn(TurnFacts.from_dict(t, f"{where} turn {i}"), t) for i, t in enumerate(facts)]
        first = facts[0] if facts else {}
        answer = next((t for t in reversed(facts) if t.get("turn_kind") == "answer"), {})
        num_chunks, stop_step = first.get("num_chunks"), first.get("stop_step")
        row = SampleRow(
            key=str(record["key"]),
            dataset="train",
            length=f"step {step}",
            sample_id=str(record["key"]),
            status="ok",
            prediction=answer.get("prediction"),
            correct=bool(values["acc"]) if "acc" in values else None,
            chunks_read=sum(1 for t in facts if t.get("turn_kind") == "write") if facts else None,
            num_chunks=num_chunks,
            stop_step=stop_step,
            stopped_early=bool(values.get("stopped_early")) if "stopped_early" in values else None,
            reward=values.get("reward"),
            components={k: float(v) for k, v in values.items() if k not in not_components},
            flags=_flags(turns),
        )
        if turns:
            row.detail = runs.add_detail(
                {"agent": first.get("agent"), "num_chunks": num_chunks, "stop_step": stop_step,
                 "prediction": row.prediction, "turns": turns, "values": dict(values)}  # fmt: skip
            )
        run.samples.append(row)
    return run


def _train_turn(facts: TurnFacts, raw: Mapping[str, Any]) -> dict[str, Any]:
    """A training turn in the evaluation's turn layout (:func:`~infmem_verl.evaluation.trajectories.turn_record`)."""
    if facts.turn_kind not in TURN_KINDS:
        raise ViewerError(f"turn {facts.turn_index}: unknown turn kind {facts.turn_kind!r}; expected one of {TURN_KINDS}")
    turn: dict[str, Any] = {
        "kind": facts.turn_kind,
        "chunk": facts.chunk_index,
        "valid": facts.valid,
        "flags": list(facts.flags),
        "llm_calls": facts.llm_calls,
        "memory_tokens": facts.memory_tokens,
        "prompt_tokens": raw.get("prompt_tokens"),
        "response_tokens": raw.get("response_tokens"),
    }
    if facts.action is not None:
        turn["action"] = {"kind": facts.action, "query": facts.query, "top_k": facts.top_k, "valid": facts.valid, "reason": facts.reason}
        turn["retrieved_units"] = list(facts.retrieved_units)
    turn["reason"] = facts.reason
    if facts.turn_kind == "write" and facts.memory_text is not None:
        turn["memory"] = facts.memory_text
    if facts.turn_kind == "answer":
        turn["output"] = facts.prediction
    return turn
