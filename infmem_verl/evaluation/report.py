"""The evaluation report: a Markdown table per dataset and two PNG plots.

Plots: accuracy against length (one line per method, one panel per dataset) and accuracy against
wall time (one point per cell), both with the 95% interval. Accuracy is the preset's headline
metric; the table shows both protocols' accuracies side by side, labelled, and the papers' number
for the same cell where one exists. The report also says what each column measures, how the
model decoded (temperature, top-p, repeats), and what each file holds: documents per context and
their tokens under the model's tokenizer next to the length label (RULER-HotpotQA's 6,400
documents are ~0.9M tokens, which InfMem's figure labels 1M).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from .aggregate import CellStats, repeat_spread
from .config import Preset
from .data import length_tokens
from .methods import METHOD_LABELS

ACC_OURS = "acc (ours: gold in prediction as whole words, any gold)"
ACC_REF = "acc (papers: two-way sub-EM, first gold)"


def headline(stats: CellStats, preset: Preset) -> tuple[float | None, tuple[float, float]]:
    """The accuracy the preset leads with, and its interval."""
    return (stats.acc, stats.acc_ci) if preset.headline == "ours" else (stats.acc_ref, stats.acc_ref_ci)


def write_report(
    out_dir: Path,
    stats: Sequence[CellStats],
    preset: Preset,
    backbone: str,
    header: str,
    decoding: str = "",
    files: Mapping[tuple[str, str], str] | None = None,
) -> Path:
    """Write ``report.md`` and the plots into ``out_dir``; return the report's path.

    ``decoding`` says how the model sampled; ``files`` maps (dataset, length) to the file read.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_accuracy(out_dir, stats, preset)
    lines = ["# Evaluation report", "", header, "", f"Preset **{preset.name}**: {preset.description}.", ""]
    if decoding:
        lines += [decoding, ""]
    lines += column_legend(stats, preset)
    for dataset, table in dataset_tables(stats, preset, backbone).items():
        lines += [f"## {dataset}", "", *table, ""]
    lines += document_table(stats, files or {})
    failures = [s for s in stats if s.failure_reasons]
    if failures:
        lines += ["## Failures", ""]
        for s in failures:
            unread = "file not read to its end; " if s.unread else ""
            lines += [f"- {s.dataset} {s.length} {s.method}: {unread}{s.failed} failed; " + "; ".join(r[:200] for r in s.failure_reasons)]
        lines.append("")
    sources = sorted({s.published.source for s in stats if s.published is not None})
    if sources:
        lines += ["Published numbers (backbone " + backbone + "): " + "; ".join(sources) + ".", ""]
    lines += [f"![{p.stem.replace('_', ' ')}]({p.name})" for p in plots]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _labels(preset: Preset) -> tuple[str, str]:
    """The headline accuracy's label and the other one's."""
    return (ACC_OURS, ACC_REF) if preset.headline == "ours" else (ACC_REF, ACC_OURS)


def _repeated(stats: Sequence[CellStats]) -> bool:
    return any(len(s.acc_by_repeat) > 1 for s in stats)


def column_legend(stats: Sequence[CellStats], preset: Preset) -> list[str]:
    """What each column of the tables measures."""
    headline_label, other_label = _labels(preset)
    repeats = ["- **mean ± std over repeats**: the headline accuracy computed separately for each "
               "repeat, then the mean and sample standard deviation of those accuracies (number of repeats in brackets)"] if _repeated(stats) else []  # fmt: skip
    return [
        "Columns:",
        "",
        "- **n**: scored runs (questions × repeats); **failed**: runs that failed, counted apart, never scored "
        "(a record that cannot become a sample, or repeats an earlier record's id, is one): n + failed is every "
        "record read times the repeats; **+ file unread**: the file could not be read to its end (see Failures)",
        f"- **acc % [95% CI]**: {headline_label}, with the 95% Wilson interval over all scored runs",
        *repeats,
        f"- **other acc %**: {other_label}",
        "- **EM %**: exact match after SQuAD normalization, best over all golds; **F1 %**: token F1, best over all golds",
        "- **latency**: seconds per question (mean / 95th percentile); **tokens / q**, **calls / q**: prompt + "
        "completion tokens and LLM calls per question; **chunks read**: chunks written into memory (agents)",
        "- **wall s**: first start to last finish of the cell, summed over runs; **published**: the paper's "
        "number for this cell (its minutes where given)",
        "",
    ]


def document_table(stats: Sequence[CellStats], files: Mapping[tuple[str, str], str]) -> list[str]:
    """Documents per context and measured tokens of each (dataset, length), next to its label."""
    cells: dict[tuple[str, str], CellStats] = {}
    for s in stats:  # every method reads the same documents; keep the cell that measured most
        best = cells.get((s.dataset, s.length))
        if s.doc_tokens is not None and (best is None or s.n > best.n):
            cells[(s.dataset, s.length)] = s
    if not cells:
        return []
    rows = [["dataset", "length label (tokens)", "file", "documents per context", "tokens per context: mean (min-max)"]]
    rows.append(["---"] * len(rows[0]))
    for (dataset, length), s in cells.items():
        mean, low, high = s.doc_tokens
        docs = "-" if s.num_docs is None else _range(*s.num_docs)
        rows.append([dataset, f"{length} ({length_tokens(length):,})", files.get((dataset, length), "-"), docs,
                     f"{mean:,.0f} ≈ {_short(mean)} ({low:,}-{high:,})"])  # fmt: skip
    return ["## Documents and tokens", "", "Tokens are counted with the evaluated model's tokenizer.", "",
            *("| " + " | ".join(row) + " |" for row in rows), ""]  # fmt: skip


