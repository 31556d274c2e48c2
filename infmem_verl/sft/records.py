"""Distilled turns as JSON: the token ids of every LLM call of a kept teacher trajectory.

For each kept trajectory, ``turns.jsonl`` (:class:`TurnStore`) stores each turn's prompt ids
(exactly what the agent core's :class:`~infmem_verl.agent.protocol.PromptBuilder` built), response
ids (what the teacher generated, plus any closing tag the loop injected) and the response mask (0
on injected tokens). SFT samples are made from these ids directly, never by re-rendering text, so
a sample trains on the very ids the agent core built for that call.

The ids live beside the result records, not in them: the record store keeps every record in
memory, and a 32K-token trajectory's ids take ~300 KB, so 12K trajectories would hold gigabytes.
The file is append-only like the records (one ``write`` per line on an ``O_APPEND`` file, then
fsync; a cut last line is dropped when the file is opened again) and is streamed when the SFT
files are built. A trajectory's line is written before its record, so a kill in between leaves an
unreferenced line, never a record without its ids.

Token arrays are stored as base64 of zlib-compressed little-endian integers: a 32K-token
trajectory has ~60K prompt ids, which as JSON numbers would be several times larger. A turn that
cannot be read back (a field missing, a cut array, arrays of different lengths) raises
:class:`RecordError` naming the turn and the field, and the trajectory is dropped with that
reason by the SFT builder.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Container, Iterator, Mapping, Sequence

import numpy as np

from infmem_verl.agent.trajectory import TURN_KINDS, Turn
from infmem_verl.evaluation.store import append_line, drop_cut_tail

TURNS_FILE = "turns.jsonl"


class RecordError(ValueError):
    """A distillation record cannot give SFT samples; the message says which turn and field."""


def pack_ids(ids: np.ndarray, dtype: str = "<i4") -> str:
    """``ids`` as base64 text of zlib-compressed ``dtype`` integers."""
    return base64.b64encode(zlib.compress(np.asarray(ids).astype(dtype).tobytes(), 6)).decode("ascii")


def unpack_ids(text: object, where: str, dtype: str = "<i4") -> np.ndarray:
    """The array :func:`pack_ids` wrote; :class:`RecordError` naming ``where`` when it is damaged."""
    if not isinstance(text, str):
        raise RecordError(f"{where}: expected packed token ids (a base64 string), got {type(text).__name__}")
    try:
        raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    except (binascii.Error, zlib.error, UnicodeEncodeError) as err:
        raise RecordError(f"{where}: packed token ids are damaged ({err})") from None
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise RecordError(f"{where}: packed token ids are damaged ({len(raw)} bytes, not a multiple of {size})")
    return np.frombuffer(raw, dtype=dtype).astype(np.int32 if size == 4 else np.int8)


@dataclass
class TurnRecord:
    """One LLM call of a distilled trajectory, as SFT needs it.

    ``response_mask`` is 1 on tokens the teacher generated and 0 on tokens the loop injected (the
    closing ``</think>`` of a two-stage call whose thinking ran out of budget): those are never
    trained. ``short_response_ids`` is set when thinking shortening rewrote this turn's thinking;
    the SFT sample then trains on it, all of it, instead of the original response.
    """

    kind: str
    chunk_index: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    finish_reason: str
    flags: list[str] = field(default_factory=list)
    short_response_ids: np.ndarray | None = None

    @classmethod
    def from_turn(cls, turn: Turn) -> TurnRecord:
        """The record of an agent-core turn; the agent must have run with ``record_token_ids``."""
        if turn.prompt_ids is None or turn.response_ids is None or turn.response_mask is None:
            raise ValueError("record_token_ids: expected true, distillation needs every turn's token ids")
        return cls(
            kind=turn.kind,
            chunk_index=turn.chunk_index,
            prompt_ids=np.asarray(turn.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(turn.response_ids, dtype=np.int32),
            response_mask=np.asarray(turn.response_mask, dtype=np.int8),
            finish_reason=turn.finish_reason,
            flags=list(turn.flags),
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": self.kind,
            "chunk": self.chunk_index,
            "prompt": pack_ids(self.prompt_ids),
            "response": pack_ids(self.response_ids),
            "mask": pack_ids(self.response_mask, "<i1"),
            "finish": self.finish_reason,
            "flags": list(self.flags),
        }
        if self.short_response_ids is not None:
            data["short_response"] = pack_ids(self.short_response_ids)
        return data

    @classmethod
    def from_json(cls, data: object, where: str) -> TurnRecord:
        """Read back :meth:`to_json`; :class:`RecordError` naming ``where`` and the field."""
        if not isinstance(data, Mapping):
            raise RecordError(f"{where}: expected a turn object, got {type(data).__name__}")
        missing = [k for k in ("kind", "chunk", "prompt", "response", "mask", "finish") if k not in data]
        if missing:
            raise RecordError(f"{where}: turn lacks field {missing[0]!r}")
        if data["kind"] not in TURN_KINDS:
            raise RecordError(f"{where}.kind: expected one of {list(TURN_KINDS)}, got {data['kind']!r}")
        prompt = unpack_ids(data["prompt"], f"{where}.prompt")
        response = unpack_ids(data["response"], f"{where}.response")
        mask = unpack_ids(data["mask"], f"{where}.mask", "<i1")
        if not len(prompt) or not len(response):
            raise RecordError(f"{where}: a turn needs prompt and response ids, got {len(prompt)} and {len(response)}")
        if len(mask) != len(response) or not np.isin(mask, (0, 1)).all():
            raise RecordError(f"{where}.mask: expected one 0/1 value per response token ({len(response)}), got {len(mask)}")
        short = data.get("short_response")
        return cls(
            kind=data["kind"],
            chunk_index=int(data["chunk"]),
            prompt_ids=prompt,
            response_ids=response,
            response_mask=mask,
            finish_reason=str(data["finish"]),
            flags=[str(f) for f in data.get("flags", [])],
            short_response_ids=None if short is None else unpack_ids(short, f"{where}.short_response"),
        )


class TurnStore:
    """``turns.jsonl`` of a distillation folder: one line per kept trajectory (module docstring)."""

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / TURNS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_cut_tail(self.path)  # a line cut by a kill is dropped, never read (module docstring)

    def append(self, ref: str, sample_id: str, turns: Sequence[TurnRecord]) -> None:
        """Write one trajectory's turns durably, as a single line, under reference ``ref``."""
        entry = {"ref": ref, "sample_id": sample_id, "turns": [turn.to_json() for turn in turns]}
        append_line(self.path, json.dumps(entry))

    def locate(self, refs: Container[str]) -> dict[str, tuple[str, int]]:
        """``ref -> (where, byte offset)`` of the line holding each of ``refs`` (a later line of a
        ref wins); lines that are not JSON or hold other references are passed over."""
        found: dict[str, tuple[str, int]] = {}
        if not self.path.is_file():
            return found
        offset = 0
        with self.path.open("rb") as handle:
            for number, line in enumerate(handle, start=1):
                try:
                    ref = json.loads(line).get("ref")
                except (ValueError, AttributeError):
                    ref = None
                if isinstance(ref, str) and ref in refs:
                    found[ref] = (f"{self.path.name}:{number}", offset)
                offset += len(line)
        return found

    def read_at(self, where: str, offset: int) -> object:
        """The entry of the line at byte ``offset`` (from :meth:`locate`), decoded."""
        with self.path.open("rb") as handle:
            handle.seek(offset)
            line = handle.readline()
        try:
            return json.loads(line)
        except ValueError as err:
            return f"{where}: not JSON ({err})"

    def entries(self) -> Iterator[tuple[str, object]]:
        """``(where, entry)`` for every line, decoded; a line that is not JSON comes as a string."""
        if not self.path.is_file():
            return
        with self.path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                where = f"{self.path.name}:{number}"
                try:
                    yield where, json.loads(line)
                except ValueError as err:
                    yield where, f"{where}: not JSON ({err})"


