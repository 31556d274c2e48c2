"""Training parquet files for verl from QA samples, with documents passed by reference.

One row per sample in the columns verl and our agent loops read:

* ``prompt``: chat messages holding the question only (verl's prompt-length filter applies to it),
* ``reward_model``: ``{"ground_truth": [answers...]}``,
* ``document_ref``: ``"<store>#<doc id>"`` into a document store written alongside,
* ``data_source``, ``extra_info`` (``index``, the sample id, ...), and optionally ``agent_name``.

The rows are written by :class:`data_prep.training.TrainingWriter`, the one writer of training
files; this module adds a command line for synthetic samples and JSON-lines records.

    python -m infmem_verl.verl_plugin.dataset --synthetic 8 --tokens 8000 --out data/smoke_train.parquet
    python -m infmem_verl.verl_plugin.dataset --records my_set.jsonl --out data/my_train.parquet

Store references are absolute paths (Ray workers need not share the launcher's working
directory); move data with ``infmem.documents.root`` and relative references instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from data_prep.io import DataError, iter_json_records
from data_prep.training import AGENT_LOOPS, TrainingWriter, store_path
from infmem_verl.cli import entry_point
from infmem_verl.data.identity import IdLedger
from infmem_verl.data.sample import QASample


def write_verl_dataset(
    samples: Sequence[QASample], out: str | Path, store: str | Path | None = None, agent_loop: str | None = None
) -> tuple[Path, Path]:
    """Write ``out`` (parquet) and its document store (default ``<out>_docs.parquet``); returns both paths.

    The rows are :mod:`data_prep.training`'s (one writer for every training file); without
    ``agent_loop`` the file has no ``agent_name`` column and the configured agent runs.
    """
    if not samples:
        raise ValueError("samples: expected at least one sample")
    out = Path(out).resolve()
    store = Path(store).resolve() if store is not None else store_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = TrainingWriter(out, store, store, agent_loop)
    for index, sample in enumerate(samples):
        writer.write(replace(sample, meta={"index": index, **sample.meta}))
    writer.close()
    return out, store


def _read_records(path: Path) -> list[QASample]:
    """Every record of ``path``, checked (fields, unique ids) before anything is written."""
    if not path.is_file():
        raise DataError(f"--records {path}: file not found")
    samples, ids = [], IdLedger()
    for record in iter_json_records(path):
        where = f"{path}:{record.line}"
        try:
            sample = QASample.from_record(record.value, where=where)
        except ValueError as err:
            raise DataError(str(err)) from None
        ids.claim(sample.id, f"record {where}")
        samples.append(sample)
    if not samples:
        raise DataError(f"--records {path}: no records; expected JSON lines of id, question, answers, context")
    return samples


@entry_point("dataset")
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--records", type=Path, help="JSON lines of QASample records (id, question, answers, context)")
    source.add_argument("--synthetic", type=int, metavar="N", help="N synthetic two-hop samples over Wikipedia text")
    parser.add_argument("--tokens", type=int, default=8000, help="document length of synthetic samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="output parquet")
    parser.add_argument("--store", type=Path, default=None, help="document store (default: <out>_docs.parquet)")
    parser.add_argument(
        "--agent-loop", choices=AGENT_LOOPS, default=None, help="agent_name column naming this loop (default: none)"
    )
    args = parser.parse_args(argv)
    if args.records is not None:
        samples = _read_records(args.records)
    else:
        from infmem_verl.assets import load_tokenizer
        from infmem_verl.data.synthetic import make_dataset

        samples = make_dataset(args.synthetic, args.tokens, load_tokenizer(), seed=args.seed)
    out, store = write_verl_dataset(samples, args.out, args.store, args.agent_loop)
    print(f"wrote {len(samples)} rows to {out} (documents in {store})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
