"""One long-document QA sample, the record every dataset loader and the agent loops share."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass
class QASample:
    """A question over a (long) context with its gold answers.

    ``answers`` holds every accepted gold string (scorers take the best match); ``source`` names
    the dataset; ``meta`` carries dataset-specific extras (e.g. where the evidence sits).
    """

    id: str
    question: str
    answers: list[str]
    context: str
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_record(cls, record: Mapping[str, Any], where: str = "") -> "QASample":
        """Validate a plain mapping (a JSON line, a parquet row) and build a sample from it.

        ``where`` (e.g. ``"train.jsonl:17"``) prefixes error messages, together with the
        record's id when it has one, so a bad row in a large file can be found.
        """
        label = _label(record, where)
        if not isinstance(record, Mapping):
            raise ValueError(f"{label}: expected a mapping with question/answers/context, got {type(record).__name__}")
        return cls(
            id=_id(record, label),
            question=_text(record, "question", label),
            answers=_answers(record, label),
            context=_text(record, "context", label),
            source=_optional(record, "source", str, "", label),
            meta=dict(_optional(record, "meta", Mapping, {}, label)),
        )

    def to_record(self) -> dict[str, Any]:
        """A plain dict (JSON/parquet friendly) that :meth:`from_record` turns back into ``self``."""
        return {
            "id": self.id,
            "question": self.question,
            "answers": list(self.answers),
            "context": self.context,
            "source": self.source,
            "meta": copy.deepcopy(self.meta),
        }


def _label(record: Any, where: str) -> str:
    """How error messages name the record: ``where`` and/or its id."""
    rid = record.get("id") if isinstance(record, Mapping) else None
    parts = [where] if where else []
    if isinstance(rid, (str, int)) and not isinstance(rid, bool):
        parts.append(f"id={rid!r}")
    return "record " + " ".join(parts) if parts else "record"


def _id(record: Mapping[str, Any], label: str) -> str:
    value = record.get("id")
    # Integer ids (row numbers) are common in public datasets; keep them, as strings.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{label}: field 'id': expected a non-empty string or an integer, got {value!r}")
    return value


def _text(record: Mapping[str, Any], name: str, label: str) -> str:
    value = record.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{label}: field {name!r}: expected a non-empty string, got {_describe(record, name)}")
    return value


def _describe(record: Mapping[str, Any], name: str) -> str:
    """A short rendering of a bad field for error messages (long contexts are cut)."""
    if name not in record:
        return "missing"
    value = record[name]
    return repr(value[:40]) if isinstance(value, str) else repr(value)[:60]


def _answers(record: Mapping[str, Any], label: str) -> list[str]:
    value = record.get("answers")
    # A single gold string is the common case in hand-written data; accept it as a list of one.
    answers = [value] if isinstance(value, str) else value
    if not isinstance(answers, (list, tuple)) or not answers:
        got = _describe(record, "answers")
        raise ValueError(f"{label}: field 'answers': expected a non-empty list of strings, got {got}")
    for i, answer in enumerate(answers):
        if not isinstance(answer, str) or not answer.strip():
            raise ValueError(f"{label}: field 'answers[{i}]': expected a non-empty string, got {answer!r}")
    return list(answers)


def _optional(record: Mapping[str, Any], name: str, kind: type, default: Any, label: str) -> Any:
    value = record.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise ValueError(f"{label}: field {name!r}: expected a {kind.__name__}, got {type(value).__name__}")
    return value
