"""Statistics of a built set: token lengths, where the gold documents sit, answer types.

    python -m data_prep.stats data/eval_qa_2_32768.json
    python -m data_prep.stats data/hotpotqa_train_32k.parquet --out reports/train32k
    python -m data_prep.stats eval_25600.json --source hotpotqa --pool hotpot_dev_distractor_v1.json

Reads a training parquet (:mod:`data_prep.training`, without loading its documents) or a
published JSON file (ours or the reference's), and writes ``<out>.png`` (three histograms) and
``<out>.md`` (a table, also printed); ``<out>`` defaults to ``<file>.stats``. Token counts come
from our files' metadata; for other files the contexts are tokenized (``--tokenizer``, Qwen3 by
default). Gold positions are known only for our files. "Distinct gold document numbers" exposes
the reference's leak: its fixed shuffle put every gold document of a file in the same ten slots.
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow.parquet as pq

from infmem_verl.reward.metrics import normalize_answer

from .io import DataError
from .published import read_published
from .sources import SOURCES, load_pool

ANSWER_TYPES = ("yes/no", "date", "number", "entity", "phrase")
_MONTHS = "january|february|march|april|may|june|july|august|september|october|november|december"
_DATE = re.compile(rf"\b({_MONTHS})\b|^\d{{3,4}}$|^\d{{1,2}}(st|nd|rd|th)?\s+century$", re.IGNORECASE)
_NUMBER = re.compile(r"^[$€£]?\s*[\d][\d,.\s]*(%|[a-z]+)?$", re.IGNORECASE)
# Lowercase words allowed inside a name ("Duke of York", "Leonardo da Vinci").
_NAME_JOINERS = frozenset({"of", "the", "and", "de", "da", "di", "von", "van", "der", "la", "le", "du", "del", "y", "&"})
_QUANTILES = (10, 50, 90)
_FIFTHS = 5


def answer_type(answer: str) -> str:
    """A coarse type of a gold answer: yes/no, date, number, entity (a capitalised name) or phrase."""
    text = answer.strip()
    if normalize_answer(text) in ("yes", "no"):
        return "yes/no"
    if _DATE.search(text):
        return "date"
    if _NUMBER.match(text):
        return "number"
    words = text.split()
    if words and all(w[0].isupper() or w[0].isdigit() or w.lower() in _NAME_JOINERS for w in words):
        return "entity"
    return "phrase"


@dataclass
class SetStats:
    """What the report is computed from: one entry per sample (gold lists may be empty)."""

    tokens: list[int] = field(default_factory=list)
    docs: list[int] = field(default_factory=list)
    gold_relative: list[float] = field(default_factory=list)  # gold start / context length, in [0, 1)
    gold_numbers: Counter = field(default_factory=Counter)  # document number -> gold documents there
    answer_types: Counter = field(default_factory=Counter)
    with_gold: int = 0

    def add(self, tokens: int, docs: int | None, answers: Sequence[str], meta: dict[str, Any]) -> None:
        self.tokens.append(int(tokens))
        if docs is not None:
            self.docs.append(int(docs))
        self.answer_types[answer_type(answers[0])] += 1
        starts = meta.get("gold_token_starts")
        if starts:
            self.with_gold += 1
            self.gold_relative.extend(s / tokens for s in starts)
            self.gold_numbers.update(meta.get("gold_positions") or ())


def collect(path: str | os.PathLike, tokenizer=None, pool: Sequence[str] | None = None) -> SetStats:
    """Statistics of the file at ``path`` (``.parquet``: training set; otherwise published JSON)."""
    path = Path(path)
    stats = SetStats()
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _published_rows(path, tokenizer, pool)
    for tokens, docs, answers, meta in rows:
        stats.add(tokens, docs, answers, meta)
    if not stats.tokens:
        raise DataError(f"{path}: no samples")
    return stats


def _parquet_rows(path: Path) -> Iterator[tuple[int, int | None, list[str], dict[str, Any]]]:
    """Rows of a training parquet, reading only the small columns (never the documents)."""
    handle = pq.ParquetFile(path)
    for batch in handle.iter_batches(columns=["extra_info", "reward_model"], batch_size=1024):
        for info, reward in zip(batch.column("extra_info").to_pylist(), batch.column("reward_model").to_pylist()):
            yield info["num_tokens"], info.get("num_docs"), list(reward["ground_truth"]), info


def _published_rows(
    path: Path, tokenizer, pool: Sequence[str] | None
) -> Iterator[tuple[int, int | None, list[str], dict[str, Any]]]:
    for sample in read_published(path, pool):
        tokens = sample.meta.get("num_tokens")
        if tokens is None:
            tokens = _count_tokens(sample.context, tokenizer)
        yield tokens, sample.meta.get("num_docs"), sample.answers, sample.meta


def _count_tokens(text: str, tokenizer) -> int:
    from infmem_verl.agent.document import tokenize_document

    if tokenizer is None:
        from infmem_verl.assets import load_tokenizer

        tokenizer = load_tokenizer()
    return int(tokenize_document(text, tokenizer).size)


def table(stats: SetStats) -> str:
    """The report as a markdown table."""
    tokens = np.asarray(stats.tokens)
    rows = [
        ("samples", str(tokens.size)),
        ("tokens min / median / mean / max", _four(tokens)),
    ]
    if stats.docs:
        docs = np.asarray(stats.docs)
        rows.append(("documents min / median / max", f"{docs.min()} / {np.median(docs):.0f} / {docs.max()}"))
    if stats.gold_relative:
        relative = np.asarray(stats.gold_relative)
        quantiles = " / ".join(f"{q:.2f}" for q in np.percentile(relative, _QUANTILES))
        fifths = np.bincount(np.minimum((relative * _FIFTHS).astype(int), _FIFTHS - 1), minlength=_FIFTHS)
        shares = " / ".join(f"{100 * n / relative.size:.0f}%" for n in fifths)
        rows += [
            ("gold documents per sample", f"{relative.size / stats.with_gold:.2f}"),
            (f"gold relative position p{'/p'.join(map(str, _QUANTILES))}", quantiles),
            ("gold documents by fifth of the context", shares),
            ("distinct gold document numbers", f"{len(stats.gold_numbers)} for {relative.size} gold documents"),
        ]
    else:
        rows.append(("gold positions", "not recorded in this file"))
    total = sum(stats.answer_types.values())
    types = ", ".join(f"{t} {stats.answer_types[t]} ({100 * stats.answer_types[t] / total:.0f}%)" for t in ANSWER_TYPES)
    rows.append(("answer types", types))
    lines = ["| statistic | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]
    return "\n".join(lines) + "\n"


def _four(values: np.ndarray) -> str:
    return f"{values.min()} / {np.median(values):.0f} / {values.mean():.0f} / {values.max()}"


def plot(stats: SetStats, path: str | os.PathLike, title: str) -> None:
    """Token-length histogram, gold relative positions, answer types, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to the file
    import matplotlib.pyplot as plt

    figure, (lengths, gold, types) = plt.subplots(1, 3, figsize=(15, 4))
    lengths.hist(stats.tokens, bins=min(40, max(5, len(stats.tokens) // 2)), color="tab:blue")
    lengths.set(title="context length", xlabel="tokens", ylabel="samples")
    if stats.gold_relative:
        gold.hist(stats.gold_relative, bins=20, range=(0, 1), color="tab:green")
    else:
        gold.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=gold.transAxes)
    gold.set(title="gold document start", xlabel="position in the context (0 = start, 1 = end)", ylabel="gold documents")
    counts = [stats.answer_types[t] for t in ANSWER_TYPES]
    types.bar(ANSWER_TYPES, counts, color="tab:orange")
    types.set(title="answer types (first gold answer)", ylabel="samples")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m data_prep.stats", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, help="a training parquet or a published JSON file")
    parser.add_argument("--out", type=Path, default=None, help="output prefix (default: <file>.stats)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for files without token counts")
    parser.add_argument("--source", choices=SOURCES, default=None, help="source of --pool")
    parser.add_argument("--pool", type=Path, default=None, help="official split file, to expand index contexts")
    args = parser.parse_args(argv)
    if (args.source is None) != (args.pool is None):
        parser.error("--source and --pool: give both (the pool's official file and its source) or neither")
    try:
        pool = load_pool(args.source, args.pool) if args.pool is not None else None
        tokenizer = None
        if args.tokenizer is not None:
            from infmem_verl.assets import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer)
        stats = collect(args.file, tokenizer, pool)
    except (DataError, ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")
    prefix = args.out or args.file.with_name(args.file.name + ".stats")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    report = table(stats)
    Path(f"{prefix}.md").write_text(f"# {args.file.name}\n\n{report}", encoding="utf-8")
    plot(stats, f"{prefix}.png", args.file.name)
    print(report, end="")
    return report


if __name__ == "__main__":
    main()
