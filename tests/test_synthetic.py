"""Sample records and the synthetic two-hop long-document QA generator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from infmem_verl.data.sample import QASample
from infmem_verl.data.synthetic import NAME_LIST, NAME_LIST_SIZE, chain, make_dataset, make_sample


@pytest.fixture(scope="module")
def samples_8k(tokenizer) -> list[QASample]:
    return make_dataset(6, 8192, tokenizer, seed=3)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- QASample


_MISSING = object()


def _record(**overrides):
    """A valid record with fields replaced, or removed when set to ``_MISSING``."""
    record = {"id": "q1", "question": "Who?", "answers": ["Ada"], "context": "Ada wrote it.", "source": "t"}
    record.update(overrides)
    return {key: value for key, value in record.items() if value is not _MISSING}


def test_record_round_trip(samples_8k):
    for sample in samples_8k[:2]:
        record = json.loads(json.dumps(sample.to_record()))
        assert QASample.from_record(record) == sample


def test_single_string_answer_is_wrapped_and_int_id_kept():
    sample = QASample.from_record(_record(answers="Ada", id=17))
    assert sample.answers == ["Ada"] and sample.id == "17" and sample.meta == {}


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"question": _MISSING}, "'question'"),
        ({"question": "  "}, "'question'"),
        ({"answers": _MISSING}, "'answers'"),
        ({"answers": []}, "'answers'"),
        ({"answers": {"text": "Ada"}}, "'answers'"),
        ({"answers": ["Ada", 3]}, "'answers[1]'"),
        ({"answers": ["Ada", " "]}, "'answers[1]'"),
        ({"context": ""}, "'context'"),
        ({"id": _MISSING}, "'id'"),
        ({"meta": [1]}, "'meta'"),
    ],
)
def test_record_validation_names_record_and_field(overrides, field):
    with pytest.raises(ValueError) as err:
        QASample.from_record(_record(**overrides), where="train.jsonl:7")
    message = str(err.value)
    assert message.startswith("record train.jsonl:7") and f"field {field}" in message
    if "id" not in overrides:
        assert "id='q1'" in message


def test_non_mapping_record_rejected():
    with pytest.raises(ValueError, match="record rows.jsonl:3: expected a mapping"):
        QASample.from_record(["not", "a", "record"], where="rows.jsonl:3")


# ---------------------------------------------------------------- synthetic data


def test_deterministic_by_seed(tokenizer, samples_8k):
    again = make_sample(2, 8192, tokenizer, seed=3)
    assert again == samples_8k[2]
    other_seed = make_sample(2, 8192, tokenizer, seed=4)
    assert other_seed.context != again.context and other_seed.question != again.question


@pytest.mark.parametrize("target", [8192, 32768])
def test_token_count_exact_and_within_one_percent(tokenizer, samples_8k, target):
    samples = samples_8k[:3] if target == 8192 else [make_sample(i, target, tokenizer, seed=3) for i in range(2)]
    for sample in samples:
        actual = len(_ids(tokenizer, sample.context))
        assert sample.meta["num_tokens"] == actual, "the recorded count must be the real count"
        assert sample.meta["target_tokens"] == target
        assert abs(actual - target) <= 0.01 * target


def test_facts_present_at_recorded_offsets(tokenizer, samples_8k):
    for sample in samples_8k:
        ids = _ids(tokenizer, sample.context)
        fact_a, fact_b = sample.meta["facts"]
        bridge, answer = sample.meta["bridge"], sample.answers[0]
        assert sample.meta["entity"] in fact_a["text"] and bridge in fact_a["text"]
        assert bridge in fact_b["text"] and answer in fact_b["text"]
        # The answer and the bridge appear only in the inserted facts.
        assert sample.context.count(answer) == 1
        assert sample.context.count(bridge) == 2
        paragraphs = sample.context.split("\n\n")
        for fact in (fact_a, fact_b):
            start = fact["char_offset"]
            assert sample.context[start : start + len(fact["text"])] == fact["text"]
            # Spliced between two sentences of a paragraph: a sentence ends before, one follows.
            assert sample.context[start - 2 : start] in (". ", "! ", "? ")
            assert sample.context[start + len(fact["text"])] == " "
            assert fact["text"] in paragraphs[fact["paragraph"]]
            assert not paragraphs[fact["paragraph"]].startswith(fact["text"])
            tokens = ids[fact["token_position"] : fact["token_position"] + fact["num_tokens"]]
            assert tokenizer.decode(tokens) == " " + fact["text"]


def test_positions_vary_across_samples(samples_8k):
    relative = [
        round(f["token_position"] / s.meta["num_tokens"], 3) for s in samples_8k for f in s.meta["facts"]
    ]
    assert len(set(relative)) == len(relative)
    # Spread over the document, not clustered in one region.
    assert np.ptp(relative) > 0.5
    paragraphs = {tuple(f["paragraph"] for f in s.meta["facts"]) for s in samples_8k}
    assert len(paragraphs) == len(samples_8k)


def test_questions_are_two_hop_and_do_not_leak_the_answer(samples_8k):
    templates = {s.meta["template"] for s in samples_8k}
    assert len(templates) >= 3, "several templates should be in use"
    for sample in samples_8k:
        question = sample.question.lower()
        assert sample.answers[0].lower() not in question
        assert sample.meta["bridge"].lower() not in question
        assert sample.meta["entity"].lower() in question
        assert sample.question.endswith("?") and sample.source == "synthetic"
    assert len({s.id for s in samples_8k}) == len(samples_8k)


def test_filler_is_real_wikipedia_shuffled_per_sample(samples_8k):
    from infmem_verl.assets import wiki_paragraphs

    titles = {p["title"] for p in wiki_paragraphs()}
    firsts = []
    for sample in samples_8k:
        heads = [part.split("\n", 1)[0] for part in sample.context.split("\n\n")]
        assert all(head in titles for head in heads)
        firsts.append(heads[0])
    assert len(set(firsts)) == len(firsts)


def test_list_names_are_single_words_of_the_closed_list_in_new_pairings(tokenizer):
    assert len(set(NAME_LIST)) == NAME_LIST_SIZE and all(" " not in name and len(name) >= 5 for name in NAME_LIST)
    chains = [chain(i, 5, "list") for i in range(300)]
    triples = set()
    for item in chains:
        entity = next(name for name in NAME_LIST if f" {name}" in item.question)
        assert {item.bridge, item.answer, entity} <= set(NAME_LIST) and len({item.bridge, item.answer, entity}) == 3
        assert item.answer not in item.question and all(item.bridge in fact for fact in item.facts)
        triples.add((entity, item.bridge, item.answer))
    assert len(triples) == len(chains)  # 256^3 pairings: none repeats in a set this size
    assert len({c.answer for c in chains}) > 150  # answers spread over the list
    # The syllable sets keep their seeds' samples; the list sets are their own streams.
    assert chain(0, 5) == chain(0, 5, "syllables") and chain(0, 5).answer not in NAME_LIST
    sample = make_sample(2, 1024, tokenizer, seed=5, names="list")
    assert sample.answers[0] in NAME_LIST and sample == make_sample(2, 1024, tokenizer, seed=5, names="list")
    assert all(fact["text"] in sample.context for fact in sample.meta["facts"])


@pytest.mark.parametrize(
    "kwargs, field",
    [({"index": -1}, "index"), ({"target_tokens": 100}, "target_tokens"), ({"seed": "x"}, "seed"), ({"names": "words"}, "names")],
)
def test_bad_arguments_name_the_field(tokenizer, kwargs, field):
    args = {"index": 0, "target_tokens": 8192, "seed": 0, "names": "syllables", **kwargs}
    with pytest.raises(ValueError, match=f"^{field}: "):
        make_sample(args["index"], args["target_tokens"], tokenizer, seed=args["seed"], names=args["names"])
