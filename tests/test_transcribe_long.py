"""Long audio: cuts at the quietest moments, and a 70 s recording transcribed by a bundle of
Whisper tiny.en (imported from CTranslate2) without words lost or doubled at the joins."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jiwer
import numpy as np
import pytest
from audio_fixtures import synthesize
from test_bundle import one_thread  # noqa: F401  (autouse: one torch thread)
from test_ct2_import import ct2_tiny_en, hf_tiny_en  # noqa: F401  (session fixtures)

from asrforge.bundle.export import bundle_from_pretrained, export_bundle
from asrforge.bundle.inference import Bundle
from asrforge.bundle.load import load_bundle
from asrforge.model.silence import quietest_point, segment, split_points

SR = 16_000

# One distinctive word per sentence (each occurs once in the whole text): a sentence lost or
# decoded twice at a join shows as a key word missing or doubled.
SENTENCES = [
    ("We will meet at the library tomorrow morning to discuss the project.", "library"),
    ("It is a beautiful day and the children are playing in the park.", "beautiful"),
    ("The train to the city leaves from the station at nine o'clock.", "station"),
    ("Please remember to buy some bread, milk and eggs on your way home.", "bread"),
    ("My brother has been learning to play the piano for three years.", "piano"),
    ("The weather forecast says it will rain heavily over the weekend.", "forecast"),
    ("She opened the window to let some fresh air into the room.", "window"),
    ("Our team finished the report just before the deadline on Friday.", "deadline"),
    ("The museum is closed on Mondays but open every other day of the week.", "museum"),
    ("He likes to read the newspaper while drinking his morning coffee.", "newspaper"),
    ("The doctor told him to get more sleep and to drink more water.", "doctor"),
    ("They are planning a trip to the mountains during the summer holidays.", "mountains"),
    ("The restaurant on the corner serves the best soup in town.", "soup"),
    ("I forgot my umbrella at the office and got wet on the way back.", "umbrella"),
    ("Students should hand in their homework by the end of the month.", "homework"),
]


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def _bursts(pattern: list[tuple[float, bool]], seed: int = 0) -> np.ndarray:
    """Noise bursts (True) and near-silence (False) of the given lengths in seconds."""
    rng = np.random.default_rng(seed)
    parts = [
        (0.3 if loud else 0.001) * rng.standard_normal(int(seconds * SR))
        for seconds, loud in pattern
    ]
    return np.concatenate(parts).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Cutting


@pytest.mark.fast
def test_audio_within_one_window_is_not_cut() -> None:
    wave = _bursts([(1.9, True)])
    assert split_points(wave, SR, 2.0) == [] and segment(wave, SR, 2.0) == [(0, wave.shape[0])]
    assert segment(np.zeros(0, np.float32), SR, 2.0) == [(0, 0)]


@pytest.mark.fast
def test_cuts_fall_in_the_longest_pause_of_the_last_quarter() -> None:
    # window 4 s: the search region is [3, 4) s of each window. Pauses at 1.0-1.5 s (outside
    # the region), 3.1-3.2 s (short) and 3.5-3.9 s (longest): the cut is the middle of the last.
    wave = _bursts(
        [
            (1.0, True),
            (0.5, False),
            (1.6, True),
            (0.1, False),
            (0.3, True),
            (0.4, False),
            (3.0, True),
        ]
    )
    cuts = split_points(wave, SR, 4.0)
    assert cuts[0] == pytest.approx(3.7 * SR, abs=0.03 * SR)
    pieces = segment(wave, SR, 4.0)
    assert pieces[0] == (0, cuts[0]) and pieces[-1][1] == wave.shape[0]
    assert all(a == b for (_, a), (b, _) in zip(pieces, pieces[1:], strict=False))
    assert all(0 < end - start <= 4 * SR for start, end in pieces)


@pytest.mark.fast
def test_without_pauses_every_cut_stays_in_the_last_quarter() -> None:
    wave = _bursts([(23.0, True)], seed=3)
    pieces = segment(wave, SR, 3.0)
    assert sum(b - a for a, b in pieces) == wave.shape[0]
    for start, end in pieces[:-1]:
        assert 0.75 * 3 * SR <= end - start <= 3 * SR


@pytest.mark.fast
def test_quietest_point_is_the_middle_of_the_longest_quiet_run() -> None:
    wave = _bursts([(0.2, True), (0.3, False), (0.2, True), (0.6, False), (0.2, True)])
    assert quietest_point(wave, SR) == pytest.approx(1.0 * SR, abs=0.02 * SR)


# ---------------------------------------------------------------------------------------------
# A 70 s recording with Whisper tiny.en


@pytest.fixture(scope="module")
def tiny_en(hf_tiny_en, tmp_path_factory) -> Bundle:  # noqa: F811
    return load_bundle(bundle_from_pretrained(hf_tiny_en, tmp_path_factory.mktemp("b") / "tiny.en"))


@pytest.fixture(scope="module")
def recording() -> np.ndarray:
    """About 70 s: fifteen spoken sentences, each followed by 0.4-0.9 s of silence."""
    rng = np.random.default_rng(0)
    parts = []
    for sentence, _key in SENTENCES:
        parts += [synthesize(sentence), np.zeros(int(SR * rng.uniform(0.4, 0.9)), np.float32)]
    return np.concatenate(parts)


def test_the_tiny_en_bundle_describes_an_english_model(tiny_en: Bundle) -> None:
    assert tiny_en.languages == ["en"] and not tiny_en.config.multilingual
    assert tiny_en.window_seconds == 30.0 and tiny_en.config.weights == "pretrained"
    assert tiny_en.specials.prompt(None) == [50257, 50362]


@pytest.mark.slow
def test_seventy_seconds_are_transcribed_without_loss_at_the_joins(tiny_en, recording) -> None:
    assert 65 * SR < recording.shape[0] < 80 * SR
    pieces = segment(recording, SR, tiny_en.window_seconds)
    assert len(pieces) == 3
    for _start, end in pieces[:-1]:  # every cut lies in a pause: 25 ms either side are silent
        assert np.abs(recording[end - 400 : end + 400]).max() < 1e-3

    t0 = time.perf_counter()
    [result] = tiny_en.recognize([recording], chunking="silence", vad=False)
    seconds = time.perf_counter() - t0
    ref = _words(" ".join(s for s, _ in SENTENCES))
    hyp = _words(result.text)
    error = jiwer.wer(" ".join(ref), " ".join(hyp))
    print(
        f"\n70 s recording: {seconds:.1f} s to transcribe, WER {error:.3f}, "
        f"{len(hyp)} words for {len(ref)}: {result.text}"
    )
    assert len(result.segments) == 3 and result.language == "en"
    assert error <= 0.2
    assert 0.9 * len(ref) <= len(hyp) <= 1.1 * len(ref)
    for _sentence, key in SENTENCES:
        assert ref.count(key) == 1
        assert hyp.count(key) == 1, f"{key!r} appears {hyp.count(key)} times: {result.text}"


def test_the_transformers_pipeline_transcribes_as_the_bundle(tiny_en) -> None:
    from transformers import pipeline

    wave = synthesize(SENTENCES[0][0])
    asr = pipeline("automatic-speech-recognition", model=str(tiny_en.path), device="cpu")
    assert asr(wave.copy())["text"].strip() == tiny_en.transcribe(wave)
    assert _words(tiny_en.transcribe(wave)) == _words(SENTENCES[0][0])


@pytest.mark.parametrize("pretrained_is_kept", [True, False])
def test_a_checkpoint_fine_tuned_from_tiny_en_exports(
    hf_tiny_en: Path,  # noqa: F811
    tiny_en: Bundle,
    tmp_path: Path,
    pretrained_is_kept: bool,
) -> None:
    """A training checkpoint whose config points at a pretrained model: its config.json comes
    from there, or, when that directory is gone, from the shape the run's config recorded."""
    from safetensors.torch import load_file

    from asrforge.checkpoint.training import (
        CheckpointContents,
        capture_rng_state,
        save_training_checkpoint,
    )
    from asrforge.config import SHAPE_FIELDS, load_config
    from asrforge.model.tokenizer import load_tokenizer

    pretrained = hf_tiny_en if pretrained_is_kept else tmp_path / "moved-away"
    hf_config = json.loads((hf_tiny_en / "config.json").read_text())
    shape = {name: hf_config[name] for name in SHAPE_FIELDS}  # as a run records it
    cfg = load_config(
        data={
            "output_dir": str(tmp_path / "run"),
            "model": {"pretrained": str(pretrained), **shape},
            "data": {"path": str(tmp_path / "no-data")},
        }
    )
    tokenizer = load_tokenizer(hf_tiny_en)
    ckpt = save_training_checkpoint(
        tmp_path / "run" / "checkpoints" / "step-000001",
        CheckpointContents(
            model=load_file(str(hf_tiny_en / "model.safetensors")),
            optimizer={},
            scheduler={},
            rng=capture_rng_state(),
            train_state={"step": 1},
            config_yaml=cfg.to_yaml(),
            tokenizer_save=lambda d: tokenizer.save_pretrained(str(d)),
            meta={"step": 1},
        ),
    )
    out = export_bundle(ckpt, tmp_path / "bundle")
    info = json.loads((out / "inference_config.json").read_text())
    assert info["weights"] == "raw" and info["source"]["checkpoint"] == "run/checkpoints/step-000001"
    assert info["languages"] == ["en"] and info["multilingual"] is False
    assert info["model"] == tiny_en.config.model.model_dump()
    bundle = load_bundle(out)
    for name in ("model.encoder.conv1.weight", "model.decoder.layers.3.fc2.bias"):
        assert bundle.model.state_dict()[name].equal(tiny_en.model.state_dict()[name])
    assert bundle.specials.prompt(None) == tiny_en.specials.prompt(None)
