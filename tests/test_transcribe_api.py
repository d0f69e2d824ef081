"""The Python API of a loaded bundle: ``transcribe`` and ``transcribe_many`` take the keywords
``recognize`` has for VAD and word timestamps, and arrays of samples are read as what they are
(a mono channel axis, samples at PCM scale)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from asrforge.bundle import languages
from asrforge.bundle import recognize as recognition
from asrforge.bundle.inference import Transcript
from asrforge.bundle.languages import detect
from asrforge.bundle.load import load_bundle
from asrforge.errors import UserError
from asrforge.model.longform import EncodedWindows
from asrforge.model.vad import Chunk
from tests.test_transcribe_files import (  # a 2 s window
    random_english_bundle,
    tiny_bundle,  # noqa: F401
)

pytestmark = pytest.mark.fast

SR = 16_000


@pytest.fixture(scope="module")
def bundle(tiny_bundle: Path):  # noqa: F811
    return load_bundle(tiny_bundle)


def noise(seconds: float) -> np.ndarray:
    return (0.1 * np.random.default_rng(0).standard_normal(round(SR * seconds))).astype(np.float32)


@pytest.fixture
def chunked(monkeypatch) -> list[int]:
    """The lengths of the waves VAD was asked to cut; one chunk of the first second each."""
    asked: list[int] = []

    def speech_chunks(wave, rate, seconds):
        asked.append(wave.shape[0])
        return [Chunk(((0, SR),))]

    monkeypatch.setattr(recognition, "speech_chunks", speech_chunks)
    return asked


def test_transcribe_takes_vad_as_recognize_does(bundle, chunked) -> None:
    long = noise(5.0)  # the window is 2 s
    bundle.transcribe(long, vad=False, max_new_tokens=2)
    assert chunked == []
    bundle.transcribe(long, vad=True, max_new_tokens=2)
    assert chunked == [long.shape[0]]
    timed = bundle.transcribe(long, vad=True, word_timestamps=True, max_new_tokens=2)
    assert isinstance(timed, Transcript) and timed.vad


def test_transcribe_many_takes_vad_and_word_timestamps(bundle, chunked) -> None:
    waves = [noise(5.0), noise(3.0)]
    texts = bundle.transcribe_many(waves, vad=True, max_new_tokens=2)
    assert all(isinstance(t, str) for t in texts) and chunked == [5 * SR, 3 * SR]
    timed = bundle.transcribe_many(waves, vad=False, word_timestamps=True, max_new_tokens=2)
    assert chunked == [5 * SR, 3 * SR]
    assert [t.text for t in timed] == bundle.transcribe_many(waves, vad=False, max_new_tokens=2)
    assert all(isinstance(t, Transcript) and not t.vad for t in timed)
    assert all(s.words is not None for t in timed for s in t.segments)


def test_a_channel_axis_of_one_is_mono(bundle) -> None:
    wave = noise(1.0)
    mono = bundle.load_audio(wave)
    assert np.array_equal(bundle.load_audio(torch.from_numpy(wave)[None]), mono)  # torchaudio
    assert np.array_equal(bundle.load_audio(wave[:, None]), mono)  # soundfile, always_2d
    with pytest.raises(UserError, match=r"got shape \(2, 16000\): average its channels"):
        bundle.load_audio(np.stack([wave, wave]))
    with pytest.raises(UserError, match="average its channels"):
        bundle.load_audio(np.zeros((1, 1, SR), np.float32))


def test_float_samples_at_pcm_scale_are_named_once_and_left_as_they_are(bundle, caplog) -> None:
    wave = noise(1.0)
    loud = wave * 32768
    with caplog.at_level(logging.WARNING, logger="asrforge.data.audio"):
        assert np.array_equal(bundle.load_audio(loud), loud)
        bundle.load_audio(loud * 2)
        bundle.load_audio(wave)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1
    assert f"peak {np.abs(loud).max():.1f}" in said[0] and "[-1, 1]" in said[0]


@pytest.fixture(scope="module")
def talking_bundle(tmp_path_factory) -> Path:
    """:func:`random_english_bundle` of a seed whose greedy and beam text of :func:`noise` is
    not empty, in float32, bfloat16 and float16 alike."""
    with torch.random.fork_rng():
        torch.manual_seed(4)
        return random_english_bundle(tmp_path_factory.mktemp("talking"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_transcribes_short_and_long_audio_with_words(
    talking_bundle: Path, dtype: torch.dtype
) -> None:
    """A bundle whose weights stay in their stored half precision (as on a GPU) is fed
    features of its own dtype: greedy and beam, one window and several, words timed."""
    bundle = load_bundle(talking_bundle)
    bundle.model.to(dtype)
    waves = [noise(1.5), noise(5.0)]  # the window is 2 s
    for beam_size in (1, 2):
        timed = bundle.recognize(
            waves, vad=False, word_timestamps=True, beam_size=beam_size, max_new_tokens=4,
            no_speech_threshold=None,
        )  # fmt: skip
        assert all(t.text and t.words for t in timed)
    assert bundle.transcribe(noise(5.0), vad=False, chunking="silence", max_new_tokens=4)
    assert bundle.detect_language(noise(1.0)) == "en"


def test_an_encoding_kept_from_detection_holds_its_own_row_not_the_batch(bundle) -> None:
    """The bound of :class:`EncodedWindows` counts rows: a kept row of a batch of three is a
    copy of its own, not a view that keeps the other two alive."""
    waves = [noise(1.0) * (k + 1) for k in range(3)]
    keep = EncodedWindows(limit=1)
    detect(bundle, waves, batch_size=3, keep=keep, reused=[True, True, False])
    assert len(keep) == 1
    kept = keep.take(waves[0])
    assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()


@pytest.mark.parametrize("cap", [0, -1])
def test_a_cap_of_new_tokens_below_one_is_refused(bundle, cap: int) -> None:
    with pytest.raises(UserError, match=f"max_new_tokens: must be >= 1, got {cap}"):
        bundle.transcribe(noise(1.0), max_new_tokens=cap)


def test_unusable_audio_gets_its_language_resolved_as_the_others_do(bundle) -> None:
    empty = np.zeros(0, np.float32)
    [named, unnamed] = bundle.recognize([empty, empty], ["English", None])
    assert (named.text, named.language, unnamed.language) == ("", "en", "en")
    with pytest.raises(UserError, match="'German': this bundle is English-only"):
        bundle.recognize([empty], "German")


def test_chunking_is_logged_only_when_some_audio_is_long(bundle, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="asrforge.bundle.recognize"):
        bundle.transcribe_many([noise(1.0), noise(1.5)], max_new_tokens=2)
        assert not [r for r in caplog.records if "chunking" in r.getMessage()]
        bundle.transcribe_many([noise(1.0), noise(5.0)], vad=False, max_new_tokens=2)
    said = [r.getMessage() for r in caplog.records if "chunking" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("long audio: chunking silence")


def test_default_heads_for_word_timestamps_are_named_once_a_bundle(tiny_bundle, caplog) -> None:  # noqa: F811
    bundle = load_bundle(tiny_bundle)
    bundle.alignment_heads = []  # align-heads found none that qualifies
    with caplog.at_level(logging.WARNING, logger="asrforge.bundle.options"):
        for _ in range(2):
            bundle.transcribe(noise(1.0), word_timestamps=True, max_new_tokens=2)
    said = [r.getMessage() for r in caplog.records if "align-heads" in r.getMessage()]
    assert len(said) == 1


def test_detect_language_reads_arrays_as_transcribe_does(bundle, monkeypatch) -> None:
    with pytest.raises(UserError, match=r"empty audio \(0 samples\)"):
        bundle.detect_language(np.zeros(0, np.float32))
    with pytest.raises(UserError, match="non-finite audio"):
        bundle.detect_language(np.full(SR, np.nan, np.float32))
    heard = []
    monkeypatch.setattr(
        languages, "detect", lambda _, waves, **kw: heard.extend(w.shape[0] for w in waves) or ["en"]
    )
    assert bundle.detect_language(noise(1.0)[::2], sampling_rate=8_000) == "en"
    assert heard == [SR]  # one second, at 16 kHz


CHOSEN = dict(  # a value other than its default for every option
    batch_size=3,
    max_new_tokens=2,
    chunking="silence",
    condition_on_previous_text=True,
    sampling_rate=8_000,
    beam_size=2,
    temperature_fallback=True,
    use_lm=False,
    lm_alpha=0.5,
    lm_beta=0.25,
    word_timestamps=True,
    vad=False,
    no_speech_threshold=0.3,
    logprob_threshold=-2.0,
)


@pytest.fixture
def decoded(monkeypatch) -> dict[str, list]:
    """What reached the decode: the options each window decodes with, the keywords and audio
    of long-form decoding (which yields no segments here), and calls to time words."""
    from asrforge.bundle import options as options_module

    seen: dict[str, list] = {"options": [], "long": [], "words": []}
    made = options_module.decode_options

    def decode_options(bundle, options, no_speech):
        seen["options"].append(options)
        return made(bundle, options, no_speech)

    def transcribe_long(model, tokenizer, features, audios, prompts, **how):
        seen["long"].append({**how, "samples": [a.shape[0] for a in audios]})
        return [[] for _ in audios]

    monkeypatch.setattr(recognition, "decode_options", decode_options)
    monkeypatch.setattr(recognition, "transcribe_long", transcribe_long)
    monkeypatch.setattr(recognition, "add_word_timestamps", lambda *a, **k: seen["words"].append(a))
    return seen


@pytest.mark.parametrize("entry", ["transcribe", "transcribe_many", "recognize"])
def test_every_option_reaches_the_decode_from_each_entry_point(bundle, decoded, entry) -> None:
    from dataclasses import fields

    from asrforge.bundle.options import RecognizeOptions

    assert {f.name for f in fields(RecognizeOptions)} == set(CHOSEN)  # every option is chosen
    eight_k = noise(1.0)[::2]
    if entry == "transcribe":
        result = bundle.transcribe(eight_k, "en", **CHOSEN)
    else:
        result = getattr(bundle, entry)([eight_k], "en", **CHOSEN)[0]
    assert isinstance(result, Transcript) and not result.vad  # word_timestamps, vad
    assert decoded["options"] == [RecognizeOptions(**CHOSEN)]
    [long] = decoded["long"]
    assert long["samples"] == [SR]  # sampling_rate: one second, resampled to 16 kHz
    assert (long["chunking"], long["max_new_tokens"], long["batch_size"]) == ("silence", 2, 3)
    assert long["condition_on_previous_text"] is True
    options = long["options"]
    assert options.beam_size == 2 and options.fusion is None  # use_lm=False
    assert options.fallback is not None and options.fallback.logprob_threshold == -2.0
    assert options.no_speech is None or options.no_speech.threshold == 0.3
    assert len(decoded["words"]) == 1


def test_transcribe_many_names_recordings_as_recognize_does(bundle, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="asrforge.bundle.recognize"):
        texts = bundle.transcribe_many([np.zeros(0, np.float32)], names=["talk.wav"])
    assert texts == [""] and "talk.wav: empty audio (0 samples)" in caplog.text


@pytest.mark.parametrize("entry", ["transcribe", "transcribe_many", "recognize"])
def test_an_unknown_option_is_refused_by_name(bundle, entry) -> None:
    audio = noise(1.0) if entry == "transcribe" else [noise(1.0)]
    with pytest.raises(TypeError, match="beams"):
        getattr(bundle, entry)(audio, beams=5)


@pytest.mark.fast
def test_the_bundle_guide_lists_every_option() -> None:
    """docs/bundle.md names the options by hand: a field added to RecognizeOptions must be too."""
    import dataclasses
    import re

    from asrforge.bundle.options import RecognizeOptions

    guide = (Path(__file__).resolve().parents[1] / "docs" / "bundle.md").read_text()
    listed = guide.split("`asrforge.bundle.options.RecognizeOptions`", 1)[1].split("(see", 1)[0]
    names = set(re.findall(r"`(\w+)`", listed))
    assert names == {f.name for f in dataclasses.fields(RecognizeOptions)}


@pytest.mark.fast
@pytest.mark.parametrize(
    "option, value, said",
    [("beam_size", "5", "beam_size: '5' is not a whole number"),
     ("no_speech_threshold", "0.6", "no_speech_threshold: '0.6' is not a number"),
     ("word_timestamps", 1, "word_timestamps: 1 is not True or False")],
)  # fmt: skip
def test_an_option_of_the_wrong_kind_is_refused_by_name(bundle, option, value, said) -> None:
    with pytest.raises(UserError, match=said):
        bundle.transcribe(np.zeros(16000, np.float32), **{option: value})


@pytest.mark.fast
def test_lm_weights_for_a_bundle_without_an_lm_are_refused_as_the_cli_refuses_them(bundle):
    assert bundle.lm is None
    with pytest.raises(UserError, match="lm_alpha/lm_beta: this bundle has no n-gram LM"):
        bundle.transcribe(np.zeros(16000, np.float32), beam_size=2, lm_alpha=0.5)
