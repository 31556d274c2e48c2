"""Prompt templates of a released checkpoint, read from the user's checkout of its reference code.

    python -m infmem_verl.eval ... --templates-from /src/MemAgent           # MemAgent's layout
    python -m infmem_verl.eval ... --templates-from infmem=/src/InfMem      # InfMem's checkpoints
    python -m infmem_verl.eval ... --templates-from memagent=/src/InfMem    # its MemAgent baseline

A checkpoint answers best with the prompts it was trained and evaluated with, and those live in
the authors' evaluation code as Python string constants filled with ``str.format``. This module
reads them from the user's own checkout (parsed with ``ast``, never imported: those modules
download data and open clients at import time), maps the reference's placeholders onto the
slots our prompt builder fills, checks that every slot is there exactly once and that no other
placeholder is, and writes the result as a ``prompt_templates`` file
(:mod:`infmem_verl.agent.templates`) next to the evaluation's results, so the run says which
prompts it used. The project ships none of the authors' texts; they come from the checkout.

For InfMem's layout the controller's grammar is the Qwen-Agent one (``controller.grammar=
qwen_agent``), with the function name read from the tool schema in the same file. The PreThink
system message that describes the tool is written here from that schema (its name, description
and JSON parameters, and the call syntax); Qwen-Agent's own wording of that message is not
reproduced.
"""

from __future__ import annotations

import ast
import json
import os
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.templates import SLOTS, load_templates

OPTION = "--templates-from"
TEMPLATES_FILE = "prompt_templates.yaml"
# The reference code's placeholder names -> the slots our prompt builder fills.
PLACEHOLDERS = {"prompt": "question", "memory": "memory", "chunk": "chunk", "retrieve": "evidence", "retrieval_history": "history"}


@dataclass(frozen=True)
class Layout:
    """Where one reference repository keeps its evaluation prompts."""

    name: str
    file: str  # relative to the checkout
    constants: dict[str, str]  # our prompt kind -> the constant holding its template
    schema_function: str | None = None  # a function returning the controller tool's JSON schema


LAYOUTS = {
    # MemAgent's harness (and the copy inside InfMem's repository, for its MemAgent baseline).
    "memagent": Layout("memagent", "taskutils/memory_eval/utils/recurrent.py", {"write_memagent": "TEMPLATE", "answer": "TEMPLATE_FINAL"}),
    "infmem": Layout(
        "infmem",
        "taskutils/memory_eval/utils/infmem.py",
        {"prethink": "TEMPLATE_CALL_OR_ANSWER", "write_infmem": "TEMPLATE_RETREIVE_RECURRENT", "answer": "TEMPLATE_FINAL"},
        schema_function="get_bm25search_tool_schema",
    ),
}


def parse_spec(spec: str) -> tuple[Layout, Path]:
    """``[LAYOUT=]PATH``: without a layout, InfMem's when its file is in the checkout, else MemAgent's."""
    name, sep, path = spec.partition("=")
    if sep and name in LAYOUTS:
        return LAYOUTS[name], Path(path).expanduser()
    if sep and not Path(spec).exists():
        raise ConfigError(f"{OPTION}: unknown layout {name!r}; expected [{'|'.join(LAYOUTS)}=]PATH, got {spec!r}")
    root = Path(spec).expanduser()
    return (LAYOUTS["infmem"] if (root / LAYOUTS["infmem"].file).is_file() else LAYOUTS["memagent"]), root


