"""Where evaluation samples come from: the synthetic set, published files, a data folder.

A :class:`CellSource` is one dataset at one length. It yields samples one at a time (a 1M-token
file is never loaded whole), and a record that cannot become a sample (a missing field, a bad
index, an id an earlier record has) is yielded as a :class:`LoadFailure` with the reason, so the
run records it and goes on.
A file that cannot be read at all raises :class:`~data_prep.io.DataError`.

Lengths are labels such as ``64k`` or ``1m`` (binary units, as the reference's 65536 ... 1048576
lengths). In a data folder each (dataset, length) is looked up under the reference's file names
(``data_prep.build`` writes the same): ``eval_qa_{k}_{tokens}.json`` for SQuAD (qa_1), HotpotQA
(qa_2), MuSiQue (qa_3) and 2Wiki (qa_4), and for HotpotQA also the RULER-HQA ``eval_{docs}.json``
whose document count the InfMem figure labels 32k ... 1m (200 ... 6400 documents) and the MemAgent
table 7k ... 3584k (50 ... 25600 documents).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from data_prep.compose import parse_size
from data_prep.io import DataError, iter_json_records
from data_prep.published import published_sample
from infmem_verl.data.identity import IdLedger
from infmem_verl.data.sample import QASample
from infmem_verl.data.synthetic import make_sample

# The reference's task numbers of its RULER-style files (as data_prep.build names them).
TASKS = {"squad": "qa_1", "hotpotqa": "qa_2", "musique": "qa_3", "2wiki": "qa_4"}
# RULER-HQA document counts by the length labels the two papers give them.
HOTPOTQA_DOCS = {
    "7k": 50, "14k": 100, "28k": 200, "56k": 400, "112k": 800, "224k": 1600, "448k": 3200, "896k": 6400,
    "1792k": 12800, "3584k": 25600,  # index contexts: pass --pool hotpotqa=<HotpotQA dev file>
    "32k": 200, "64k": 400, "128k": 800, "256k": 1600, "512k": 3200, "1m": 6400,
}  # fmt: skip
SYNTHETIC = "synthetic"


@dataclass(frozen=True)
class LoadFailure:
    """A record of an evaluation file that could not become a sample."""

    sample_id: str
    reason: str


Item = QASample | LoadFailure


@dataclass(frozen=True)
class CellSource:
    """The samples of one dataset at one length; ``items()`` streams them."""

    dataset: str
    length: str
    items: Callable[[], Iterator[Item]]
    path: Path | None = None  # the file read (None: generated, or not found)


def length_tokens(label: str) -> int:
    """Tokens of a length label (``"64k"`` -> 65536)."""
    return parse_size(label, "lengths")


def normalize_length(label: str) -> str:
    """The canonical form of a length label (lower case, checked)."""
    label = str(label).strip().lower()
    length_tokens(label)
    return label


def synthetic_sources(lengths: Sequence[str], samples: int, tokenizer, seed: int) -> list[CellSource]:
    """The synthetic two-hop set at each length, ``samples`` samples each, built lazily."""

    def items(tokens: int) -> Iterator[Item]:
        for index in range(samples):
            yield make_sample(index, tokens, tokenizer, seed)

    return [
        CellSource(SYNTHETIC, label, functools.partial(items, length_tokens(label)))
        for label in map(normalize_length, lengths)
    ]


def file_source(dataset: str, length: str, path: Path, pool: Callable[[], Sequence[str] | None], limit: int | None) -> CellSource:
    """The samples of a published evaluation file (text or index contexts)."""
    return CellSource(dataset, normalize_length(length), functools.partial(_file_items, dataset, path, pool, limit), path)


def _file_items(dataset: str, path: Path, pool: Callable[[], Sequence[str] | None], limit: int | None) -> Iterator[Item]:
    if not path.is_file():
        raise DataError(f"{path}: evaluation file of {dataset} not found")
    records = iter_json_records(path)
    ids = IdLedger()
    for record in itertools.islice(records, limit):
        where = f"{path}:{record.line}: record #{record.number}"
        value = record.value
        try:
            contexts_are_indices = isinstance(value, dict) and isinstance(value.get("context"), list)
            item: Item = published_sample(value, where, path.stem, pool() if contexts_are_indices else None, dataset)
        except (DataError, ValueError) as err:
            item = LoadFailure(_record_id(value, path.stem, record.number), str(err))
        # Without an 'id' the id derives from 'index' (the reference's files): name that field.
        named = "id" if isinstance(value, dict) and "id" in value else "index"
        yield distinct(ids, item, where, f"{path.stem}#record{record.number}", named)
    if not len(ids):
        raise DataError(f"{path}: no records (an empty file or array); expected the evaluation records of {dataset}")


def distinct(ids: IdLedger, item: Item, where: str, position: str, field: str = "id") -> Item:
    """``item``, or, when its id repeats one an earlier item of the same input had, a failure
    naming both places, under ``position`` (an id of its own, so the results store keeps both).

    Every record read thus ends in exactly one result: a report's n + failed add up to the
    records read.
    """
    sample_id = item.sample_id if isinstance(item, LoadFailure) else item.id
    refusal = ids.repeat(sample_id, where, field)
    if refusal is None:
        return item
    while position in ids:  # a record really has this id: the failure needs one of its own
        position += "+"
    ids.repeat(position, where)
    return LoadFailure(position, f"{item.reason}; {refusal}" if isinstance(item, LoadFailure) else refusal)


def _record_id(value: object, stem: str, number: int) -> str:
    """The id a broken record would have had, or its position when it has none."""
    if isinstance(value, dict):
        if isinstance(value.get("id"), (str, int)) and not isinstance(value.get("id"), bool):
            return str(value["id"])
        if isinstance(value.get("index"), int) and not isinstance(value.get("index"), bool):
            return f"{stem}-{value['index']}"
    return f"{stem}#record{number}"


def candidates(data_dir: Path, dataset: str, length: str) -> list[Path]:
    """The files that may hold ``dataset`` at ``length`` in ``data_dir``, in order of preference."""
    if dataset not in TASKS:
        raise DataError(f"datasets: unknown dataset {dataset!r} for a data folder; expected one of {sorted(TASKS)}")
    paths = [data_dir / f"eval_{TASKS[dataset]}_{length_tokens(length)}.json"]
    if dataset == "hotpotqa" and length in HOTPOTQA_DOCS:
        paths.append(data_dir / f"eval_{HOTPOTQA_DOCS[length]}.json")
    return paths


def find_file(data_dir: Path, dataset: str, length: str) -> Path:
    """The evaluation file of ``dataset`` at ``length``; a clear error when none exists."""
    found = [p for p in candidates(data_dir, dataset, normalize_length(length)) if p.is_file()]
    if not found:
        looked = ", ".join(p.name for p in candidates(data_dir, dataset, normalize_length(length)))
        raise DataError(f"length {length} of {dataset} is not present in {data_dir} (looked for {looked})")
    return found[0]


def missing_source(dataset: str, length: str, reason: str) -> CellSource:
    """A cell whose data could not be found: reading it raises ``reason`` (recorded, not fatal)."""

    def items() -> Iterator[Item]:
        raise DataError(reason)
        yield  # makes this a generator: the error comes with the first item, as for a bad file

    return CellSource(dataset, normalize_length(length), items)
