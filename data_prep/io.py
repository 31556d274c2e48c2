"""Streaming readers and atomic, streaming writers for data preparation.

The official HotpotQA training file is one 540 MB JSON array on a single line, and a 1M-token
evaluation file holds half a gigabyte of context text, so nothing here loads a whole file of
records or holds a whole output in memory:

* :func:`iter_json_records` yields the records of a JSON array or of JSON lines one at a time,
  with the line each record starts on, so an error can name it;
* :class:`JsonArrayWriter` and :class:`ParquetRowWriter` write records as they come;
* :func:`atomic_outputs` writes every file of one job under a temporary name and renames them
  into place only when the whole job succeeded, so a failure never leaves a partial file behind
  and never touches an output an earlier job finished;
* a job's manifest (written last) records its parameters, so a re-run can tell a finished
  output from one built with other settings (:func:`finished`).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

# Characters read per refill of the streaming JSON reader.
_READ_CHARS = 1 << 20
_WHITESPACE = " \t\r\n"


class DataError(ValueError):
    """Bad input data; the message names the file, the line or record, and the field."""


@dataclass(frozen=True)
class JsonRecord:
    """One top-level record of a JSON array or JSON-lines file.

    ``number`` is its 0-based position among the records, ``line`` the 1-based line it starts on.
    """

    number: int
    line: int
    value: Any


def iter_json_records(path: str | os.PathLike) -> Iterator[JsonRecord]:
    """The records of ``path``: a JSON array (``[...]``) or JSON lines (one value per line).

    The format is told by the first non-blank character. Malformed or truncated input, text that
    is not UTF-8 (a leading byte-order mark is accepted) and an object with a repeated key (JSON
    would keep only the last) raise :class:`DataError` naming the file and line. ``NaN`` and
    ``Infinity`` parse as Python's json parses them: as floats, which the record checks then judge.
    """
    path = Path(path)
    with _text(path) as handle:
        first = _first_char(handle)
        handle.seek(0)
        if first == "[":
            yield from _ArrayReader(handle, path).records()
        else:
            yield from _json_lines(handle, path)


@contextlib.contextmanager
def _text(path: Path) -> Iterator[Any]:
    """``path`` opened as UTF-8 text; a decoding error anywhere in it is a DataError naming it."""
    try:
        with path.open(encoding="utf-8-sig") as handle:
            yield handle
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason}, byte 0x{err.object[err.start]:02x}); save it as UTF-8") from None


class _RepeatedKey(ValueError):
    """An object with one key twice (raised inside the JSON parser, reported with the line)."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a repeated key (``json`` would silently keep the last value)."""
    value = dict(pairs)
    if len(value) < len(pairs):
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _RepeatedKey(f"key {repeated!r} appears twice in one object (only one value can be meant)")
    return value


def load_json(path: str | os.PathLike) -> Any:
    """A whole JSON document (for small files such as SQuAD's); errors name the line."""
    path = Path(path)
    try:
        with _text(path) as handle:
            return json.load(handle, object_pairs_hook=_object)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: malformed or truncated JSON: {err.msg} (column {err.colno})") from None
    except _RepeatedKey as err:
        raise DataError(f"{path}: {err}") from None


def _first_char(handle) -> str:
    while True:
        chunk = handle.read(4096)
        if not chunk:
            return ""
        stripped = chunk.lstrip(_WHITESPACE)
        if stripped:
            return stripped[0]


def _json_lines(handle, path: Path) -> Iterator[JsonRecord]:
    number = 0
    for line_number, line in enumerate(handle, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line, object_pairs_hook=_object)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path}:{line_number}: malformed or truncated JSON line: {err.msg} (column {err.colno})"
            ) from None
        except _RepeatedKey as err:
            raise DataError(f"{path}:{line_number}: record #{number}: {err}") from None
        yield JsonRecord(number, line_number, value)
        number += 1


