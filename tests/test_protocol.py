"""The protocol module with the real Qwen3 tokenizer and real Wikipedia text."""

from __future__ import annotations

import copy
import difflib
import json
import random
import re

import numpy as np
import pytest
from tokenizers import pre_tokenizers

from infmem_verl.agent.config import AgentConfig, RetrievalConfig, agent_config
from infmem_verl.agent.protocol import (
    EMPTY_MEMORY_TEXT,
    NO_EVIDENCE_TEXT,
    HistoryEntry,
    PromptBuilder,
    parse_action,
    parse_answer,
    render_history,
    split_thinking,
    tool_schemas,
)
from infmem_verl.agent.trajectory import FLAG_CHUNK_SHORTENED, FLAG_EVIDENCE_SHORTENED
from infmem_verl.assets import qwen3_tokenizer_dir, wiki_paragraphs

RCFG = RetrievalConfig()  # top_k in [1, 8], default 4


def call(payload: object) -> str:
    """A Qwen3-native tool call around ``payload`` (a JSON-able object or raw body text)."""
    body = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def retrieve(**arguments: object) -> str:
    return call({"name": "retrieve", "arguments": arguments})


STOP_CALL = call({"name": "stop", "arguments": {}})


# --------------------------------------------------------------------------------------------
# parse_action
# --------------------------------------------------------------------------------------------

VALID_ACTIONS = [
    # (output, kind, query, top_k, clamped)
    (retrieve(query="capital of France", top_k=3), "retrieve", "capital of France", 3, False),
    (retrieve(query="capital of France"), "retrieve", "capital of France", 4, False),  # default
    (retrieve(query="x", top_k=1), "retrieve", "x", 1, False),
    (retrieve(query="x", top_k=8), "retrieve", "x", 8, False),
    (retrieve(query="x", top_k=0), "retrieve", "x", 1, True),
    (retrieve(query="x", top_k=-5), "retrieve", "x", 1, True),
    (retrieve(query="x", top_k=99), "retrieve", "x", 8, True),
    (retrieve(query="x", top_k=10**30), "retrieve", "x", 8, True),
    (retrieve(query="  padded query \n"), "retrieve", "padded query", 4, False),
    (retrieve(query="Straße in 東京 — Ærø"), "retrieve", "Straße in 東京 — Ærø", 4, False),
    (STOP_CALL, "stop", None, None, False),
    ("\n\n   " + STOP_CALL + "\n  ", "stop", None, None, False),
    ('<tool_call>{"name": "stop", "arguments": {}}</tool_call>', "stop", None, None, False),
    ('<tool_call>{"arguments": {"query": "q"}, "name": "retrieve"}</tool_call>', "retrieve", "q", 4, False),
]


@pytest.mark.parametrize("output,kind,query,top_k,clamped", VALID_ACTIONS)
def test_valid_actions(output, kind, query, top_k, clamped):
    action = parse_action(output, RCFG)
    assert (action.kind, action.valid, action.query, action.top_k, action.clamped) == (kind, True, query, top_k, clamped)


INVALID_ACTIONS = [
    # (output, words the reason must contain)
    ("", "empty output"),
    ("  \n\t", "empty output"),
    ("STOP", "no tool call"),
    ('{"name": "stop", "arguments": {}}', "no tool call"),
    (STOP_CALL + "\n" + STOP_CALL, "more than one tool call"),
    (retrieve(query="a") + retrieve(query="b"), "more than one tool call"),
    ("<tool_call>\n" + STOP_CALL + "\n</tool_call>", "more than one tool call"),  # nested call
    ("I will stop now.\n" + STOP_CALL, "text before the tool call"),
    ("```json\n" + STOP_CALL + "\n```", "text before the tool call"),
    ("<think>again</think>\n" + STOP_CALL, "text before the tool call"),
    (STOP_CALL + "\nThat is my decision.", "text after the tool call"),
    (STOP_CALL + " STOP", "text after the tool call"),
    ('<tool_call>\n{"name": "retrieve", "arguments": {"query": "x"', "unterminated tool call"),
    ('<tool_call>\n{"name": "retrieve", "arguments": {"query": "x"\n</tool_call>', "invalid JSON"),
    ("<tool_call>\n\n</tool_call>", "invalid JSON"),
    ("<tool_call>\nstop\n</tool_call>", "invalid JSON"),
    ('<tool_call>\n{"name": "stop", "name": "retrieve", "arguments": {}}\n</tool_call>', "invalid JSON"),
    ('<tool_call>\n{"name": "retrieve", "arguments": {"query": "x", "top_k": NaN}}\n</tool_call>', "invalid JSON"),
    (call(["stop"]), "not a JSON object"),
    (call({"name": "stop"}), "exactly the keys"),
    (call({"name": "stop", "arguments": {}, "id": 1}), "exactly the keys"),
    (call({"name": "retrieve", "arguments": '{"query": "x"}'}), "arguments is not a JSON object"),
    (call({"name": "search", "arguments": {"query": "x"}}), "unknown tool"),
    (call({"name": "STOP", "arguments": {}}), "unknown tool"),
    (call({"name": ["retrieve"], "arguments": {}}), "unknown tool"),
    (call({"name": "stop", "arguments": {"reason": "done"}}), "stop takes no arguments"),
    (retrieve(query="x", k=3), "unknown retrieve argument"),
    (retrieve(top_k=3), "non-empty string query"),
    (retrieve(query="   "), "non-empty string query"),
    (retrieve(query={"text": "nested"}), "non-empty string query"),
    (retrieve(query=["a", "b"]), "non-empty string query"),
    (retrieve(query="x", top_k=4.5), "top_k must be an integer"),
    (retrieve(query="x", top_k=4.0), "top_k must be an integer"),
    (retrieve(query="x", top_k="4"), "top_k must be an integer"),
    (retrieve(query="x", top_k=True), "top_k must be an integer"),
    (retrieve(query="x", top_k=None), "top_k must be an integer"),
    (retrieve(query="x", top_k=[4]), "top_k must be an integer"),
]


