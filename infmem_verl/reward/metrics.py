"""Answer metrics for QA: exact match, token F1, substring match, and answer-in-text detection.

``normalize_answer``, ``exact_match`` and ``f1`` follow the official SQuAD / HotpotQA evaluation
scripts, so scores are comparable with published numbers. ``sub_em`` is the two-way containment
the MemAgent / InfMem harnesses report as "accuracy" (spec §6.3); ``sub_em_strict`` keeps only the
gold-in-prediction direction, because a short prediction inside a long gold (e.g. "1" inside
"1990") is not a correct answer, and matches whole words, because a gold inside a longer word is
not either ("no" inside "not sure", "3" inside "1923"). Unlike the reference harness, every metric
is maximised over all gold answers, not just the first.

Pure Python on purpose: the reward manager and the evaluation scripts both import it.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
# HotpotQA's F1 gives no partial credit when either side is one of these and they differ.
_CLOSED_ANSWERS = frozenset({"yes", "no", "noanswer"})


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace (SQuAD)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(pred: str | None, golds: Iterable[str]) -> float:
    """1.0 when the normalized prediction equals some normalized gold answer."""
    return _best(pred, golds, lambda p, g: float(p == g))


def f1(pred: str | None, golds: Iterable[str]) -> float:
    """Best token-level F1 over the gold answers, with HotpotQA's yes/no/noanswer rule."""
    return _best(pred, golds, _token_f1)


def sub_em(pred: str | None, golds: Iterable[str]) -> float:
    """1.0 when a normalized gold is inside the normalized prediction or vice versa.

    Containment is on characters, as in the reference harness. An empty side never matches:
    the empty string is inside everything.
    """
    return _best(pred, golds, lambda p, g: float(bool(p and g) and (g in p or p in g)))


def sub_em_strict(pred: str | None, golds: Iterable[str]) -> float:
    """1.0 when a gold occurs in the prediction as whole words (:func:`answer_in_text`).

    One direction only (gold in prediction), on normalized text: "Paris, France" holds "Paris",
    "not sure" does not hold "no" and "1923" does not hold "3".
    """
    # Normalized text is words joined by single spaces, so padding both sides with spaces turns
    # a substring test into a whole-word test.
    return _best(pred, golds, lambda p, g: float(bool(g) and f" {g} " in f" {p} "))


# The keys of score_answer, in its order: the metrics a caller may pick one of.
ANSWER_METRICS = ("em", "f1", "sub_em", "sub_em_strict")


def score_answer(pred: str | None, golds: Iterable[str]) -> dict[str, float]:
    """All answer metrics at once, keyed by :data:`ANSWER_METRICS` (em, f1, sub_em, sub_em_strict)."""
    golds = _checked_golds(golds)
    return {
        "em": exact_match(pred, golds),
        "f1": f1(pred, golds),
        "sub_em": sub_em(pred, golds),
        "sub_em_strict": sub_em_strict(pred, golds),
    }


def answer_in_text(answer: str, text: str) -> bool:
    """Whether the normalized ``answer`` occurs in the normalized ``text`` as whole words.

    Whole words, so that short answers such as "no" or "1" are not found inside "not", "piano"
    or "10". An answer that normalizes to nothing is never found.
    """
    if not isinstance(answer, str):
        raise ValueError(f"answer must be a string, got {type(answer).__name__}")
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    return sub_em_strict(text, [answer]) == 1.0


def is_yes_no(answer: str) -> bool:
    """Whether ``answer`` is "yes" or "no" once normalized (HotpotQA's comparison answers).

    Such words occur in ordinary text ("No relevant information here"), so their presence in a
    memory says nothing about whether the answer was found.
    """
    return normalize_answer(answer) in ("yes", "no")


def _token_f1(pred: str, gold: str) -> float:
    """Token F1 of two normalized strings (HotpotQA's ``f1_score``)."""
    if (pred in _CLOSED_ANSWERS or gold in _CLOSED_ANSWERS) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _best(pred: str | None, golds: Iterable[str], metric: Callable[[str, str], float]) -> float:
    """Maximum of ``metric(normalized pred, normalized gold)`` over the golds; 0.0 for no pred."""
    golds = _checked_golds(golds)
    if pred is None:
        return 0.0
    if not isinstance(pred, str):
        raise ValueError(f"pred must be a string or None, got {type(pred).__name__}")
    normalized = normalize_answer(pred)
    return max(metric(normalized, normalize_answer(gold)) for gold in golds)


def _checked_golds(golds: Iterable[str]) -> list[str]:
    """``golds`` as a list, or ValueError unless it is a non-empty collection of strings.

    Any non-string iterable is accepted (lists, tuples, numpy object arrays read from parquet);
    a bare string is rejected because iterating it would score each character as an answer.
    """
    if isinstance(golds, (str, bytes, Mapping)) or not isinstance(golds, Iterable):
        raise ValueError(f"golds must be a non-empty list of strings, got {type(golds).__name__}")
    out = list(golds)
    if not out or not all(isinstance(g, str) for g in out):
        raise ValueError(f"golds must be a non-empty list of strings, got {out!r}")
    return out
