"""Prompt templates supplied as a user file, for models trained with another protocol's prompts.

A checkpoint answers best with the prompts it was trained on. A template file lets a user point
the harness at those (written out by the user; the project ships none of the authors' texts)
while everything else (token-id assembly, budgets, parsing) stays the agent core's. The file is
YAML (or JSON) with one entry per prompt kind it replaces; kinds it leaves out keep the built-in
prompts::

    write_memagent: |
      Update the notes for the question using the passage.
      Question: {question}
      Passage: {chunk}
      Notes so far: {memory}
    answer:
      system: You answer from notes.      # optional system message
      user: "{question}\n{memory}\nReply with the answer."

A slot is its name in braces; each kind must use each of its slots exactly once (the order is
free, so "chunk before memory" is just another template), other braces are literal text:

========================  ==============================================
kind                      slots
========================  ==============================================
``prethink``              question, history, memory
``write_memagent``        question, memory, chunk
``write_infmem``          question, memory, evidence, chunk
``answer``                question, memory
========================  ==============================================
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

SLOTS: dict[str, tuple[str, ...]] = {
    "prethink": ("question", "history", "memory"),
    "write_memagent": ("question", "memory", "chunk"),
    "write_infmem": ("question", "memory", "evidence", "chunk"),
    "answer": ("question", "memory"),
}
_SLOT = re.compile(r"\{(question|history|memory|chunk|evidence)\}")


@dataclass(frozen=True)
class PromptTemplate:
    """One prompt kind's messages: an optional system message and the user message with slots."""

    user: str
    system: str | None = None

    def messages(self, slots: Mapping[str, str]) -> list[dict[str, str]]:
        """The chat messages with ``slots`` (slot name -> text) filled in."""
        content = _SLOT.sub(lambda m: slots[m.group(1)], self.user)
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*system, {"role": "user", "content": content}]


def load_templates(path: str | os.PathLike) -> dict[str, PromptTemplate]:
    """The templates of the file at ``path``, checked; ConfigError naming the file, the kind and
    what was expected on any problem. Cached per (path, modification time)."""
    file = Path(path)
    try:
        stamp = file.stat().st_mtime_ns
    except OSError as err:
        raise ConfigError(f"prompt_templates: cannot read {file} ({err.strerror})") from None
    return dict(_load(str(file.resolve()), stamp))


@functools.lru_cache(maxsize=16)
def _load(path: str, stamp: int) -> tuple[tuple[str, PromptTemplate], ...]:
    del stamp  # part of the cache key only: an edited file is read again
    import yaml

    where = f"prompt_templates: {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{where}: not UTF-8 text ({err.reason}); save it as UTF-8") from None
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys) if path.endswith(".json") else yaml.load(text, _yaml_loader())
    except (ValueError, yaml.YAMLError) as err:
        # One line: YAML's messages spread over several, with the place marked.
        detail = " ".join(str(err).split())
        raise ConfigError(f"{where}: not valid {'JSON' if path.endswith('.json') else 'YAML'} ({detail})") from None
    if not isinstance(data, Mapping) or not data:
        raise ConfigError(f"{where}: expected a mapping of prompt kinds {sorted(SLOTS)} to templates")
    unknown = sorted(set(data) - set(SLOTS))
    if unknown:
        raise ConfigError(f"{where}: unknown prompt kind {unknown[0]!r}; expected some of {sorted(SLOTS)}")
    return tuple((kind, _template(data[kind], f"{where}: {kind}", SLOTS[kind])) for kind in data)


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A mapping with each key once: a file naming a kind twice leaves it unclear which is meant."""
    value = dict(pairs)
    if len(value) < len(pairs):
        keys = [key for key, _ in pairs]
        raise ValueError(f"key {next(k for i, k in enumerate(keys) if k in keys[:i])!r} appears twice in one mapping")
    return value


@functools.cache
def _yaml_loader():
    """PyYAML's safe loader, refusing a key repeated in one mapping (it keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            _unique_keys([(self.construct_object(key, deep=deep), None) for key, _ in node.value])
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _template(value: Any, where: str, slots: tuple[str, ...]) -> PromptTemplate:
    if isinstance(value, str):
        value = {"user": value}
    if not isinstance(value, Mapping) or set(value) - {"user", "system"} or not isinstance(value.get("user"), str):
        raise ConfigError(f"{where}: expected a string or a mapping with 'user' (and optionally 'system') strings")
    system = value.get("system")
    if system is not None and not isinstance(system, str):
        raise ConfigError(f"{where}.system: expected a string, got {type(system).__name__}")
    if system is not None and _SLOT.search(system):
        raise ConfigError(f"{where}.system: slots belong in the user message, found {_SLOT.search(system).group()}")
    found = _SLOT.findall(value["user"])
    for slot in slots:
        if found.count(slot) != 1:
            raise ConfigError(f"{where}.user: expected the slot {{{slot}}} exactly once, found it {found.count(slot)} times")
    extra = sorted(set(found) - set(slots))
    if extra:
        raise ConfigError(f"{where}.user: slot {{{extra[0]}}} is not available here; its slots are {list(slots)}")
    return PromptTemplate(user=value["user"], system=system)
