"""The n-gram LM (asrforge.lm.ngram): Kneser–Ney probabilities computed by hand on a toy text,
distributions that sum to 1 through the back-off weights, discounts, and the ARPA round trip."""

from __future__ import annotations

import os

import pytest

from asrforge.errors import CheckpointCorruptError
from asrforge.lm.ngram import (
    BOS,
    EOS,
    UNK,
    adjusted_counts,
    count_ngrams,
    discounts,
    estimate,
    read_arpa,
    write_arpa,
)

pytestmark = pytest.mark.fast

TOY = [["a", "b"], ["a"]]
HALF = [(0.5, 0.5, 0.5)] * 3


def p(lm, word, *context) -> float:
    return 10 ** lm.log10_prob(word, context)


def test_bigram_probabilities_match_a_hand_computation():
    # <s> a b </s> / <s> a </s>. Unigram continuation counts: a 1 (after <s>), b 1 (after a),
    # </s> 2 (after a, b); vocabulary {a, b, </s>, <unk>}; D = 0.5 everywhere.
    # gamma() = (0.5 * 2 + 0.5 * 1) / 4 = 0.375, so each word gets 0.375 / 4 = 0.09375 extra.
    lm = estimate(TOY, 2, fixed_discounts=HALF)
    assert p(lm, "a") == pytest.approx(0.5 / 4 + 0.09375)
    assert p(lm, "b") == pytest.approx(0.21875)
    assert p(lm, EOS) == pytest.approx(1.5 / 4 + 0.09375)
    assert p(lm, UNK) == pytest.approx(0.09375)
    # context <s>: a seen twice, gamma = 0.5 / 2
    assert p(lm, "a", BOS) == pytest.approx(1.5 / 2 + 0.25 * 0.21875)
    # context a: b and </s> once each, gamma = (0.5 + 0.5) / 2
    assert p(lm, "b", "a") == pytest.approx(0.5 / 2 + 0.5 * 0.21875)
    assert p(lm, EOS, "a") == pytest.approx(0.5 / 2 + 0.5 * 0.46875)
    # unseen bigrams back off through the stored weight gamma(a) = 0.5
    assert p(lm, "a", "a") == pytest.approx(0.5 * 0.21875)
    assert p(lm, "never-seen", "b") == pytest.approx(0.5 * 0.09375)
    assert lm.log10_prob(BOS, ()) == -99.0
    assert lm.vocab_size == 5  # a, b, </s>, <unk> and <s> (as a context)


def test_continuation_counts_count_distinct_words_before():
    top = count_ngrams([["x", "y"], ["z", "y"], ["x", "y"]], 2)
    assert top[("x", "y")] == 2 and top[(BOS, "x")] == 2
    uni = adjusted_counts(top, 2)[0]
    assert uni[("y",)] == 2  # after x and z, however often
    assert uni[(EOS,)] == 1  # only after y
    assert uni[("x",)] == 1  # only after <s>


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_every_distribution_sums_to_one_over_the_vocabulary(order):
    text = "the cat sat on the mat . the dog sat on the cat . a cat and a dog sat".split(" . ")
    sentences = [s.split() for s in text] + [["the", "the", "the"], ["mat"]] * 3
    lm = estimate(sentences, order)
    vocab = [g[0] for g in lm.probs[0] if g[0] != BOS]
    contexts = {()} | {g for n in range(order - 1) for g in lm.probs[n] if g[-1] != EOS}
    contexts |= {("zebra",), ("the", "zebra")}  # unseen contexts back off to shorter ones
    for h in contexts:
        total = sum(10 ** lm.log10_prob(w, h) for w in vocab)
        assert total == pytest.approx(1.0, abs=1e-9), h


def test_modified_discounts_from_counts_of_counts():
    counts = [1] * 10 + [2] * 5 + [3] * 3 + [4] * 2 + [9] * 7
    d1, d2, d3 = discounts(counts)
    y = 10 / (10 + 2 * 5)
    assert (d1, d2, d3) == pytest.approx((1 - 2 * y * 5 / 10, 2 - 3 * y * 3 / 5, 3 - 4 * y * 2 / 3))
    assert discounts([1, 1, 2]) is None  # no 3s or 4s: the toy-text fallback applies


def test_estimated_trigram_uses_the_fallback_on_a_toy_text_and_records_it():
    lm = estimate(TOY, 3, meta={"normalizer": "basic"})
    assert lm.meta["discounts"] == [[0.5, 1.0, 1.5]] * 3
    assert lm.meta["order"] == 3 and lm.normalizer == "basic"