def _range(low: int, high: int) -> str:
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def _short(tokens: float) -> str:
    """``896123`` -> ``896K``; ``1_750_000`` -> ``1.75M``."""
    return f"{tokens / 1e6:.3g}M" if tokens >= 1e6 else f"{tokens / 1e3:.3g}K"


def dataset_tables(stats: Sequence[CellStats], preset: Preset, backbone: str) -> dict[str, list[str]]:
    """The Markdown table of each dataset's cells, by dataset in order of first appearance."""
    datasets = dict.fromkeys(s.dataset for s in stats)
    return {dataset: markdown_table([s for s in stats if s.dataset == dataset], preset, backbone) for dataset in datasets}


def markdown_table(stats: Sequence[CellStats], preset: Preset, backbone: str) -> list[str]:
    repeated = _repeated(stats)
    head = ["length", "method", "n", "failed", "acc % [95% CI]", *(["mean ± std over repeats"] if repeated else []),
            "other acc %", "EM %", "F1 %", "latency mean / p95 s", "tokens / q", "calls / q", "chunks read", "wall s",
            f"published ({backbone})"]  # fmt: skip
    rows = [head, ["---"] * len(head)]
    for s in stats:
        acc, ci = headline(s, preset)
        other = s.acc_ref if preset.headline == "ours" else s.acc
        spread = repeat_spread(s.acc_by_repeat if preset.headline == "ours" else s.acc_ref_by_repeat)
        published = s.published
        rows.append([
            s.length,
            METHOD_LABELS.get(s.method, s.method),
            str(s.n),
            str(s.failed) + (" + file unread" if s.unread else ""),
            f"{_pct(acc)} [{_pct(ci[0])}, {_pct(ci[1])}]" if acc is not None else "-",
            *([f"{_pct(spread[0])} ± {_pct(spread[1])} ({len(s.acc_by_repeat)})" if spread else "-"] if repeated else []),
            _pct(other),
            _pct(s.em),
            _pct(s.f1),
            f"{_num(s.latency_mean_s, 2)} / {_num(s.latency_p95_s, 2)}",
            _num(s.tokens_per_question, 0),
            _num(s.calls_per_question, 1),
            _num(s.chunks_read_mean, 1),
            _num(s.wall_s, 1),
            "-" if published is None else f"{published.accuracy:.1f}" + (f" ({published.minutes:.0f} min)" if published.minutes else ""),
        ])  # fmt: skip
    return ["| " + " | ".join(row) + " |" for row in rows]


def plot_accuracy(out_dir: Path, stats: Sequence[CellStats], preset: Preset) -> list[Path]:
    """``accuracy_vs_length.png`` and ``accuracy_vs_time.png``; no plot without scored cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = [s for s in stats if headline(s, preset)[0] is not None]
    if not scored:
        return []
    datasets = list(dict.fromkeys(s.dataset for s in scored))
    methods = list(dict.fromkeys(s.method for s in scored))
    figure, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for axis, dataset in zip(axes[0], datasets):
        for rank, method in enumerate(methods):
            cells = sorted((s for s in scored if s.dataset == dataset and s.method == method), key=lambda s: s.tokens)
            if not cells:
                continue
            # Nudge each method sideways a little so that equal accuracies do not hide each other.
            dodge = 2 ** (0.04 * (rank - (len(methods) - 1) / 2))
            xs = [s.tokens * dodge for s in cells]
            ys = [100 * headline(s, preset)[0] for s in cells]
            low = [y - 100 * headline(s, preset)[1][0] for y, s in zip(ys, cells)]
            high = [100 * headline(s, preset)[1][1] - y for y, s in zip(ys, cells)]
            axis.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=METHOD_LABELS.get(method, method))
        axis.set_xscale("log", base=2)
        ticks = sorted({(s.tokens, s.length) for s in scored if s.dataset == dataset})
        axis.set_xticks([tokens for tokens, _ in ticks], [label for _, label in ticks])
        axis.set_title(dataset)
        axis.set_xlabel("document length (tokens)")
        axis.set_ylabel("accuracy %")
        axis.set_ylim(-2, 102)
        axis.legend(fontsize=7)
    figure.tight_layout()
    by_length = out_dir / "accuracy_vs_length.png"
    figure.savefig(by_length, dpi=100)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(6, 4))
    for method in methods:
        cells = [s for s in scored if s.method == method]
        axis.scatter([s.wall_s / 60 for s in cells], [100 * headline(s, preset)[0] for s in cells], label=METHOD_LABELS.get(method, method))
        for s in cells:
            axis.annotate(f"{s.dataset} {s.length}", (s.wall_s / 60, 100 * headline(s, preset)[0]), fontsize=6)
    axis.set_xlabel("wall time of the cell (min)")
    axis.set_ylabel("accuracy %")
    axis.set_title("accuracy vs wall time")
    axis.legend(fontsize=7)
    figure.tight_layout()
    by_time = out_dir / "accuracy_vs_time.png"
    figure.savefig(by_time, dpi=100)
    plt.close(figure)
    return [by_length, by_time]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