@pytest.mark.parametrize("output,reason", INVALID_ACTIONS)
def test_invalid_actions_fall_back_to_continue(output, reason):
    action = parse_action(output, RCFG)
    assert (action.kind, action.valid) == ("continue", False)
    assert reason in action.reason
    assert action.query is None and action.top_k is None


THINKING_RESPONSES = [
    # (full response with thinking on, expected kind or None for invalid)
    ("<think>\nMaybe I should STOP here.\n</think>\n\n" + retrieve(query="x"), "retrieve"),
    ("<think>\nThe memory suffices.\n</think>\n\n" + STOP_CALL, "stop"),
    ("Thinking without the opening tag.\n</think>\n\n" + STOP_CALL, "stop"),
    ("<think>\n" + STOP_CALL + "\n</think>\n\nSTOP", None),  # the call inside thinking never counts
    ("<think>\n" + retrieve(query="x") + "\n</think>\n\n", None),
    ('<think>\n{"name": "stop", "arguments": {}}\n</think>\n\nI am done.', None),
    ("<think>\nSTOP " + STOP_CALL, None),  # thinking never closed
    ("<think>\na\n</think>\n" + STOP_CALL + "\n</think>", None),  # text after the call
]


@pytest.mark.parametrize("response,kind", THINKING_RESPONSES)
def test_only_text_after_thinking_counts(response, kind):
    action = parse_action(split_thinking(response, thinking=True).output, RCFG)
    assert action.valid is (kind is not None)
    assert action.kind == (kind or "continue")


def test_parse_action_never_raises_on_hostile_strings():
    fragments = [
        "<tool_call>", "</tool_call>", "<think>", "</think>", "{", "}", "[", "]", '"', ":", ",", "\\",
        '"name"', '"arguments"', '"retrieve"', '"stop"', '"query"', '"top_k"', "4", "-1", "4.5", "null",
        "true", "NaN", " ", "\n", "STOP", "é", "\ud800", "\x00",
    ]
    rng = random.Random(0)
    outputs = ["".join(rng.choice(fragments) for _ in range(rng.randint(0, 30))) for _ in range(3000)]
    outputs += [call("[" * 100_000), call('{"a": ' * 100_000), call('"' + "x" * 1_000_000 + '"')]
    for output in outputs:
        action = parse_action(output, RCFG)
        if action.valid:
            assert action.kind in ("retrieve", "stop")
        else:
            assert action.kind == "continue" and action.reason
        if action.kind == "retrieve":
            assert RCFG.top_k_min <= action.top_k <= RCFG.top_k_max
    deep = parse_action(call("[" * 100_000), RCFG)
    assert not deep.valid and "invalid JSON" in deep.reason


def test_clamping_follows_the_configured_range():
    cfg = RetrievalConfig(top_k_min=3, top_k_max=5, top_k_default=5)
    assert parse_action(retrieve(query="q"), cfg).top_k == 5
    low, high = parse_action(retrieve(query="q", top_k=1), cfg), parse_action(retrieve(query="q", top_k=20), cfg)
    assert (low.top_k, low.clamped, high.top_k, high.clamped) == (3, True, 5, True)


# --------------------------------------------------------------------------------------------
# split_thinking
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,thinking,expected",
    [
        ("<think>\nplan it\n</think>\n\nthe memory\n", True, ("plan it", "the memory", True)),
        ("plan it\n</think>\n\nthe memory", True, ("plan it", "the memory", True)),
        ("<think>\nlong thought that ran out", True, ("long thought that ran out", "", False)),
        ("<think></think>", True, ("", "", True)),
        ("a</think>b</think>c", True, ("a", "b</think>c", True)),
        ("", True, ("", "", False)),
        ("  <think>x</think> y \n", False, ("", "<think>x</think> y", True)),
        ("just the memory", False, ("", "just the memory", True)),
    ],
)
def test_split_thinking(text, thinking, expected):
    split = split_thinking(text, thinking)
    assert (split.thinking, split.output, split.closed) == expected