class _ArrayReader:
    """Incremental parser of a top-level JSON array: one element decoded at a time.

    Holds a text buffer that is refilled on demand and trimmed after each element, so memory
    stays at about one element plus one read, whatever the file size.
    """

    def __init__(self, handle, path: Path) -> None:
        self.handle = handle
        self.path = path
        self.decoder = json.JSONDecoder(object_pairs_hook=_object)
        self.buffer = ""
        self.pos = 0
        # Line numbers are counted incrementally: ``line`` is the line of ``buffer[counted]``.
        self.counted = 0
        self.line = 1
        self.eof = False

    def records(self) -> Iterator[JsonRecord]:
        self._expect("[")
        if self._peek() == "]":
            self.pos += 1
            self._expect_end()
            return
        number = 0
        while True:
            self._peek()  # skip to the record's first character: its line is the record's line
            line = self._line_at(self.pos)
            yield JsonRecord(number, line, self._value(number))
            number += 1
            separator = self._peek()
            if separator == "]":
                self.pos += 1
                self._expect_end()
                return
            if separator != ",":
                self._fail(f"expected ',' or ']' after record #{number - 1}, got {self._shown(separator)}")
            self.pos += 1

    def _value(self, number: int) -> Any:
        """Decode the element at ``pos``, reading more whenever the buffer ends inside it.

        Each retry decodes the element from its start, so the read size doubles per retry:
        a 15 MB element (a 3M-token context) costs a few retries, not fifteen.
        """
        more = _READ_CHARS
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.pos)
            except json.JSONDecodeError as err:
                if self.eof:
                    self._fail(f"record #{number}: malformed or truncated JSON: {err.msg}", err.pos)
                self._fill(more)
                more *= 2
                continue
            except _RepeatedKey as err:
                self._fail(f"record #{number}: {err}")
            # A number or literal cut by the end of the buffer decodes as a shorter one; an
            # element must be followed by a delimiter we have read to be complete.
            if end >= len(self.buffer) and not self.eof:
                self._fill(more)
                continue
            self.pos = end
            self._trim()
            return value

    def _peek(self) -> str:
        """The next non-whitespace character (``""`` at the end of the file)."""
        while True:
            while self.pos < len(self.buffer) and self.buffer[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.buffer) or self.eof:
                return self.buffer[self.pos] if self.pos < len(self.buffer) else ""
            self._fill()

    def _expect(self, char: str) -> None:
        got = self._peek()
        if got != char:
            self._fail(f"expected {char!r}, got {self._shown(got)}")
        self.pos += 1

    def _expect_end(self) -> None:
        got = self._peek()
        if got:
            self._fail(f"unexpected data after the closing ']': {self._shown(got)}")

    def _fill(self, chars: int | None = None) -> None:
        chunk = self.handle.read(_READ_CHARS if chars is None else chars)
        if chunk:
            self.buffer += chunk
        else:
            self.eof = True

    def _trim(self) -> None:
        """Drop consumed text once it is large, keeping the line count of the new buffer start."""
        if self.pos >= _READ_CHARS:
            self._line_at(self.pos)
            self.buffer = self.buffer[self.pos :]
            self.counted -= self.pos
            self.pos = 0

    def _line_at(self, pos: int) -> int:
        """Line of ``buffer[pos]``; positions only move forward, so each newline is counted once."""
        if pos >= self.counted:
            self.line += self.buffer.count("\n", self.counted, pos)
            self.counted = pos
            return self.line
        return self.line - self.buffer.count("\n", pos, self.counted)

    @staticmethod
    def _shown(char: str) -> str:
        return repr(char) if char else "end of file (truncated?)"

    def _fail(self, message: str, pos: int | None = None) -> None:
        line = self._line_at(min(self.pos if pos is None else pos, len(self.buffer)))
        raise DataError(f"{self.path}:{line}: {message}")


# ------------------------------------------------------------------------------------ writers


