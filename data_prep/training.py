"""The verl training parquet: one row per sample, streamed, with a document store beside it.

Columns (what verl's ``RLHFDataset`` and our agent loops and reward manager read):

* ``data_source``: the source name (``hotpotqa``, ...);
* ``prompt``: ``[{"role": "user", "content": question}]``, the question only;
* ``context``: the document text, only with ``inline_context=True`` (see below);
* ``document_ref``: ``"<store path>#<sample id>"``, the reference our agent loop resolves
  (:mod:`infmem_verl.data.documents`);
* ``reward_model``: ``{"style": "rule", "ground_truth": [every gold answer]}``;
* ``extra_info``: ``index``, ``id``, ``source``, ``split``, ``question``, ``num_tokens``,
  ``num_docs``, ``gold_positions`` (1-based document numbers), ``gold_token_starts``, ``seed``,
  ``target``;
* ``agent_name``: only when the writer is given a loop (``infmem_agent`` or ``memagent_agent``).
  verl runs the loop a row names whatever the configuration says, so by default there is no
  such column and the trainer's configured agent runs (``agent=memagent`` switches a whole run).

The store (``<name>_docs.parquet``, columns ``doc_id`` and ``text`` in row groups of
:data:`~infmem_verl.data.documents.ROW_GROUP_SIZE`) holds each document once, keyed by the
sample id, so a worker fetches one document without reading the training file's other rows.
verl copies every dataset column into each stored sequence, so for long documents the inline
``context`` column is best left out of the file given to the trainer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from infmem_verl.data.documents import ROW_GROUP_SIZE, make_ref, resolve
from infmem_verl.data.identity import IdLedger
from infmem_verl.data.sample import QASample

from .io import ParquetRowWriter

AGENT_LOOPS = ("infmem_agent", "memagent_agent")
# Rows per row group of the training file: its rows are small when documents are by reference.
_TRAIN_ROW_GROUP = 256
# Rows per row group when the context is inline: keeps a row group of 1M-token rows near 32 MB.
_INLINE_ROW_GROUP = 8

_EXTRA_INFO = pa.struct(
    [
        ("index", pa.int64()),
        ("id", pa.string()),
        ("source", pa.string()),
        ("split", pa.string()),
        ("question", pa.string()),
        ("num_tokens", pa.int64()),
        ("num_docs", pa.int64()),
        ("gold_positions", pa.list_(pa.int64())),
        ("gold_token_starts", pa.list_(pa.int64())),
        ("seed", pa.int64()),
        ("target", pa.string()),
    ]
)
STORE_SCHEMA = pa.schema([("doc_id", pa.string()), ("text", pa.string())])


def training_schema(inline_context: bool, with_agent_name: bool = True) -> pa.Schema:
    """The training file's schema, with or without the inline ``context`` and ``agent_name`` columns."""
    fields = [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("document_ref", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.list_(pa.string()))])),
        ("extra_info", _EXTRA_INFO),
    ]
    if with_agent_name:
        fields.append(("agent_name", pa.string()))
    if inline_context:
        fields.insert(2, ("context", pa.large_string()))
    return pa.schema(fields)


def store_path(out: str | os.PathLike) -> Path:
    """The document store written beside training file ``out``: ``<stem>_docs.parquet``."""
    out = Path(out)
    return out.with_name(f"{out.stem}_docs.parquet")


def training_row(
    sample: QASample, store: str | os.PathLike, agent_name: str | None, inline_context: bool
) -> dict[str, Any]:
    """The row of a composed sample (``meta`` as :mod:`data_prep.build` fills it)."""
    if agent_name is not None and agent_name not in AGENT_LOOPS:
        raise ValueError(f"agent_name: expected one of {', '.join(AGENT_LOOPS)}, got {agent_name!r}")
    if "#" in sample.id:
        raise ValueError(f"sample id {sample.id!r}: '#' separates the store from the id in a document reference")
    meta = sample.meta
    row = {
        "data_source": sample.source,
        "prompt": [{"role": "user", "content": sample.question}],
        "document_ref": make_ref(store, sample.id),
        "reward_model": {"style": "rule", "ground_truth": list(sample.answers)},
        "extra_info": {"id": sample.id, "source": sample.source, "question": sample.question}
        | {key: meta[key] for key in _EXTRA_INFO.names if key in meta},
    }
    if agent_name is not None:
        row["agent_name"] = agent_name
    if inline_context:
        row["context"] = sample.context
    return row


class TrainingWriter:
    """Streams samples into a training parquet and its document store.

    ``out`` / ``store`` are the paths written now (temporary names during an atomic build);
    ``final_store`` is where the store will live, the path the references name. The store is
    keyed by sample id, so a second sample with an id already written is refused
    (:class:`~infmem_verl.data.identity.DuplicateIdError`), never stored over the first.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        store: str | os.PathLike,
        final_store: str | os.PathLike,
        agent_name: str | None,
        inline_context: bool = False,
    ) -> None:
        self.final_store = Path(final_store).resolve()
        self.agent_name = agent_name
        self.inline_context = inline_context
        row_group = _INLINE_ROW_GROUP if inline_context else _TRAIN_ROW_GROUP
        self._rows = ParquetRowWriter(out, training_schema(inline_context, agent_name is not None), row_group)
        self._docs = ParquetRowWriter(store, STORE_SCHEMA, ROW_GROUP_SIZE)
        self._ids = IdLedger()

    def write(self, sample: QASample, where: str | None = None) -> None:
        """Write ``sample``; ``where`` names it in a refusal (default: its row number)."""
        self._ids.claim(sample.id, where or f"{self.final_store.name}: row {len(self._ids)}")
        row = training_row(sample, self.final_store, self.agent_name, self.inline_context)
        self._docs.write({"doc_id": sample.id, "text": sample.context})
        self._rows.write(row)

    def close(self) -> None:
        self._docs.close()
        self._rows.close()


def read_training_set(path: str | os.PathLike) -> Iterator[QASample]:
    """The samples of a training parquet, one row group at a time.

    The context comes from the ``context`` column when the file has it, from the document
    store otherwise.
    """
    for where, row in training_rows(path):
        yield training_sample(row, where)


def training_rows(path: str | os.PathLike) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for every row of a training parquet, one row group at a time.

    Separate from :func:`training_sample` so a reader that must survive a bad row (distillation
    records it and goes on) can convert each row on its own.
    """
    handle = pq.ParquetFile(os.fspath(path))
    for group in range(handle.num_row_groups):
        for number, row in enumerate(handle.read_row_group(group).to_pylist()):
            yield f"{path} row group {group} row {number}", row


def training_sample(row: dict[str, Any], where: str) -> QASample:
    """The sample of one training-file row (context inline or from the document store)."""
    info = dict(row["extra_info"])
    context = row["context"] if "context" in row else resolve(row["document_ref"])
    meta = {k: v for k, v in info.items() if k not in ("id", "source", "question")}
    return QASample.from_record(
        {
            "id": info["id"],
            "question": row["prompt"][-1]["content"],
            "answers": list(row["reward_model"]["ground_truth"]),
            "context": context,
            "source": row["data_source"],
            "meta": meta,
        },
        where=where,
    )
