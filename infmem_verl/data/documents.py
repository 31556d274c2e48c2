"""Documents passed by reference: a parquet document store and ``"<store>#<doc id>"`` references.

verl's v1 agent-loop worker copies every dataset column of a sample into every sequence it stores
in TransferQueue, i.e. once per LLM call. A 1M-token document in a dataset column would therefore
be copied hundreds of times per trajectory. Instead the training parquet holds a short reference
(column ``infmem.documents.ref_key``, default ``document_ref``) and the agent loop resolves it here.

A store is a parquet file with columns ``doc_id`` and ``text``, written in small row groups so a
lookup reads only the few documents of one group; each process keeps the recently used documents
in a bounded cache. Build one with :func:`write_store` (or :func:`pack_documents`, which also
returns the references to put in the training parquet).
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROW_GROUP_SIZE = 8  # documents per row group: one lookup reads at most this many


def document_id(text: str) -> str:
    """Content id of a document (sha256 prefix): identical documents share one store entry."""
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:24]


def make_ref(store: str | os.PathLike, doc_id: str) -> str:
    return f"{os.fspath(store)}#{doc_id}"


def split_ref(ref: object) -> tuple[str, str]:
    """``(store path, doc id)`` of a reference, or ValueError naming what is wrong."""
    if not isinstance(ref, str) or "#" not in ref:
        raise ValueError(f"document reference: expected '<store.parquet>#<doc id>', got {ref!r}")
    store, _, doc_id = ref.rpartition("#")
    if not store or not doc_id:
        raise ValueError(f"document reference: expected '<store.parquet>#<doc id>', got {ref!r}")
    return store, doc_id


def write_store(path: str | os.PathLike, documents: Iterable[tuple[str, str]]) -> int:
    """Write ``(doc_id, text)`` pairs (duplicate ids kept once) to a store; returns the count."""
    seen: dict[str, str] = {}
    for doc_id, text in documents:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"document {doc_id!r}: expected non-empty text")
        seen.setdefault(str(doc_id), text)
    if not seen:
        raise ValueError("documents: expected at least one document")
    table = pa.table({"doc_id": list(seen), "text": list(seen.values())})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=ROW_GROUP_SIZE)
    return len(seen)


def pack_documents(texts: Sequence[str], store: str | os.PathLike) -> list[str]:
    """Store ``texts`` (content-addressed) and return one reference per text, in order."""
    ids = [document_id(t) for t in texts]
    write_store(store, zip(ids, texts, strict=False))
    return [make_ref(store, i) for i in ids]


class DocumentStore:
    """Read-only, thread-safe view of one store file with an LRU cache of documents."""

    def __init__(self, path: str | os.PathLike, cache_size: int = 8):
        self.path = Path(path)
        if not self.path.is_file() or not os.access(self.path, os.R_OK):
            raise FileNotFoundError(
                f"document store {str(self.path)!r} is not readable on {socket.gethostname()}; documents travel by "
                "reference, so every node running agent-loop workers needs the store at this same path (shared storage)"
            )
        self._file = pq.ParquetFile(self.path)
        names = self._file.schema_arrow.names
        if "doc_id" not in names or "text" not in names:
            raise ValueError(f"document store {str(self.path)!r}: expected columns doc_id and text, found {names}")
        ids = self._file.read(columns=["doc_id"]).column("doc_id").to_pylist()
        self._rows = {doc_id: row for row, doc_id in enumerate(ids)}
        sizes = [self._file.metadata.row_group(g).num_rows for g in range(self._file.num_row_groups)]
        self._group_starts = np.cumsum([0, *sizes])
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_size = max(1, cache_size)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, doc_id: str) -> bool:
        return doc_id in self._rows

    def get(self, doc_id: str) -> str:
        """The text of ``doc_id`` (KeyError naming the store when absent)."""
        with self._lock:
            text = self._cache.get(doc_id)
            if text is not None:
                self._cache.move_to_end(doc_id)
                return text
            if doc_id not in self._rows:
                raise KeyError(f"document {doc_id!r} is not in store {str(self.path)!r} ({len(self)} documents)")
            row = self._rows[doc_id]
            group = int(np.searchsorted(self._group_starts, row, side="right")) - 1
            texts = self._file.read_row_group(group, columns=["text"]).column("text")
            text = texts[row - int(self._group_starts[group])].as_py()
            self._cache[doc_id] = text
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return text


@functools.lru_cache(maxsize=32)
def open_store(path: str, cache_size: int = 8) -> DocumentStore:
    """The process-wide :class:`DocumentStore` of ``path`` (opened once per process)."""
    return DocumentStore(path, cache_size)


def store_path(store: str, root: str | os.PathLike | None = None) -> str:
    """Where a reference's store lies: ``store`` itself, or under ``root`` (``infmem.documents.root``)
    when it is relative."""
    return store if root is None or os.path.isabs(store) else os.path.join(root, store)


def resolve(ref: object, root: str | os.PathLike | None = None, cache_size: int = 8) -> str:
    """The document text of reference ``ref``; relative store paths are taken from ``root``."""
    store, doc_id = split_ref(ref)
    return open_store(str(Path(store_path(store, root)).resolve()), cache_size).get(doc_id)
