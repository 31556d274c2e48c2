"""Per-cell statistics (dataset x length x method) from the per-sample records.

Accuracy is a mean of 0/1 scores over the samples that ran; failed samples are counted apart and
never scored 0. Its 95% confidence interval is Wilson's score interval, which stays inside
[0, 1] and is honest for the small cells (a few hundred samples, often near 0 or 1) evaluation
has. Wall time is the span from the first start to the last finish of the cell's samples within
one run, summed over the runs that contributed (a resumed cell is the sum of its parts).

With ``--repeats K`` a cell holds K scored runs per question: the accuracy and its Wilson
interval pool all of them, and each accuracy is also computed per repeat, whose mean and
standard deviation (over the K repeats) show how much sampling moves the score.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from .data import length_tokens
from .methods import METHODS
from .published import PublishedNumber, lookup
from .store import CELL

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a binomial proportion (``(0, 1)`` when ``n == 0``)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # The interval always holds p; clamping keeps rounding from putting p outside it.
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


@dataclass
class CellStats:
    dataset: str
    length: str
    method: str
    n: int  # samples scored
    failed: int  # samples that failed (n + failed: every record read, times the repeats)
    acc: float | None  # ours: whole-word gold-in-prediction over all golds
    acc_ci: tuple[float, float]
    acc_ref: float | None  # the papers': two-way sub-EM against the first gold
    acc_ref_ci: tuple[float, float]
    em: float | None
    f1: float | None
    latency_mean_s: float | None
    latency_p95_s: float | None
    tokens_per_question: float | None
    calls_per_question: float | None
    chunks_read_mean: float | None
    wall_s: float
    failure_reasons: list[str] = field(default_factory=list)
    published: PublishedNumber | None = None
    # Accuracy of each repeat (index = repeat), both protocols; one entry without --repeats.
    acc_by_repeat: list[float] = field(default_factory=list)
    acc_ref_by_repeat: list[float] = field(default_factory=list)
    # What the cell's documents are: documents per context and tokens (the model's tokenizer).
    num_docs: tuple[int, int] | None = None  # (min, max)
    doc_tokens: tuple[float, int, int] | None = None  # (mean, min, max)
    # Why the cell's file could not be read to its end (missing, truncated), if it could not.
    unread: str | None = None

    @property
    def tokens(self) -> int:
        return length_tokens(self.length)


def aggregate(records: Iterable[dict[str, Any]], backbone: str) -> list[CellStats]:
    """One :class:`CellStats` per cell, ordered by dataset, length (tokens) and method."""
    cells: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        cells[(record["dataset"], record["length"], record["method"])].append(record)
    stats = [_cell(key, rows, backbone) for key, rows in cells.items()]
    order = {name: i for i, name in enumerate(METHODS)}
    return sorted(stats, key=lambda s: (s.dataset, s.tokens, order.get(s.method, len(order)), s.method))


def _cell(key: tuple[str, str, str], rows: list[dict[str, Any]], backbone: str) -> CellStats:
    dataset, length, method = key
    cell = [r for r in rows if r["sample_id"] == CELL]
    rows = [r for r in rows if r["sample_id"] != CELL]
    unread = cell[-1].get("reason") if cell and cell[-1]["status"] != "ok" else None
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] != "ok"]
    acc = _values(ok, "acc")
    acc_ref = _values(ok, "acc_ref")
    latency = _values(ok, "latency_s")
    reasons = list(dict.fromkeys([*([unread] if unread else []), *(r.get("reason", "") for r in failed)]))
    return CellStats(
        dataset=dataset,
        length=length,
        method=method,
        n=len(ok),
        failed=len(failed),
        acc=_mean(acc),
        acc_ci=wilson_interval(float(np.sum(acc)), len(acc)),
        acc_ref=_mean(acc_ref),
        acc_ref_ci=wilson_interval(float(np.sum(acc_ref)), len(acc_ref)),
        em=_mean(_values(ok, "em")),
        f1=_mean(_values(ok, "f1")),
        latency_mean_s=_mean(latency),
        latency_p95_s=float(np.percentile(latency, 95)) if len(latency) else None,
        tokens_per_question=_mean(_values(ok, "tokens")),
        calls_per_question=_mean(_values(ok, "llm_calls")),
        chunks_read_mean=_mean(_values(ok, "chunks_read")),
        wall_s=_wall(rows),
        failure_reasons=reasons[:3],
        published=lookup(backbone, dataset, length, method),
        acc_by_repeat=_by_repeat(ok, "acc"),
        acc_ref_by_repeat=_by_repeat(ok, "acc_ref"),
        num_docs=_span(_values(ok, "num_docs")),
        doc_tokens=_mean_span(_values(ok, "doc_tokens")),
        unread=unread,
    )


def repeat_spread(values: Sequence[float]) -> tuple[float, float] | None:
    """Mean and sample standard deviation of per-repeat accuracies; None for fewer than two."""
    if len(values) < 2:
        return None
    return float(np.mean(values)), float(np.std(values, ddof=1))


def _by_repeat(rows: Sequence[dict[str, Any]], name: str) -> list[float]:
    """The mean of ``name`` over the rows of each repeat, in repeat order."""
    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row.get("repeat", 0)].append(row)
    means = (_mean(_values(groups[r], name)) for r in sorted(groups))
    return [m for m in means if m is not None]


def _span(values: np.ndarray) -> tuple[int, int] | None:
    return (int(values.min()), int(values.max())) if len(values) else None


def _mean_span(values: np.ndarray) -> tuple[float, int, int] | None:
    return (float(values.mean()), int(values.min()), int(values.max())) if len(values) else None


def _values(rows: Sequence[dict[str, Any]], name: str) -> np.ndarray:
    return np.asarray([r[name] for r in rows if r.get(name) is not None], dtype=np.float64)


def _mean(values: np.ndarray) -> float | None:
    return float(values.mean()) if len(values) else None


def _wall(rows: Sequence[dict[str, Any]]) -> float:
    spans: dict[str, list[float]] = {}
    for row in rows:
        if row.get("started_at") is None:
            continue
        span = spans.setdefault(row["run_id"], [math.inf, -math.inf])
        span[0] = min(span[0], row["started_at"])
        span[1] = max(span[1], row["finished_at"])
    return float(sum(end - start for start, end in spans.values()))