# --------------------------------------------------------------------------------------------
# parse_answer
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "output,expected",
    [
        ("So the city is \\boxed{Paris}.", "Paris"),
        ("\\boxed{ Paris }", "Paris"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\text{New {York} City}}", "New {York} City"),
        ("\\boxed{\\text{Paris}}", "Paris"),
        ("\\boxed{\\textbf{Marie Curie}}.", "Marie Curie"),
        ("\\boxed{\\mathrm{1923}}", "1923"),
        ("\\boxed{\\text{New\\ York}}", "New York"),
        ("\\boxed{\\text{AT\\&T}}", "AT&T"),
        ("\\boxed{\\text{\\emph{Hamlet}} (1603)}", "Hamlet (1603)"),
        ("\\boxed {Paris}", "Paris"),
        ("\\boxed  {\\text{ Paris }}", "Paris"),
        ("\\fbox{Paris}", "Paris"),
        ("\\boxed{Rome} or rather \\fbox{Paris}", "Paris"),
        ("\\boxed{\\text{}}", None),
        ("\\boxed{\\text{Par", None),  # truncated inside the wrapper
        ("first \\boxed{Rome}, then on reflection \\boxed{Paris}", "Paris"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("no box at all", None),
        ("\\boxed{Par", None),  # truncated
        ("\\boxed{A} and later \\boxed{B", None),  # the last box is the answer, and it is broken
        ("\\boxed{}", None),
        ("\\boxed Paris", None),
    ],
)
def test_parse_boxed_answer(output, expected):
    assert parse_answer(output, "boxed") == expected


@pytest.mark.parametrize(
    "output,expected",
    [
        ("Therefore, the answer is Paris.", "Paris"),
        ("THE ANSWER IS **Paris**.", "Paris"),
        ("The answer is: \u201cParis\u201d", "Paris"),
        ("The answer is 'Paris'\nBecause the memory says so.", "Paris"),
        ("Therefore, the answer is 3.5.", "3.5"),
        ("The answer is Rome. No wait, the answer is Paris", "Paris"),
        ("I cannot tell.", None),
        ("the answer isn't in the memory", None),
        ("Therefore, the answer is", None),
        ("Therefore, the answer is **.**", None),
        ("Therefore, the answer is\n\nParis", "Paris"),
        ("The answer is:\n**Paris**.\nIt is in the memory.", "Paris"),
        ("Therefore, the answer is \\boxed{\\text{Paris}}.", "Paris"),
        ("Therefore, the answer is \\textbf{Paris}", "Paris"),
    ],
)
def test_parse_answer_is(output, expected):
    assert parse_answer(output, "answer_is") == expected


def test_parse_answer_rejects_an_unknown_format():
    with pytest.raises(ValueError, match="answer_format"):
        parse_answer("\\boxed{x}", "json")


# --------------------------------------------------------------------------------------------
# PromptBuilder fixtures and helpers
# --------------------------------------------------------------------------------------------


def make_builder(tokenizer, **overrides) -> PromptBuilder:
    return PromptBuilder(tokenizer, agent_config(overrides))


@pytest.fixture(scope="module")
def builder(tokenizer) -> PromptBuilder:
    return make_builder(tokenizer)


@pytest.fixture(scope="module")
def wiki_ids(builder) -> np.ndarray:
    """About 6K tokens of real Wikipedia text."""
    return builder.encode("\n\n".join(p["text"] for p in wiki_paragraphs()[100:160]))


def letter_bounded(text: str) -> str:
    """``text`` trimmed so that it starts and ends with a letter."""
    return re.sub(r"^[^A-Za-z]+|[^A-Za-z]+$", "", text)


def wiki_slot(builder: PromptBuilder, index: int, tokens: int) -> str:
    """Real text of about ``tokens`` tokens from paragraphs starting at ``index``, letter-bounded."""
    text = " ".join(p["text"] for p in wiki_paragraphs()[index : index + 20])
    return letter_bounded(builder.decode(builder.encode(text)[:tokens]))


def find(haystack: np.ndarray, needle: np.ndarray) -> int:
    """Index of the first occurrence of ``needle`` in ``haystack``, -1 when absent."""
    hay, pin = haystack.astype(np.int32).tobytes(), needle.astype(np.int32).tobytes()
    pos = hay.find(pin)
    while pos > 0 and pos % 4:
        pos = hay.find(pin, pos + 1)
    return pos // 4 if pos >= 0 else -1


