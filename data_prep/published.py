"""The evaluation JSON format of the MemAgent / InfMem releases, read and written.

A file is a JSON array of records::

    {"context": str | [int, ...], "input": str, "answers": [str, ...], "num_docs": int, "index": int}

``context`` is the rendered document text, or, in the variant the reference uses for its largest
sets (over 10k documents or 2M tokens), the list of the documents' indices into the split's
sorted paragraph pool (:attr:`data_prep.sources.SourceSet.pool`), rendered at load time.
``index`` is the question's position in the split. RULER-style files name the answers
``outputs`` and may lack ``num_docs``; both are accepted.

Files we write add ``id``, ``source`` and ``meta`` (token count, gold positions and token
offsets, seed, target, the documents' pool indices); their loaders ignore extra keys, ours
restores a :class:`~infmem_verl.data.sample.QASample` exactly.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from infmem_verl.data.identity import IdLedger
from infmem_verl.data.sample import QASample

from .compose import render_context
from .io import DataError, JsonArrayWriter, iter_json_records

# Sample meta keys written as top-level fields of a record rather than inside ``meta``.
_TOP_LEVEL_META = ("index", "num_docs")
_HEADER = re.compile(r"(?m)^Document \d+:\n")


def document_count(sample: QASample) -> int:
    """The documents in ``sample``'s context: its recorded ``num_docs``, else its pool indices,
    else (e.g. a RULER-style file read back) the "Document i:" headers counted; 0 for a context
    without documents (the synthetic set)."""
    num_docs = sample.meta.get("num_docs")
    if num_docs is not None:
        return num_docs
    docs = sample.meta.get("docs")
    return len(docs) if isinstance(docs, list) else len(_HEADER.findall(sample.context))


def published_record(sample: QASample, indices: bool = False) -> dict[str, Any]:
    """The published record of ``sample``; with ``indices`` its context is its documents' pool
    indices (``sample.meta["docs"]``) instead of text."""
    meta = dict(sample.meta)
    if "index" not in meta:
        raise ValueError(f"sample {sample.id!r}: meta 'index' (the question's position in its split) is required")
    context: str | list[int] = sample.context
    if indices:
        docs = meta.pop("docs", None)
        if not isinstance(docs, list) or not docs:
            raise ValueError(f"sample {sample.id!r}: meta 'docs' (pool indices) is required for an index context")
        context = docs
    return {
        "context": context,
        "input": sample.question,
        "answers": list(sample.answers),
        "num_docs": document_count(sample),
        "index": meta["index"],
        "id": sample.id,
        "source": sample.source,
        "meta": {k: v for k, v in meta.items() if k not in _TOP_LEVEL_META},
    }


class PublishedWriter:
    """Streams samples into a published JSON file through an open text handle."""

    def __init__(self, handle, indices: bool = False) -> None:
        self._writer = JsonArrayWriter(handle)
        self.indices = indices
        self._ids = IdLedger()

    def write(self, sample: QASample) -> None:
        """Write ``sample``; one whose id an earlier sample has is refused (readers key by id)."""
        self._ids.claim(sample.id, f"record #{len(self._ids)}")
        self._writer.write(published_record(sample, self.indices))

    def close(self) -> None:
        self._writer.close()


def read_published(
    path: str | os.PathLike, pool: Sequence[str] | None = None, source: str = ""
) -> Iterator[QASample]:
    """The samples of a published file, ours or the reference's, one at a time.

    ``pool`` (the split's sorted paragraph pool) is needed only for index contexts. ``source``
    names samples whose record does not. Ids default to ``<file stem>-<index>``.
    """
    path = Path(path)
    for rec in iter_json_records(path):
        where = f"{path}:{rec.line}: record #{rec.number}"
        yield published_sample(rec.value, where, path.stem, pool, source)


def published_sample(record: Any, where: str, stem: str, pool: Sequence[str] | None, source: str) -> QASample:
    """One record of a published file as a sample; a malformed record raises DataError naming
    ``where`` and the field. Readers that must go on past a bad record (the evaluation records a
    load failure per record) call this per record; ``read_published`` stops at the first."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    index = record.get("index")
    if isinstance(index, bool) or not isinstance(index, int):
        raise DataError(f"{where}: field 'index': expected an integer, got {index!r}")
    where = f"{where} index={index}"
    key = "answers" if "answers" in record else "outputs"
    extra = record.get("meta")
    if extra is not None and not isinstance(extra, Mapping):
        raise DataError(f"{where}: field 'meta': expected a JSON object, got {type(extra).__name__}")
    meta = dict(extra or {})
    meta["index"] = index
    if record.get("num_docs") is not None:
        meta["num_docs"] = record["num_docs"]
    context = record.get("context")
    if isinstance(context, list):
        meta["docs"] = context
        context = _expand(context, pool, where)
    fields = {
        "id": record.get("id", f"{stem}-{index}"),
        "question": record.get("input"),
        "answers": record.get(key),
        "context": context,
        "source": record.get("source") or source,
        "meta": meta,
    }
    try:
        return QASample.from_record(fields, where=where)
    except ValueError as err:
        # QASample names its own fields; translate them to the published names.
        message = str(err).replace("'question'", "'input'").replace("'answers", f"'{key}")
        raise DataError(message) from None


def _expand(indices: list[Any], pool: Sequence[str] | None, where: str) -> str:
    """Render an index context with ``pool``, as the reference's loader does."""
    if pool is None:
        raise DataError(
            f"{where}: field 'context' holds document indices; pass the split's paragraph pool "
            f"(data_prep.sources.load_pool(source, official file)) to expand it"
        )
    for i, doc in enumerate(indices):
        if isinstance(doc, bool) or not isinstance(doc, int) or not 0 <= doc < len(pool):
            raise DataError(f"{where}: field 'context[{i}]': expected a pool index in [0, {len(pool)}), got {doc!r}")
    if not indices:
        raise DataError(f"{where}: field 'context': expected at least one document index")
    return render_context(pool, indices)