def read_constants(file: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The module-level string constants of ``file`` and the dicts its functions return literally."""
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    except (OSError, SyntaxError, ValueError) as err:
        raise ConfigError(f"{OPTION}: cannot parse {file} ({err})") from None
    constants: dict[str, str] = {}
    returned: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = node.value.value
        elif isinstance(node, ast.FunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Return) and isinstance(inner.value, ast.Dict):
                    try:
                        returned[node.name] = ast.literal_eval(inner.value)
                    except ValueError:
                        continue
                    break
    return constants, returned


def to_slots(text: str, where: str, kind: str) -> str:
    """A ``str.format`` template as ours: reference placeholders renamed to our slots, escaped
    braces made literal; a missing slot or an unknown placeholder is a ConfigError naming it."""
    out, found = [], []
    try:
        parts = list(string.Formatter().parse(text))
    except ValueError as err:
        raise ConfigError(f"{where}: not a str.format template ({err})") from None
    for literal, name, _spec, _conversion in parts:
        out.append(literal)
        if name is None:
            continue
        if name not in PLACEHOLDERS or PLACEHOLDERS[name] not in SLOTS[kind]:
            expected = sorted(ref for ref, ours in PLACEHOLDERS.items() if ours in SLOTS[kind])
            raise ConfigError(f"{where}: placeholder {{{name}}} has no slot in our {kind} prompt; expected {expected}")
        found.append(PLACEHOLDERS[name])
        out.append("{" + PLACEHOLDERS[name] + "}")
    for slot in SLOTS[kind]:
        if found.count(slot) != 1:
            reference = next(ref for ref, ours in PLACEHOLDERS.items() if ours == slot)
            raise ConfigError(f"{where}: expected the placeholder {{{reference}}} (our {{{slot}}}) exactly once, found it {found.count(slot)} times")
    return "".join(out)


def tool_system_message(schema: dict[str, Any], where: str) -> tuple[str, str]:
    """(function name, PreThink system message) from an OpenAI-style tool schema."""
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ConfigError(f"{where}: expected a tool schema {{'function': {{'name': ..., 'parameters': ...}}}}")
    name = function["name"]
    spec = json.dumps({k: function[k] for k in ("name", "description", "parameters") if k in function}, ensure_ascii=False)
    message = (
        "# Tools\n\nYou may call this function:\n\n"
        f"{spec}\n\n"
        "To call it, write after your thinking:\n"
        f"✿FUNCTION✿: {name}\n"
        "✿ARGS✿: a JSON object of its arguments\n\n"
        "To stop retrieving, write STOP instead."
    )
    return name, message


def templates_from(spec: str, out_dir: Path) -> dict[str, Any]:
    """Write ``out_dir/prompt_templates.yaml`` from the checkout ``spec`` names; returns the agent
    settings that use it (``prompt_templates``, answer format, controller grammar)."""
    layout, root = parse_spec(spec)
    if not root.is_dir():
        raise ConfigError(f"{OPTION}: {root} is not a folder (expected a checkout of the reference repository)")
    file = root / layout.file
    if not file.is_file():
        raise ConfigError(f"{OPTION}: {file} not found; a checkout with the {layout.name} layout holds {layout.file}")
    constants, returned = read_constants(file)
    templates: dict[str, Any] = {}
    for kind, constant in layout.constants.items():
        if constant not in constants:
            raise ConfigError(f"{OPTION}: {file} defines no string constant {constant} (the {kind} prompt)")
        templates[kind] = {"user": to_slots(constants[constant], f"{OPTION}: {file}: {constant}", kind)}
    settings: dict[str, Any] = {"answer_format": "answer_is" if "the answer is" in constants[layout.constants["answer"]].lower() else "boxed"}
    if layout.schema_function:
        where = f"{OPTION}: {file}: {layout.schema_function}()"
        if layout.schema_function not in returned:
            raise ConfigError(f"{where}: no function returning the tool schema as a literal dict")
        name, templates["prethink"]["system"] = tool_system_message(returned[layout.schema_function], where)
        settings["controller"] = {"grammar": "qwen_agent", "function_name": name}
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / TEMPLATES_FILE
    header = f"# Written by {OPTION} from {file} ({layout.name} layout); the texts are the checkout's.\n"
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(header + yaml.safe_dump(templates, allow_unicode=True, sort_keys=False, width=1000), encoding="utf-8")
    os.replace(tmp, target)  # a resumed run finds the same file, never a half-written one
    load_templates(target)  # the builder's own checks, on the file the run will read
    return {**settings, "prompt_templates": str(target)}
