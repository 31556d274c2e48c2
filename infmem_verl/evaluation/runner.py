"""Runs the cells of an evaluation: every method on every sample of every source, resumably.

Cells run one after another (their wall time is then a property of the cell); inside a cell up to
``concurrency`` samples are in flight. Samples are read from their source one at a time in a
worker thread (building a synthetic 1M-token document or parsing a large file must not stall the
requests in flight), one sample ahead of the free slots: while every slot is busy, the next
sample is read and its document prepared (the method's ``prepare``: tokens and chunks, the index
behind them), so a slot that frees starts its next sample's first call at once instead of
leaving the server idle while a document prepares. Memory holds at most ``concurrency + 1``
documents. Every sample ends in exactly one record: ``ok`` with its scores, or ``failed`` with
the reason (and ``error_kind``, the :class:`~infmem_verl.policy.openai.PolicyError` kind, when the
policy failed); an exception of one sample never stops the others.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from tqdm import tqdm

from data_prep.io import DataError
from data_prep.published import document_count
from infmem_verl.agent.policy import Policy
from infmem_verl.data.sample import QASample
from infmem_verl.policy.openai import TRANSIENT_KINDS, ErrorKind, PolicyError
from infmem_verl.reward.metrics import score_answer

from .data import CellSource, LoadFailure
from .methods import MethodOutcome
from .store import CELL, Key, ResultStore, RetryPolicy
from .trajectories import TrajectoryWriter

_ANSWER_CHARS = 500


@dataclass
class RunCounts:
    """What a run did: records read from its sources, samples run, skipped as already done,
    failed (of those run), and cells whose file could not be read to its end.

    Every record read ends in exactly one result per repeat: ``ran + skipped == read * repeats``."""

    read: int = 0
    ran: int = 0
    skipped: int = 0
    failed: int = 0
    unread: int = 0


class Runner:
    """Runs every method over every source; ``repeats`` samples of each question per method
    (``--repeats``: at a temperature above 0 they differ, and the report gives their spread);
    ``trajectories``: where agent trajectories are recorded (``--record-turns``), or None."""

    def __init__(self, policy: Policy, methods: Mapping[str, Any], store: ResultStore, concurrency: int,
                 retry_failed: RetryPolicy = "transient", progress: bool = True, repeats: int = 1,
                 trajectories: TrajectoryWriter | None = None):  # fmt: skip
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats: expected an integer >= 1, got {repeats!r}")
        self.policy = policy
        self.methods = methods
        self.store = store
        self.concurrency = concurrency
        self.retry_failed = retry_failed
        self.progress = progress
        self.repeats = repeats
        self.trajectories = trajectories
        self.run_id = uuid.uuid4().hex[:12]
        self.counts = RunCounts()

    async def run(self, sources: list[CellSource], limit: int | None = None) -> RunCounts:
        for source in sources:
            for name in self.methods:
                await self._cell(source, name, limit)
        return self.counts

    async def _cell(self, source: CellSource, method: str, limit: int | None) -> None:
        slots = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task] = set()
        total = None if limit is None else limit * self.repeats
        bar = tqdm(desc=f"{source.dataset} {source.length} {method}", unit="sample", total=total,
                   disable=not self.progress, file=sys.stderr, dynamic_ncols=True)  # fmt: skip
        try:
            items = source.items()
            while True:
                # Read before a slot is free: one sample (and its document) ahead of the slots,
                # so at most `concurrency + 1` documents are held; the repeats share a document.
                try:
                    item = await asyncio.to_thread(next, items, None)
                except Exception as err:  # an unreadable file or a missing length fails the cell only
                    self._fail_cell(source, method, str(err) if isinstance(err, DataError) else f"{type(err).__name__}: {err}")
                    break
                if item is None:
                    self._cell_read(source, method)
                    break
                self.counts.read += 1
                sample_id = item.sample_id if isinstance(item, LoadFailure) else item.id
                keys = [Key(source.dataset, source.length, method, sample_id, r) for r in range(self.repeats)]
                pending = [key for key in keys if self.store.should_run(key, self.retry_failed)]
                self.counts.skipped += len(keys) - len(pending)
                bar.update(len(keys) - len(pending))
                if not pending or isinstance(item, LoadFailure):
                    for key in pending:
                        self._write(key, _failed(item.reason, transient=False))
                        bar.update()
                    continue
                prefetch = asyncio.create_task(_prepare(self.methods[method], item))
                tasks.add(prefetch)
                prefetch.add_done_callback(tasks.discard)
                for key in pending:
                    await slots.acquire()
                    task = asyncio.create_task(self._sample(key, item, slots, bar))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            bar.close()

    async def _sample(self, key: Key, sample: QASample, slots: asyncio.Semaphore, bar: tqdm) -> None:
        started_at, started = time.time(), time.perf_counter()
        try:
            outcome = await self.methods[key.method].run(self.policy, sample)
        except Exception as err:  # any failure of one sample is recorded; the others go on
            # A policy error's kind is kept so that reports group by it (its message varies).
            kind = err.kind if isinstance(err, PolicyError) else None
            fields = _failed(f"{type(err).__name__}: {err}", kind in TRANSIENT_KINDS, kind)
        else:
            fields = self.record_fields(outcome, sample)
            if self.trajectories is not None and outcome.trajectory is not None:
                # Before the result record, so a finished sample always has its trajectory.
                await asyncio.to_thread(self.trajectories.write, key, self.run_id, sample, outcome.trajectory, outcome.document)
        finally:
            slots.release()
        fields.update(started_at=started_at, finished_at=time.time(), latency_s=time.perf_counter() - started)
        self._write(key, fields)
        bar.update()

    def record_fields(self, outcome: Any, sample: QASample) -> dict[str, Any]:
        """The fields of a finished sample's record (distillation records other fields)."""
        return _scored(outcome, sample)

    def _fail_cell(self, source: CellSource, method: str, reason: str) -> None:
        # Transient: the file may be there next time; a resume should look again.
        self._cell_record(source, method, _failed(reason, transient=True))
        self.counts.unread += 1
        print(f"[eval] {source.dataset} {source.length} {method}: {reason}", file=sys.stderr)

    def _cell_read(self, source: CellSource, method: str) -> None:
        """After a cell's file was read to its end: supersede an earlier run's "could not read"."""
        earlier = self.store.records.get(Key(source.dataset, source.length, method, CELL))
        if earlier is not None and earlier["status"] != "ok":
            self._cell_record(source, method, {"status": "ok"})

    def _cell_record(self, source: CellSource, method: str, fields: dict[str, Any]) -> None:
        """The cell's own record (not a sample's: the counts of samples leave it out)."""
        self.store.append({"dataset": source.dataset, "length": source.length, "method": method, "sample_id": CELL,
                           "repeat": 0, "run_id": self.run_id, **fields})  # fmt: skip

    def _write(self, key: Key, fields: dict[str, Any]) -> None:
        record = {"dataset": key.dataset, "length": key.length, "method": key.method, "sample_id": key.sample_id,
                  "repeat": key.repeat, "run_id": self.run_id, **fields}  # fmt: skip
        self.store.append(record)
        self.counts.ran += 1
        if record["status"] != "ok":
            self.counts.failed += 1


