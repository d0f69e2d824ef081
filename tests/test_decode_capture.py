"""The captured decoder step (``eval.compile``) and the greedy decoder's one additive pick mask.

On the CPU nothing is recorded, but the captured path runs: its static input buffer, the same
:func:`greedy_step`, the same picks. The CUDA graph itself is checked on a GPU by
``bench/gpu_check.py`` (captured and uncaptured hypotheses equal)."""

from __future__ import annotations

import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from asrforge.model import decoding
from asrforge.model.capture import CapturedStep
from asrforge.model.decoding import (
    DecodeOptions,
    PickMask,
    Suppression,
    capture_for,
    greedy_decode,
)

EOT = 2


def _model(eot_bias: float = 0.0) -> WhisperForConditionalGeneration:
    """A tiny random Whisper; ``eot_bias`` makes EOT likelier, so rows end at different steps."""
    torch.manual_seed(0)
    cfg = WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=40,
        pad_token_id=EOT, bos_token_id=1, eos_token_id=EOT, decoder_start_token_id=1,
        max_source_positions=20, max_target_positions=48, num_mel_bins=8,
    )  # fmt: skip
    model = WhisperForConditionalGeneration(cfg).eval()
    weight = model.proj_out.weight.detach().clone()
    weight[EOT] += eot_bias * weight.mean(0) / weight.mean(0).norm()
    model.proj_out.weight = torch.nn.Parameter(weight)
    model.generation_config.suppress_tokens = [5, 7]
    model.generation_config.begin_suppress_tokens = [EOT]
    return model


def _inputs(rows: int = 8):
    g = torch.Generator().manual_seed(1)
    prompts = torch.tensor([[1, 3 + i % 5, 9 + i % 3] for i in range(rows)])
    return torch.randn(rows, 20, 32, generator=g), prompts


def test_the_captured_step_decodes_what_the_uncaptured_one_does(monkeypatch):
    enc, prompts = _inputs()
    model = _model(eot_bias=0.3)
    calls = {"step": 0, "captures": 0}
    step, captured = decoding.greedy_step, decoding.CapturedStep

    def counted_step(*args, **kwargs):
        calls["step"] += 1
        return step(*args, **kwargs)

    def counted_capture(*args, **kwargs):
        calls["captures"] += 1
        return captured(*args, **kwargs)

    monkeypatch.setattr(decoding, "greedy_step", counted_step)
    monkeypatch.setattr(decoding, "CapturedStep", counted_capture)
    plain = greedy_decode(model, enc, prompts, EOT, 12, DecodeOptions(check_every=1))
    plain_calls, calls["step"] = calls["step"], 0
    assert calls["captures"] == 0
    again = greedy_decode(model, enc, prompts, EOT, 12, DecodeOptions(check_every=1, capture=True))
    assert again == plain
    # the captured path ran the same step function once per token, from one capture
    assert calls["captures"] == 1 and calls["step"] == plain_calls
    ends = [len(s) for s in plain[0]]
    assert len(set(ends)) > 1  # rows ended at different steps: the pick mask's ended rows ran


def test_evaluations_path_from_a_teacher_forced_cache_decodes_the_same_captured(monkeypatch):
    """evaluate() starts the decode from its loss pass's cache and first token: the step after
    is the warm-up, the one after that is captured."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    model = _model(eot_bias=0.3)
    enc, prompts = _inputs(4)
    labels = torch.randint(3, 40, (4, 5), generator=torch.Generator().manual_seed(2))

    def decode(capture: bool):
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        with torch.no_grad():
            h = decoding.decoder_states(model, torch.cat([prompts, labels], 1), enc, cache)
            logits = model.proj_out(h[:, prompts.shape[1] - 1])
        first = Suppression.of(model, "cpu").apply(logits, 0).argmax(-1)
        cache.crop(-labels.shape[1])
        options = DecodeOptions(check_every=1, capture=capture)
        return greedy_decode(model, enc, prompts, EOT, 12, options, cache=cache, first_tokens=first)

    captures: list[int] = []
    real = decoding.CapturedStep
    monkeypatch.setattr(decoding, "CapturedStep", lambda *a: captures.append(1) or real(*a))
    assert decode(capture=True) == decode(capture=False) and captures == [1]
    assert decode(False) == greedy_decode(model, enc, prompts, EOT, 12)


@pytest.mark.fast
def test_rules_are_never_captured(monkeypatch):
    model = _model()
    enc, prompts = _inputs(2)
    monkeypatch.setattr(decoding, "CapturedStep", lambda *a: pytest.fail("captured with rules"))
    seen: list[int] = []

    def rules(logits, generated):
        seen.append(generated.shape[1])
        return logits

    options = DecodeOptions(rules=rules, capture=True, check_every=1)
    greedy_decode(model, enc, prompts, EOT, 8, options)
    assert seen[:3] == [0, 1, 2]


@pytest.mark.fast
def test_the_pick_mask_folds_suppression_and_ended_rows_in_place():
    model = _model()
    mask = PickMask(Suppression.of(model, "cpu"), EOT, rows=3, vocab=40)
    address = mask.values.data_ptr()
    assert torch.isinf(mask.values[:, [EOT, 5, 7]]).all()  # the first step: EOT too
    assert (mask.values[:, 8] == 0).all()
    mask.update(torch.tensor([EOT, 8, 9]))
    assert mask.values.data_ptr() == address  # rewritten, not reallocated
    assert mask.values[0].argmax() == EOT and torch.isinf(mask.values[0, :EOT]).all()
    assert (mask.values[1:, EOT] == 0).all() and torch.isinf(mask.values[1:, [5, 7]]).all()
    mask.update(torch.tensor([8, 8, EOT]))  # an ended row stays ended
    assert mask.ended.tolist() == [True, False, True]


@pytest.mark.fast
def test_compile_setting_captures_on_cuda_only_when_auto():
    assert capture_for("auto", "cpu") is False
    assert capture_for("auto", torch.device("cuda", 0)) is True
    assert capture_for("on", "cpu") is True and capture_for("off", "cuda") is False
    with pytest.raises(ValueError, match="eval.compile"):
        capture_for("yes", "cpu")


@pytest.mark.fast
def test_a_captured_step_reads_its_input_from_its_own_buffer():
    seen: list[int] = []

    def step(tokens):
        seen.append(tokens.data_ptr())
        return tokens[:, 0] + 1

    first = torch.tensor([[3], [4]])
    captured = CapturedStep(step, first)
    assert captured(first).tolist() == [4, 5]
    assert captured(torch.tensor([[7], [8]])).tolist() == [8, 9]
    # every call hands the step the same tensor, as a replayed graph reads one address
    assert len(set(seen)) == 1 and seen[0] != first.data_ptr()


def test_a_step_that_cannot_be_captured_is_decoded_uncaptured(monkeypatch, caplog):
    enc, prompts = _inputs(4)
    model = _model(eot_bias=0.3)
    plain = greedy_decode(model, enc, prompts, EOT, 8, DecodeOptions(check_every=1))

    def refuse(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decoding, "CapturedStep", refuse)
    options = DecodeOptions(check_every=1, capture=True)
    assert greedy_decode(model, enc, prompts, EOT, 8, options) == plain
    assert "could not be captured" in caplog.text
