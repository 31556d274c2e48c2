"""The InfMem / MemAgent protocol: every prompt, the controller's action grammar, every parser.

RL rollouts, SFT data, evaluation and distillation all build their prompts through
:class:`PromptBuilder` and read model outputs through the parsers below, so the model sees one
protocol everywhere (the reference mixed several; spec §8.1 items 2-4).

Action grammar (PreThink)
-------------------------
The controller may think first. Only the text after the first ``</think>`` counts (see
:func:`split_thinking`); whatever the thinking contains (the word STOP, a tool call, JSON) is
ignored. That text must be exactly ONE Qwen3-native tool call, with nothing else around it but
whitespace::

    <tool_call>
    {"name": "retrieve", "arguments": {"query": "<text>", "top_k": <int>}}
    </tool_call>

or::

    <tool_call>
    {"name": "stop", "arguments": {}}
    </tool_call>

The two tools reach the model as JSON schemas through the chat template's ``tools`` argument
(:func:`tool_schemas`). ``query`` must be a non-empty string; ``top_k`` is optional (default
``RetrievalConfig.top_k_default``) and must be a JSON integer: an integer outside
``[top_k_min, top_k_max]`` is clamped (the action stays valid, ``clamped=True``), any other type
(float, string, bool, null) is a protocol error. The JSON object must have exactly the keys
``name`` and ``arguments``; unknown tools or arguments, duplicate keys, a second call, text
before or after the call, truncated or invalid JSON are protocol errors too.
:func:`parse_action` turns every protocol error into ``Action(kind="continue", valid=False)``
with a reason; the agent loop decides the fallback. With thinking off the whole response is the
output.

Prompt assembly and its one tokenization difference
---------------------------------------------------
Each prompt kind is rendered once, at construction, by ``tokenizer.apply_chat_template`` with
sentinel strings in its slots (question, memory, chunk, evidence, search history). The rendered
text is split at the sentinels and the static pieces are tokenized once; a call only
concatenates static ids with the slot ids, which callers pass in already tokenized (a document
is tokenized once, not once per prompt). ``decode(ids)`` of a built prompt is therefore exactly
the text the chat template renders for the same messages with the slot texts filled in
(:meth:`PromptBuilder.render_text`).

The token ids equal ``tokenizer(rendered_text)`` except at slot boundaries, because Qwen's
byte-level BPE may merge characters across a boundary that separate tokenization keeps apart
(e.g. a question ending in "?" followed by the template's "\\n" is one token "?\\n" when
tokenized together, two tokens here; a slot starting with "\\n" merges with the template's
"\\n" before it). Every static piece in front of a slot ends with "\\n" and every piece after a
slot starts with "\\n", so when each slot text starts and ends with a letter the ids are
identical; otherwise the difference is confined to at most 2 tokens on each side of a slot
boundary. Retrieved passages are slots of their own, so the same holds around each
``[Retrieved #i]`` label.

User templates (``prompt_templates``, :mod:`infmem_verl.agent.templates`) replace the built-in
messages of the kinds they name and are assembled the same way; the decoded prompt is again
exactly the chat template's text, and the ids differ from whole-text tokenization only at slot
boundaries (by more than the two tokens above only where a template glues a slot to a word).

Prompt budgets: a prompt never exceeds its ``prompt_tokens``. Retrieved evidence is first capped
at ``retrieval.evidence_tokens``; when the Write prompt is still too long, evidence is shortened
further (lowest-ranked passages dropped from the end, then the last kept one cut), then the chunk
(its head kept). The question, the memory and the template are never cut; if they alone do not
fit, a ``ValueError`` names the question. A PreThink prompt drops its oldest search-history lines
when needed.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from infmem_verl.agent.config import AgentConfig, ControllerConfig, RetrievalConfig
from infmem_verl.agent.document import split_safe
from infmem_verl.agent.templates import load_templates
from infmem_verl.agent.trajectory import FLAG_CHUNK_SHORTENED, FLAG_EVIDENCE_SHORTENED, Action

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
RETRIEVE_TOOL = "retrieve"
STOP_TOOL = "stop"
# The qwen_agent grammar (controller.grammar): Qwen-Agent's function-call markers and the stop word.
QWEN_FUNCTION = "\u273fFUNCTION\u273f"
QWEN_ARGS = "\u273fARGS\u273f"
STOP_WORD = "STOP"
_QWEN_CALL = re.compile(
    rf"{QWEN_FUNCTION}:(?P<name>[^\n]*)\n[ \t]*{QWEN_ARGS}:(?P<args>.*?)\s*(?:\u273f(?:RESULT|RETURN)\u273f.*)?\Z", re.DOTALL
)

# Slot texts used when a slot has nothing to show. They start and end with a letter so that
# they tokenize the same inside and outside the template (see the module docstring).
EMPTY_MEMORY_TEXT = "No previous memory"
NO_EVIDENCE_TEXT = "No passages were retrieved for this step"

# Most search-history lines each of a PromptBuilder's two line caches (entries, headers) keeps
# encoded; least recently used go. A worker's concurrent rollouts each add about one entry line
# and a few header lines per chunk read; 32K lines take ~10 MiB.
HISTORY_LINE_CACHE = 1 << 15

PromptKind = Literal["prethink", "write_memagent", "write_infmem", "answer"]

# Sections of each prompt's user message after its instructions: (tag shown to the model, slot).
_LAYOUT: dict[str, tuple[tuple[str, str], ...]] = {
    "prethink": (("question", "question"), ("search_history", "history"), ("memory", "memory")),
    "write_memagent": (("question", "question"), ("previous_memory", "memory"), ("current_chunk", "chunk")),
    "write_infmem": (
        ("question", "question"),
        ("previous_memory", "memory"),
        ("retrieved_passages", "evidence"),
        ("current_chunk", "chunk"),
    ),
    "answer": (("question", "question"), ("memory", "memory")),
}


def layout(kind: PromptKind, write_layout: str) -> tuple[tuple[str, str], ...]:
    """The sections of prompt ``kind``; ``write_layout="chunk_first"`` moves a Write's chunk right
    after the question (AgentConfig.write_layout)."""
    sections = _LAYOUT[kind]
    if write_layout != "chunk_first" or not kind.startswith("write"):
        return sections
    return (sections[0], *[s for s in sections if s[1] == "chunk"], *[s for s in sections[1:] if s[1] != "chunk"])


# --------------------------------------------------------------------------------------------
# Output parsing
# --------------------------------------------------------------------------------------------


@dataclass
class ThinkSplit:
    """A response cut at its first ``</think>``.

    ``closed`` is False when thinking was on and no ``</think>`` appeared; ``output`` is then
    empty and everything is ``thinking``.
    """

    thinking: str
    output: str
    closed: bool


def split_thinking(text: str, thinking: bool) -> ThinkSplit:
    """Separate the thinking part of a decoded response from its output.

    Cut by string at the FIRST ``</think>`` (never by a token offset, spec §8.1 item 7): text
    after a second ``</think>`` belongs to the output, where the grammar rejects it. With thinking
    off the whole text is the output.
    """
    if not thinking:
        return ThinkSplit(thinking="", output=text.strip(), closed=True)
    head, sep, tail = text.partition(THINK_END)
    head = head.strip()
    if head.startswith(THINK_START):
        head = head[len(THINK_START):].strip()
    return ThinkSplit(thinking=head, output=tail.strip(), closed=bool(sep))


class _ProtocolError(Exception):
    """A PreThink output broke the action grammar; the message is the reason recorded."""


class _NoCall(_ProtocolError):
    """The output holds no call at all (what ``controller.no_call_stops`` counts as a stop vote)."""


def parse_action(output: str, cfg: RetrievalConfig, controller: ControllerConfig | None = None) -> Action:
    """The controller's action from the text after ``</think>``; never raises on a string.

    ``controller`` picks the grammar (ours by default, see the module docstring; ``qwen_agent``:
    :func:`_qwen_agent_call`). A protocol error yields ``Action(kind="continue", valid=False,
    reason=...)``; an output without any call does too, unless ``controller.no_call_stops``
    makes it a stop vote.
    """
    controller = controller or ControllerConfig()
    try:
        if controller.grammar == "qwen_agent":
            call = _qwen_agent_call(output, controller.function_name)
            return Action(kind="stop") if call is None else _action_from_call(call, cfg)
        return _action_from_call(_single_tool_call(output), cfg)
    except _NoCall as err:
        if controller.no_call_stops:
            return Action(kind="stop", reason=f"{err}: a stop vote (no_call_stops)", restarts_votes=True)
        return Action(kind="continue", valid=False, reason=str(err))
    except _ProtocolError as err:
        return Action(kind="continue", valid=False, reason=str(err))


def decide_action(split: ThinkSplit, cfg: AgentConfig) -> Action:
    """The controller's action from a whole PreThink response, under ``cfg.controller``.

    With ``stop_anywhere`` (the reference's rule, off by default) the word STOP anywhere in the
    response, thinking included, is a stop whatever else it says. Otherwise a response whose
    thinking never closed has no action; the rest goes to :func:`parse_action`.
    """
    if cfg.controller.stop_anywhere and STOP_WORD in f"{split.thinking}\n{split.output}":
        return Action(kind="stop", reason="STOP in the response (stop_anywhere)")
    if not split.closed:
        return Action(kind="continue", valid=False, reason="thinking never closed")
    return parse_action(split.output, cfg.retrieval, cfg.controller)


def _qwen_agent_call(output: str, function_name: str) -> dict[str, Any] | None:
    """The call in a Qwen-Agent-style output, as ``{"name", "arguments"}``; None for STOP.

    The output must be exactly the word ``STOP``, or exactly one call::

        ✿FUNCTION✿: <function_name>
        ✿ARGS✿: {"query": "...", "top_k": 4}

    whose arguments are a JSON object (a code fence around it is allowed). Text from a
    ``✿RESULT✿`` / ``✿RETURN✿`` marker on is ignored: it is the model imagining the tool's reply.
    """
    text = output.strip()
    if text == STOP_WORD:
        return None
    if not text:
        raise _NoCall("empty output")
    if QWEN_FUNCTION not in text:
        raise _ProtocolError("STOP with other text") if STOP_WORD in text else _NoCall("no function call")
    if text.count(QWEN_FUNCTION) > 1:
        raise _ProtocolError("more than one function call")
    call = _QWEN_CALL.match(text)
    if call is None:
        raise _ProtocolError(f"text before the function call, or no {QWEN_ARGS} line after it")
    name = call["name"].strip()
    if name != function_name:
        raise _ProtocolError(f"unknown function {_clip(repr(name))}")
    body = call["args"].strip()
    fence = re.fullmatch(r"```[a-z]*\s*(.*?)\s*```", body, re.DOTALL)
    body = fence.group(1) if fence else body
    try:
        arguments = json.loads(body, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:
        raise _ProtocolError(f"invalid JSON in {QWEN_ARGS}: {_clip(str(err))}") from None
    return {"name": RETRIEVE_TOOL, "arguments": arguments}


def _single_tool_call(output: str) -> Any:
    """The decoded JSON of the one tool call that must make up ``output``."""
    text = output.strip()
    if not text:
        raise _NoCall("empty output")
    opens, closes = text.count(TOOL_CALL_OPEN), text.count(TOOL_CALL_CLOSE)
    if opens == 0:
        raise _NoCall("no tool call")
    if opens > 1 or closes > 1:
        raise _ProtocolError("more than one tool call")
    if not text.startswith(TOOL_CALL_OPEN):
        raise _ProtocolError("text before the tool call")
    if closes == 0:
        raise _ProtocolError("unterminated tool call")
    if not text.endswith(TOOL_CALL_CLOSE):
        raise _ProtocolError("text after the tool call")
    body = text[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)]
    try:
        return json.loads(body, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:  # RecursionError: absurdly deep nesting
        raise _ProtocolError(f"invalid JSON in tool call: {_clip(str(err))}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of duplicate keys silently; an ambiguous call is a protocol error.
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")
    return dict(pairs)


def _reject_constant(name: str) -> Any:
    # NaN / Infinity are not JSON, although Python's json accepts them by default.
    raise ValueError(f"{name} is not valid JSON")


def _action_from_call(call: Any, cfg: RetrievalConfig) -> Action:
    if not isinstance(call, dict):
        raise _ProtocolError("tool call is not a JSON object")
    if set(call) != {"name", "arguments"}:
        raise _ProtocolError(f"tool call needs exactly the keys name and arguments, got {_clip(str(sorted(call)))}")
    name, args = call["name"], call["arguments"]
    if not isinstance(args, dict):
        raise _ProtocolError("arguments is not a JSON object")
    if name == STOP_TOOL:
        if args:
            raise _ProtocolError("stop takes no arguments")
        return Action(kind="stop")
    if name != RETRIEVE_TOOL:
        raise _ProtocolError(f"unknown tool {_clip(repr(name))}")
    unknown = sorted(set(args) - {"query", "top_k"})
    if unknown:
        raise _ProtocolError(f"unknown retrieve argument {_clip(repr(unknown[0]))}")
    query = args.get("query")
    if not isinstance(query, str) or not query.strip():
        raise _ProtocolError("retrieve needs a non-empty string query")
    top_k = args.get("top_k", cfg.top_k_default)
    # bool is an int subclass in Python, but `true` is not a JSON integer.
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise _ProtocolError(f"top_k must be an integer, got {_clip(json.dumps(top_k))}")
    kept = min(max(top_k, cfg.top_k_min), cfg.top_k_max)
    return Action(kind="retrieve", query=query.strip(), top_k=kept, clamped=kept != top_k)


def _clip(text: str, limit: int = 80) -> str:
    """Keep reasons short: they are logged per turn and counted."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


# A box around the final answer: \boxed{...} or \fbox{...}, spaces allowed before the brace.
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Commands whose argument is the text itself (\text{Paris}); unwrapped inside an answer.
_TEXT_WRAPPERS = re.compile(
    r"\\(?:text|textbf|textit|textrm|textsf|texttt|textnormal|mathrm|mathbf|mathit|mathsf|mathtt|"
    r"mathbb|mathcal|emph|mbox|operatorname|boxed|fbox)\s*\{"
)
# LaTeX spacing commands and escaped characters, as plain text.
_LATEX_ESCAPES = {"\\ ": " ", "\\,": " ", "\\;": " ", "\\:": " ", "\\!": "",
                  "\\&": "&", "\\%": "%", "\\$": "$", "\\#": "#", "\\_": "_"}  # fmt: skip
_ANSWER_IS = re.compile(r"\bthe answer is\b", re.IGNORECASE)
# Decoration models put around a final answer: markdown bold, quotes, a colon after "is".
_ANSWER_EDGES = " \t*\"'`:\u201c\u201d\u2018\u2019"


def parse_answer(output: str, answer_format: str) -> str | None:
    """The final answer in ``output`` (the text after ``</think>``), or None when there is none.

    ``"boxed"``: the content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (``\\boxed {...}``
    too), braces matched (nested and backslash-escaped braces allowed); None when absent,
    unbalanced (e.g. truncated) or empty.
    ``"answer_is"``: the text after the last case-insensitive "the answer is": the rest of its
    line, or the next non-empty line when the phrase ends a line; stripped of surrounding ``*``,
    quotes, whitespace and a trailing period; None when absent or empty.
    Either way, text commands are unwrapped (``\\text{Paris}``, ``\\textbf{...}``,
    ``\\mathrm{...}``, a box after "the answer is") and LaTeX spaces and escapes read as text, so
    ``\\boxed{\\text{New\\ York}}`` is "New York"; mathematics (``\\frac{1}{2}``) stays as written.
    """
    if answer_format == "boxed":
        found = _last_boxed(output)
    elif answer_format == "answer_is":
        found = _after_answer_is(output)
    else:
        raise ValueError(f"answer_format: expected 'boxed' or 'answer_is', got {answer_format!r}")
    return None if found is None else (_plain_answer(found) or None)


def _braced(text: str, begin: int) -> int | None:
    """The index of the brace closing the group that starts at ``begin`` (just after its
    opening brace), or None when the group never closes."""
    depth, pos = 1, begin
    while pos < len(text):
        char = text[pos]
        if char == "\\":  # \{ and \} are literal braces in LaTeX; skip the escaped character
            pos += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return pos
        pos += 1
    return None


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    last = None
    for last in pattern.finditer(text):
        pass
    return last


def _last_boxed(text: str) -> str | None:
    opened = _last_match(_BOX_OPEN, text)
    if opened is None:
        return None
    end = _braced(text, opened.end())
    return None if end is None else text[opened.end() : end].strip() or None


def _plain_answer(text: str) -> str:
    """``text`` with its text commands unwrapped and LaTeX escapes read (see :func:`parse_answer`)."""
    while (wrapper := _TEXT_WRAPPERS.search(text)) is not None:
        end = _braced(text, wrapper.end())
        if end is None:  # an unclosed wrapper: keep the rest as it is
            break
        text = text[: wrapper.start()] + text[wrapper.end() : end] + text[end + 1 :]
    for escape, plain in _LATEX_ESCAPES.items():
        text = text.replace(escape, plain)
    return " ".join(text.split())


def _after_answer_is(text: str) -> str | None:
    last = _last_match(_ANSWER_IS, text)
    if last is None:
        return None
    # The rest of the phrase's line, or ("The answer is:\n\n**Paris**") the next line that says something.
    for line in text[last.end() :].split("\n"):
        answer = _strip_edges(line)
        if answer:
            return answer
    return None


def _strip_edges(answer: str) -> str:
    previous = None
    while answer != previous:  # "**Paris**." needs the period and the stars removed in turn
        previous = answer
        answer = answer.strip(_ANSWER_EDGES).removesuffix(".")
    return answer


# --------------------------------------------------------------------------------------------
# Tools and instructions (our own wording)
# --------------------------------------------------------------------------------------------


def tool_schemas(cfg: RetrievalConfig) -> list[dict[str, Any]]:
    """JSON schemas of the controller's two tools, as the chat template's ``tools`` expects."""
    retrieve = {
        "type": "function",
        "function": {
            "name": RETRIEVE_TOOL,
            "description": (
                "Keyword (BM25) search over short passages of the whole document, read or not. "
                "The passages found are shown to the memory writer together with the next chunk."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {
                        "type": "string",
                        "description": "Distinctive words for the missing fact: names, titles, dates, places.",
                    },
                    "top_k": {
                        "type": "integer",
                        "description": "How many passages to return: few for a precise query, more for a broad one.",
                        "minimum": cfg.top_k_min,
                        "maximum": cfg.top_k_max,
                        "default": cfg.top_k_default,
                    },
                },
                "required": ["query"],
            },
        },
    }
    stop = {
        "type": "function",
        "function": {
            "name": STOP_TOOL,
            "description": "Stop reading: the memory already holds every fact the answer needs.",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    }
    return [retrieve, stop]


def _planner_instructions(cfg: RetrievalConfig) -> str:
    retrieve_example = json.dumps(
        {"name": RETRIEVE_TOOL, "arguments": {"query": "keywords for the missing fact", "top_k": cfg.top_k_default}}
    )
    stop_example = json.dumps({"name": STOP_TOOL, "arguments": {}})
    return (
        "You direct the searches of a reader that answers a question about a document far too long "
        "to see at once. The reader goes through the document chunk by chunk and keeps a short "
        "memory of what matters; a separate step later answers the question from that memory alone. "
        "Before each new chunk you decide, with one tool call, whether to search the document or to "
        "stop reading.\n"
        f"- {RETRIEVE_TOOL}: keyword search over passages of the entire document, read or not. The "
        "passages found are shown to the memory writer together with the next chunk. Give a focused "
        f"query and a top_k from {cfg.top_k_min} to {cfg.top_k_max} (default {cfg.top_k_default}).\n"
        f"- {STOP_TOOL}: end the reading now. Use it only when the memory already states every fact "
        "the answer depends on.\n\n"
        "Work it out this way: split the question into the facts it rests on; check which of them "
        "the memory states clearly; if some are missing or doubtful, search for one of them with a "
        "short query made of names, titles, dates or other distinctive words, following leads the "
        "memory already holds. Never repeat an earlier query; if one did not help, try another "
        "angle. Use a small top_k for a precise query and a larger one for a broad query; search "
        "widely early on and narrow down later. Searching costs little, so search unless the memory "
        "clearly settles the question. Do not answer the question yourself.\n\n"
        "Your reply must be one tool call and nothing else, either\n"
        f"{TOOL_CALL_OPEN}\n{retrieve_example}\n{TOOL_CALL_CLOSE}\n"
        f"or\n{TOOL_CALL_OPEN}\n{stop_example}\n{TOOL_CALL_CLOSE}"
    )


def _writer_instructions(memory_tokens: int, with_evidence: bool) -> str:
    intro = (
        "You keep the memory of a reader that answers a question about a long document. The "
        "document is read one chunk at a time, and after each chunk you rewrite the memory."
    )
    evidence = (
        " Besides the current chunk you get passages that a keyword search picked from anywhere in "
        "the document for this step; they are often the most useful text you will see, but some "
        "may be off-topic."
    )
    task = (
        "\n\nWrite the updated memory: keep the facts of the previous memory that still matter, add "
        "what the new text contributes to the question (names, numbers, dates and how they connect, "
        "precise enough to stand on their own), and leave out whatever does not help."
    )
    gaps = (
        " If the question still needs facts the memory lacks, say briefly which ones; that guides "
        "the next searches."
    )
    cap = (
        f"\n\nThe memory holds at most {memory_tokens} tokens, and it is all that the answering "
        "step will see: the document and everything shown here are gone after this step. Reply "
        "with the updated memory only."
    )
    return intro + (evidence if with_evidence else "") + task + (gaps if with_evidence else "") + cap


def _answer_instructions(answer_format: str) -> str:
    intro = (
        "Answer the question using only the memory below: the notes a reader kept while going "
        "through a long document. Keep the final answer short (a name, number, date, or yes/no)"
    )
    if answer_format == "boxed":
        return intro + " and write it inside \\boxed{}."
    return intro + ' and end with a line of the form "Therefore, the answer is <answer>".'


# --------------------------------------------------------------------------------------------
# Prompt builder
# --------------------------------------------------------------------------------------------


@dataclass
class HistoryEntry:
    """One earlier retrieve call, shown to the controller so it does not repeat itself."""

    query: str
    top_k: int


@dataclass
class BuiltPrompt:
    """Prompt token ids (int32) and what the budget forced us to shorten (trajectory flags)."""

    ids: np.ndarray
    flags: list[str]


def render_history(history: Sequence[HistoryEntry], step: int, num_chunks: int, hidden: int = 0) -> str:
    """The search-history slot of a PreThink prompt; the ``hidden`` oldest entries are left out.

    Starts and ends with a letter or digit so that it tokenizes the same inside the template.
    """
    lines = [*_history_header(len(history), step, num_chunks, hidden)]
    shown = enumerate(history[hidden:], start=hidden + 1)
    lines += [_history_entry(number, entry.query, entry.top_k) for number, entry in shown]
    return "\n".join(lines)


def _history_header(searches: int, step: int, num_chunks: int, hidden: int) -> tuple[str, str]:
    """The two lines above the history entries: reading progress, then the count of searches."""
    progress = f"Step {step + 1} of {num_chunks}: {step} of the {num_chunks} chunks have been read into the memory"
    if not searches:
        return progress, "No searches made yet"
    note = f", the {hidden} oldest not shown" if hidden else ""
    return progress, f"Searches made so far: {searches}{note}"


def _history_entry(number: int, query: str, top_k: int) -> str:
    """The history line of search ``number`` (1-based)."""
    return f"{number}. query {json.dumps(query, ensure_ascii=False)}, top_k {top_k}"


@dataclass(frozen=True)
class _Template:
    """A rendered prompt kind: static token pieces around named slots.

    ``pieces`` has one more element than ``slots``: piece 0, slot 0, piece 1, ..., last piece.
    """

    pieces: tuple[np.ndarray, ...]
    slots: tuple[str, ...]

    @property
    def static_tokens(self) -> int:
        return sum(len(piece) for piece in self.pieces)

    def assemble(self, values: Mapping[str, np.ndarray]) -> np.ndarray:
        parts = [self.pieces[0]]
        for name, piece in zip(self.slots, self.pieces[1:]):
            parts.append(values[name])
            parts.append(piece)
        return np.concatenate(parts)


def encode_text(tokenizer: Any, text: str) -> np.ndarray:
    """Token ids of ``text`` without added special tokens, as int32 (what :meth:`PromptBuilder.encode` does)."""
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


def think_end_token_id(tokenizer: Any) -> int | None:
    """The id of the ``</think>`` token, or None when the tokenizer has no such token.

    Tokenizers map an unknown token to their unk id (or to None without one), so the bare lookup
    would hand a non-thinking model's unk id to code that searches responses for ``</think>``.
    """
    token_id = tokenizer.convert_tokens_to_ids(THINK_END)
    return token_id if isinstance(token_id, int) and token_id != tokenizer.unk_token_id else None


class PromptBuilder:
    """Builds the token ids of every prompt: PreThink, Write (InfMem and MemAgent), Answer.

    Construction renders each prompt kind once through the tokenizer's chat template; per call
    the builder only concatenates token ids and enforces the prompt budgets (module docstring).
    """

    think_end_token: str = THINK_END

    def __init__(self, tokenizer: Any, cfg: AgentConfig) -> None:
        self.tokenizer = tokenizer
        self.cfg = cfg.validate()
        self.tools = tool_schemas(cfg.retrieval)
        self._instructions = {
            "prethink": _planner_instructions(cfg.retrieval),
            "write_memagent": _writer_instructions(cfg.memory_tokens, with_evidence=False),
            "write_infmem": _writer_instructions(cfg.memory_tokens, with_evidence=True),
            "answer": _answer_instructions(cfg.answer_format),
        }
        # Kinds a user template file replaces (cfg.prompt_templates); the others are built in.
        self._user_templates = load_templates(cfg.prompt_templates) if cfg.prompt_templates else {}
        self._layout = {kind: layout(kind, cfg.write_layout) for kind in _LAYOUT}
        self._templates = {kind: self._compile(kind) for kind in _LAYOUT}
        self._empty_memory_ids = self.encode(EMPTY_MEMORY_TEXT)
        self._no_evidence_ids = self.encode(NO_EVIDENCE_TEXT)
        self._evidence_labels: dict[int, np.ndarray] = {}
        # What the loop appends when thinking runs out of budget before closing itself.
        self.close_think_ids = self.encode(f"\n{THINK_END}\n\n")
        # Where a response's thinking ends (None: the tokenizer has no '</think>' token).
        self.think_end_id = think_end_token_id(tokenizer)
        # A rollout's search history grows by one line per step and every PreThink prompt shows it,
        # so encoding it whole each time costs O(steps^2) tokens per rollout (a 1M-token document
        # has 200 steps). Its lines are therefore encoded once each and concatenated, which gives
        # the same ids only when the tokenizer never merges across the line breaks between them
        # (history lines end with a letter or digit); other tokenizers get the whole text encoded.
        self._history_lines_separable = split_safe(tokenizer)
        self._header_line_ids = functools.lru_cache(maxsize=HISTORY_LINE_CACHE)(self._encode_frozen)
        self._entry_line_ids = functools.lru_cache(maxsize=HISTORY_LINE_CACHE)(self._encode_entry_line)

    # -- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` without added special tokens, as int32."""
        return encode_text(self.tokenizer, text)

    def _encode_frozen(self, text: str) -> np.ndarray:
        """:meth:`encode`, read-only: the result is cached and shared by every later prompt."""
        ids = self.encode(text)
        ids.flags.writeable = False
        return ids

    def _encode_entry_line(self, number: int, query: str, top_k: int) -> np.ndarray:
        """Ids of a history entry's line with the line break in front of it (cached by number,
        query and top_k: the line is the same in every later prompt of the rollout)."""
        return self._encode_frozen("\n" + _history_entry(number, query, top_k))

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; chat markers such as ``<|im_start|>`` are dropped unless asked for.

        ``<think>``, ``</think>`` and ``<tool_call>`` are not special tokens in Qwen3 and survive.
        """
        return self.tokenizer.decode(
            np.asarray(ids).tolist(), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    # -- the chat-template path (construction, tests, chat-API teachers) ----------------------

    def chat_messages(self, kind: PromptKind, slots: Mapping[str, str]) -> list[dict[str, str]]:
        """The chat messages of prompt ``kind`` with ``slots`` (slot name -> text) filled in."""
        if kind in self._user_templates:
            return self._user_templates[kind].messages(slots)
        sections = [f"<{tag}>\n{slots[slot]}\n</{tag}>" for tag, slot in self._layout[kind]]
        content = "\n\n".join([self._instructions[kind], *sections])
        return [{"role": "user", "content": content}]

    def render_text(self, kind: PromptKind, slots: Mapping[str, str]) -> str:
        """The prompt text the chat template renders for :meth:`chat_messages` (slow path)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("tokenizer: expected a tokenizer with a chat template, it has none")
        return self.tokenizer.apply_chat_template(
            self.chat_messages(kind, slots),
            # The qwen_agent grammar's tool description is the template's system message.
            tools=self.tools if kind == "prethink" and self.cfg.controller.grammar == "tool_call" else None,
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=self.cfg.thinking,
        )

    def _compile(self, kind: PromptKind) -> _Template:
        sentinels = {slot: f"@@INFMEM_SLOT_{slot.upper()}@@" for _, slot in self._layout[kind]}
        rendered = self.render_text(kind, sentinels)
        pattern = re.compile("|".join(re.escape(s) for s in sentinels.values()))
        found = pattern.findall(rendered)
        if sorted(found) != sorted(sentinels.values()):
            raise ValueError(
                f"tokenizer.chat_template: expected the {kind} prompt to contain each slot exactly once, "
                f"found {found}"
            )
        slot_of = {sentinel: slot for slot, sentinel in sentinels.items()}
        pieces = tuple(self.encode(text) for text in pattern.split(rendered))
        return _Template(pieces=pieces, slots=tuple(slot_of[s] for s in found))

    # -- the three calls ----------------------------------------------------------------------

    def prethink(
        self,
        question_ids: Sequence[int] | np.ndarray,
        memory_ids: Sequence[int] | np.ndarray,
        history: Sequence[HistoryEntry],
        step: int,
        num_chunks: int,
    ) -> BuiltPrompt:
        """The controller's prompt before reading chunk ``step`` (0-based) of ``num_chunks``.

        Tools in the system message; planner instructions, question, search history and memory
        in the user message. The oldest history lines are left out when the budget requires it.
        """
        if num_chunks < 1 or not 0 <= step < num_chunks:
            raise ValueError(f"step: expected 0 <= step < num_chunks, got step={step}, num_chunks={num_chunks}")
        template = self._templates["prethink"]
        question, memory = self._question(question_ids), self._memory(memory_ids)
        room = self.cfg.prethink.prompt_tokens - template.static_tokens - len(question) - len(memory)
        history_ids = self._fitting_history(history, step, num_chunks, room, question, memory, template)
        ids = template.assemble({"question": question, "history": history_ids, "memory": memory})
        return BuiltPrompt(ids=ids, flags=[])

    def write(
        self,
        question_ids: Sequence[int] | np.ndarray,
        memory_ids: Sequence[int] | np.ndarray,
        chunk_ids: Sequence[int] | np.ndarray,
        evidence: Sequence[Sequence[int] | np.ndarray] | None,
    ) -> BuiltPrompt:
        """The memory writer's prompt.

        ``evidence=None``: MemAgent's update (question, previous memory, chunk). A sequence of
        retrieved units' ids, best first (possibly empty): InfMem's evidence-aware Write. The
        sections follow ``cfg.write_layout`` (default: the chunk right after the question).
        """
        kind: PromptKind = "write_memagent" if evidence is None else "write_infmem"
        template = self._templates[kind]
        question, memory = self._question(question_ids), self._memory(memory_ids)
        chunk = _as_ids(chunk_ids, "chunk_ids")
        floor = 0 if evidence is None else len(self._no_evidence_ids)
        room = self._room("write", template, question, memory, floor)
        values = {"question": question, "memory": memory}
        flags: list[str] = []
        if evidence is not None:
            units = [_as_ids(unit, f"evidence[{i}]") for i, unit in enumerate(evidence)]
            limit = min(self.cfg.retrieval.evidence_tokens, room - len(chunk))
            block, shortened = self._evidence_block(units, limit)
            if shortened:
                flags.append(FLAG_EVIDENCE_SHORTENED)
            values["evidence"] = block
            room -= len(block)
        if len(chunk) > room:
            chunk = chunk[:room]
            flags.append(FLAG_CHUNK_SHORTENED)
        values["chunk"] = chunk
        return BuiltPrompt(ids=template.assemble(values), flags=flags)

    def answer(self, question_ids: Sequence[int] | np.ndarray, memory_ids: Sequence[int] | np.ndarray) -> BuiltPrompt:
        """The final call: question and memory, answer format from ``cfg.answer_format``."""
        template = self._templates["answer"]
        question, memory = self._question(question_ids), self._memory(memory_ids)
        self._room("answer", template, question, memory, 0)
        return BuiltPrompt(ids=template.assemble({"question": question, "memory": memory}), flags=[])

    # -- helpers ------------------------------------------------------------------------------

    def _question(self, question_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        question = _as_ids(question_ids, "question_ids")
        if question.size == 0:
            raise ValueError("question_ids: expected at least one token, got none")
        return question

    def _memory(self, memory_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        memory = _as_ids(memory_ids, "memory_ids")
        return memory if memory.size else self._empty_memory_ids

    def _room(self, call: str, template: _Template, question: np.ndarray, memory: np.ndarray, floor: int) -> int:
        """Tokens left for the cuttable slots; raises when even their smallest form (``floor``
        tokens) does not fit beside the question, the memory and the template."""
        budget = getattr(self.cfg, call).prompt_tokens
        fixed = template.static_tokens + len(question) + len(memory)
        if fixed + floor > budget:
            raise ValueError(
                f"question: {len(question)} question tokens + {len(memory)} memory tokens + "
                f"{template.static_tokens} template tokens + {floor} tokens of shortest slot content "
                f"exceed {call}.prompt_tokens={budget}; the question and the memory are never cut"
            )
        return budget - fixed

    def _fitting_history(
        self,
        history: Sequence[HistoryEntry],
        step: int,
        num_chunks: int,
        room: int,
        question: np.ndarray,
        memory: np.ndarray,
        template: _Template,
    ) -> np.ndarray:
        """The history slot's ids, showing as many of the newest entries as ``room`` allows."""
        slot = _HistorySlot(self, history, step, num_chunks)
        if slot.length(0) <= room:
            return slot.ids(0)
        self._room("prethink", template, question, memory, slot.length(len(history)))
        # Binary search on the number of hidden entries; `best` always fits (checked just above).
        low, high, best = 1, len(history), len(history)
        while low < high:
            hidden = (low + high) // 2
            if slot.length(hidden) <= room:
                best, high = hidden, hidden
            else:
                low = hidden + 1
        return slot.ids(best)

    def _evidence_label(self, rank: int) -> np.ndarray:
        """Ids of the label before the passage of ``rank`` (1-based), blank line included."""
        label = self._evidence_labels.get(rank)
        if label is None:
            label = self.encode(("\n\n" if rank > 1 else "") + f"[Retrieved #{rank}] ")
            self._evidence_labels[rank] = label
        return label

    def _evidence_block(self, units: list[np.ndarray], limit: int) -> tuple[np.ndarray, bool]:
        """Labelled passages within ``limit`` tokens, and whether any passage was dropped or cut.

        Passages are kept best first; the first one that does not fit whole is cut to the room
        left and the rest dropped. With no passage left, the block says nothing was retrieved.
        """
        parts: list[np.ndarray] = []
        used = whole = 0
        for rank, unit in enumerate(units, start=1):
            label = self._evidence_label(rank)
            room = limit - used - len(label)
            if room <= 0:
                break
            parts += [label, unit[:room]]
            if len(unit) > room:
                break
            used += len(label) + len(unit)
            whole += 1
        if not parts:
            return self._no_evidence_ids, bool(units)
        return np.concatenate(parts), whole < len(units)


class _HistorySlot:
    """The search-history slot of one PreThink prompt for any number of hidden oldest entries.

    With separable lines (see :class:`PromptBuilder`) the ids are the cached ids of the two header
    lines followed by those of each shown entry, so the length for any ``hidden`` is a header
    length plus a suffix sum and a call encodes at most its new lines. Otherwise every variant
    asked for is encoded whole, as rendered, once per call.
    """

    def __init__(self, builder: PromptBuilder, history: Sequence[HistoryEntry], step: int, num_chunks: int) -> None:
        self._builder = builder
        self._history = history
        self._step = step
        self._num_chunks = num_chunks
        self._whole: dict[int, np.ndarray] = {}  # hidden -> ids, when lines are not separable
        self._entries: list[np.ndarray] | None = None
        if builder._history_lines_separable:
            self._entries = [builder._entry_line_ids(n, e.query, e.top_k) for n, e in enumerate(history, start=1)]
            lengths = [len(ids) for ids in reversed(self._entries)]
            # _suffix[h]: tokens of the entries shown when the h oldest are hidden.
            self._suffix = np.cumsum([0, *lengths])[::-1]

    def length(self, hidden: int) -> int:
        """Tokens of the slot with the ``hidden`` oldest entries left out."""
        if self._entries is None:
            return len(self.ids(hidden))
        return sum(len(ids) for ids in self._header(hidden)) + int(self._suffix[hidden])

    def ids(self, hidden: int) -> np.ndarray:
        """Ids of the slot with the ``hidden`` oldest entries left out."""
        if self._entries is not None:
            return np.concatenate([*self._header(hidden), *self._entries[hidden:]])
        if hidden not in self._whole:
            text = render_history(self._history, self._step, self._num_chunks, hidden=hidden)
            self._whole[hidden] = self._builder.encode(text)
        return self._whole[hidden]

    def _header(self, hidden: int) -> tuple[np.ndarray, np.ndarray]:
        progress, searches = _history_header(len(self._history), self._step, self._num_chunks, hidden)
        return self._builder._header_line_ids(progress), self._builder._header_line_ids("\n" + searches)


def _as_ids(ids: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    """``ids`` as a 1-D int32 array; raises ValueError naming ``name`` otherwise."""
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name}: expected integer token ids, got dtype {array.dtype}")
    return array.astype(np.int32, copy=False)
