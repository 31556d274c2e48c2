"""The configuration reference: every ``infmem.*`` key, its default and its meaning, as Markdown.

    python -m infmem_verl.config_reference > docs/configuration.md

Generated, not written: the keys come from the settings dataclasses that read each ``infmem``
section (:data:`SECTIONS`), the defaults from ``conf/infmem_trainer.yaml`` (what every recipe
starts from; the record's own default is given where it differs), the meanings from the comment
above each field in its dataclass, else from the comment on the key in that YAML file.
``tests/test_docs.py`` fails when docs/configuration.md differs from this output, when a key of a
shipped config is missing here, or when a settings class read with ``read_settings`` is not listed.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from infmem_verl import conf_dir
from infmem_verl.agent.config import AgentConfig
from infmem_verl.cpu.backend import CPUSettings
from infmem_verl.cpu.bootstrap import BootstrapSettings
from infmem_verl.cpu.warmup import WarmupSettings
from infmem_verl.run_record import RecordSettings
from infmem_verl.settings import CostSettings, DocumentSettings, TrainSettings


@dataclass(frozen=True)
class Section:
    """One ``infmem`` section and the dataclass that reads it."""

    path: str
    record: type
    read_by: str  # where it is read, for the reader who wants the code


SECTIONS = (
    Section("infmem.agent", AgentConfig, "infmem_verl/agent/config.py (AgentConfig)"),
    Section("infmem.documents", DocumentSettings, "infmem_verl/settings.py"),
    Section("infmem.train", TrainSettings, "infmem_verl/settings.py"),
    Section("infmem.cost", CostSettings, "infmem_verl/settings.py, infmem_verl/cost.py"),
    Section("infmem.records", RecordSettings, "infmem_verl/run_record.py"),
    Section("infmem.cpu", CPUSettings, "infmem_verl/cpu/backend.py"),
    Section("infmem.bootstrap", BootstrapSettings, "infmem_verl/cpu/bootstrap.py"),
    Section("infmem.warmup", WarmupSettings, "infmem_verl/cpu/warmup.py"),
)
# Keys read directly (no record of their own), documented by their comment in the trainer YAML.
SCALARS = ("infmem.backend", "infmem.allow_mixed_agents")
# Reward components are free-form (name -> {_target_, weight, **kwargs}); their keys are listed
# from the shipped presets.
COMPONENTS = "infmem.reward.components"
TRAINER_YAML = "infmem_trainer.yaml"
# A meaning is the comment's first sentence, so a long measurement note stays in the source.
MAX_MEANING = 240


@dataclass(frozen=True)
class Row:
    key: str
    default: str
    meaning: str


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment block directly above its line in ``cls``'s source, or the
    comment at the end of that line."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[str, str] = {}
    pending: list[str] = []
    group = ""  # a comment block above consecutive fields speaks for all of them
    line_of_comment: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            line_of_comment[token.start[0]] = token.string.lstrip("#").strip()
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(line_of_comment.get(number, ""))
            continue
        match = re.match(r"\s{4}(\w+)\s*:", line)
        if match and not stripped.startswith(("def ", "return")):
            name = match.group(1)
            own = number in line_of_comment and not pending
            group = "" if own else " ".join(pending) or group
            text = line_of_comment[number] if own else group
            if text and name not in comments:
                comments[name] = text
        else:
            group = ""
        pending = []
    return comments


def yaml_comments(path: Path) -> dict[str, str]:
    """Dotted key -> its comment in a block-style YAML file (the lines above it, or on its line)."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"(\s*)([\w.-]+):(.*)$", line)
        if not match:
            pending = []
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        trailing = rest.split(" #", 1)[1].strip() if " #" in rest else ""
        text = " ".join(pending) or trailing
        if text:
            comments[".".join(k for _, k in stack)] = text
        pending = []
    return comments


def first_sentence(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    match = re.match(r"(.+?\.)(\s+[A-Z(\"`]|$)", text)
    sentence = match.group(1) if match else text
    return sentence if len(sentence) <= MAX_MEANING else sentence[: MAX_MEANING - 1].rstrip() + "…"


def _show(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, dict)):
        return f"`{OmegaConf.to_yaml(value).strip()}`" if isinstance(value, dict) else f"`{value}`"
    return f"`{value}`"


