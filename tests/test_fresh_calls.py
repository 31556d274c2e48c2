"""Fresh oracle calls without the agent loop (infmem_verl/sft/fresh.py) on real components: the
demo recipe's protocol, the small-vocabulary tokenizer and the oracle policy itself."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from infmem_verl.agent.policy import SamplingParams
from infmem_verl.assets import load_tokenizer
from infmem_verl.data.sample import QASample
from infmem_verl.data.synthetic import chain
from infmem_verl.agent.protocol import EMPTY_MEMORY_TEXT
from infmem_verl.distill import recipe_agent
from infmem_verl.policy.scripted import oracle_policy
from infmem_verl.sft.fresh import NOTHING, FreshCalls
from infmem_verl.small_vocab import small_vocab_dir


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(small_vocab_dir()))


@pytest.fixture(scope="module")
def demo_cfg():
    return recipe_agent("demo", [])[1]


@pytest.mark.parametrize("agent", ["infmem", "memagent"])
def test_every_response_is_what_the_oracle_answers_to_that_prompt(tokenizer, demo_cfg, agent):
    """The oracle policy, shown each fresh prompt, returns the fresh call's response token for
    token (its cut at the call's budget included): the responses are the distilled ones'."""
    fresh = FreshCalls(tokenizer, demo_cfg, agent, seed=5)
    kinds: dict[str, int] = {}
    copied = 0
    for index in range(12):
        item = chain(index, 5)
        sample = QASample(
            id=f"c{index}", question=item.question, answers=[item.answer], context="-", source="synthetic",
            meta={"bridge": item.bridge, "facts": [{"text": fact} for fact in item.facts]},
        )  # fmt: skip
        oracle = oracle_policy(tokenizer, [sample])
        for call in fresh.trajectory(index):
            generation = asyncio.run(oracle.generate(call.prompt, SamplingParams(max_tokens=10_000, temperature=0.0)))
            text = fresh.builder.decode(call.response)
            if call.response[-1] == fresh.end_id:
                assert generation.token_ids == call.response.tolist()
            else:  # cut where the loop cuts it: output_tokens after the thinking's end
                after = len(call.response) - call.response.tolist().index(fresh.builder.think_end_id) - 1
                assert generation.token_ids[: len(call.response)] == call.response.tolist()
                assert after == getattr(demo_cfg, call.kind).output_tokens
            kinds[call.kind] = kinds.get(call.kind, 0) + 1
            copied += call.kind == "write" and NOTHING not in text
    assert kinds["answer"] == 12 and kinds["write"] >= 12 and copied >= 6
    assert ("prethink" in kinds) == (agent == "infmem")


def test_trajectories_are_deterministic_and_never_repeat_a_question(tokenizer, demo_cfg):
    fresh = FreshCalls(tokenizer, demo_cfg, "infmem", seed=5)
    first = [c.prompt.tolist() for c in fresh.trajectory(3)]
    assert first == [c.prompt.tolist() for c in FreshCalls(tokenizer, demo_cfg, "infmem", seed=5).trajectory(3)]
    calls = itertools.takewhile(lambda pair: pair[0] < 50, fresh.calls())
    answers = {fresh.builder.decode(c.prompt) for _, c in calls if c.kind == "answer"}
    assert len(answers) == 50


def test_each_call_shows_the_memory_the_previous_write_left(tokenizer, demo_cfg):
    """Memories pass from call to call as the loop passes them: the text after the previous
    Write's thinking, stripped (no fresh Write here outgrows the 64-token cap)."""
    fresh = FreshCalls(tokenizer, demo_cfg, "infmem", seed=5)
    checked = 0
    for index in range(10):
        memory = EMPTY_MEMORY_TEXT
        for call in fresh.trajectory(index):
            prompt = fresh.builder.decode(call.prompt)
            tag = "previous_memory" if call.kind == "write" else "memory"
            assert f"<{tag}>\n{memory}\n</{tag}>" in prompt
            checked += memory != EMPTY_MEMORY_TEXT
            if call.kind == "write":
                memory = fresh.builder.decode(call.response).split("</think>", 1)[1].strip()
    assert checked >= 20


def test_clean_chunks_hold_the_facts_alone_and_the_oracle_still_copies_them(tokenizer, demo_cfg):
    """The copy curriculum's first stage: each chunk is the facts it holds (or a short
    Wikipedia window when none), the Write's response those facts, and the names single tokens."""
    from infmem_verl.data.synthetic import NAME_LIST

    fresh = FreshCalls(tokenizer, demo_cfg, "memagent", seed=5, names="roles", clean=True)
    copied = 0
    for index in range(10):
        item = chain(index, 5, "roles")
        assert {item.entity, item.bridge, item.answer} <= set(NAME_LIST)
        for call in fresh.trajectory(index):
            if call.kind != "write":
                continue
            prompt, text = fresh.builder.decode(call.prompt), fresh.builder.decode(call.response)
            chunk = prompt.split("<current_chunk>\n", 1)[1].split("\n</current_chunk>", 1)[0]
            held = [fact for fact in item.facts if fact in chunk]
            if held:
                assert chunk.strip() == " ".join(held) and all(fact in text for fact in held)
                copied += 1
            else:  # a short window; the response keeps what the memory held
                assert len(fresh.builder.encode(chunk)) <= 17
                assert all(fact in text for fact in item.facts if fact in prompt.split("<previous_memory>", 1)[1])
    assert copied >= 10