def reference_ids(builder: PromptBuilder, text: str) -> np.ndarray:
    return np.asarray(builder.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


def build(builder: PromptBuilder, kind: str, texts: dict, history=(), step: int = 2, num_chunks: int = 7):
    """Build prompt ``kind`` from slot texts; returns (built prompt, slot texts as rendered, slot ids)."""
    ids = {name: builder.encode(text) for name, text in texts.items() if name != "evidence"}
    units = [builder.encode(text) for text in texts.get("evidence", [])]
    rendered = {"question": texts["question"], "memory": texts["memory"] or EMPTY_MEMORY_TEXT}
    if kind == "prethink":
        built = builder.prethink(ids["question"], ids["memory"], list(history), step, num_chunks)
        rendered["history"] = render_history(list(history), step, num_chunks)
    elif kind == "answer":
        built = builder.answer(ids["question"], ids["memory"])
    else:
        evidence = None if kind == "write_memagent" else units
        built = builder.write(ids["question"], ids["memory"], ids["chunk"], evidence)
        rendered["chunk"] = texts["chunk"]
        if evidence is not None:
            rendered["evidence"] = (
                "\n\n".join(f"[Retrieved #{i}] {t}" for i, t in enumerate(texts["evidence"], 1)) or NO_EVIDENCE_TEXT
            )
    slot_ids = [builder.encode(rendered[name]) for name in rendered if name != "evidence"]
    return built, rendered, slot_ids + (units if "evidence" in rendered else [])


HISTORY = [HistoryEntry("Olympic host city 1936", 4), HistoryEntry("Berlin stadium architect", 6)]
KINDS = ["prethink", "write_memagent", "write_infmem", "answer"]


# --------------------------------------------------------------------------------------------
# Chat-template equivalence
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_prompt_equals_chat_template_with_letter_bounded_slots(tokenizer, kind, thinking):
    builder = make_builder(tokenizer, thinking=thinking)
    texts = {
        "question": "Which city hosted the games whose stadium the architect designed",
        "memory": wiki_slot(builder, 0, 300),
        "chunk": wiki_slot(builder, 40, 900),
        "evidence": [],  # the empty-evidence line is letter-bounded too
    }
    built, rendered, _ = build(builder, kind, texts, history=HISTORY)
    reference = builder.render_text(kind, rendered)
    assert builder.decode(built.ids, skip_special_tokens=False) == reference
    assert built.ids.dtype == np.int32
    np.testing.assert_array_equal(built.ids, reference_ids(builder, reference))
    assert built.flags == []


@pytest.mark.parametrize("kind", KINDS)
def test_tokenization_differs_only_at_slot_boundaries(builder, kind):
    texts = {
        "question": "Which city hosted the 1936 games?",  # "?" + the template's "\n" merge
        "memory": "\n- " + builder.decode(builder.encode(wiki_paragraphs()[7]["text"])[:120]) + ".\n",
        "chunk": builder.decode(builder.encode(wiki_paragraphs()[300]["text"] * 3)[3:400]),  # mid-word start
        "evidence": [builder.decode(builder.encode(wiki_paragraphs()[500 + i]["text"])[:90]) for i in range(3)],
    }
    history = HISTORY + [HistoryEntry("  spaced\nquery?  ", 2)]
    built, rendered, slot_ids = build(builder, kind, texts, history=history)
    reference_text = builder.render_text(kind, rendered)
    assert builder.decode(built.ids, skip_special_tokens=False) == reference_text
    reference = reference_ids(builder, reference_text)

    boundaries = []
    for ids in slot_ids:
        start = find(built.ids, ids)
        assert start >= 0, "every slot's ids appear unchanged in the prompt"
        boundaries += [start, start + len(ids)]
    matcher = difflib.SequenceMatcher(None, built.ids.tolist(), reference.tolist(), autojunk=False)
    diffs = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    assert diffs, "these slot texts do merge across a boundary when tokenized together"
    for _, i1, i2, j1, j2 in diffs:
        assert any(b - 2 <= i1 and i2 <= b + 2 for b in boundaries), (i1, i2, boundaries)
        assert j2 - j1 <= 4


_SECTIONS = {
    "question": "<question>\nQ\n</question>",
    "memory": "<previous_memory>\nM\n</previous_memory>",
    "evidence": "<retrieved_passages>\nE\n</retrieved_passages>",
    "chunk": "<current_chunk>\nC\n</current_chunk>",
}


@pytest.mark.parametrize(
    "overrides,infmem_order,memagent_order",
    [
        ({}, ("question", "chunk", "memory", "evidence"), ("question", "chunk", "memory")),  # the default
        ({"write_layout": "memory_first"}, ("question", "memory", "evidence", "chunk"), ("question", "memory", "chunk")),
    ],
)
def test_chat_messages_layout(tokenizer, overrides, infmem_order, memagent_order):
    builder = make_builder(tokenizer, **overrides)
    slots = {"question": "Q", "memory": "M", "chunk": "C", "evidence": "E", "history": "H"}
    for kind, expected in (("write_infmem", infmem_order), ("write_memagent", memagent_order)):
        content = builder.chat_messages(kind, slots)[0]["content"]
        found = sorted((content.index(text), slot) for slot, text in _SECTIONS.items() if text in content)
        assert tuple(slot for _, slot in found) == expected, kind
        assert content.endswith(_SECTIONS[expected[-1]])
    assert builder.chat_messages("prethink", slots)[0]["content"].endswith("<memory>\nM\n</memory>")


# --------------------------------------------------------------------------------------------
# Prompt content
# --------------------------------------------------------------------------------------------


def test_prethink_carries_the_tools_and_the_search_history(tokenizer):
    builder = make_builder(tokenizer, retrieval={"top_k_min": 2, "top_k_max": 6, "top_k_default": 3})
    q, m = builder.encode("Who designed the stadium"), builder.encode("The games were held in Berlin")
    text = builder.decode(builder.prethink(q, m, HISTORY, step=2, num_chunks=7).ids)
    assert '"name": "retrieve"' in text and '"name": "stop"' in text
    assert '"minimum": 2, "maximum": 6, "default": 3' in text
    assert 'query "Olympic host city 1936", top_k 4' in text and 'query "Berlin stadium architect", top_k 6' in text
    assert "Step 3 of 7" in text and "Searches made so far: 2" in text
    assert "<memory>\nThe games were held in Berlin\n</memory>" in text
    first = builder.decode(builder.prethink(q, [], [], step=0, num_chunks=7).ids)
    assert "No searches made yet" in first and f"<memory>\n{EMPTY_MEMORY_TEXT}\n</memory>" in first


def test_tool_schemas_follow_the_config():
    retrieve_tool, stop_tool = tool_schemas(RetrievalConfig(top_k_min=2, top_k_max=6, top_k_default=3))
    params = retrieve_tool["function"]["parameters"]
    assert (retrieve_tool["function"]["name"], stop_tool["function"]["name"]) == ("retrieve", "stop")
    assert params["required"] == ["query"] and params["properties"]["query"]["type"] == "string"
    assert {k: params["properties"]["top_k"][k] for k in ("type", "minimum", "maximum", "default")} == {
        "type": "integer", "minimum": 2, "maximum": 6, "default": 3,
    }
    assert stop_tool["function"]["parameters"]["properties"] == {}


def test_write_prompts(tokenizer):
    builder = make_builder(tokenizer, memory_tokens=768)
    q, chunk = builder.encode("Who designed the stadium"), builder.encode("Werner March designed it")
    units = [builder.encode("The stadium opened in 1936"), builder.encode(" It seats 74,000")]
    infmem = builder.decode(builder.write(q, [], chunk, units).ids)
    assert "[Retrieved #1] The stadium opened in 1936\n\n[Retrieved #2]  It seats 74,000" in infmem
    assert "768 tokens" in infmem and "<tools>" not in infmem
    assert f"<previous_memory>\n{EMPTY_MEMORY_TEXT}\n</previous_memory>" in infmem
    assert infmem.index("<current_chunk>\nWerner March designed it") < infmem.index("<retrieved_passages>")
    empty = builder.decode(builder.write(q, [], chunk, []).ids)
    assert f"<retrieved_passages>\n{NO_EVIDENCE_TEXT}\n</retrieved_passages>" in empty
    memagent = builder.decode(builder.write(q, builder.encode("old notes"), chunk, None).ids)
    assert "768 tokens" in memagent and "<retrieved_passages>" not in memagent and "search" not in memagent
    assert "<previous_memory>\nold notes\n</previous_memory>" in memagent


@pytest.mark.parametrize("answer_format,marker", [("boxed", "\\boxed{}"), ("answer_is", "Therefore, the answer is")])
def test_answer_prompt_matches_the_answer_format(tokenizer, answer_format, marker):
    builder = make_builder(tokenizer, answer_format=answer_format)
    text = builder.decode(builder.answer(builder.encode("Who won"), builder.encode("Owens won four golds")).ids)
    assert marker in text and "<memory>\nOwens won four golds\n</memory>" in text and "<tools>" not in text
    assert ("\\boxed" in text) is (answer_format == "boxed")


@pytest.mark.parametrize("kind", KINDS)
def test_generation_prompt_with_thinking_on_and_off(tokenizer, kind):
    texts = {"question": "Who won", "memory": "", "chunk": "Owens won", "evidence": []}
    ends = {}
    for thinking in (True, False):
        builder = make_builder(tokenizer, thinking=thinking)
        built, _, _ = build(builder, kind, texts)
        ends[thinking] = builder.decode(built.ids, skip_special_tokens=False)
    assert ends[True].endswith("<|im_end|>\n<|im_start|>assistant\n") and "<think>" not in ends[True]
    assert ends[False].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ends[False].removesuffix("<think>\n\n</think>\n\n") == ends[True]


QWEN25_STYLE_TEMPLATE = (
    r"{%- if tools %}{{- '<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>' }}"
    r"{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}{{- '\n</tools><|im_end|>\n' }}{%- endif %}"
    r"{%- for message in messages %}"
    r"{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def test_template_without_thinking_support(tokenizer):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    plain.chat_template = QWEN25_STYLE_TEMPLATE
    texts = {"question": "Who won", "memory": "Owens won", "chunk": "He ran fast", "evidence": []}
    for kind in KINDS:
        built = {}
        for thinking in (True, False):
            builder = make_builder(plain, thinking=thinking)
            built[thinking], rendered, _ = build(builder, kind, texts, history=HISTORY)
            reference = builder.render_text(kind, rendered)
            np.testing.assert_array_equal(built[thinking].ids, reference_ids(builder, reference))
            assert reference.endswith("<|im_start|>assistant\n")
        np.testing.assert_array_equal(built[True].ids, built[False].ids)
        assert ("<tools>" in builder.decode(built[True].ids)) is (kind == "prethink")


def test_close_think_ids_round_trip(builder):
    assert builder.think_end_token == "</think>"
    assert builder.decode(builder.close_think_ids) == "\n</think>\n\n"
    # A two-stage response: unfinished thinking, the injected closing tag, then the action.
    response = np.concatenate(
        [builder.encode("<think>\nThe memory lacks the architect"), builder.close_think_ids,
         builder.encode(retrieve(query="stadium architect", top_k=2))]
    )
    split = split_thinking(builder.decode(response), thinking=True)
    assert split.closed and split.thinking == "The memory lacks the architect"
    action = parse_action(split.output, RCFG)
    assert (action.kind, action.query, action.top_k) == ("retrieve", "stadium architect", 2)


# --------------------------------------------------------------------------------------------
# Prompt budgets
# --------------------------------------------------------------------------------------------


def budget_builder(tokenizer, write_tokens: int = 8000, evidence_tokens: int = 2500, prethink_tokens: int = 4096, **overrides):
    return make_builder(
        tokenizer,
        **overrides,
        document={"chunk_tokens": 400, "unit_tokens": 100, "unit_overlap": 20},
        memory_tokens=64,
        retrieval={"evidence_tokens": evidence_tokens},
        write={"prompt_tokens": write_tokens, "thinking_tokens": 64, "output_tokens": 64},
        prethink={"prompt_tokens": prethink_tokens, "thinking_tokens": 64, "output_tokens": 64},
        answer={"prompt_tokens": 256, "thinking_tokens": 64, "output_tokens": 64},
    )


@pytest.fixture(scope="module")
def parts(builder, wiki_ids):
    """Question, 64-token memory, 400-token chunk and four 100-token units of real text."""
    question = builder.encode("Which architect designed the stadium of the 1936 games")
    units = [wiki_ids[1000 + 100 * i : 1100 + 100 * i] for i in range(4)]
    return question, wiki_ids[:64], wiki_ids[200:600], units


def evidence_tokens(builder, built, question, memory, chunk) -> int:
    """Tokens of the evidence block: the prompt minus the same prompt without evidence."""
    bare = builder.write(question, memory, chunk, []).ids
    return len(built.ids) - len(bare) + len(builder.encode(NO_EVIDENCE_TEXT))


def assert_intact(built, *slots) -> None:
    for ids in slots:
        assert find(built.ids, ids) >= 0


def kept_chunk(builder, built) -> np.ndarray:
    """The chunk ids of a Write prompt: what lies between its chunk tags (the closing tag's ``>``
    left out: with a section after the chunk, BPE merges it with the blank line that follows)."""
    opening, closing = builder.encode("<current_chunk>\n"), builder.encode("\n</current_chunk")
    start = find(built.ids, opening) + len(opening)
    return built.ids[start : start + find(built.ids[start:], closing)]


def test_evidence_is_capped_at_evidence_tokens(tokenizer, parts):
    question, memory, chunk, units = parts
    builder = budget_builder(tokenizer, evidence_tokens=250)
    built = builder.write(question, memory, chunk, units)
    assert built.flags == [FLAG_EVIDENCE_SHORTENED]
    assert evidence_tokens(builder, built, question, memory, chunk) <= 250
    assert_intact(built, question, memory, chunk, units[0], units[1], units[2][:20])
    assert find(built.ids, units[2]) < 0 and find(built.ids, units[3][:20]) < 0  # third cut, fourth dropped
    full = budget_builder(tokenizer, evidence_tokens=1000).write(question, memory, chunk, units)
    assert full.flags == [] and find(full.ids, units[3]) >= 0


def test_budget_shortens_evidence_before_the_chunk(tokenizer, parts):
    question, memory, chunk, units = parts
    roomy = budget_builder(tokenizer)
    # The prompt with the no-evidence line and an empty chunk, minus that line: everything fixed.
    fixed = len(roomy.write(question, memory, [], []).ids) - len(roomy.encode(NO_EVIDENCE_TEXT))
    budget = fixed + len(chunk) + 150
    built = budget_builder(tokenizer, write_tokens=budget).write(question, memory, chunk, units)
    assert built.flags == [FLAG_EVIDENCE_SHORTENED] and len(built.ids) == budget
    assert_intact(built, question, memory, chunk, units[0])
    assert find(built.ids, units[1]) < 0


def test_budget_cuts_the_chunk_head_once_evidence_is_gone(tokenizer, parts):
    question, memory, chunk, units = parts
    bare = len(budget_builder(tokenizer).write(question, memory, [], []).ids)  # no-evidence line, empty chunk
    budget = bare + len(chunk) - 50
    builder = budget_builder(tokenizer, write_tokens=budget)
    built = builder.write(question, memory, chunk, units)
    assert built.flags == [FLAG_EVIDENCE_SHORTENED, FLAG_CHUNK_SHORTENED] and len(built.ids) == budget
    assert_intact(built, question, memory, chunk[:350])
    assert find(built.ids, chunk[:351]) < 0 and find(built.ids, units[0][:10]) < 0
    assert NO_EVIDENCE_TEXT in builder.decode(built.ids)


def test_memagent_write_cuts_only_the_chunk(tokenizer, parts):
    question, memory, chunk, _ = parts
    budget = len(budget_builder(tokenizer).write(question, memory, [], None).ids) + len(chunk) - 30
    builder = budget_builder(tokenizer, write_tokens=budget)
    built = builder.write(question, memory, chunk, None)
    assert built.flags == [FLAG_CHUNK_SHORTENED] and len(built.ids) == budget
    np.testing.assert_array_equal(kept_chunk(builder, built), chunk[:370])
    assert_intact(built, question, memory)


@pytest.mark.parametrize("write_layout", ["chunk_first", "memory_first"])
def test_budget_never_exceeded_and_question_memory_never_cut(tokenizer, wiki_ids, write_layout):
    rng = random.Random(1)
    for trial in range(40):
        budget = rng.randint(530, 1400)
        builder = budget_builder(tokenizer, write_tokens=budget, evidence_tokens=rng.randint(0, 600), write_layout=write_layout)
        question = wiki_ids[3000 : 3000 + rng.randint(1, 60)]
        memory = wiki_ids[4000 : 4000 + rng.randint(0, 64)]
        chunk = wiki_ids[: rng.randint(0, 400)]
        units = [wiki_ids[5000 + 100 * i : 5000 + 100 * i + rng.randint(1, 100)] for i in range(rng.randint(0, 8))]
        evidence = None if trial % 4 == 0 else units
        built = builder.write(question, memory, chunk, evidence)
        assert len(built.ids) <= budget
        assert_intact(built, question, memory)
        kept = kept_chunk(builder, built)
        np.testing.assert_array_equal(kept, chunk[: len(kept)])  # the head is what stays
        assert (len(kept) < len(chunk)) is (FLAG_CHUNK_SHORTENED in built.flags)
        if FLAG_CHUNK_SHORTENED in built.flags:
            assert len(built.ids) == budget
            if evidence:
                assert FLAG_EVIDENCE_SHORTENED in built.flags, "the chunk is only cut after the evidence"


def test_question_too_long_raises(tokenizer, wiki_ids):
    builder = budget_builder(tokenizer, write_tokens=600, prethink_tokens=700)
    question, memory = wiki_ids[:500], wiki_ids[500:564]
    with pytest.raises(ValueError, match=r"question: 500 question tokens.*write\.prompt_tokens=600"):
        builder.write(question, memory, wiki_ids[:400], [wiki_ids[:100]])
    with pytest.raises(ValueError, match=r"question:.*answer\.prompt_tokens=256"):
        builder.answer(question, memory)
    with pytest.raises(ValueError, match=r"question:.*prethink\.prompt_tokens=700"):
        builder.prethink(question, memory, HISTORY, 0, 3)


def test_prethink_drops_the_oldest_searches_to_fit(tokenizer, parts):
    question, memory, _, _ = parts
    history = [HistoryEntry(f"query number {i} about the stadium", 3) for i in range(1, 41)]
    roomy = budget_builder(tokenizer)
    minimal = len(roomy.prethink(question, memory, [], 0, 50).ids)
    budget = minimal + 120
    built = budget_builder(tokenizer, prethink_tokens=budget).prethink(question, memory, history, 40, 50)
    text = roomy.decode(built.ids)
    assert len(built.ids) <= budget and built.flags == []
    assert 'query "query number 40 about the stadium"' in text and '"query number 1 about' not in text
    assert "Searches made so far: 40, the" in text and "oldest not shown" in text
    assert_intact(built, question, memory)
    full = roomy.prethink(question, memory, history, 40, 50)
    assert "oldest not shown" not in roomy.decode(full.ids) and len(full.ids) > budget


def whole_text_history(builder: PromptBuilder, history, step: int, num_chunks: int, room: int) -> np.ndarray | None:
    """The history slot as the builder computed it before its lines were cached: the whole text
    encoded for each candidate, binary search on the hidden entries; None when nothing fits."""

    def encoded(hidden: int) -> np.ndarray:
        return reference_ids(builder, render_history(history, step, num_chunks, hidden=hidden))

    full = encoded(0)
    if len(full) <= room:
        return full
    best = encoded(len(history))
    if len(best) > room:
        return None
    low, high = 1, len(history)
    while low < high:
        hidden = (low + high) // 2
        ids = encoded(hidden)
        if len(ids) <= room:
            best, high = ids, hidden
        else:
            low = hidden + 1
    # The search's answer is the fewest hidden entries that fit (the lengths are monotone).
    assert len(encoded(low - 1)) > room
    return best


ODD_QUERIES = [
    "caf\u00e9 \u00e0 Montr\u00e9al",
    "\u65e5\u672c\u8a9e \u6771\u4eac 1964",
    "\u0645\u0631\u062d\u0628\u0627 \U0001f600",
    'a "quoted" back\\slash',
    "two\nlines\tand tab",
    "  padded query  ",
    "<|im_end|> <think>",
    "Zo\u0308e 12345",
]


def history_queries(count: int, seed: int) -> list[HistoryEntry]:
    """Controller-like queries from real Wikipedia titles, a third of them non-ASCII or escaped."""
    rng = random.Random(seed)
    titles = [p["title"] for p in wiki_paragraphs()[:2000]]
    entries = []
    for i in range(count):
        query = rng.choice(titles) if i % 3 else rng.choice(ODD_QUERIES) + " " + rng.choice(titles)
        entries.append(HistoryEntry(query, rng.randint(1, 8)))
    return entries


def history_prompt(builder: PromptBuilder, question: np.ndarray, filler: np.ndarray, history, step, room: int):
    """A PreThink prompt (of 240 chunks) whose memory leaves exactly ``room`` tokens for the
    history slot; returns the template, that memory and the built prompt."""
    template = builder._templates["prethink"]
    memory = np.resize(filler, builder.cfg.prethink.prompt_tokens - template.static_tokens - len(question) - room)
    return template, memory, builder.prethink(question, memory, history, step, 240)


def history_lengths(builder: PromptBuilder, history, step: int) -> tuple[int, int]:
    """Tokens of the history slot with every entry shown and with none shown."""
    full = render_history(history, step, 240)
    shortest = render_history(history, step, 240, hidden=len(history))
    return len(reference_ids(builder, full)), len(reference_ids(builder, shortest))


def test_history_ids_equal_whole_text_encoding(tokenizer, wiki_ids):
    # Every history length 0..200 with rooms from "everything fits" down to "not even the
    # header fits"; the ids must be exactly those of encoding the rendered history whole.
    builder = make_builder(tokenizer, prethink={"prompt_tokens": 12_000, "thinking_tokens": 64, "output_tokens": 64})
    assert builder._history_lines_separable  # the cached-lines path is the one under test
    question = builder.encode("Which stadium hosted the 1936 games, and who was its architect?")
    history = history_queries(200, seed=5)
    rng = random.Random(7)
    checked = {"fits": 0, "cut": 0, "error": 0}
    for n in range(201):
        step = n + rng.randint(0, 3)
        full, shortest = history_lengths(builder, history[:n], step)
        for room in [full, full - 1, rng.randint(shortest, full), shortest, shortest - 1][n % 5 :: 2]:
            expected = whole_text_history(builder, history[:n], step, 240, room)
            if expected is None:
                with pytest.raises(ValueError, match=r"question:.*prethink\.prompt_tokens=12000"):
                    history_prompt(builder, question, wiki_ids, history[:n], step, room)
                checked["error"] += 1
                continue
            template, memory, built = history_prompt(builder, question, wiki_ids, history[:n], step, room)
            want = template.assemble({"question": question, "history": expected, "memory": memory})
            np.testing.assert_array_equal(built.ids, want, err_msg=f"{n} searches, room {room}")
            checked["fits" if len(expected) == full else "cut"] += 1
    assert min(checked.values()) >= 30, checked


def test_history_of_a_tokenizer_without_separable_lines(tokenizer, wiki_ids):
    # GPT-2 style pre-tokenization is not proven to split at line breaks: the builder must
    # encode each history variant whole, and still pick the same number of hidden entries.
    other = copy.deepcopy(tokenizer)
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    builder = make_builder(other, prethink={"prompt_tokens": 8000, "thinking_tokens": 64, "output_tokens": 64})
    assert not builder._history_lines_separable
    question = builder.encode("Which stadium hosted the 1936 games?")
    history = history_queries(60, seed=11)
    for n, fraction in [(0, 1.0), (25, 1.0), (60, 0.5), (60, 0.0)]:
        full, shortest = history_lengths(builder, history[:n], n)
        room = shortest + int(fraction * (full - shortest))
        template, memory, built = history_prompt(builder, question, wiki_ids, history[:n], n, room)
        expected = whole_text_history(builder, history[:n], n, 240, room)
        want = template.assemble({"question": question, "history": expected, "memory": memory})
        np.testing.assert_array_equal(built.ids, want)


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


def test_bad_inputs_name_the_field(builder, parts):
    question, memory, chunk, units = parts
    with pytest.raises(ValueError, match="question_ids: expected a 1-D"):
        builder.answer(question.reshape(1, -1), memory)
    with pytest.raises(ValueError, match="question_ids: expected at least one token"):
        builder.answer([], memory)
    with pytest.raises(ValueError, match="chunk_ids: expected integer"):
        builder.write(question, memory, chunk.astype(np.float32), None)
    with pytest.raises(ValueError, match=r"evidence\[1\]"):
        builder.write(question, memory, chunk, [units[0], units[1].reshape(2, -1)])
    with pytest.raises(ValueError, match="step: expected 0 <= step < num_chunks"):
        builder.prethink(question, memory, [], 5, 5)
    lists = builder.write(question.tolist(), memory.tolist(), chunk.tolist(), [u.tolist() for u in units])
    np.testing.assert_array_equal(lists.ids, builder.write(question, memory, chunk, units).ids)


def test_config_is_validated(tokenizer):
    with pytest.raises(ValueError, match="retrieval.top_k_default"):
        PromptBuilder(tokenizer, AgentConfig(retrieval=RetrievalConfig(top_k_default=20)))
