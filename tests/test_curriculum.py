"""The warm-up's curriculum (infmem_verl/sft/curriculum.py) on real components: the demo recipe's
protocol, the small-vocabulary tokenizer, role-named chains and the SFT parquet the verl SFT
command reads."""

from __future__ import annotations

import itertools

import pyarrow.parquet as pq
import pytest

from infmem_verl.agent.protocol import PromptBuilder
from infmem_verl.assets import load_tokenizer
from infmem_verl.data.synthetic import chain
from infmem_verl.distill import recipe_agent
from infmem_verl.sft.curriculum import answer_call, asked, stage_calls, write_stage
from infmem_verl.sft.fresh import FreshCalls
from infmem_verl.small_vocab import small_vocab_dir


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(small_vocab_dir()))


@pytest.fixture(scope="module")
def demo_cfg():
    return recipe_agent("demo", ["infmem.agent.document.chunk_tokens=128"])[1]


def test_answer_calls_ask_each_name_of_a_chain_in_turn():
    item = chain(0, 3, "roles")
    assert asked(item, 0) == item and asked(item, 3) == item and asked(item, 0, "chain") == item
    bridge, entity = asked(item, 1), asked(item, 5)
    assert (bridge.answer, entity.answer) == (item.bridge, item.entity)
    assert item.entity in bridge.question and item.bridge in entity.question
    assert asked(item, 4, "chain") == item
    with pytest.raises(ValueError, match="questions: expected 'chain' or 'all'"):
        asked(item, 1, "some")


