"""Repetition-trap flags."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asrforge.text import repetition_flags, repetition_score, summarize_flags

pytestmark = pytest.mark.fast

NORMAL = "the quick brown fox jumps over the lazy dog while the farmer watches from the porch"
LOOPED = "so we went to the market and then " + "we bought some bread and then " * 12


def test_normal_sentence_is_not_flagged():
    flags = repetition_flags(NORMAL, n_tokens=20, max_new_tokens=448)
    assert flags == {"hit_cap": False, "repetitive": False, "rep_trap": False, "rep_score": 0.0}


def test_loop_is_flagged():
    flags = repetition_flags(LOOPED, n_tokens=90, max_new_tokens=448)
    assert flags["repetitive"] and flags["rep_trap"] and not flags["hit_cap"]
    assert flags["rep_score"] > 0.8


def test_hitting_the_cap_is_a_trap_even_without_repeats():
    flags = repetition_flags(NORMAL, n_tokens=448, max_new_tokens=448)
    assert flags["hit_cap"] and flags["rep_trap"] and not flags["repetitive"]


def test_token_ids_see_loops_in_unspaced_scripts():
    text = "ผมไปตลาด" * 10  # a Thai loop: one whitespace "word"
    assert not repetition_flags(text, 30, 448)["repetitive"]
    ids = [101, 7, 55, 9] * 10
    assert repetition_flags(ids, len(ids), 448)["repetitive"]


def test_one_word_stutter_is_flagged_and_short_text_is_not():
    assert repetition_flags("no " * 12, 12, 448)["repetitive"]
    assert repetition_flags("no no no", 3, 448)["rep_score"] == 0.0  # fewer words than n


def test_threshold_and_ngram_are_respected():
    text = "a b c d e f a b c d e f"  # two cycles of a 6-word phrase
    score = repetition_flags(text, 12, 448)["rep_score"]
    assert 0 < score < 1
    assert repetition_flags(text, 12, 448, threshold=score)["repetitive"]
    assert not repetition_flags(text, 12, 448, threshold=score + 1e-6)["repetitive"]
    assert repetition_score(text.split(), ngram=7) == 0.0  # no 7-gram repeats
    with pytest.raises(ValueError):
        repetition_score([1, 2], ngram=0)


@given(st.integers(1, 12), st.integers(1, 8), st.integers(1, 6))
def test_score_of_a_periodic_loop(period, cycles, n):
    # Distinct tokens repeated: every n-gram after the first `period` of them is a repeat.
    units = list(range(period)) * cycles
    total = len(units) - n + 1
    expected = 0.0 if total <= 0 else (total - min(period, total)) / total
    assert repetition_score(units, n) == pytest.approx(expected)


def test_summarize():
    flags = [
        repetition_flags(NORMAL, 20, 448),
        repetition_flags(LOOPED, 448, 448),  # both symptoms: counted once as a trap
        repetition_flags(NORMAL, 448, 448),
        repetition_flags(LOOPED, 100, 448),
    ]
    summary = summarize_flags(flags)
    assert summary["n"] == 4
    assert summary["rep_trap_count"] == 3 and summary["rep_trap_rate"] == 0.75
    assert summary["hit_cap_count"] == 2 and summary["hit_cap_rate"] == 0.5
    assert summary["repetitive_count"] == 2
    assert summary["mean_rep_score"] == pytest.approx(sum(f["rep_score"] for f in flags) / 4)
    empty = summarize_flags([])
    assert empty["n"] == 0 and empty["rep_trap_rate"] == 0.0