def _leaves(cls: type, prefix: str) -> Iterator[tuple[str, dataclasses.Field, type, Any]]:
    """(dotted key, field, owning class, record default) for every leaf field, nested records
    walked."""
    instance = _defaults(cls)
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name) if instance is not None else dataclasses.MISSING
        if dataclasses.is_dataclass(value):
            for key, sub, owner, default in _leaves(type(value), f"{prefix}.{f.name}"):
                yield key, sub, owner, getattr(value, sub.name) if owner is type(value) and default is not dataclasses.MISSING else default
        else:
            yield f"{prefix}.{f.name}", f, cls, value


def _defaults(cls: type) -> Any:
    try:
        return cls()
    except TypeError:  # a record with required fields (CallBudget): no defaults of its own
        return None


def rows(conf: Path | None = None) -> dict[str, list[Row]]:
    """Section title -> its rows, in :data:`SECTIONS` order (then the scalars and the reward)."""
    conf = conf or conf_dir()
    trainer = OmegaConf.load(conf / TRAINER_YAML)
    comments = yaml_comments(conf / TRAINER_YAML)
    out: dict[str, list[Row]] = {}
    scalars = []
    for key in SCALARS:
        scalars.append(Row(key, _show(OmegaConf.select(trainer, key)), first_sentence(comments.get(key, ""))))
    out["infmem"] = scalars
    for section in SECTIONS:
        section_rows = []
        for key, f, owner, record_default in _leaves(section.record, section.path):
            meaning = field_comments(owner).get(f.name) or comments.get(key)
            yaml_value = OmegaConf.select(trainer, key, default=dataclasses.MISSING)
            default = _show(record_default) if yaml_value is dataclasses.MISSING else _show(yaml_value)
            if yaml_value is not dataclasses.MISSING and record_default is not dataclasses.MISSING and yaml_value != record_default:
                default += f" (record: {_show(record_default)})"
            section_rows.append(Row(key, default, first_sentence(meaning) if meaning else "(no comment in the source)"))
        out[section.path] = section_rows
    out[COMPONENTS] = component_rows(conf)
    return out


def component_rows(conf: Path) -> list[Row]:
    """Every key of every component in the shipped reward presets, with the preset that sets it."""
    found: dict[str, list[str]] = {}
    for preset in sorted((conf / "reward_fn").glob("*.yaml")):
        node = OmegaConf.select(OmegaConf.load(preset), COMPONENTS) or {}
        for name, component in node.items():
            for key, value in component.items():
                found.setdefault(f"{COMPONENTS}.{name}.{key}", []).append(f"{preset.stem}: {value}")
    meaning = {
        "_target_": "the scoring function, by dotted path (any importable function of a trajectory record)",
        "weight": "its weight in the summed reward",
    }
    return [
        Row(key, "; ".join(f"`{v}`" for v in values), meaning.get(key.rpartition(".")[2], "a keyword argument of the function"))
        for key, values in found.items()
    ]


def documented_keys(conf: Path | None = None) -> set[str]:
    return {row.key for section in rows(conf).values() for row in section}


def markdown(conf: Path | None = None) -> str:
    lines = [
        "# Configuration reference: `infmem.*`",
        "",
        "<!-- Generated by `python -m infmem_verl.config_reference > docs/configuration.md`; do not edit by hand."
        " tests/test_docs.py fails when this file is out of date. -->",
        "",
        "Every key under `infmem` in the trainer config, with its default in `conf/infmem_trainer.yaml`",
        "(what every recipe starts from; recipes override some, see `conf/recipe/*.yaml`) and its meaning.",
        "Set one on the command line: `python -m infmem_verl.main +recipe=infmem_4b infmem.agent.stop_votes=3`.",
        "verl's own keys (`trainer.*`, `actor_rollout_ref.*`, `data.*`, `algorithm.*`) are verl's: print the",
        "composed config with `python -m infmem_verl.main +recipe=infmem_4b --cfg job`.",
        "Evaluation and distillation take the `infmem.agent` keys without the prefix (`--set stop_votes=3`).",
        "",
    ]
    readers = {s.path: s.read_by for s in SECTIONS}
    for title, section in rows(conf).items():
        lines.append(f"## `{title}`")
        lines.append("")
        if title in readers:
            lines += [f"Read by {readers[title]}.", ""]
        lines += ["| key | default | meaning |", "|---|---|---|"]
        lines += [f"| `{r.key}` | {r.default} | {r.meaning.replace('|', '/')} |" for r in section]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    del argv
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
