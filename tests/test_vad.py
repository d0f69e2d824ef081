"""Voice activity detection for long audio: regions merged into chunks, chunks' segments moved
back, and tiny.en decoding only the speech of a recording with noise between its sentences."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from audio_fixtures import synthesize
from conftest import save_english_only_model
from test_bundle import one_thread  # noqa: F401  (autouse: one torch thread)
from test_ct2_import import ct2_tiny_en, hf_tiny_en  # noqa: F401  (session fixtures)

from asrforge.model.longform import Segment
from asrforge.model.vad import merge_regions

SR = 16_000


@pytest.mark.fast
def test_regions_merge_in_order_while_the_chunk_fits() -> None:
    regions = [(0, 10), (12, 20), (25, 31), (40, 45), (46, 90)]
    assert merge_regions(regions, 30) == [(0, 20), (25, 45), (46, 90)]
    assert merge_regions(regions, 100) == [(0, 90)]
    assert merge_regions([], 30) == []


@pytest.mark.fast
def test_a_chunks_segment_moves_to_the_recordings_clock() -> None:
    seg = Segment(1.0, 2.5, "hi", [7], (0.0, 3.0))
    moved = seg.moved(40.0)
    assert (moved.start, moved.end, moved.window, moved.text) == (41.0, 42.5, (40.0, 43.0), "hi")
    assert (seg.start, seg.window) == (1.0, (0.0, 3.0))


@pytest.mark.fast
def test_silero_finds_no_speech_in_silence_and_noise() -> None:
    pytest.importorskip("silero_vad")
    from asrforge.model.vad import speech_chunks

    rng = np.random.default_rng(0)
    quiet = np.concatenate([np.zeros(3 * SR), 0.01 * rng.standard_normal(3 * SR)])
    assert speech_chunks(quiet.astype(np.float32), SR, 30.0) == []


@pytest.mark.fast
def test_vad_asked_for_without_the_package_is_one_line(monkeypatch, tmp_path, capsys) -> None:
    import asrforge.model.vad as vad
    from asrforge.cli import main

    monkeypatch.setattr(vad, "vad_available", lambda: False)
    assert main(["transcribe", str(tmp_path / "none"), str(tmp_path / "a.wav"), "--vad"]) == 2
    assert "--vad: needs the package silero-vad" in capsys.readouterr().err


def test_tiny_en_decodes_only_the_speech_of_a_long_recording(hf_tiny_en: Path) -> None:  # noqa: F811
    pytest.importorskip("silero_vad")
    from asrforge.bundle.export import bundle_from_checkpoint

    rng = np.random.default_rng(0)
    first = synthesize("We will meet at the library tomorrow morning to discuss the project.")
    second = synthesize("The museum is closed on Mondays but open late on Fridays.")
    t = np.arange(20 * SR) / SR
    music = 0.05 * (np.sin(2 * np.pi * 220 * t) + np.sin(2 * np.pi * 330 * t))
    noise = 0.03 * rng.standard_normal(8 * SR)
    wave = np.concatenate([first, music, noise, second]).astype(np.float32)
    second_at = (first.shape[0] + music.shape[0] + noise.shape[0]) / SR
    bundle = bundle_from_checkpoint(hf_tiny_en)
    [by_vad] = bundle.recognize([wave])  # longer than 30 s: VAD by default
    assert by_vad.vad
    words = by_vad.text.lower()
    assert "library" in words and "museum" in words
    # nothing was decoded where nobody speaks
    gap = (first.shape[0] / SR + 0.5, second_at - 0.5)
    assert not [s for s in by_vad.segments if gap[0] < s.start and s.end < gap[1]]
    assert any(abs(s.start - second_at) < 1.0 for s in by_vad.segments)
    # words are timed on the recording's clock, not their chunk's
    [timed] = bundle.recognize([wave], word_timestamps=True)
    [the] = [w for w in timed.words if w.start > second_at - 1.0][:1]
    assert abs(the.start - second_at) < 0.5
    [sequential] = bundle.recognize([wave], vad=False)
    assert not sequential.vad
    [clip] = bundle.recognize([first])
    assert not clip.vad  # a clip within one window decodes whole


@pytest.mark.fast
def test_long_form_evaluation_decodes_the_vad_chunks_when_asked(
    monkeypatch, tmp_path, tones_dir
) -> None:
    import asrforge.evaluation.longform as longform
    from asrforge.bundle.export import bundle_from_checkpoint
    from asrforge.evaluation.longform import LongItem, evaluate_items

    bundle = bundle_from_checkpoint(save_english_only_model(tmp_path, tones_dir))
    wave = np.random.default_rng(0).standard_normal(5 * SR).astype(np.float32) * 0.1
    item = LongItem("r0", "en", wave, "la la", ["a", "b"])
    asked: list[int] = []

    def chunks(w, rate, seconds):
        asked.append(w.shape[0])
        return [(SR, 2 * SR)]  # one second of it, one window (2 s) at most

    monkeypatch.setattr(longform, "speech_chunks", chunks)
    run = dict(max_new_tokens=4, batch_size=2)  # noqa: C408
    _metrics, [record] = evaluate_items(
        bundle.model, bundle.tokenizer, bundle.features, bundle.specials, [item], vad=True, **run
    )
    assert asked == [5 * SR]
    assert all(1.0 <= s["start"] and s["end"] <= 2.0 for s in record["segments"])
    evaluate_items(bundle.model, bundle.tokenizer, bundle.features, bundle.specials, [item], **run)
    assert asked == [5 * SR]  # sequential by default


@pytest.mark.fast
def test_eval_longform_vad_without_the_package_is_a_config_error(monkeypatch, tmp_path) -> None:
    import importlib.util

    from asrforge.config import load_config

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "silero_vad" else real(name, *a),
    )
    with pytest.raises(Exception, match="longform_vad: needs the package silero-vad"):
        load_config(data={"output_dir": str(tmp_path), "data": {"path": str(tmp_path)},
                          "eval": {"longform_vad": True}})  # fmt: skip


@pytest.mark.fast
def test_evaluate_longform_vad_needs_long_recordings(tmp_path, capsys) -> None:
    from asrforge.cli import main

    argv = ["evaluate", str(tmp_path / "none"), "--data", str(tmp_path), "--longform-vad"]
    assert main(argv) == 2
    assert "--longform-vad: needs --longform-items" in capsys.readouterr().err
