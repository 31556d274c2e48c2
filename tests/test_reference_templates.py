"""``--templates-from``: a released checkpoint's prompts read from a checkout of its reference code.

The checkouts here are fixtures written for the test in the reference repositories' layout (the
files and constant names the authors' harnesses use, texts of our own), never the authors' texts.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.protocol import PromptBuilder, parse_action
from infmem_verl.agent.templates import load_templates
from infmem_verl.eval import parse_args
from infmem_verl.evaluation.reference_templates import LAYOUTS, TEMPLATES_FILE

# Importing the file would fail: the reader must parse it, never run it.
UNIMPORTABLE = "import a_module_nobody_installed\n"


def checkout(root: Path, layout: str, body: str) -> Path:
    file = root / LAYOUTS[layout].file
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(UNIMPORTABLE + textwrap.dedent(body))
    return root


MEMAGENT = '''
    NO_MEMORY = "nothing yet"
    TEMPLATE = """Question {prompt}
    Notes so far: {memory}
    Passage: {chunk}
    Rewrite the notes:"""
    TEMPLATE_FINAL = """Question {prompt}
    Notes: {memory}
    End with "Therefore, the answer is ..." and never write \\\\boxed{{}}."""
'''

INFMEM = '''
    TEMPLATE_CALL_OR_ANSWER = """Plan retrieval for {prompt}.
    Done so far: {retrieval_history}
    Notes: {memory}"""
    TEMPLATE_RETREIVE_RECURRENT = """Question {prompt}
    Found: {retrieve}
    Passage: {chunk}
    Notes: {memory}"""
    TEMPLATE_FINAL = """Question {prompt} notes {memory}. Say: Therefore, the answer is X."""

    def get_bm25search_tool_schema():
        return {"type": "function", "function": {"name": "lookup", "description": "Find passages.",
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
'''


def test_memagent_layout_becomes_our_templates_next_to_the_results(tmp_path):
    root = checkout(tmp_path / "MemAgent", "memagent", MEMAGENT)
    out = tmp_path / "run"
    cfg = parse_args(["--templates-from", str(root), "--out", str(out), "--methods", "memagent"])
    agent = cfg.agent_config()
    assert agent.prompt_templates == str(out / TEMPLATES_FILE) and agent.answer_format == "answer_is"
    templates = load_templates(out / TEMPLATES_FILE)
    assert set(templates) == {"write_memagent", "answer"}
    write = templates["write_memagent"].messages({"question": "Q?", "memory": "M", "chunk": "C"})
    assert write == [{"role": "user", "content": "Question Q?\nNotes so far: M\nPassage: C\nRewrite the notes:"}]
    answer = templates["answer"].messages({"question": "Q?", "memory": "M"})[0]["content"]
    assert answer.endswith("never write \\boxed{}.")  # str.format's escaped braces are literal text
    assert f"from {root / LAYOUTS['memagent'].file}" in (out / TEMPLATES_FILE).read_text().splitlines()[0]


def test_infmem_layout_sets_the_qwen_agent_grammar_from_the_tool_schema(tmp_path):
    root = checkout(tmp_path / "InfMem", "infmem", INFMEM)
    cfg = parse_args(["--templates-from", str(root), "--out", str(tmp_path / "run"), "--set", "stop_votes=3"])
    agent = cfg.agent_config()
    assert (agent.controller.grammar, agent.controller.function_name, agent.stop_votes) == ("qwen_agent", "lookup", 3)
    templates = load_templates(agent.prompt_templates)
    assert set(templates) == {"prethink", "write_infmem", "answer"}
    prethink = templates["prethink"].messages({"question": "Q?", "history": "H", "memory": "M"})
    assert prethink[0]["role"] == "system" and "✿FUNCTION✿: lookup" in prethink[0]["content"] and '"Find passages."' in prethink[0]["content"]
    assert prethink[1]["content"] == "Plan retrieval for Q?.\nDone so far: H\nNotes: M"
    write = templates["write_infmem"].messages({"question": "Q", "memory": "M", "evidence": "E", "chunk": "C"})
    assert write[0]["content"] == "Question Q\nFound: E\nPassage: C\nNotes: M"
    # The same checkout read with the MemAgent layout is the baseline's prompts (InfMem's repo holds both).
    checkout(root, "memagent", MEMAGENT)
    baseline = parse_args(["--templates-from", f"memagent={root}", "--out", str(tmp_path / "base"), "--methods", "memagent"])
    assert set(yaml.safe_load((tmp_path / "base" / TEMPLATES_FILE).read_text())) == {"write_memagent", "answer"}
    assert baseline.agent_config().controller.grammar == "tool_call"


@pytest.mark.parametrize(
    "edit, message",
    [
        (("Passage: {chunk}", "Passage: (none)"), r"TEMPLATE: expected the placeholder \{chunk\} \(our \{chunk\}\) exactly once, found it 0 times"),
        (("Passage: {chunk}", "Passage: {chunk} {chunk}"), r"\{chunk\}\) exactly once, found it 2 times"),
        (("Passage: {chunk}", "Passage: {chunk} {title}"), r"TEMPLATE: placeholder \{title\} has no slot in our write_memagent prompt"),
        (("TEMPLATE_FINAL =", "FINAL ="), r"defines no string constant TEMPLATE_FINAL \(the answer prompt\)"),
    ],
)
def test_a_missing_or_extra_placeholder_is_named(tmp_path, edit, message):
    root = checkout(tmp_path / "MemAgent", "memagent", MEMAGENT.replace(*edit))
    with pytest.raises(ConfigError, match=message):
        parse_args(["--templates-from", str(root), "--out", str(tmp_path / "run")])


def test_a_wrong_checkout_or_a_second_template_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"recurrent\.py not found; a checkout with the memagent layout holds"):
        parse_args(["--templates-from", str(tmp_path), "--out", str(tmp_path / "run")])
    with pytest.raises(ConfigError, match="is not a folder"):
        parse_args(["--templates-from", str(tmp_path / "absent"), "--out", str(tmp_path / "run")])
    root = checkout(tmp_path / "MemAgent", "memagent", MEMAGENT)
    with pytest.raises(ConfigError, match="give it or --set prompt_templates=FILE, not both"):
        parse_args(["--templates-from", str(root), "--set", "prompt_templates=mine.yaml"])


def test_the_templates_read_build_the_prompts_the_checkpoint_sees(tokenizer, tmp_path):
    """Through the real prompt builder and Qwen3 chat template: the checkout's text with our slots
    filled, the tool described in PreThink's system message, and the qwen_agent call parsed."""
    root = checkout(tmp_path / "InfMem", "infmem", INFMEM)
    cfg = parse_args(["--templates-from", str(root), "--out", str(tmp_path / "run"), "--set", "record_token_ids=true"])
    agent = cfg.agent_config()
    builder = PromptBuilder(tokenizer, agent)
    question, memory = builder.encode("Who designed the stadium"), builder.encode("It opened in 1936")
    chunk, unit = builder.encode("The architect Werner March built it"), builder.encode("March was born in Berlin")
    write = builder.decode(builder.write(question, memory, chunk, [unit]).ids)
    assert "Question Who designed the stadium\nFound: [Retrieved #1] March was born in Berlin\nPassage: The architect Werner March" in write
    prethink = builder.decode(builder.prethink(question, memory, [], 0, 3).ids, skip_special_tokens=False)
    assert prethink.startswith("<|im_start|>system\n# Tools") and "✿FUNCTION✿: lookup" in prethink
    assert "Plan retrieval for Who designed the stadium." in prethink
    action = parse_action('✿FUNCTION✿: lookup\n✿ARGS✿: {"query": "stadium architect", "top_k": 3}', agent.retrieval, agent.controller)
    assert (action.kind, action.query, action.top_k) == ("retrieve", "stadium architect", 3)


def test_a_resume_with_other_prompts_in_the_checkout_is_refused(tmp_path):
    """The written file keeps its path when the checkout changes; the run's manifest holds the texts."""
    from infmem_verl.eval import run_protocol
    from infmem_verl.evaluation.store import ResultStore

    root = checkout(tmp_path / "MemAgent", "memagent", MEMAGENT)
    out = tmp_path / "run"
    first = parse_args(["--templates-from", str(root), "--out", str(out), "--methods", "memagent"]).agent_config()
    ResultStore(out, run_protocol("reference", first, "m", 8192))
    ResultStore(out, run_protocol("reference", first, "m", 8192))  # the same prompts resume
    checkout(root, "memagent", MEMAGENT.replace("Rewrite the notes:", "Write new notes:"))
    second = parse_args(["--templates-from", str(root), "--out", str(out), "--methods", "memagent"]).agent_config()
    assert second.prompt_templates == first.prompt_templates
    with pytest.raises(ConfigError, match=r"holds results of another protocol \(prompt_texts\.write_memagent\.user"):
        ResultStore(out, run_protocol("reference", second, "m", 8192))
