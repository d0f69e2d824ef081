"""The no-speech gate (asrforge.model.no_speech): decoders measure a window's no-speech
probability and average log-probability as openai-whisper defines them, a window the gate
skips yields no text, and on real tiny.en noise becomes no text while speech is unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from audio_fixtures import synthesize
from test_beam import EOT, _inputs, _model
from test_bundle import one_thread  # noqa: F401  (autouse)
from test_ct2_import import ct2_tiny_en, hf_tiny_en  # noqa: F401  (session fixtures)

import asrforge.model.fallback as fallback_module
from asrforge.cli.transcribe import optional_float
from asrforge.model.beam import beam_search
from asrforge.model.decoding import DecodeOptions, Hypothesis, greedy_search
from asrforge.model.fallback import Fallback, decode_with_fallback
from asrforge.model.no_speech import NoSpeech

SOT, NO_SPEECH, PREV = 1, 30, 0


def _gate(**kw) -> NoSpeech:
    return NoSpeech(token=NO_SPEECH, sot=SOT, **kw)


@pytest.mark.fast
def test_the_gate_skips_a_likely_silence_unless_its_text_is_likely() -> None:
    gate = _gate()
    assert gate.skips(0.61, -1.2) and gate.skips(0.61, -1.0)
    assert not gate.skips(0.61, -0.9)  # the text is likely enough to keep
    assert not gate.skips(0.6, -3.0)  # not above the threshold
    assert not gate.skips(None, -3.0)  # not measured
    assert _gate(logprob_threshold=None).skips(0.61, -0.1)
    # temperature fallback stops at a likely silence whose text is unlikely
    assert gate.silent(0.7, -1.5) and not gate.silent(0.7, -0.5) and not gate.silent(0.5, -1.5)


def _reference(model, enc, prompt: list[int], tokens: list[int], ended: bool, always, first):
    """openai-whisper's arithmetic by one teacher-forced pass: the softmax at
    <|startoftranscript|> and the log-softmax of each chosen token after suppression."""
    ids = torch.tensor([prompt + tokens + ([EOT] if ended else [])])
    logits = model(encoder_outputs=(enc[None],), decoder_input_ids=ids).logits[0].float()
    no_speech = logits[prompt.index(SOT)].softmax(-1)[NO_SPEECH]
    total = 0.0
    for k, token in enumerate(ids[0, len(prompt) :].tolist()):
        row = logits[len(prompt) - 1 + k].clone()
        row[always] = float("-inf")
        if k == 0:
            row[first] = float("-inf")
        total += float(row.log_softmax(-1)[token])
    return float(no_speech), total


@pytest.mark.fast
@pytest.mark.parametrize("search", ["greedy", "beam", "captured"])
def test_decoders_measure_the_no_speech_probability_and_log_probabilities(search) -> None:
    model = _model(0, eot_bias=0.6)
    model.generation_config.suppress_tokens = [5, 7]
    model.generation_config.begin_suppress_tokens = [11]
    enc, prompts = _inputs(model, 3)
    # a <|startofprev|> text before the prompt moves <|startoftranscript|> off position 0
    prompts = torch.cat([torch.tensor([[PREV, 20, 21]] * 3), prompts], dim=1)
    options = DecodeOptions(no_speech=_gate(), capture=search == "captured")
    if search == "beam":
        hyps = beam_search(model, enc, prompts, EOT, 12, DecodeOptions(no_speech=_gate()))
    else:
        hyps = greedy_search(model, enc, prompts, EOT, 12, options)
    with torch.no_grad():
        for row, hyp in enumerate(hyps):
            no_speech, total = _reference(
                model, enc[row], prompts[row].tolist(), hyp.tokens, not hyp.hit_cap, [5, 7], [11]
            )
            assert hyp.no_speech_prob == pytest.approx(no_speech, rel=1e-4)
            assert hyp.sum_logprob == pytest.approx(total, rel=1e-4, abs=1e-4)
    assert any(not h.hit_cap for h in hyps) and any(len(h.tokens) > 2 for h in hyps)


@pytest.mark.fast
def test_without_the_gate_no_probability_is_measured() -> None:
    model = _model(0, eot_bias=0.6)
    enc, prompts = _inputs(model, 2)
    assert all(h.no_speech_prob is None for h in greedy_search(model, enc, prompts, EOT, 8))
    assert all(h.no_speech_prob is None for h in beam_search(model, enc, prompts, EOT, 8))


@pytest.mark.fast
def test_fallback_keeps_a_likely_silence_and_its_first_no_speech_probability(monkeypatch):
    """openai-whisper's order: a window whose text is unlikely is sampled again, unless it is
    likely silence; a sampled window keeps the no-speech probability of the first pass."""
    first = [Hypothesis([4, 4], -6.0, False, 0.9), Hypothesis([4, 4], -6.0, False, 0.2)]
    sampled = []

    def fake_beam_search(model, enc, prompts, eot, cap, options):
        return first[: prompts.shape[0]]

    def fake_best_of(model, enc, prompts, eot, cap, options, temperature, generator):
        sampled.append(prompts.shape[0])
        return [Hypothesis([8], -0.2, False)] * prompts.shape[0]

    monkeypatch.setattr(fallback_module, "beam_search", fake_beam_search)
    monkeypatch.setattr(fallback_module, "_best_of", fake_best_of)
    enc, prompts = torch.zeros(2, 4, 8), torch.tensor([[SOT, 3], [SOT, 3]])
    options = DecodeOptions(fallback=Fallback(), no_speech=_gate())
    hyps, temps = decode_with_fallback(
        None, enc, prompts, EOT, 8, options, decode_text=lambda ids: str(ids)
    )
    assert temps == [0.0, 0.2] and sampled == [1]
    assert hyps[0] == first[0]
    assert hyps[1].tokens == [8] and hyps[1].no_speech_prob == 0.2
    # without the gate both rows are sampled again
    sampled.clear()
    decode_with_fallback(
        None, enc, prompts, EOT, 8, DecodeOptions(fallback=Fallback()), decode_text=str
    )
    assert sampled == [2]


@pytest.mark.fast
def test_the_thresholds_read_a_number_or_none() -> None:
    assert optional_float("0.45") == 0.45 and optional_float("None") is None
    with pytest.raises(Exception, match="a number or none"):
        optional_float("off")


# -- real tiny.en --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_en(hf_tiny_en):  # noqa: F811  (the imported fixture)
    from asrforge.bundle.export import bundle_from_checkpoint

    return bundle_from_checkpoint(hf_tiny_en)


SR = 16000
TEXT = "The train to the city leaves every hour from platform two."


def _noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(seconds * SR))).astype(np.float32)


def test_tiny_en_turns_white_noise_into_no_text_and_keeps_speech(tiny_en) -> None:
    noise, speech = _noise(10), synthesize(TEXT).astype(np.float32)
    for beam_size in (1, 3):
        [off] = tiny_en.recognize([noise], "en", beam_size=beam_size, no_speech_threshold=None)
        [on] = tiny_en.recognize([noise], "en", beam_size=beam_size)
        assert off.text.strip() and off.segments  # the text it made up before
        assert on.text == "" and on.segments == []
    [fallback] = tiny_en.recognize([noise], "en", temperature_fallback=True)
    assert fallback.text == ""
    [off] = tiny_en.recognize([speech], "en", no_speech_threshold=None)
    [on] = tiny_en.recognize([speech], "en")
    assert on.text == off.text and "platform" in on.text


def test_tiny_en_digital_silence_needs_the_probability_alone(tiny_en) -> None:
    """tiny.en makes "you" of 10 s of zeros with an average log-probability of -0.70, above
    the default -1.0, so openai-whisper's rule keeps it; the probability alone (0.95) skips it."""
    silence = np.zeros(10 * SR, np.float32)
    [off] = tiny_en.recognize([silence], "en", no_speech_threshold=None)
    [alone] = tiny_en.recognize([silence], "en", logprob_threshold=None)
    assert off.text.strip() and alone.text == ""