def test_arpa_round_trip(tmp_path):
    sentences = [s.split() for s in ["a b c", "b c a", "c a b b"]]
    lm = estimate(sentences, 3, meta={"normalizer": "basic"})
    path = tmp_path / "lm.arpa"
    write_arpa(lm, path)
    text = path.read_text()
    # a comment line, the only kind KenLM reads past before \data\
    assert text.startswith("# asrforge-lm {") and "\\data\\\nngram 1=" in text
    back = read_arpa(path)
    assert back.order == 3 and back.meta == lm.meta
    path.write_text(text.removeprefix("# "))  # as asrforge wrote it before
    assert read_arpa(path).meta == lm.meta
    for words in (["a", "b"], ["c", "c", "zebra"], []):
        assert back.score_sentence(words) == pytest.approx(lm.score_sentence(words), abs=1e-6)


@pytest.mark.parametrize(
    "content, message",
    [
        ("hello\n", "no \\data\\ line"),
        ("\\data\\\nngram 1=2\n\n\\1-grams:\n-1.0\t<unk>\n", "truncated"),
        (
            "\\data\\\nngram 1=3\n\n\\1-grams:\n-1.0\t<unk>\n\\end\\\n",
            "announces 3 1-grams, the file holds 1",
        ),
        ("\\data\\\nngram 1=1\n\n\\1-grams:\nx\t<unk>\n\\end\\\n", "line 5: not a number"),
        ("\\data\\\nngram 1=1\n\n\\1-grams:\n-1.0\ta\n\\end\\\n", "no <unk>"),
    ],
)
def test_a_malformed_arpa_file_is_named(tmp_path, content, message):
    path = tmp_path / "bad.arpa"
    path.write_text(content)
    with pytest.raises(CheckpointCorruptError, match=str(path)) as e:
        read_arpa(path)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "content",
    [
        "\\data\\\n" + "".join(f"ngram {k}=0\n" for k in range(1, 200_001))
        + "\n\\1-grams:\n-1.0\t<unk>\n\\end\\\n",
        "\\data\\\nngram 1=1\n\n\\1-grams:\n" + "x " * 10**6 + "\n\\end\\\n",
        "\\data\\\nngram 1=1\nngram " + "7" * 10**6 + "=1\n",
    ],
    ids=["orders", "entry", "count-line"],
)
def test_a_malformed_arpa_file_is_refused_in_a_message_of_one_short_line(tmp_path, content):
    path = tmp_path / "bad.arpa"
    path.write_text(content)
    with pytest.raises(CheckpointCorruptError, match=str(path)) as e:
        read_arpa(path)
    assert len(str(e.value)) < len(str(path)) + 400 and "\n" not in str(e.value)


GOOD = "\\data\\\nngram 1=1\n\n\\1-grams:\n-1.0\t<unk>\n\\end\\\n"


@pytest.mark.parametrize(
    "content, message",
    [
        (GOOD.replace("ngram 1=1", "ngram \u00b9=1"), "line 2: expected 'ngram 1=COUNT'"),
        (GOOD.replace("ngram 1=1", "ngram 1=\u0661"), "line 2: expected 'ngram 1=COUNT'"),
        (GOOD.replace("\\1-grams:", "\\\u00b9-grams:"), "line 4: an unexpected section"),
        ("# asrforge-lm [1, 2]\n" + GOOD, "line 1: the asrforge-lm line: not a JSON object"),
        ("# asrforge-lm " + "[" * 10**5 + "]" * 10**5 + "\n" + GOOD, "nested deeper than"),
        ('# asrforge-lm {"languages": "en"}\n' + GOOD, "languages must be a list of language"),
        ('# asrforge-lm {"languages": ["en", {"a": 1}]}\n' + GOOD, "a list of language codes"),
        ('# asrforge-lm {"normalizer": ["x"]}\n' + GOOD, "normalizer must be one of english"),
        (
            '# asrforge-lm {"normalizer": "bogus"}\n' + GOOD,
            "normalizer must be one of english, basic, by-language, got 'bogus'",
        ),
    ],
)
def test_arpa_counts_and_header_facts_asrforge_cannot_use_are_named(tmp_path, content, message):
    """Superscript digits passed str.isdigit() and failed int(); header facts of the wrong type
    failed where they were used, and an unknown normalizer was carried into a bundle."""
    path = tmp_path / "bad.arpa"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(CheckpointCorruptError, match=str(path)) as e:
        read_arpa(path)
    assert message in str(e.value)
    path.write_text('# asrforge-lm {"normalizer": "english", "languages": ["en"]}\n' + GOOD)
    assert read_arpa(path).meta["languages"] == ["en"]


def test_an_arpa_fifo_or_device_is_refused_unread(tmp_path):
    fifo = tmp_path / "lm.arpa"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointCorruptError, match=f"{fifo}: .*a FIFO, not a regular file"):
        read_arpa(fifo)
    zero = tmp_path / "zero.arpa"
    zero.symlink_to("/dev/zero")
    with pytest.raises(CheckpointCorruptError, match="a character device, not a regular file"):
        read_arpa(zero)
