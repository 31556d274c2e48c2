"""What an agent did on each sample, for the trajectory viewer (``python -m infmem_verl.eval --record-turns``).

Two kinds of files join ``results.jsonl`` in the output folder:

* ``trajectories.jsonl`` - one line per (dataset, length, method, sample) an agent ran: the
  question, golds, prediction and every turn (PreThink action with query, top_k, validity and
  parse error; retrieved unit numbers; the memory after each Write; the answer text; flags and
  token counts), the texts of the retrieved and gold retrieval units (once per sample, however
  often they were retrieved), the gold token ranges and the document's content hash.
  Appended like the results (one write per line on an ``O_APPEND`` file, fsynced), written
  before the sample's result record; the latest line of a key wins, as in the results.
* ``documents/<hash>.json`` - the reading chunks' texts and token edges of one document, written
  once (atomically) and shared by every method and sample that read it, so no text is stored
  once per call, nor once per method.

Cost: a document's text (about 4 bytes per token: ~4 MB for a 1M-token document) once per
distinct document, plus per sample and agent method the memories written (up to
``memory_tokens`` per chunk read) and the retrieved units. Off by default for that reason.

Gold evidence is located from what the data records: the synthetic set's facts (token position
and length), or the token start of each gold document that ``data_prep.build`` records
(``gold_token_starts``; the document runs to the next paragraph start). Data without either has
no gold highlighted.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from infmem_verl.agent.document import Document
from infmem_verl.agent.trajectory import Trajectory, Turn
from infmem_verl.data.sample import QASample

from .store import Key, append_line, drop_cut_tail

TRAJECTORIES = "trajectories.jsonl"
DOCUMENTS = "documents"


def gold_ranges(sample: QASample, document: Document) -> list[tuple[int, int]]:
    """Token ``[start, end)`` ranges of the sample's gold evidence, from its ``meta``; [] when unknown."""
    meta = sample.meta
    facts = meta.get("facts")
    if isinstance(facts, list) and all(isinstance(f, Mapping) and "token_position" in f for f in facts):
        return [(int(f["token_position"]), int(f["token_position"]) + max(1, int(f.get("num_tokens", 1)))) for f in facts]
    starts = meta.get("gold_token_starts")
    if isinstance(starts, list) and starts:
        paragraphs = document.paragraph_starts
        ranges = []
        for start in map(int, starts):
            end = start + 1
            if paragraphs is not None:
                later = paragraphs[paragraphs > start]
                end = int(later[0]) if later.size else document.num_tokens
            ranges.append((start, end))
        return ranges
    return []


def units_overlapping(document: Document, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """The retrieval units that share a token with any of ``ranges``, in document order."""
    bounds = document.unit_bounds
    hit = np.zeros(document.num_units, dtype=bool)
    for start, end in ranges:
        hit |= (bounds[:, 0] < end) & (bounds[:, 1] > start)
    return np.flatnonzero(hit).tolist()


def turn_record(turn: Turn) -> dict[str, Any]:
    """One turn's facts and texts. A Write keeps its memory (and its raw output only when the
    memory differs from it: cut to the cap, or the old memory kept)."""
    record: dict[str, Any] = {
        "kind": turn.kind,
        "chunk": turn.chunk_index,
        "valid": turn.valid,
        "flags": list(turn.flags),
        "reason": turn.reason,
        "finish_reason": turn.finish_reason,
        "prompt_tokens": turn.prompt_tokens,
        "response_tokens": turn.response_tokens,
        "llm_calls": turn.llm_calls,
        "memory_tokens": turn.memory_tokens,
        "latency_s": round(turn.latency_s, 4),
    }
    if turn.action is not None:
        a = turn.action
        record["action"] = {"kind": a.kind, "query": a.query, "top_k": a.top_k, "valid": a.valid, "reason": a.reason, "clamped": a.clamped}
        record["retrieved_units"] = list(turn.retrieved_units)
        record["output"] = turn.text
    elif turn.kind == "write":
        record["memory"] = turn.memory_text
        if turn.text.strip() != (turn.memory_text or "").strip():
            record["output"] = turn.text
    else:
        record["output"] = turn.text
    return record


def document_record(document: Document) -> dict[str, Any]:
    """The chunk texts and token edges of ``document`` (decoded as one batch)."""
    seqs = [document.chunk_ids(i).tolist() for i in range(document.num_chunks)]
    backend = getattr(document.tokenizer, "backend_tokenizer", None)
    decode = backend.decode_batch if backend is not None else document.tokenizer.batch_decode
    return {
        "hash": document.content_hash,
        "num_tokens": document.num_tokens,
        "chunk_edges": document.chunk_edges.tolist(),
        "chunks": decode(seqs, skip_special_tokens=False),
    }


class TrajectoryWriter:
    """Writes the trajectory records of one evaluation folder (module docstring)."""

    def __init__(self, out_dir: str | os.PathLike):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / TRAJECTORIES
        self.documents = self.out_dir / DOCUMENTS
        self.documents.mkdir(parents=True, exist_ok=True)
        drop_cut_tail(self.path)

    def write(self, key: Key, run_id: str, sample: QASample, trajectory: Trajectory, document: Document) -> None:
        """Store ``trajectory`` of ``sample`` under ``key`` and its document if not yet stored."""
        self._store_document(document)
        gold = gold_ranges(sample, document)
        gold_units = units_overlapping(document, gold)
        retrieved = sorted({u for t in trajectory.turns for u in t.retrieved_units})
        shown = sorted(set(retrieved) | set(gold_units))
        texts = document.unit_texts()
        record = {
            "dataset": key.dataset,
            "length": key.length,
            "method": key.method,
            "sample_id": key.sample_id,
            "run_id": run_id,
            "agent": trajectory.agent,
            "question": sample.question,
            "answers": list(sample.answers),
            "prediction": trajectory.prediction,
            "document": document.content_hash,
            "num_chunks": trajectory.num_chunks,
            "stop_step": trajectory.stop_step,
            "gold_ranges": [list(r) for r in gold],
            "gold_units": gold_units,
            "units": {
                str(u): {"chunk": int(document.unit_chunk[u]), "tokens": document.unit_bounds[u].tolist(), "text": texts[u]}
                for u in shown
            },
            "turns": [turn_record(t) for t in trajectory.turns],
        }
        append_line(self.path, json.dumps(record, ensure_ascii=False))

    def _store_document(self, document: Document) -> None:
        path = self.documents / f"{document.content_hash}.json"
        if path.is_file():
            return
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")  # concurrent writers never share one
        tmp.write_text(json.dumps(document_record(document), ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)
