"""The evaluation report: a Markdown table per dataset and two PNG plots.

Plots: accuracy against length (one line per method, one panel per dataset) and accuracy against
wall time (one point per cell), both with the 95% interval. Accuracy is the preset's headline
metric; the table shows both protocols' accuracies side by side, labelled, and the papers' number
for the same cell where one exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .aggregate import CellStats
from .config import Preset
from .methods import METHOD_LABELS

ACC_OURS = "acc (ours: gold in prediction as whole words, any gold)"
ACC_REF = "acc (papers: two-way sub-EM, first gold)"


def headline(stats: CellStats, preset: Preset) -> tuple[float | None, tuple[float, float]]:
    """The accuracy the preset leads with, and its interval."""
    return (stats.acc, stats.acc_ci) if preset.headline == "ours" else (stats.acc_ref, stats.acc_ref_ci)


def write_report(out_dir: Path, stats: Sequence[CellStats], preset: Preset, backbone: str, header: str) -> Path:
    """Write ``report.md`` and the plots into ``out_dir``; return the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_accuracy(out_dir, stats, preset)
    lines = ["# Evaluation report", "", header, "", f"Preset **{preset.name}**: {preset.description}.", ""]
    label = ACC_OURS if preset.headline == "ours" else ACC_REF
    lines += [f"Headline accuracy: {label}, in %, with its 95% Wilson interval. Failed samples are counted apart, never scored.", ""]
    for dataset, table in dataset_tables(stats, preset, backbone).items():
        lines += [f"## {dataset}", "", *table, ""]
    failures = [s for s in stats if s.failure_reasons]
    if failures:
        lines += ["## Failures", ""]
        for s in failures:
            lines += [f"- {s.dataset} {s.length} {s.method}: {s.failed} failed; " + "; ".join(r[:200] for r in s.failure_reasons)]
        lines.append("")
    sources = sorted({s.published.source for s in stats if s.published is not None})
    if sources:
        lines += ["Published numbers (backbone " + backbone + "): " + "; ".join(sources) + ".", ""]
    lines += [f"![{p.stem.replace('_', ' ')}]({p.name})" for p in plots]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def dataset_tables(stats: Sequence[CellStats], preset: Preset, backbone: str) -> dict[str, list[str]]:
    """The Markdown table of each dataset's cells, by dataset in order of first appearance."""
    datasets = dict.fromkeys(s.dataset for s in stats)
    return {dataset: markdown_table([s for s in stats if s.dataset == dataset], preset, backbone) for dataset in datasets}


def markdown_table(stats: Sequence[CellStats], preset: Preset, backbone: str) -> list[str]:
    head = ["length", "method", "n", "failed", "acc % [95% CI]", "other acc %", "EM %", "F1 %",
            "latency mean / p95 s", "tokens / q", "calls / q", "chunks read", "wall s", f"published ({backbone})"]  # fmt: skip
    rows = [head, ["---"] * len(head)]
    for s in stats:
        acc, ci = headline(s, preset)
        other = s.acc_ref if preset.headline == "ours" else s.acc
        published = s.published
        rows.append([
            s.length,
            METHOD_LABELS.get(s.method, s.method),
            str(s.n),
            str(s.failed),
            f"{_pct(acc)} [{_pct(ci[0])}, {_pct(ci[1])}]" if acc is not None else "-",
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