class JsonArrayWriter:
    """Writes a JSON array one record at a time, one record per line.

    The result is an ordinary JSON array (``json.load`` and ``datasets``' JSON loader read it);
    a record per line keeps line numbers meaningful in error messages.
    """

    def __init__(self, handle) -> None:
        self.handle = handle
        self.count = 0
        handle.write("[\n")

    def write(self, record: Mapping[str, Any]) -> None:
        if self.count:
            self.handle.write(",\n")
        self.handle.write(json.dumps(record, ensure_ascii=False))
        self.count += 1

    def close(self) -> None:
        self.handle.write("\n]\n")


class ParquetRowWriter:
    """Writes rows (dicts) to a parquet file in row groups of ``row_group_size`` rows.

    Only one row group is buffered, so a file of 1M-token rows is written with a few rows in
    memory; small row groups also let readers fetch a few rows without decoding the rest.
    """

    def __init__(self, path: str | os.PathLike, schema: pa.Schema, row_group_size: int) -> None:
        if row_group_size < 1:
            raise ValueError(f"row_group_size: expected an integer >= 1, got {row_group_size}")
        self.path = Path(path)
        self.schema = schema
        self.row_group_size = row_group_size
        self.rows: list[dict[str, Any]] = []
        self._writer = pq.ParquetWriter(os.fspath(path), schema)

    def write(self, row: Mapping[str, Any]) -> None:
        self.rows.append(dict(row))
        if len(self.rows) >= self.row_group_size:
            self._flush()

    def close(self) -> None:
        self._flush()
        self._writer.close()

    def _flush(self) -> None:
        if self.rows:
            self._writer.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows = []


# ---------------------------------------------------------------------------- atomic outputs


@contextlib.contextmanager
def atomic_outputs(paths: Sequence[str | os.PathLike]) -> Iterator[dict[Path, Path]]:
    """Temporary paths for ``paths``, renamed into place (in the given order) on success.

    On any exception the temporary files are deleted and the final paths are left as they were,
    so an output from an earlier run stays intact. Temporary files sit next to their targets
    (same file system, so the rename is atomic) and carry the process id.
    """
    finals = [Path(p) for p in paths]
    temps = {final: final.with_name(f".{final.name}.tmp{os.getpid()}") for final in finals}
    for final in finals:
        final.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield temps
    except BaseException:
        for temp in temps.values():
            temp.unlink(missing_ok=True)
        raise
    for final in finals:
        os.replace(temps[final], final)


def manifest_path(output: str | os.PathLike) -> Path:
    """Where the manifest of ``output`` lives: ``<output>.manifest.json``."""
    output = Path(output)
    return output.with_name(output.name + ".manifest.json")


def write_manifest(path: str | os.PathLike, params: Mapping[str, Any], results: Mapping[str, Any]) -> None:
    """Write a manifest: the parameters that define the output and what the build produced."""
    text = json.dumps({"params": params, "results": results}, indent=2, sort_keys=True, ensure_ascii=False)
    Path(path).write_text(text + "\n", encoding="utf-8")


def read_manifest(path: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest at ``path``, or None when it is missing or unreadable (an unfinished output)."""
    try:
        manifest = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def finished(outputs: Sequence[str | os.PathLike], manifest: str | os.PathLike, params: Mapping[str, Any]) -> bool:
    """Whether a previous run finished these outputs with these parameters.

    Raises :class:`DataError` when they were finished with *other* parameters, rather than
    silently keeping (or replacing) data the caller did not ask for.
    """
    found = read_manifest(manifest)
    if found is None or not all(Path(p).is_file() for p in outputs):
        return False
    # Compare through JSON so tuples and lists, int keys and str keys, compare as written.
    wanted = json.loads(json.dumps(params, sort_keys=True))
    old = found.get("params") if isinstance(found.get("params"), dict) else {}
    if old == wanted:
        return True
    differing = sorted(k for k in set(wanted) | set(old) if old.get(k) != wanted.get(k))
    raise DataError(
        f"{Path(outputs[0])}: already built with other parameters (differing: {', '.join(differing)}); "
        f"pass --overwrite to rebuild it or choose another --out"
    )
