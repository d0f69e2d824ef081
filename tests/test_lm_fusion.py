"""Shallow fusion (asrforge.lm.fusion) in beam search: alpha = beta = 0 is beam search without an
LM, to the bit; the bonuses are alpha * ln p + beta per completed word and </s> at EOT; the
word bonus steers how many words hypotheses have."""

from __future__ import annotations

import math

import pytest
from test_beam import EOT, _inputs, _model

from asrforge.lm.fusion import ShallowFusion
from asrforge.lm.ngram import BOS, EOS, estimate
from asrforge.model.beam import beam_search
from asrforge.model.decoding import DecodeOptions

# ids 0-2 are special (<|0|>, <|1|>, EOT); the others spell letters, every third with a space
PIECES = ["<|0|>", "<|1|>", "<|endoftext|>"] + [
    ("Ġ" if i % 3 == 0 else "") + "abcdefg"[i % 7] for i in range(3, 40)
]


class Letters:
    """A tokenizer for the 40-token test model: what fusion needs (pieces and decoding)."""

    def convert_ids_to_tokens(self, ids):
        return [PIECES[i] for i in ids]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids if not PIECES[i].startswith("<|")).replace("Ġ", " ")


LM = estimate(
    [s.split() for s in ["ab cd", "ab ab", "cd ef ab", "g"]], 2, meta={"languages": ["en"]}
)


def _fusion(alpha: float, beta: float) -> ShallowFusion:
    return ShallowFusion(LM, Letters(), EOT, alpha, beta, language_of=lambda prompt: "en")


@pytest.mark.fast
@pytest.mark.parametrize("beam_size", [1, 4])
def test_alpha_and_beta_zero_decode_exactly_as_without_an_lm(beam_size):
    model = _model(eot_bias=4.0)
    enc, prompts = _inputs(model, 6)
    plain = beam_search(model, enc, prompts, EOT, 16, DecodeOptions(beam_size=beam_size))
    fused = beam_search(
        model, enc, prompts, EOT, 16, DecodeOptions(beam_size=beam_size, fusion=_fusion(0, 0))
    )
    assert fused == plain  # tokens, sums and caps: bit for bit


@pytest.mark.fast
def test_bonuses_are_the_lm_log_probabilities_of_completed_words():
    fusion = _fusion(0.7, 0.3)
    starts = fusion.starts_word(40, "cpu")
    a, b, space_c = 3 + 4, 3 + 5, 3 + 6  # "a", "b", " c"... as PIECES spells them
    assert PIECES[a] == "a" and PIECES[b] == "b" and PIECES[space_c] == "Ġc"
    assert starts[space_c] == 1 and starts[a] == 0 and starts[0] == 1 and starts[EOT] == 0
    state = fusion.start([1, 0])
    assert fusion.bonuses([state]) == ([0.0], [0.7 * LM.log10_prob(EOS, (BOS,)) * math.log(10)])
    for token in (a, b):  # spell "ab"
        state = fusion.advance(state, token, False)
    boundary, end = fusion.bonuses([state])
    p_ab = LM.log10_prob("ab", (BOS,)) * math.log(10)
    assert boundary == [pytest.approx(0.7 * p_ab + 0.3)]
    p_end = LM.log10_prob(EOS, (BOS, "ab")) * math.log(10)
    assert end == [pytest.approx(0.7 * (p_ab + p_end) + 0.3)]
    state = fusion.advance(state, space_c, True)  # " c" completes "ab" and starts "c"
    assert state.context == ("ab",) and state.pending == (space_c,)


def test_a_language_the_lm_does_not_know_is_decoded_without_it():
    fusion = ShallowFusion(LM, Letters(), EOT, 5.0, 5.0, language_of=lambda prompt: "de")
    model = _model(eot_bias=4.0)
    enc, prompts = _inputs(model, 4)
    assert beam_search(
        model, enc, prompts, EOT, 16, DecodeOptions(beam_size=3, fusion=fusion)
    ) == beam_search(model, enc, prompts, EOT, 16, DecodeOptions(beam_size=3))


def test_the_word_bonus_changes_how_many_words_are_decoded():
    model = _model()
    enc, prompts = _inputs(model, 4)
    tok = Letters()

    def words(beta: float) -> int:
        hyps = beam_search(
            model, enc, prompts, EOT, 12, DecodeOptions(beam_size=3, fusion=_fusion(0.0, beta))
        )
        return sum(len(tok.decode(h.tokens).split()) for h in hyps)

    assert words(8.0) > words(0.0) > words(-8.0)
