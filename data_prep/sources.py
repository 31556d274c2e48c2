"""Readers of the official QA files: HotpotQA, 2WikiMultihopQA, MuSiQue, SQuAD v1.1 / v2.0.

Each reader turns one file (one split) into a :class:`SourceSet`: the split's paragraph pool and
its questions, each pointing at its gold paragraphs and its own distractors by pool index.

The pool is every paragraph of the split rendered as one document text, de-duplicated and
sorted, exactly as the MemAgent / InfMem generators build theirs, because their largest
evaluation files store contexts as indices into that list (see :mod:`data_prep.published`).
Rendering per source, also as theirs:

* HotpotQA: ``title + "\\n" + "".join(sentences)`` (its sentences carry their leading spaces);
* 2WikiMultihopQA: ``title + "\\n" + sentences`` joined with a space where neither side has one
  (its sentences carry none; a plain join would glue them);
* MuSiQue: ``title + "\\n" + paragraph_text``;
* SQuAD: the paragraph's ``context`` (no title).

Gold paragraphs are HotpotQA / 2Wiki's supporting-fact titles, MuSiQue's ``is_supporting``
paragraphs and SQuAD's own paragraph. Own distractors are the question's other context
paragraphs, and for SQuAD the other paragraphs of the same article (RULER's hard distractors).
Unanswerable questions (MuSiQue ``answerable: false``, SQuAD v2 ``is_impossible``) are skipped.
``index`` is a question's position among the kept questions, the published files' ``index``.

Bad records raise :class:`~data_prep.io.DataError` naming file, line or record, id and field. Real
splits carry a few noisy questions (e.g. a supporting-fact title missing from the question's own
context): ``skip_invalid`` (``--skip-invalid``) leaves such questions out and lists them in
:attr:`SourceSet.invalid` instead, while their paragraphs stay in the pool, so the pool is still
the reference's (whose generators take every record's context) and index contexts still match.
A file that does not parse at all is an error either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from infmem_verl.data.identity import IdLedger

from .io import DataError, iter_json_records, load_json

SOURCES = ("hotpotqa", "2wiki", "musique", "squad")


@dataclass(frozen=True)
class SourceQuestion:
    """One usable question of a split; paragraphs are indices into its :class:`SourceSet` pool."""

    id: str
    index: int
    question: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]
    distractors: tuple[int, ...]


@dataclass
class SourceSet:
    """A split read from one official file: its sorted paragraph pool and its questions.

    ``extra`` paragraphs at the end of ``pool`` come from other files of the source
    (:func:`with_extra_pool`): distractors only, after the split's own pool so that its indices
    stay the reference's.
    """

    source: str
    path: Path
    pool: list[str]
    questions: list[SourceQuestion]
    skipped: int = 0  # unanswerable questions left out
    invalid: list[str] = field(default_factory=list)  # why each left-out invalid question was (skip_invalid)
    extra: int = 0


@dataclass
class _Parsed:
    """A validated question with its paragraphs as rendered text (before pool indexing)."""

    id: str
    question: str
    answers: list[str]
    gold: list[str]
    distractors: list[str]
    where: str = field(repr=False)


@dataclass(frozen=True)
class _Invalid:
    """A question that failed its checks: the error, and its paragraphs when its context reads."""

    reason: str
    paragraphs: tuple[str, ...] = ()


def _salvage(read: Callable[[], Sequence[str]]) -> tuple[str, ...]:
    """The paragraphs of an invalid question, or none when its context itself is what is broken."""
    try:
        return tuple(read())
    except (DataError, AttributeError, TypeError):
        return ()


def load_source(source: str, path: str | os.PathLike, skip_invalid: bool = False) -> SourceSet:
    """Read the official file ``path`` of ``source`` (one of :data:`SOURCES`).

    An invalid question (a field missing or malformed, a repeated id) raises :class:`DataError`;
    with ``skip_invalid`` it is left out and its reason kept in :attr:`SourceSet.invalid`.
    """
    if source not in _READERS:
        raise ValueError(f"source: expected one of {', '.join(SOURCES)}, got {source!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {source} input file not found")
    interned: dict[str, str] = {}
    parsed: list[_Parsed] = []
    invalid: list[str] = []
    ids = IdLedger()
    skipped = 0
    for item in _READERS[source](path):
        if item is None:
            skipped += 1
            continue
        repeat = ids.repeat(item.id, item.where) if isinstance(item, _Parsed) else None
        if repeat is not None:
            item = _Invalid(repeat, (*item.gold, *item.distractors))
        if isinstance(item, _Invalid):
            if not skip_invalid:
                raise DataError(f"{item.reason} (--skip-invalid leaves such questions out)")
            invalid.append(item.reason)
            for p in item.paragraphs:
                interned.setdefault(p, p)
            continue
        # Shared paragraphs (the same article in many questions) are kept once in memory.
        item.gold = [interned.setdefault(p, p) for p in item.gold]
        item.distractors = [interned.setdefault(p, p) for p in item.distractors]
        parsed.append(item)
    if not parsed:
        raise DataError(f"{path}: no answerable {source} questions found" + (f" ({len(invalid)} invalid)" if invalid else ""))
    pool = sorted(interned)
    position = {text: i for i, text in enumerate(pool)}
    questions = [
        SourceQuestion(
            id=item.id,
            index=index,
            question=item.question,
            answers=tuple(item.answers),
            gold=tuple(position[p] for p in item.gold),
            distractors=tuple(position[p] for p in item.distractors),
        )
        for index, item in enumerate(parsed)
    ]
    return SourceSet(source=source, path=path, pool=pool, questions=questions, skipped=skipped, invalid=invalid)


def load_pool(source: str, path: str | os.PathLike) -> list[str]:
    """The paragraph pool of a split, for index contexts and held-out paragraphs: every question's
    context counts, valid or not (as :func:`load_source` with ``skip_invalid`` builds it)."""
    return load_source(source, path, skip_invalid=True).pool


def load_extra_pool(source: str, path: str | os.PathLike) -> list[str]:
    """The paragraphs of ``path``, any official file of ``source`` (a test split without answers
    too), for ``--extra-pool``: only paragraphs are taken, so a record counts when its context
    reads, whether or not its question passes the checks. A file that does not parse as
    ``source``, or where most records have no readable context (a file of another source), is an
    error naming the option and the file."""
    if source not in _READERS:
        raise ValueError(f"source: expected one of {', '.join(SOURCES)}, got {source!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--extra-pool {path}: file not found")
    expected = f"--extra-pool {path}: expected an official {source} file"
    paragraphs: dict[str, None] = {}
    read, unread = 0, []
    try:
        for item in _READERS[source](path):
            if item is None:  # unanswerable: the reader keeps none of its paragraphs
                continue
            found = [*item.gold, *item.distractors] if isinstance(item, _Parsed) else item.paragraphs
            if found:
                read += 1
                paragraphs.update(dict.fromkeys(found))
            else:
                unread.append(item.reason)
    except DataError as err:
        raise DataError(f"{expected}: {err}") from None
    if len(unread) >= max(read, 1):
        example = f", e.g. {unread[0]}" if unread else ""
        raise DataError(f"{expected}: {len(unread)} of its {read + len(unread)} records have no readable {source} context{example}")
    return list(paragraphs)


def with_extra_pool(data: SourceSet, paragraphs: Sequence[str]) -> SourceSet:
    """``data`` with ``paragraphs`` appended to its pool as distractors (those it holds already and
    repeats are left out, sorted as the split's own pool is)."""
    own = set(data.pool)
    extra = sorted({p for p in paragraphs if p not in own})
    return replace(data, pool=data.pool + extra, extra=data.extra + len(extra))


# ------------------------------------------------------------------------------ field checks


def _where(path: Path, number: int, line: int | None, record: Any, id_key: str) -> str:
    """How errors name a record: file, line, record number and id when it has one."""
    place = f"{path}:{line}" if line is not None else str(path)
    rid = record.get(id_key) if isinstance(record, Mapping) else None
    named = f" id={rid!r}" if isinstance(rid, (str, int)) and not isinstance(rid, bool) else ""
    return f"{place}: record #{number}{named}"


def _mapping(value: Any, where: str, name: str = "") -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        target = f"field {name!r}" if name else "record"
        raise DataError(f"{where}: {target}: expected a JSON object, got {type(value).__name__}")
    return value


def _string(record: Mapping[str, Any], key: str, where: str, hint: str = "") -> str:
    if key not in record:
        raise DataError(f"{where}: field {key!r}: missing{hint}")
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field {key!r}: expected a non-empty string, got {_shown(value)}")
    return value


def _record_id(record: Mapping[str, Any], key: str, where: str) -> str:
    value = record.get(key)
    # Integer ids occur in converted copies of these sets; keep them, as strings.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return _string(record, key, where)


def _list(record: Mapping[str, Any], key: str, where: str, optional: bool = False) -> list[Any]:
    if key not in record and optional:
        return []
    value = record.get(key)
    if not isinstance(value, list):
        got = "missing" if key not in record else _shown(value)
        raise DataError(f"{where}: field {key!r}: expected a list, got {got}")
    return value


def _shown(value: Any) -> str:
    """A short rendering of a bad value for error messages."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _unique(items: Sequence[str]) -> list[str]:
    """``items`` without repeats, first occurrence kept (gold answers, paragraphs)."""
    return list(dict.fromkeys(items))


def _answers(main: str, aliases: Sequence[Any], where: str, field_name: str) -> list[str]:
    for i, alias in enumerate(aliases):
        if not isinstance(alias, str):
            raise DataError(f"{where}: field '{field_name}[{i}]': expected a string, got {_shown(alias)}")
    return _unique([main, *[a for a in aliases if a.strip()]])


# ------------------------------------------------------------------- HotpotQA and 2Wiki format


def _titled_context(
    record: Mapping[str, Any], where: str, join: Callable[[Sequence[str]], str]
) -> list[tuple[str, str]]:
    """``context`` as ``(title, rendered paragraph)`` pairs, validated."""
    context = _list(record, "context", where)
    if not context:
        raise DataError(f"{where}: field 'context': expected a non-empty list of [title, sentences]")
    pairs = []
    for i, entry in enumerate(context):
        ok = isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
        ok = ok and isinstance(entry[1], list) and all(isinstance(s, str) for s in entry[1])
        if not ok:
            raise DataError(f"{where}: field 'context[{i}]': expected [title, [sentences...]], got {_shown(entry)}")
        title, sentences = entry
        pairs.append((title, f"{title}\n{join(sentences)}"))
    return pairs


def _supporting_titles(record: Mapping[str, Any], where: str, titles: set[str]) -> list[str]:
    facts = _list(record, "supporting_facts", where)
    if not facts:
        raise DataError(f"{where}: field 'supporting_facts': expected a non-empty list of [title, sentence id]")
    out = []
    for i, fact in enumerate(facts):
        if not (isinstance(fact, (list, tuple)) and len(fact) == 2 and isinstance(fact[0], str)):
            raise DataError(f"{where}: field 'supporting_facts[{i}]': expected [title, sentence id], got {_shown(fact)}")
        if fact[0] not in titles:
            raise DataError(f"{where}: field 'supporting_facts[{i}]': title {fact[0]!r} is not in 'context'")
        out.append(fact[0])
    return _unique(out)


def _read_titled(path: Path, join: Callable[[Sequence[str]], str]) -> Iterator[_Parsed | _Invalid]:
    """HotpotQA / 2WikiMultihopQA: a JSON array (or JSON lines) of questions with titled context."""
    for rec in iter_json_records(path):
        where = _where(path, rec.number, rec.line, rec.value, "_id")
        try:
            item: _Parsed | _Invalid = _titled_question(rec.value, where, join)
        except DataError as err:
            item = _Invalid(str(err), _salvage(lambda: [text for _, text in _titled_context(rec.value, where, join)]))
        yield item


def _titled_question(value: Any, where: str, join: Callable[[Sequence[str]], str]) -> _Parsed:
    record = _mapping(value, where)
    qid = _record_id(record, "_id", where)
    question = _string(record, "question", where)
    answer = _string(record, "answer", where, hint=" (the test split has no answers; use train or dev)")
    pairs = _titled_context(record, where, join)
    gold_titles = set(_supporting_titles(record, where, {title for title, _ in pairs}))
    gold = _unique([text for title, text in pairs if title in gold_titles])
    distractors = _unique([text for title, text in pairs if title not in gold_titles and text not in gold])
    aliases = _list(record, "answer_aliases", where, optional=True)
    return _Parsed(qid, question, _answers(answer, aliases, where, "answer_aliases"), gold, distractors, where)


def _join_hotpot(sentences: Sequence[str]) -> str:
    return "".join(sentences)


def _join_spaced(sentences: Sequence[str]) -> str:
    """Sentences joined with one space where neither neighbour brings whitespace."""
    out = ""
    for sentence in sentences:
        if out and not out[-1].isspace() and sentence and not sentence[0].isspace():
            out += " "
        out += sentence
    return out


def _read_hotpotqa(path: Path) -> Iterator[_Parsed | _Invalid]:
    return _read_titled(path, _join_hotpot)


def _read_2wiki(path: Path) -> Iterator[_Parsed | _Invalid]:
    return _read_titled(path, _join_spaced)


# ------------------------------------------------------------------------------------ MuSiQue


def _read_musique(path: Path) -> Iterator[_Parsed | _Invalid | None]:
    """MuSiQue JSON lines; questions marked ``answerable: false`` are skipped (yield None)."""
    for rec in iter_json_records(path):
        where = _where(path, rec.number, rec.line, rec.value, "id")
        try:
            item: _Parsed | _Invalid | None = _musique_question(rec.value, where)
        except DataError as err:
            item = _Invalid(str(err), _salvage(lambda: [p for part in _musique_paragraphs(rec.value, where) for p in part]))
        yield item


def _musique_question(value: Any, where: str) -> _Parsed | None:
    record = _mapping(value, where)
    qid = _record_id(record, "id", where)
    answerable = record.get("answerable", True)
    if not isinstance(answerable, bool):
        raise DataError(f"{where}: field 'answerable': expected true or false, got {_shown(answerable)}")
    if not answerable:
        return None
    question = _string(record, "question", where)
    answer = _string(record, "answer", where)
    aliases = _list(record, "answer_aliases", where, optional=True)
    gold, distractors = _musique_paragraphs(record, where)
    if not gold:
        raise DataError(f"{where}: field 'paragraphs': no paragraph has is_supporting = true")
    gold = _unique(gold)
    distractors = _unique([p for p in distractors if p not in gold])
    return _Parsed(qid, question, _answers(answer, aliases, where, "answer_aliases"), gold, distractors, where)


def _musique_paragraphs(record: Mapping[str, Any], where: str) -> tuple[list[str], list[str]]:
    """``paragraphs`` rendered, as (supporting, other) lists."""
    gold, distractors = [], []
    for i, raw in enumerate(_list(record, "paragraphs", where)):
        para_where = f"{where}: field 'paragraphs[{i}]'"
        paragraph = _mapping(raw, where, f"paragraphs[{i}]")
        title = paragraph.get("title")
        text = paragraph.get("paragraph_text")
        supporting = paragraph.get("is_supporting")
        if not isinstance(title, str) or not isinstance(text, str) or not text.strip():
            raise DataError(f"{para_where}: expected a string 'title' and a non-empty 'paragraph_text'")
        if not isinstance(supporting, bool):
            raise DataError(f"{para_where}.is_supporting: expected true or false, got {_shown(supporting)}")
        (gold if supporting else distractors).append(f"{title}\n{text}")
    return gold, distractors


# -------------------------------------------------------------------------------------- SQuAD


def _read_squad(path: Path) -> Iterator[_Parsed | _Invalid | None]:
    """SQuAD v1.1 / v2.0 (``{"data": [article...]}``); v2's impossible questions are skipped."""
    document = _mapping(load_json(path), f"{path}: top level")
    articles = _list(document, "data", f"{path}: top level")
    for a, raw_article in enumerate(articles):
        article_where = f"{path}: data[{a}]"
        article = _mapping(raw_article, article_where)
        paragraphs = []
        for p, raw_paragraph in enumerate(_list(article, "paragraphs", article_where)):
            paragraph_where = f"{article_where}.paragraphs[{p}]"
            paragraph = _mapping(raw_paragraph, paragraph_where)
            paragraphs.append((paragraph_where, _string(paragraph, "context", paragraph_where), paragraph))
        contexts = _unique([context for _, context, _ in paragraphs])
        for paragraph_where, context, paragraph in paragraphs:
            others = [c for c in contexts if c != context]
            for q, raw_qa in enumerate(_list(paragraph, "qas", paragraph_where)):
                try:
                    item: _Parsed | _Invalid | None = _squad_question(raw_qa, f"{paragraph_where}.qas[{q}]", context, others)
                except DataError as err:
                    item = _Invalid(str(err), (context,))
                yield item


def _squad_question(raw: Any, where: str, context: str, others: list[str]) -> _Parsed | None:
    rid = raw.get("id") if isinstance(raw, Mapping) else None
    where = f"{where} id={rid!r}" if isinstance(rid, str) else where
    qa = _mapping(raw, where)
    qid = _record_id(qa, "id", where)
    impossible = qa.get("is_impossible", False)
    if not isinstance(impossible, bool):
        raise DataError(f"{where}: field 'is_impossible': expected true or false, got {_shown(impossible)}")
    if impossible:
        return None
    question = _string(qa, "question", where)
    texts = []
    for i, answer in enumerate(_list(qa, "answers", where)):
        text = answer.get("text") if isinstance(answer, Mapping) else None
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: field 'answers[{i}].text': expected a non-empty string, got {_shown(answer)}")
        texts.append(text)
    if not texts:
        raise DataError(f"{where}: field 'answers': expected at least one answer for an answerable question")
    return _Parsed(qid, question, _unique(texts), [context], list(others), where)


# Each yields per question: a _Parsed, an _Invalid (failed its checks) or None (unanswerable).
_READERS: dict[str, Callable[[Path], Iterator[_Parsed | _Invalid | None]]] = {
    "hotpotqa": _read_hotpotqa,
    "2wiki": _read_2wiki,
    "musique": _read_musique,
    "squad": _read_squad,
}
