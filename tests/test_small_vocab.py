"""The small-vocabulary Qwen3 tokenizer (infmem_verl/small_vocab.py) keeps Qwen3's protocol:
its special tokens, its chat template and lossless text, at a few thousand tokens."""

from __future__ import annotations

import json

import pytest

from infmem_verl.agent.config import AgentConfig
from infmem_verl.agent.protocol import PromptBuilder
from infmem_verl.assets import load_tokenizer, qwen3_tokenizer_dir, tiny_qwen3_dir
from infmem_verl.small_vocab import small_vocab_dir


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return small_vocab_dir(cache_dir=tmp_path_factory.mktemp("small_vocab"))


def test_protocol_text_round_trips_and_every_qwen3_added_token_is_one_token(small_dir):
    small, qwen = load_tokenizer(str(small_dir)), load_tokenizer()
    assert len(small) == 4096
    added = json.loads((qwen3_tokenizer_dir() / "tokenizer.json").read_text())["added_tokens"]
    for token in added:
        ids = small(token["content"], add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] >= 4096 - len(added), token["content"]
    assert small.eos_token == "<|im_end|>" and small.pad_token == "<|endoftext|>"
    builder = PromptBuilder(small, AgentConfig())
    slots = {"question": "Who commanded the Vrouthen?", "history": "", "memory": "Zaelor Brintov, née Ståhl",
             "chunk": "Paris\nParis is the capital of France.\t 中文", "evidence": ""}
    for kind in ("prethink", "write_memagent", "write_infmem", "answer"):
        text = builder.render_text(kind, slots)
        # The same chat template renders the same text under both tokenizers.
        assert text == PromptBuilder(qwen, AgentConfig()).render_text(kind, slots)
        ids = small(text, add_special_tokens=False)["input_ids"]
        assert small.decode(ids) == text and max(ids) < 4096
        assert ids.count(small.convert_tokens_to_ids("<|im_start|>")) == text.count("<|im_start|>")
    reply = '<think>\n\n</think>\n\n<tool_call>\n{"name": "stop", "arguments": {}}\n</tool_call>'
    assert small.decode(small(reply, add_special_tokens=False)["input_ids"]) == reply


def test_the_stand_in_model_covers_the_small_vocabulary(small_dir, tmp_path):
    from transformers import AutoConfig

    model = tiny_qwen3_dir(cache_dir=tmp_path, hidden_size=64, tokenizer_dir=small_dir)
    config = AutoConfig.from_pretrained(str(model))
    reloaded = load_tokenizer(str(model))
    assert config.vocab_size == 4096 and len(reloaded) == 4096
    assert config.eos_token_id == reloaded.convert_tokens_to_ids("<|im_end|>")
    text = "<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is Drouvaeth.<|im_end|>"
    assert reloaded(text)["input_ids"] == load_tokenizer(str(small_dir))(text)["input_ids"]


def test_every_name_of_the_closed_list_is_one_token_after_a_space_and_at_a_line_start(small_dir):
    from infmem_verl.data.synthetic import NAME_LIST, chain

    small = load_tokenizer(str(small_dir))
    for name in NAME_LIST:
        assert len(small(f" {name}", add_special_tokens=False)["input_ids"]) == 1, name
        assert len(small(f"\n{name}", add_special_tokens=False)["input_ids"]) == 2, name  # the line break, the name
    # A syllable-built name still takes several tokens: the list, not the BPE, makes names single.
    assert len(small(" " + chain(0, 5).answer, add_special_tokens=False)["input_ids"]) > 2
