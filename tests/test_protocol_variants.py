"""Protocol variants for checkpoints trained elsewhere: user prompt templates, the Qwen-Agent
controller grammar with the reference's two compatibility rules, the paper-era retrieval and the
MemAgent budget variants. Real Qwen3 tokenizer, real chat template, real rank_bm25."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from infmem_verl.agent.config import AgentConfig, CallBudget, RetrievalConfig, agent_config, from_mapping
from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.document import Document
from infmem_verl.agent.loops import build_agent
from infmem_verl.agent.protocol import PromptBuilder, ThinkSplit, decide_action, parse_action
from infmem_verl.agent.retrieval import BM25Index
from infmem_verl.agent.templates import load_templates
from infmem_verl.assets import wiki_paragraphs
from infmem_verl.evaluation.config import VARIANTS, EvalConfig
from infmem_verl.policy.scripted import ScriptedPolicy

TEMPLATES = Path(__file__).with_name("protocol_variant_templates.yaml")
FN = "\u273fFUNCTION\u273f"
ARGS = "\u273fARGS\u273f"


def variant_cfg(**agent):
    """The embedded preset with the test templates and the qwen_agent grammar (function `lookup`)."""
    settings = {"prompt_templates": str(TEMPLATES), "controller": {"grammar": "qwen_agent", "function_name": "lookup"}}
    for key, value in agent.items():
        settings[key] = {**settings.get(key, {}), **value} if isinstance(value, dict) else value
    return EvalConfig(preset="embedded", agent=settings).agent_config()


# ------------------------------------------------------------------------------ templates


def test_user_templates_replace_the_prompts_and_assemble_to_the_chat_templates_text(tokenizer, tmp_path):
    cfg = variant_cfg(record_token_ids=True)
    builder = PromptBuilder(tokenizer, cfg)
    question, memory = builder.encode("Who designed the stadium"), builder.encode("The stadium opened in 1936")
    chunk, unit = builder.encode("The architect Werner March built it"), builder.encode("March was born in Berlin")
    built = {
        "write_memagent": builder.write(question, memory, chunk, None),
        "write_infmem": builder.write(question, memory, chunk, [unit]),
        "answer": builder.answer(question, memory),
        "prethink": builder.prethink(question, memory, [], 0, 3),
    }
    slots = {"question": "Who designed the stadium", "memory": "The stadium opened in 1936",
             "chunk": "The architect Werner March built it", "evidence": "[Retrieved #1] March was born in Berlin",
             "history": "Step 1 of 3: 0 of the 3 chunks have been read into the memory\nNo searches made yet"}  # fmt: skip
    for kind, prompt in built.items():
        text = builder.decode(prompt.ids, skip_special_tokens=False)
        assert text == builder.render_text(kind, slots), kind
    # The slot order is the file's: the MemAgent write shows the chunk before the memory.
    memagent = builder.decode(built["write_memagent"].ids)
    assert memagent.index("Werner March") < memagent.index("opened in 1936") < memagent.index("Rewritten notes:")
    # qwen_agent: the tool description is the template's system message, no Qwen3 tool schema.
    prethink = builder.decode(built["prethink"].ids, skip_special_tokens=False)
    assert prethink.startswith("<|im_start|>system\nYou can call one function, lookup") and "<tools>" not in prethink
    # Kinds the file leaves out keep the built-in prompts.
    partial = tmp_path / "answer_only.yaml"
    partial.write_text('answer: "Notes: {memory}\\nQuestion: {question}\\nAnswer:"\n')
    mixed = PromptBuilder(tokenizer, agent_config({"prompt_templates": str(partial)}))
    assert "Notes: The stadium" in mixed.decode(mixed.answer(question, memory).ids)
    assert "<previous_memory>" in mixed.decode(mixed.write(question, memory, chunk, None).ids)


@pytest.mark.parametrize(
    "text, words",
    [
        ("answer: 'Q: {question}'\n", "answer.user: expected the slot {memory} exactly once, found it 0 times"),
        ("answer: '{question} {memory} {memory}'\n", "answer.user: expected the slot {memory} exactly once, found it 2"),
        ("answer: '{question} {memory} {chunk}'\n", "answer.user: slot {chunk} is not available here"),
        ("summary: '{question}'\n", "unknown prompt kind 'summary'"),
        ("answer: {user: 3}\n", "answer: expected a string or a mapping with 'user'"),
        ("answer: {system: 'About {memory}', user: '{question} {memory}'}\n", "answer.system: slots belong in the user"),
        ("answer: [unclosed\n", "not valid YAML"),
    ],
)
def test_a_bad_template_file_is_refused_naming_the_file_the_kind_and_the_slot(tmp_path, text, words):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="prompt_templates: .*mine.yaml") as err:
        agent_config({"prompt_templates": str(path)})
    assert words in str(err.value)


def test_missing_template_file_and_qwen_agent_without_a_prethink_template_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"prompt_templates: cannot read .*nope.yaml"):
        agent_config({"prompt_templates": str(tmp_path / "nope.yaml")})
    with pytest.raises(ConfigError, match="prethink template describing the qwen_agent grammar"):
        agent_config({"controller": {"grammar": "qwen_agent"}})
    assert load_templates(TEMPLATES).keys() == {"prethink", "write_memagent", "write_infmem", "answer"}


# ------------------------------------------------------------------- the qwen_agent grammar


QWEN = agent_config({"prompt_templates": str(TEMPLATES), "controller": {"grammar": "qwen_agent", "function_name": "lookup"}})


@pytest.mark.parametrize(
    "output, expected",
    [
        (f'{FN}: lookup\n{ARGS}: {{"query": "stadium architect", "top_k": 3}}', ("retrieve", "stadium architect", 3, True)),
        (f'{FN}: lookup\n{ARGS}: {{"query": "stadium architect"}}', ("retrieve", "stadium architect", 4, True)),
        (f'{FN}: lookup\n{ARGS}: ```json\n{{"query": "Berlin"}}\n```', ("retrieve", "Berlin", 4, True)),
        # The model went on to imagine the tool's reply: ignored.
        (f'{FN}: lookup\n{ARGS}: {{"query": "Berlin"}}\n\u273fRESULT\u273f: Berlin is ...', ("retrieve", "Berlin", 4, True)),
        ("STOP", ("stop", None, None, True)),
        ("  STOP\n", ("stop", None, None, True)),
        ("I will STOP here", ("continue", None, None, False)),
        ("The memory is enough.", ("continue", None, None, False)),
        ("", ("continue", None, None, False)),
        (f'Let me search.\n{FN}: lookup\n{ARGS}: {{"query": "x"}}', ("continue", None, None, False)),
        (f'{FN}: search\n{ARGS}: {{"query": "x"}}', ("continue", None, None, False)),
        (f'{FN}: lookup\n{ARGS}: {{"query": "x"}}\n{FN}: lookup\n{ARGS}: {{"query": "y"}}', ("continue", None, None, False)),
        (f"{FN}: lookup\n{ARGS}: {{query: x}}", ("continue", None, None, False)),
        (f'{FN}: lookup\n{ARGS}: {{"query": "x", "top_k": "3"}}', ("continue", None, None, False)),
        (f'{FN}: lookup\n{ARGS}: {{"query": "x", "top_k": 30}}', ("retrieve", "x", 8, True)),  # clamped
    ],
)
def test_qwen_agent_grammar(output, expected):
    action = parse_action(output, QWEN.retrieval, QWEN.controller)
    assert (action.kind, action.query, action.top_k, action.valid) == expected, action.reason


def test_stop_anywhere_and_no_call_stops_are_off_unless_asked():
    thought = ThinkSplit(thinking="Should I STOP? No, the year is missing.", output=f'{FN}: lookup\n{ARGS}: {{"query": "year"}}', closed=True)
    no_call = ThinkSplit(thinking="hm", output="The notes look complete.", closed=True)
    assert decide_action(thought, QWEN).kind == "retrieve"
    assert decide_action(no_call, QWEN).valid is False
    anywhere = agent_config({**_qwen_settings(), "controller": {**_qwen_settings()["controller"], "stop_anywhere": True}})
    assert decide_action(thought, anywhere).kind == "stop"  # the reference's rule: thinking included
    unclosed = ThinkSplit(thinking="I think we can STOP", output="", closed=False)
    assert decide_action(unclosed, anywhere).kind == "stop" and decide_action(unclosed, QWEN).valid is False
    votes = agent_config({**_qwen_settings(), "controller": {**_qwen_settings()["controller"], "no_call_stops": True}})
    action = decide_action(no_call, votes)
    assert (action.kind, action.valid, action.restarts_votes) == ("stop", True, True)
    # Our own grammar has the same two rules.
    ours = agent_config({"controller": {"no_call_stops": True}})
    assert decide_action(ThinkSplit("", "No call here.", True), ours).kind == "stop"


def _qwen_settings() -> dict:
    return {"prompt_templates": str(TEMPLATES), "controller": {"grammar": "qwen_agent", "function_name": "lookup"}}


def test_a_no_call_vote_restarts_the_count_of_consecutive_stop_votes(tokenizer):
    """As in the reference's harness: with 3 votes needed, no-call outputs alone never stop,
    and an explicit STOP after one counts as the second vote, not the third."""
    document = "\n\n".join(f"{p['title']}\n{p['text']}" for p in wiki_paragraphs()[:12])
    settings = _qwen_settings()
    settings["controller"]["no_call_stops"] = True
    cfg = variant_cfg(stop_votes=3, controller=settings["controller"], thinking=False, document={"chunk_tokens": 300})
    outputs = iter(["nothing to call", "STOP", "no call again", "STOP", "STOP", "STOP"])

    def respond(prompt, params):
        text = tokenizer.decode(prompt.tolist())
        return next(outputs) if "Decide whether to search again" in text else "notes: nothing yet"

    agent = build_agent("infmem", cfg, tokenizer)
    trajectory = asyncio.run(agent.run(ScriptedPolicy(tokenizer, respond), "Who designed the stadium?", document))
    kinds = [t.action.kind for t in trajectory.turns if t.kind == "prethink"]
    # votes: 1 (no call), 2, 1 (no call restarts), 2, 3 -> stop at the fifth PreThink
    assert kinds == ["stop"] * 5 and trajectory.stop_step == 4 and trajectory.num_chunks > 5


# ---------------------------------------------------------------------- paper-era retrieval


def test_paper_retrieval_variant_ranks_as_bm25okapi_over_whitespace_words(tokenizer):
    from rank_bm25 import BM25Okapi

    cfg = EvalConfig(preset="reference", variants=["paper_retrieval"]).agent_config()
    assert (cfg.document.unit_overlap, cfg.retrieval.k1, cfg.retrieval.analyzer) == (0, 1.5, "whitespace")
    assert (cfg.retrieval.top_k_min, cfg.retrieval.top_k_max) == (4, 4)
    text = "\n\n".join(f"{p['title']}\n{p['text']}" for p in wiki_paragraphs()[:40])
    document = Document.from_text(text, tokenizer, cfg.document)
    units = list(document.unit_texts())
    bounds = document.unit_bounds
    assert len(units) >= 8 and np.array_equal(bounds[1:, 0], bounds[:-1, 1]), "units without overlap"
    index = BM25Index.build(units, cfg.retrieval)
    okapi = BM25Okapi([u.lower().split() for u in units], k1=1.5, b=0.75)
    for query in ("Olympic Games held in", "the river, which", "Paris, France"):
        expected = okapi.get_scores(query.lower().split())
        np.testing.assert_allclose(index.scores(query), expected)
    # Punctuation stays glued: "france" is not "france," as in the paper-era code.
    assert np.array_equal(index.scores("france") > 0, okapi.get_scores(["france"]) > 0)
    assert RetrievalConfig().analyzer == "words"  # ours stays the default


# ------------------------------------------------------------------------ MemAgent variants


@pytest.mark.parametrize("variant", ["memagent_shared", "memagent_nothink"])
def test_memagent_variants_budget_thinking_and_memory_as_described(tokenizer, variant):
    cfg = EvalConfig(preset="reference", variants=[variant]).agent_config()
    document = "\n\n".join(f"{p['title']}\n{p['text']}" for p in wiki_paragraphs()[:6])
    policy = ScriptedPolicy(tokenizer, lambda prompt, params: "<think>\nok\n</think>\n\nThe notes"
                            if cfg.thinking else "Therefore, the answer is Paris")  # fmt: skip
    trajectory = asyncio.run(build_agent("memagent", cfg, tokenizer).run(policy, "Where?", document))
    # One generate call per turn with one 1024-token budget: thinking and memory share it.
    assert [c.params.max_tokens for c in policy.calls] == [1024] * len(trajectory.turns)
    prompt = tokenizer.decode(policy.calls[0].prompt_ids.tolist())
    assert ("<think>\n\n</think>" in prompt) == (variant == "memagent_nothink")  # Qwen3's thinking-off marker
    assert set(VARIANTS) >= {"paper_retrieval", "memagent_shared", "memagent_nothink"}


@pytest.mark.parametrize(
    "preset,variants,method,memory_first",
    [
        ("default", [], "memagent", False),  # ours: chunk_first, for RL, SFT data and evaluation alike
        ("default", [], "infmem", False),
        ("reference", [], "memagent", True),
        ("reference", [], "infmem", True),
        ("embedded", [], "memagent", False),
        ("embedded", ["memagent_shared"], "memagent", True),  # the variants pin it on any preset
        ("embedded", ["memagent_nothink"], "memagent", True),
    ],
)
def test_the_reference_protocols_write_the_memory_before_the_chunk(tokenizer, preset, variants, method, memory_first):
    cfg = EvalConfig(preset=preset, variants=variants).agent_config()
    document = "\n\n".join(f"{p['title']}\n{p['text']}" for p in wiki_paragraphs()[:6])
    policy = ScriptedPolicy(tokenizer, lambda prompt, params: "<think>\nok\n</think>\n\nThe notes")
    asyncio.run(build_agent(method, cfg, tokenizer).run(policy, "Where?", document))
    writes = [tokenizer.decode(c.prompt_ids.tolist()) for c in policy.calls]
    writes = [text for text in writes if "<current_chunk>" in text]
    assert writes and cfg.write_layout == ("memory_first" if memory_first else "chunk_first")
    for text in writes:
        assert (text.index("<previous_memory>") < text.index("<current_chunk>")) is memory_first


def test_a_variant_setting_part_of_a_budget_keeps_the_rest_of_the_default():
    cfg = EvalConfig(preset="default", variants=["memagent_nothink"]).agent_config()
    assert (cfg.write.prompt_tokens, cfg.write.thinking_tokens, cfg.write.output_tokens) == (
        AgentConfig().write.prompt_tokens, AgentConfig().write.thinking_tokens, 1024,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"^write\.prompt_tokens: missing; CallBudget needs"):
        from_mapping(CallBudget, {"thinking_tokens": 0, "output_tokens": 4}, "write")
