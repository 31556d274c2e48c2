"""Statistics of a built set: token lengths, where the gold documents sit, answer types.

    python -m data_prep.stats data/eval_qa_2_32768.json
    python -m data_prep.stats data/hotpotqa_train_32k.parquet --out reports/train32k
    python -m data_prep.stats eval_25600.json --source hotpotqa --pool hotpot_dev_distractor_v1.json
    python -m data_prep.stats eval_qa_1_*.json     # several files: one more table, label vs real size

Reads a training parquet (:mod:`data_prep.training`, without loading its documents) or a
published JSON file (ours or the reference's), and writes ``<out>.png`` (three histograms) and
``<out>.md`` (a table, also printed); ``<out>`` defaults to ``<file>.stats``. Token counts come
from our files' metadata; for other files the contexts are tokenized (``--tokenizer``, Qwen3 by
default). Gold positions are known only for our files. "Distinct gold document numbers" exposes
the reference's leak: its fixed shuffle put every gold document of a file in the same ten slots.

Every report sets the real size against the file's label (the target recorded in our files, or
what the reference's name says: ``eval_qa_{k}_{L}.json`` L tokens, ``eval_{N}.json`` N
documents): a generator that ran out of pool, as the reference's SQuAD one did silently, writes
files whose names promise more than they hold.
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

from .compose import Target
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
# A sample below this share of its label is "short of the label" (our builds stay within 0.5%).
_SHORT = 0.99
# The reference's file names and the size they state.
_LABELLED_NAMES = ((re.compile(r"(?:^|_)qa_\d+_(\d+)\.json$"), "tokens"), (re.compile(r"^eval_(\d+)\.json$"), "docs"))


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
    label: Target | None = None  # the size the file is labelled with (None: not known)

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

    def real_sizes(self) -> np.ndarray | None:
        """Each sample's real size in the unit of its label (tokens or documents), or None."""
        if self.label is None or (self.label.kind == "docs" and len(self.docs) != len(self.tokens)):
            return None
        return np.asarray(self.tokens if self.label.kind == "tokens" else self.docs)


def label_of(path: Path, meta: dict[str, Any]) -> Target | None:
    """The size a file is labelled with: the target our builds record, else the one the
    reference's file name states, else None."""
    recorded = meta.get("target")
    if isinstance(recorded, str) and recorded:
        try:
            return Target.from_label(recorded)
        except ValueError:
            pass
    for pattern, kind in _LABELLED_NAMES:
        match = pattern.search(path.name)
        if match and int(match.group(1)) > 0:
            return Target(kind, int(match.group(1)))
    return None


def collect(path: str | os.PathLike, tokenizer=None, pool: Sequence[str] | None = None) -> SetStats:
    """Statistics of the file at ``path`` (``.parquet``: training set; otherwise published JSON)."""
    path = Path(path)
    stats = SetStats()
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _published_rows(path, tokenizer, pool)
    for tokens, docs, answers, meta in rows:
        if not stats.tokens:
            stats.label = label_of(path, meta)
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
        *_label_rows(stats),
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


def _label_rows(stats: SetStats) -> list[tuple[str, str]]:
    """The label and the real sizes against it."""
    if stats.label is None:
        return [("label", "none (not recorded, and not a reference file name)")]
    unit = "tokens" if stats.label.kind == "tokens" else "documents"
    rows = [("label", f"{stats.label.label} ({stats.label.value} {unit})")]
    real = stats.real_sizes()
    if real is None:
        return rows + [("real / label", "document counts not recorded")]
    share = real / stats.label.value
    short = int((share < _SHORT).sum())
    return rows + [
        (f"real {unit} / label min / median / max", " / ".join(f"{100 * q:.1f}%" for q in _three(share))),
        (f"samples short of the label (< {100 * _SHORT:.0f}%)", f"{short} of {real.size}"),
    ]


def summary_table(reports: Sequence[tuple[str, SetStats]]) -> str:
    """One row per file: its label, its real token counts and their share of the label."""
    lines = [
        "| file | label | samples | real tokens min / median / max | real / label (median) | short of the label |",
        "|---|---|---|---|---|---|",
    ]
    for name, stats in reports:
        tokens = np.asarray(stats.tokens)
        real = stats.real_sizes()
        label = "none" if stats.label is None else stats.label.label
        share = short = "-"
        if real is not None:
            share = f"{100 * np.median(real) / stats.label.value:.1f}%"
            short = str(int((real < _SHORT * stats.label.value).sum()))
        counts = " / ".join(f"{v:.0f}" for v in _three(tokens))
        lines.append(f"| {name} | {label} | {tokens.size} | {counts} | {share} | {short} |")
    return "\n".join(lines) + "\n"


def _three(values: np.ndarray) -> tuple[float, float, float]:
    return values.min(), np.median(values), values.max()


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
    parser.add_argument("files", type=Path, nargs="+", help="training parquets or published JSON files")
    parser.add_argument("--out", type=Path, default=None, help="output prefix of one file (default: <file>.stats)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for files without token counts")
    parser.add_argument("--source", choices=SOURCES, default=None, help="source of --pool")
    parser.add_argument("--pool", type=Path, default=None, help="official split file, to expand index contexts")
    args = parser.parse_args(argv)
    if (args.source is None) != (args.pool is None):
        parser.error("--source and --pool: give both (the pool's official file and its source) or neither")
    if args.out is not None and len(args.files) > 1:
        parser.error("--out: a prefix for one file; several files each get <file>.stats")
    try:
        pool = load_pool(args.source, args.pool) if args.pool is not None else None
        tokenizer = None
        if args.tokenizer is not None:
            from infmem_verl.assets import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer)
        collected = [(path.name, collect(path, tokenizer, pool)) for path in args.files]
    except (DataError, ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")
    printed = []
    for path, (name, stats) in zip(args.files, collected):
        prefix = args.out or path.with_name(name + ".stats")
        prefix.parent.mkdir(parents=True, exist_ok=True)
        report = table(stats)
        Path(f"{prefix}.md").write_text(f"# {name}\n\n{report}", encoding="utf-8")
        plot(stats, f"{prefix}.png", name)
        printed.append(report if len(args.files) == 1 else f"## {name}\n\n{report}")
    if len(args.files) > 1:
        printed.append(f"## label against real size\n\n{summary_table(collected)}")
    text = "\n".join(printed)
    print(text, end="")
    return text


if __name__ == "__main__":
    main()
