"""The papers' published accuracies, for the report's "published" column (spec §7.2-7.4).

Values read off the InfMem README figures are approximate (about ±1 point, MuSiQue markers at
1M the least certain); the MemAgent values are its paper's Table 2, exact. Each number says
where it comes from, and the report prints that next to the table.

Keys: backbone (``qwen3-4b``, ``qwen3-1.7b``, ``qwen2.5-7b``, ``qwen2.5-14b``), dataset
(``hotpotqa``, ``squad``, ``musique``, ``2wiki``), length label as our evaluation files are
labelled, and method (``infmem3`` = the 3-stop InfMem, ``infmem`` = 1-stop, ``memagent``,
``full_context`` = the backbone itself with its long context window).
"""

from __future__ import annotations

from dataclasses import dataclass

from .data import length_tokens

FIG_ACC = "InfMem README benchmark figure (Qwen3-4B, ±1 pt)"
FIG_SCATTER = "InfMem README scatter at 1M (±1 pt, ±1 min)"
MEMAGENT_TABLE = "MemAgent paper Table 2 (RULER-HQA, exact)"


@dataclass(frozen=True)
class PublishedNumber:
    backbone: str
    dataset: str
    length: str
    method: str
    accuracy: float
    minutes: float | None  # wall time of the whole cell, when the source gives it
    source: str


def _row(backbone: str, dataset: str, method: str, lengths: tuple[str, ...], values: tuple[float, ...], source: str):
    return [PublishedNumber(backbone, dataset, length, method, value, None, source) for length, value in zip(lengths, values)]


_L72 = ("64k", "128k", "256k", "512k", "1m")
_TABLE_72 = {  # spec §7.2: dataset -> method -> accuracies at 64k ... 1m
    "hotpotqa": {"infmem3": (68.6, 71.2, 67.3, 67.7, 66.0), "memagent": (65.4, 62.3, 58.1, 58.7, 51.6), "full_context": (41.7, 35.0, 10.8, 8.0, 4.9)},
    "squad": {"infmem3": (66.3, 65.9, 63.5, 77.9, 73.7), "memagent": (68.8, 72.8, 71.1, 75.6, 77.6), "full_context": (39.5, 36.5, 25.0, 34.8, 9.2)},
    "musique": {"infmem3": (57.1, 55.6, 61.3, 59.5, 56.7), "memagent": (40.7, 36.6, 43.0, 35.6, 35.8), "full_context": (13.7, 9.1, 14.2, 7.2, 7.2)},
    "2wiki": {"infmem3": (74.7, 70.3, 66.5, 71.4, 66.3), "memagent": (47.4, 46.1, 41.4, 39.0, 35.1), "full_context": (40.4, 39.3, 20.0, 19.6, 20.3)},
}  # fmt: skip

# spec §7.3: backbone -> method -> dataset -> (accuracy, minutes) at 1M tokens.
_TABLE_73 = {
    "qwen3-1.7b": {
        "memagent": {"hotpotqa": (42.2, 37.8), "squad": (46.8, 41.1), "musique": (23.5, 43.3), "2wiki": (32.0, 45.3)},
        "infmem3": {"hotpotqa": (50.9, 16.6), "squad": (59.1, 18.3), "musique": (37.6, 28.7), "2wiki": (47.8, 19.8)},
        "infmem": {"hotpotqa": (54.2, 11.0), "squad": (52.9, 10.8), "musique": (35.7, 16.3), "2wiki": (49.0, 12.5)},
    },
    "qwen3-4b": {
        "memagent": {"hotpotqa": (51.7, 51.7), "squad": (77.7, 64.1), "musique": (35.9, 59.6), "2wiki": (35.2, 67.7)},
        "infmem3": {"hotpotqa": (66.1, 27.6), "squad": (73.8, 18.7), "musique": (57.0, 19.0), "2wiki": (66.4, 30.7)},
        "infmem": {"hotpotqa": (62.9, 15.3), "squad": (66.2, 9.4), "musique": (50.3, 12.3), "2wiki": (67.7, 9.8)},
    },
    "qwen2.5-7b": {
        "memagent": {"hotpotqa": (58.4, 43.9), "squad": (68.6, 50.2), "musique": (38.3, 54.6), "2wiki": (43.2, 57.7)},
        "infmem3": {"hotpotqa": (57.5, 28.2), "squad": (67.7, 18.9), "musique": (58.5, 18.4), "2wiki": (68.2, 20.9)},
        "infmem": {"hotpotqa": (54.0, 21.3), "squad": (70.1, 13.4), "musique": (51.5, 14.0), "2wiki": (63.8, 14.2)},
    },
}

_L74 = ("7k", "14k", "28k", "56k", "112k", "224k", "448k", "896k", "1792k", "3584k")
_TABLE_74 = {  # spec §7.4: RL-MemAgent on RULER-HQA (eval_{50 ... 25600}.json)
    "qwen2.5-14b": (83.59, 82.03, 84.38, 80.47, 76.56, 81.25, 75.00, 77.34, 76.56, 78.12),
    "qwen2.5-7b": (82.03, 79.69, 78.91, 77.34, 79.69, 72.66, 74.22, 76.56, 75.78, 71.09),
}


def _all_numbers() -> list[PublishedNumber]:
    numbers: list[PublishedNumber] = []
    for dataset, methods in _TABLE_72.items():
        for method, values in methods.items():
            # The 1M column of §7.2 is the 3-stop point of §7.3, which also gives its time.
            numbers += [n for n in _row("qwen3-4b", dataset, method, _L72, values, FIG_ACC) if not (n.length == "1m" and method != "full_context")]
    for backbone, methods in _TABLE_73.items():
        for method, per_dataset in methods.items():
            numbers += [PublishedNumber(backbone, d, "1m", method, acc, minutes, FIG_SCATTER) for d, (acc, minutes) in per_dataset.items()]
    for backbone, values in _TABLE_74.items():
        numbers += _row(backbone, "hotpotqa", "memagent", _L74, values, MEMAGENT_TABLE)
    return numbers


PUBLISHED: tuple[PublishedNumber, ...] = tuple(_all_numbers())
BACKBONES = tuple(sorted({n.backbone for n in PUBLISHED}))


def lookup(backbone: str, dataset: str, length: str, method: str) -> PublishedNumber | None:
    """The published number for this cell, matching lengths by their token count."""
    tokens = length_tokens(length)
    for number in PUBLISHED:
        if (number.backbone, number.dataset, number.method) == (backbone, dataset, method) and length_tokens(number.length) == tokens:
            return number
    return None