def test_a_long_recording_has_no_text_in_its_noise_gap_without_vad(tiny_en) -> None:
    first = synthesize("The train to the city leaves every hour.").astype(np.float32)
    second = synthesize("Please close the window before you leave.").astype(np.float32)
    gap = _noise(65, seed=3)  # a window of noise alone, at 30-60 s
    wave = np.concatenate([first, gap, second])
    gap_at, gap_end = first.shape[0] / SR, (first.shape[0] + gap.shape[0]) / SR
    [on] = tiny_en.recognize([wave], "en", vad=False)
    [off] = tiny_en.recognize([wave], "en", vad=False, no_speech_threshold=None)
    inside = [s for s in on.segments if s.start >= gap_at + 1.0 and s.end <= gap_end - 1.0]
    assert inside == [], inside
    assert "train" in on.text and "window" in on.text
    made_up = [s for s in off.segments if s.start >= gap_at + 1.0 and s.end <= gap_end - 1.0]
    assert made_up, "the gap made no text without the gate: the test shows nothing"


def test_transcribe_options_turn_the_gate_off_and_are_checked(
    hf_tiny_en,  # noqa: F811  (the imported fixture)
    tmp_path,
    capsys,
) -> None:
    import soundfile as sf

    from asrforge.cli import main

    noise = tmp_path / "noise.wav"
    sf.write(noise, _noise(10), SR)
    common = ["transcribe", str(hf_tiny_en), str(noise), "--json"]
    assert main(common) == 0
    assert json.loads(capsys.readouterr().out)["text"] == ""
    assert main([*common, "--no-speech-threshold", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["text"].strip()
    assert main([*common, "--no-speech-threshold", "1.5", "--logprob-threshold", "2"]) == 2
    err = capsys.readouterr().err
    assert "--no-speech-threshold: must be in [0, 1] or none, got 1.5" in err
    assert "--logprob-threshold: must be <= 0 or none, got 2" in err