def test_an_answer_call_reads_the_facts_from_memory_and_answers_the_name_asked(tokenizer, demo_cfg):
    builder = PromptBuilder(tokenizer, demo_cfg)
    item = asked(chain(7, 3, "roles"), 2)
    call = answer_call(builder, item)
    prompt, response = builder.decode(call.prompt.tolist()), builder.decode(call.response.tolist())
    assert call.kind == "answer" and all(fact in prompt for fact in item.facts) and item.question in prompt
    assert response.endswith("\\boxed{ " + item.entity + "}")
    assert call.response[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_a_stage_batch_shares_its_calls_between_its_sources_and_the_answer_calls(tokenizer, demo_cfg):
    batch, answers = 7, 3
    calls = list(itertools.islice(stage_calls("infmem", tokenizer, demo_cfg, "roles", 4, batch, answers), 2 * batch))
    # Each batch: two InfMem calls, then two MemAgent Writes, then the answer calls, each source
    # continuing its own stream of fresh trajectories (seed 4; the answer calls' chains: seed 5).
    infmem = list(itertools.islice((c for _, c in FreshCalls(tokenizer, demo_cfg, "infmem", 4, names="roles").calls() if c.kind != "answer"), 4))
    memagent = list(itertools.islice((c for _, c in FreshCalls(tokenizer, demo_cfg, "memagent", 4, names="roles").calls() if c.kind == "write"), 4))
    builder = PromptBuilder(tokenizer, demo_cfg)
    expected = [*infmem[0:2], *memagent[0:2], *(answer_call(builder, asked(chain(i, 5, "roles"), i)) for i in range(3))]
    expected += [*infmem[2:4], *memagent[2:4], *(answer_call(builder, asked(chain(i, 5, "roles"), i)) for i in range(3, 6))]
    assert [(c.kind, c.prompt.tolist(), c.response.tolist()) for c in calls] == [
        (c.kind, c.prompt.tolist(), c.response.tolist()) for c in expected
    ]
    memagent = list(itertools.islice(stage_calls("memagent", tokenizer, demo_cfg, "roles", 4, 4, 1), 8))
    assert [c.kind for c in memagent] == ["write", "write", "write", "answer"] * 2
    # The answer calls may draw their chains with other names than the documents' (the demo's
    # answer_names=list): the Writes stay the same, the answer calls are list-named chains.
    mixed = list(itertools.islice(stage_calls("memagent", tokenizer, demo_cfg, "roles", 4, 4, 1, answer_names="list"), 8))
    assert [c.prompt.tolist() for c in mixed if c.kind == "write"] == [c.prompt.tolist() for c in memagent if c.kind == "write"]
    assert [c.prompt.tolist() for c in mixed if c.kind == "answer"] == [
        answer_call(builder, asked(chain(i, 5, "list"), i)).prompt.tolist() for i in range(2)
    ]
    assert chain(0, 5, "list") != chain(0, 5, "roles")
    answers_only = list(itertools.islice(stage_calls("answer", tokenizer, demo_cfg, "roles", 4, 4, 0), 6))
    assert {c.kind for c in answers_only} == {"answer"}
    with pytest.raises(ValueError, match="stage: expected one of"):
        next(stage_calls("write", tokenizer, demo_cfg, "roles", 4, 4, 1))
    with pytest.raises(ValueError, match=r"answers: expected an integer in \[0, 4\), got 4"):
        next(stage_calls("memagent", tokenizer, demo_cfg, "roles", 4, 4, 4))


def test_a_stage_is_one_pass_of_new_calls_in_an_sft_parquet(tmp_path, tokenizer, demo_cfg):
    path = write_stage(tmp_path / "answer.parquet", "answer", 3, 4, tokenizer, demo_cfg, "roles", 9, 0)
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 12 and not list(tmp_path.glob("*.tmp*"))
    assert len({tuple(r["input_ids"]) for r in rows}) == 12  # no call repeats
    for row in rows:
        first = row["loss_mask"].index(1)
        assert set(row["loss_mask"][first:]) == {1} and row["num_trained"] == len(row["input_ids"]) - first
        assert row["kind"] == "answer" and row["source"] == "curriculum:answer"
    # The answers cycle through the chains' three names: the two-hop answer, the bridge, the entity.
    answers = [tokenizer.decode(r["input_ids"][r["loss_mask"].index(1) :]) for r in rows[:3]]
    items = [chain(i, 10, "roles") for i in range(3)]
    assert [items[0].answer, items[1].bridge, items[2].entity] == [a.split("\\boxed{ ")[1].split("}")[0] for a in answers]


def test_exact_share_is_true_where_the_response_is_the_models_own_greedy_continuation(tokenizer, demo_cfg):
    import torch

    from infmem_verl.assets import tiny_qwen3_dir
    from infmem_verl.cpu.engine import load_model
    from infmem_verl.sft.curriculum import exact_share

    model = load_model(str(tiny_qwen3_dir(hidden_size=64, tokenizer_dir=small_vocab_dir())))
    builder = PromptBuilder(tokenizer, demo_cfg)
    pairs = []
    for i in range(3):  # prompts of different lengths: right padding must not shift a row's positions
        call = answer_call(builder, asked(chain(i, 9, "roles"), i))
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([call.prompt.tolist()]), max_new_tokens=5, do_sample=False)
        own = out[0, len(call.prompt) :].numpy()
        pairs += [(call.prompt, own), (call.prompt, call.response)]
    assert exact_share(model, pairs, tokenizer.pad_token_id) == [True, False] * 3  # a random student copies no name


def test_copied_kinds_asks_every_kind_of_question_of_held_out_chains(tokenizer, demo_cfg):
    from infmem_verl.assets import tiny_qwen3_dir
    from infmem_verl.cpu.engine import load_model
    from infmem_verl.sft.curriculum import ASKED_KINDS, copied_kinds

    model = load_model(str(tiny_qwen3_dir(hidden_size=64, tokenizer_dir=small_vocab_dir())))
    kinds = copied_kinds(model, tokenizer, demo_cfg, "roles", seed=9, per_kind=4)
    assert list(kinds) == list(ASKED_KINDS) == ["two-hop", "bridge", "entity"]
    assert kinds == {"two-hop": 0.0, "bridge": 0.0, "entity": 0.0}