async def _prepare(method: Any, sample: QASample) -> None:
    """Prepare ``sample``'s document in the method's cache ahead of its run, if the method has a
    ``prepare``. An error is left to the run: the cache keeps no failed build, so the run builds
    again, meets the same error and records it as the sample's."""
    prepare = getattr(method, "prepare", None)
    if prepare is not None:
        try:
            await prepare(sample)
        except Exception:  # noqa: BLE001 (recorded by the sample's own run)
            pass


def _failed(reason: str, transient: bool, kind: ErrorKind | None = None) -> dict[str, Any]:
    return {"status": "failed", "reason": reason, "transient": transient, "error_kind": kind}


def _scored(outcome: MethodOutcome, sample: QASample) -> dict[str, Any]:
    """The ``ok`` record fields: measurements and scores under both protocols."""
    ours = score_answer(outcome.prediction, sample.answers)
    first = score_answer(outcome.prediction, sample.answers[:1])
    return {
        "status": "ok",
        "prediction": outcome.prediction,
        "answers": list(sample.answers),
        "acc": ours["sub_em_strict"],
        "acc_ref": first["sub_em"],
        "em": ours["em"],
        "f1": ours["f1"],
        "sub_em": ours["sub_em"],
        "llm_calls": outcome.llm_calls,
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "doc_tokens": outcome.doc_tokens,
        "num_docs": document_count(sample) or None,
        "chunks_read": outcome.chunks_read,
        "num_chunks": outcome.num_chunks,
        "stop_step": outcome.stop_step,
        "retrieval_queries": outcome.retrieval_queries,
        "invalid_turns": outcome.invalid_turns,
        "answer_text": outcome.answer_text[:_ANSWER_CHARS],
    }