def read_turns(entry: object, expected: object, agent: str, where: str) -> list[TurnRecord]:
    """The turns of one :class:`TurnStore` entry, checked to form a whole trajectory.

    A whole trajectory has ``expected`` turns (its record's count), ends with its one answer turn,
    and (InfMem) has a PreThink before every Write. Anything else is a trajectory with missing
    turns: :class:`RecordError` with the reason.
    """
    raw = entry.get("turns") if isinstance(entry, Mapping) else None
    if not isinstance(raw, list) or not raw:
        raise RecordError(f"{where}: missing turns (no turn list)")
    turns = [TurnRecord.from_json(item, f"{where} turn {i}") for i, item in enumerate(raw)]
    if expected != len(turns):
        raise RecordError(f"{where}: missing turns ({len(turns)} stored, the trajectory had {expected})")
    problem = sequence_problem([t.kind for t in turns], agent)
    if problem:
        raise RecordError(f"{where}: missing turns ({problem})")
    return turns


def sequence_problem(kinds: Sequence[str], agent: str) -> str | None:
    """Why ``kinds`` is not a whole trajectory of ``agent``, or None when it is."""
    if kinds.count("answer") != 1 or kinds[-1] != "answer":
        return "a trajectory ends with exactly one answer turn"
    if agent == "infmem":
        for i, kind in enumerate(kinds):
            if kind == "write" and (i == 0 or kinds[i - 1] != "prethink"):
                return f"turn {i} is a write without the PreThink before it"
            if kind == "prethink" and kinds[i + 1] == "prethink":
                return f"turn {i} is a PreThink without the write after it"
    elif "prethink" in kinds:
        return "a MemAgent trajectory has no PreThink turns"
    return None
