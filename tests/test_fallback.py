"""Temperature fallback (asrforge.model.fallback): a window stuck in a loop at temperature 0 is
decoded again by seeded sampling at a higher temperature; a fine window is left alone."""

from __future__ import annotations

import pytest
import torch
from test_beam import EOT, _inputs, _model

from asrforge.model.beam import Hypothesis, beam_search
from asrforge.model.decoding import DecodeOptions
from asrforge.model.fallback import (
    Fallback,
    compression_ratio,
    decode_with_fallback,
    fallback_reason,
)

LOOP = 7


def _looping_model():
    """Greedy loops on 7 (``9 7 7 15 7 7 7 15 7 7 7 ...``) to the cap; EOT is likely enough
    that samples end early."""
    model = _model(0)
    weight = model.proj_out.weight.detach().clone()
    direction = weight.mean(0) / weight.mean(0).norm()
    weight[LOOP] += 3.0 * direction
    weight[EOT] += 2.6 * direction
    model.proj_out.weight = torch.nn.Parameter(weight)
    return model


def _text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def test_a_repetitive_window_falls_back_to_sampling_deterministically():
    model = _looping_model()
    enc, prompts = _inputs(model, 3)
    # an untrained model's samples are all unlikely: judge by the loop's symptoms only
    fallback = Fallback(logprob_threshold=None)
    greedy = beam_search(model, enc, prompts, EOT, 20, DecodeOptions(beam_size=1))
    for first in greedy:  # the crafted loop
        assert first.tokens.count(LOOP) > 12 and first.hit_cap
        assert fallback_reason(first, _text(first.tokens), fallback).startswith("compression")
    hyps, temps = decode_with_fallback(
        model, enc, prompts, EOT, 20, DecodeOptions(fallback=fallback), decode_text=_text
    )
    assert all(t > 0 for t in temps)
    assert all(fallback_reason(h, _text(h.tokens), fallback) is None for h in hyps)
    again, temps_again = decode_with_fallback(
        model, enc, prompts, EOT, 20, DecodeOptions(fallback=fallback), decode_text=_text
    )
    assert again == hyps and temps_again == temps  # seeded


def test_a_fine_window_is_kept_at_temperature_zero():
    model = _model(1, eot_bias=0.2)
    enc, prompts = _inputs(model, 4, 1)
    # a random model's text is noise: only the thresholds decide, and these pass everything
    lenient = Fallback(
        compression_ratio_threshold=None, logprob_threshold=-100.0, repetition_threshold=None
    )
    hyps, temps = decode_with_fallback(
        model, enc, prompts, EOT, 20, DecodeOptions(fallback=lenient), decode_text=_text
    )
    assert temps == [0.0] * 4
    assert hyps == beam_search(model, enc, prompts, EOT, 20, DecodeOptions(beam_size=1))


@pytest.mark.fast
def test_thresholds():
    assert compression_ratio("the cat " * 40) > 2.4 > compression_ratio("a quick brown fox")
    h = Hypothesis([3, 4, 5], sum_logprob=-8.0, hit_cap=False)
    assert fallback_reason(h, "a b c", Fallback()) == "average log-probability -2.00"
    assert fallback_reason(h, "a b c", Fallback(logprob_threshold=None)) is None
