"""WER/CER against jiwer (a test-only dependency) and by hand."""

import math

import jiwer
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asrforge.text import (
    EditCounts,
    cer,
    corpus_error_rate,
    edit_counts,
    error_rates,
    split_units,
    wer,
)

# Text whose only whitespace is " " (single and in runs): jiwer reads words exactly as we do.
_non_space = st.characters(blacklist_categories=("Cs",)).filter(lambda c: not c.isspace())
_small = st.sampled_from(list("abcé日ไ") + ["\u0301"])  # few symbols: many matches, a mark
_spaced_text = st.lists(
    st.one_of(_non_space, _small, st.just(" "), st.just("  ")), max_size=40
).map("".join)
_any_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


def _pairs(text):
    return st.integers(1, 5).flatmap(
        lambda n: st.tuples(
            st.lists(text, min_size=n, max_size=n), st.lists(text, min_size=n, max_size=n)
        )
    )


def _n_ref(refs, unit):
    return sum(len(split_units(r, unit)) for r in refs)


@settings(max_examples=300, deadline=None)
@given(_pairs(_spaced_text))
def test_wer_equals_jiwer(pair):
    refs, hyps = pair
    if _n_ref(refs, "word") == 0:
        return  # jiwer returns the insertion count there, not a rate (see test_empty_references)
    assert wer(refs, hyps) == pytest.approx(jiwer.wer(refs, hyps), abs=1e-9)


@settings(max_examples=300, deadline=None)
@given(_pairs(_any_text))
def test_cer_equals_jiwer_on_any_text(pair):
    refs, hyps = pair
    if _n_ref(refs, "char") == 0:
        return
    assert cer(refs, hyps) == pytest.approx(jiwer.cer(refs, hyps), abs=1e-9)


@pytest.mark.fast
@settings(max_examples=200, deadline=None)
@given(_pairs(_any_text))
def test_any_whitespace_separates_words(pair):
    # Documented difference: jiwer splits on " " only ("a\tb" is one word to it); we split on
    # any Unicode whitespace, i.e. jiwer's result once every whitespace character is a space.
    refs, hyps = pair
    if _n_ref(refs, "word") == 0:
        return

    def spaces(s):
        return "".join(" " if c.isspace() else c for c in s)

    expected = jiwer.wer([spaces(r) for r in refs], [spaces(h) for h in hyps])
    assert wer(refs, hyps) == pytest.approx(expected, abs=1e-9)


@pytest.mark.fast
@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=300),
    st.lists(st.sampled_from(["a", "b", "c", "e"]), max_size=300),
)
def test_long_utterances_equal_jiwer(ref_words, hyp_words):
    ref, hyp = " ".join(ref_words), " ".join(hyp_words)  # well past a 64-bit machine word
    assert wer(ref, hyp) == pytest.approx(jiwer.wer(ref, hyp), abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(_spaced_text, _spaced_text, st.sampled_from(["word", "char"]))
def test_edit_counts_agree_with_jiwer(ref, hyp, unit):
    counts = edit_counts(ref, hyp, unit)
    process = jiwer.process_words if unit == "word" else jiwer.process_characters
    out = process(ref, hyp)
    n_hyp = len(split_units(hyp, unit))
    assert counts.n_ref == len(split_units(ref, unit))
    # Minimum alignments may split the same total differently; these invariants hold for all.
    assert counts.errors == out.substitutions + out.deletions + out.insertions
    assert counts.dels - counts.ins == counts.n_ref - n_hyp
    assert min(counts) >= 0


@pytest.mark.fast
@settings(max_examples=100, deadline=None)
@given(_pairs(_spaced_text))
def test_corpus_error_rate_from_counts_equals_wer_and_cer(pair):
    refs, hyps = pair
    for unit, fn in (("word", wer), ("char", cer)):
        counts = [edit_counts(r, h, unit) for r, h in zip(refs, hyps, strict=True)]
        assert corpus_error_rate(counts) == fn(refs, hyps)


@pytest.mark.fast
def test_hand_examples():
    assert wer("the cat sat", "the cat sat") == 0.0
    assert wer("the cat sat", "the cat sat down") == pytest.approx(1 / 3)  # one insertion
    assert wer("the cat sat", "the sat") == pytest.approx(1 / 3)  # one deletion
    assert wer("the cat sat", "a cat sat") == pytest.approx(1 / 3)  # one substitution
    assert wer("the cat sat", "") == 1.0
    # corpus-level: 1 error over 5 reference words, not the mean of 1/2 and 0/3
    assert wer(["a b", "c d e"], ["a x", "c d e"]) == pytest.approx(1 / 5)
    assert wer("a  b ", " a b") == 0.0  # whitespace runs and ends do not matter to WER
    assert cer("a  b", "a b") == pytest.approx(1 / 4)  # but inner spaces are characters
    assert cer(" ab ", "ab") == 0.0  # ends are stripped
    assert edit_counts("a b c d", "a x c d e") == EditCounts(subs=1, dels=0, ins=1, n_ref=4)
    assert edit_counts("a b c", "c", "word") == EditCounts(subs=0, dels=2, ins=0, n_ref=3)


@pytest.mark.fast
def test_empty_references():
    # An empty reference in a corpus: its hypothesis words are insertions.
    assert wer(["", "a b"], ["x y", "a b"]) == pytest.approx(2 / 2)
    assert wer(["", "a b"], ["x y", "a b"]) == jiwer.wer(["", "a b"], ["x y", "a b"])
    # No reference words at all: 0.0 when nothing was said either way, else inf (never "best").
    assert wer([""], [""]) == 0.0
    assert cer(["", " "], ["", ""]) == 0.0
    assert wer([], []) == 0.0
    assert math.isinf(wer([""], ["a"]))
    assert math.isinf(cer([" "], ["a"]))
    assert corpus_error_rate([]) == 0.0


@pytest.mark.fast
def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 references but 1 hypotheses"):
        wer(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="unit"):
        edit_counts("a", "b", "syllable")


@pytest.mark.fast
def test_error_rates_normalize_and_handle_unspaced_scripts():
    en = error_rates(["Hello, World!"], ["hello world"], "english")
    assert en == {"wer": 0.0, "cer": 0.0, "primary_metric": "wer", "wer_reliable": True}
    # Thai: the same characters with the phrase break moved. Spaces do not count in CER there;
    # WER (one "word" against two) is reported but flagged.
    th = error_rates(["สวัสดีครับ ผมชื่อสมชาย"], ["สวัสดีครับผม ชื่อสมชาย"], "th")
    assert th["cer"] == 0.0
    assert th["wer"] > 0
    assert th["primary_metric"] == "cer" and th["wer_reliable"] is False
    # A spaced language keeps spaces in CER, as jiwer does.
    de = error_rates(["guten tag"], ["gutentag"], "de", normalized=True)
    assert de["cer"] == pytest.approx(jiwer.cer("guten tag", "gutentag"))
