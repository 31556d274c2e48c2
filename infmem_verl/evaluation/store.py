"""Resumable per-sample results: one JSON line per (dataset, length, method, sample, repeat).

``results.jsonl`` only grows. Each record is written with a single ``write`` on a file opened
with ``O_APPEND`` and then fsynced, so a run killed at any moment leaves whole records plus at
most one cut last line, which the next open drops. The latest record of a key wins, so a retried
sample supersedes its failure. ``manifest.json`` holds the protocol the results were made with
(preset, agent settings, model): resuming with a different protocol is refused, because mixing
would make the scores meaningless.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, get_args

from data_prep.io import DataError, load_json
from infmem_verl.agent.errors import ConfigError

RESULTS = "results.jsonl"
# Sample id of a cell's own record: its file could not be read (failed), or was read whole again.
CELL = "__cell__"
MANIFEST = "manifest.json"
RECORD_VERSION = 1
# Which failed samples a resumed run runs again (see ResultStore.should_run).
RetryPolicy = Literal["transient", "all", "none"]
RETRY_POLICIES: tuple[RetryPolicy, ...] = get_args(RetryPolicy)


def check_retry_policy(value: object) -> None:
    """ConfigError unless ``value`` is one of :data:`RETRY_POLICIES` (a run's ``retry_failed``)."""
    if value not in RETRY_POLICIES:
        expected = f"{', '.join(RETRY_POLICIES[:-1])} or {RETRY_POLICIES[-1]}"
        raise ConfigError(f"retry_failed: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class Key:
    dataset: str
    length: str
    method: str
    sample_id: str
    repeat: int = 0  # which of the ``--repeats`` samples of this question (0-based)

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> Key:
        # Records written before repeats existed are repeat 0.
        return cls(record["dataset"], record["length"], record["method"], record["sample_id"], record.get("repeat", 0))


class ResultStore:
    """The records of one output folder (see the module docstring)."""

    def __init__(self, out_dir: str | os.PathLike, protocol: Mapping[str, Any]):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / RESULTS
        self._check_manifest(json.loads(json.dumps(protocol)))
        self.dropped_tail = drop_cut_tail(self.path)
        self.records: dict[Key, dict[str, Any]] = {}
        for record in _read_records(self.path):
            self.records[Key.of(record)] = record

    def _check_manifest(self, protocol: dict[str, Any]) -> None:
        manifest = self.out_dir / MANIFEST
        if manifest.is_file():
            saved = load_json(manifest)
            difference = _first_difference(saved, protocol)
            if difference is not None:
                raise ConfigError(
                    f"out: {self.out_dir} holds results of another protocol ({difference}); "
                    f"use another output folder to evaluate this one"
                )
            return
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps(protocol, indent=2, sort_keys=True), encoding="utf-8")
        os.replace(tmp, manifest)

    def should_run(self, key: Key, retry_failed: RetryPolicy) -> bool:
        """Whether ``key`` still needs a run: never done, or failed and retried by the policy
        (``transient``: failures the server caused, such as an unreachable endpoint)."""
        record = self.records.get(key)
        if record is None:
            return True
        if record["status"] == "ok" or retry_failed == "none":
            return False
        return retry_failed == "all" or bool(record.get("transient"))

    def append(self, record: Mapping[str, Any]) -> None:
        """Write ``record`` durably as one line (one write call on an O_APPEND file)."""
        append_line(self.path, json.dumps({"v": RECORD_VERSION, **record}, ensure_ascii=False))
        self.records[Key.of(record)] = dict(record)

    def latest(self) -> list[dict[str, Any]]:
        """The latest record of every key, in the order keys were first written."""
        return list(self.records.values())


def append_line(path: Path, text: str) -> None:
    """Append ``text`` and a newline durably: one write call on an O_APPEND file, then fsync.

    A kill can only leave a cut last line, which :func:`drop_cut_tail` removes on reopen.
    """
    line = (text + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(f"{path}: short write ({written} of {len(line)} bytes)")
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cut_tail(path: Path) -> bool:
    """Cut a last line that a kill left without its newline; True when one was dropped."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with path.open("rb+") as handle:
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) == b"\n":
            return False
        end = path.stat().st_size
        # Walk back a MiB at a time to the last newline.
        while end > 0:
            start = max(0, end - (1 << 20))
            handle.seek(start)
            chunk = handle.read(end - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                handle.truncate(start + cut + 1)
                return True
            end = start
        handle.truncate(0)
        return True


def _read_records(path: Path) -> Iterable[dict[str, Any]]:
    if not path.is_file():
        return
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                Key.of(record)
            except (ValueError, KeyError, TypeError) as err:
                raise DataError(f"{path}:{number}: not a result record ({err}); the file was edited by hand?") from None
            yield record


def _first_difference(saved: Any, current: Any, path: str = "") -> str | None:
    """The first field where two JSON values differ, as ``field: saved vs current``."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            found = _first_difference(saved.get(key), current.get(key), f"{path}.{key}" if path else key)
            if found is not None:
                return found
        return None
    if saved != current:
        return f"{path or 'protocol'}: {saved!r} before, {current!r} now"
    return None
