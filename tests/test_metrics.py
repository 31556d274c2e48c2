"""Answer metrics on worked examples whose expected values were computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from infmem_verl.assets import wiki_paragraphs
from infmem_verl.reward.metrics import (
    answer_in_text,
    exact_match,
    f1,
    normalize_answer,
    score_answer,
    sub_em,
    sub_em_strict,
)


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("The Eiffel Tower.", "eiffel tower"),
        ("An apple a day", "apple day"),
        ("Theatre of the Absurd", "theatre of absurd"),  # articles only as whole words
        ("U.S.A.", "usa"),  # punctuation is deleted, not replaced by a space
        ("  Jay-Z\t and\n\nBeyoncé ", "jayz and beyoncé"),
        ("A", ""),
    ],
)
def test_normalize_answer_matches_squad(raw: str, normalized: str) -> None:
    assert normalize_answer(raw) == normalized


def test_exact_match_after_normalization_and_over_all_golds() -> None:
    assert exact_match("the Eiffel Tower.", ["Eiffel tower"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel tower"]) == 0.0
    assert exact_match("Barack Obama", ["Obama", "barack obama!"]) == 1.0  # second gold matches


def test_f1_partial_overlap() -> None:
    # pred "cat sat on mat" (4 tokens) vs gold "cat on mat" (3): 3 shared -> P 3/4, R 1, F1 6/7.
    assert f1("The cat sat on the mat", ["a cat on the mat"]) == pytest.approx(6 / 7)
    # shared tokens are counted with multiplicity: "paris" once -> P 1/3, R 1, F1 1/2.
    assert f1("Paris Paris London", ["Paris"]) == pytest.approx(0.5)
    assert f1("Rome", ["Paris"]) == 0.0


def test_f1_takes_the_best_gold() -> None:
    # vs "obama": P 1/2, R 1 -> 2/3; vs "barack hussein obama": P 1, R 2/3 -> 4/5.
    assert f1("Barack Obama", ["Obama", "Barack Hussein Obama"]) == pytest.approx(0.8)


def test_f1_yes_no_rule() -> None:
    # Without HotpotQA's rule "yes" vs "yes it is" would score 1/2.
    assert f1("yes", ["yes, it is"]) == 0.0
    assert f1("no it is not", ["no"]) == 0.0
    assert f1("noanswer", ["no answer"]) == 0.0
    assert f1("No.", ["no"]) == 1.0
    assert f1("yes", ["no", "Yes"]) == 1.0


def test_sub_em_two_way_versus_strict() -> None:
    # prediction inside gold: counted by the reference's two-way rule only
    assert sub_em("1", ["1990"]) == 1.0
    assert sub_em_strict("1", ["1990"]) == 0.0
    # gold inside prediction: both
    assert sub_em("In 1990, during the war", ["1990"]) == 1.0
    assert sub_em_strict("In 1990, during the war", ["1990"]) == 1.0
    # the reference's two-way rule compares characters
    assert sub_em("not", ["no"]) == 1.0
    assert sub_em("London", ["Paris", "Lond"]) == 1.0


@pytest.mark.parametrize(
    "pred, golds, expected",
    [
        ("not sure", ["no"], 0.0),  # characters would find "no" in "not"
        ("1923", ["3"], 0.0),  # and "3" in "1923"
        ("London", ["Paris", "Lond"], 0.0),
        ("No.", ["no"], 1.0),
        ("Paris, France", ["Paris"], 1.0),
        ("the city of New York", ["New York"], 1.0),
        ("New Yorker", ["New York"], 0.0),
        ("in 1923 or 3", ["3"], 1.0),
        ("Marie Curie", ["Curie", "Marie Sklodowska"], 1.0),  # best over all golds
    ],
)
def test_sub_em_strict_is_whole_word_gold_in_prediction(pred, golds, expected) -> None:
    # The headline "ours" accuracy of the evaluation report.
    assert sub_em_strict(pred, golds) == expected


@pytest.mark.parametrize("pred", ["", "the", "...", "  "])
def test_empty_normalized_prediction_never_matches(pred: str) -> None:
    assert score_answer(pred, ["Paris"]) == {"em": 0.0, "f1": 0.0, "sub_em": 0.0, "sub_em_strict": 0.0}


def test_score_answer_keys_and_none_prediction() -> None:
    assert score_answer(None, ["Paris"]) == {"em": 0.0, "f1": 0.0, "sub_em": 0.0, "sub_em_strict": 0.0}
    scores = score_answer("Paris, France", ("Paris",))
    assert scores == {"em": 0.0, "f1": pytest.approx(2 / 3), "sub_em": 1.0, "sub_em_strict": 1.0}


def test_golds_from_a_numpy_object_array() -> None:
    golds = np.array(["Obama", "Barack Obama"], dtype=object)
    assert exact_match("barack obama", golds) == 1.0


@pytest.mark.parametrize("golds", ["Paris", [], [1], None, {"a": "Paris"}])
def test_bad_golds_raise_naming_golds(golds) -> None:
    for metric in (exact_match, f1, sub_em, sub_em_strict, score_answer):
        with pytest.raises(ValueError, match="golds"):
            metric("Paris", golds)


def test_bad_prediction_type_raises() -> None:
    with pytest.raises(ValueError, match="pred"):
        exact_match(42, ["42"])


@pytest.mark.parametrize(
    ("answer", "text", "found"),
    [
        ("no", "It is not a piano.", False),
        ("no", "No, he was not.", True),
        ("yes", "The eyes have it", False),
        ("1", "Chapter 10", False),
        ("1", "see chapter 1.", True),
        ("The Beatles", "an album by the Beatles, released", True),
        ("New York", "born in New York City", True),
        ("York City", "New York", False),
        ("the", "the end", False),  # normalizes to nothing
    ],
)
def test_answer_in_text_whole_words(answer: str, text: str, found: bool) -> None:
    assert answer_in_text(answer, text) is found


def test_answer_in_text_on_real_wikipedia_words() -> None:
    """Every word of a real paragraph is found; a word cut short is found only if it is a word too."""
    words = normalize_answer(wiki_paragraphs()[0]["text"]).split()
    text = " ".join(words)
    assert all(answer_in_text(w, text) for w in words)
    cut = {w[:-1] for w in words if len(w) >= 4}
    assert cut - set(words), "the paragraph should have words whose prefix is not a word"
    for prefix in cut:
        assert answer_in_text(prefix, text) is (prefix in words)


def test_answer_in_text_rejects_non_strings() -> None:
    with pytest.raises(ValueError, match="answer"):
        answer_in_text(None, "text")
    with pytest.raises(ValueError, match="text"):
        answer_in_text("a", None)
