"""Voice activity detection for long audio: regions joined into chunks without the pauses
between them, chunks' segments and words placed back on the recording's clock, and tiny.en
decoding only the speech of a recording with noise between its sentences."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from audio_fixtures import synthesize
from conftest import save_english_only_model
from test_bundle import one_thread  # noqa: F401  (autouse: one torch thread)
from test_ct2_import import ct2_tiny_en, hf_tiny_en  # noqa: F401  (session fixtures)
from test_transcribe_files import clip, tiny_bundle  # noqa: F401  (a 2 s window)

from asrforge.model.alignment import Word
from asrforge.model.longform import Segment
from asrforge.model.vad import SPEECH_PAD_MS, Chunk, join_regions

SR = 16_000


@pytest.mark.fast
def test_regions_join_in_order_while_their_speech_fits_a_chunk() -> None:
    regions = [(0, 10), (12, 20), (25, 31), (40, 45), (47, 90)]
    chunks = join_regions(regions, 30)
    # the pauses between regions do not count: 10 + 8 + 6 + 5 = 29 fits, 43 more does not
    assert [c.regions for c in chunks] == [((0, 10), (12, 20), (25, 31), (40, 45)), ((47, 90),)]
    assert [c.regions for c in join_regions(regions, 100)] == [tuple(regions)]
    assert join_regions([], 30) == []


@pytest.mark.fast
def test_regions_that_touch_become_one_region_of_their_chunk() -> None:
    # Silero shares a short pause between neighbours (rounding each half down)
    [chunk] = join_regions([(0, 10), (10, 20), (21, 30), (40, 45)], 100)
    assert chunk.regions == ((0, 30), (40, 45))
    # nothing was left out at 10 or 20: a time there is not moved to a region's edge
    assert chunk.recording_seconds(9.9 / SR, end=True, sample_rate=SR) == pytest.approx(9.9 / SR)


@pytest.mark.fast
def test_a_chunks_audio_leaves_out_the_pauses_between_its_regions() -> None:
    wave = np.arange(100, dtype=np.float32)
    chunk = Chunk(((10, 20), (50, 55)))
    assert chunk.audio(wave).tolist() == [*range(10, 20), *range(50, 55)]
    whole = Chunk.whole(wave)
    assert whole.audio(wave) is not wave and np.shares_memory(whole.audio(wave), wave)


# 1 s of speech at 10-11 s, then 2 s at 40-42 s, joined: chunk time 1.0 is where they meet
JOINED = Chunk(((10 * SR, 11 * SR), (40 * SR, 42 * SR)))


@pytest.mark.fast
def test_a_chunks_segment_and_its_words_move_to_the_recordings_clock() -> None:
    words = [Word(" one", 0.2, 0.9, 0.9), Word(" two", 1.1, 1.5, 0.8)]
    seg = Segment(0.2, 2.5, "one two", [7], (0.0, 3.0), words)
    placed = JOINED.placed(seg)
    times = [t for w in placed.words for t in (w.start, w.end)]
    assert times == pytest.approx([10.2, 10.9, 40.1, 40.5])
    # a segment with words spans them, not its timestamps (2.5 s: 41.5)
    assert (placed.start, placed.end, *placed.window) == pytest.approx((10.2, 40.5, 10.0, 42.0))
    assert (seg.start, seg.words[1].start) == (0.2, 1.1)  # the chunk's own segment is unchanged
    # a time past the chunk's audio (a segment closed in the padding) stays past its end
    assert JOINED.recording_seconds(3.5, end=True) == pytest.approx(42.5)


@pytest.mark.fast
def test_a_word_across_a_joint_stays_in_the_region_of_its_middle() -> None:
    # timed 0.7-1.3 s on the chunk: its middle is the second region's first 0.0 s
    words = [Word(" so", 0.7, 1.3, 0.9)]
    placed = JOINED.placed(Segment(0.2, 2.0, "so", [7], (0.0, 3.0), words))
    [word] = placed.words
    assert (word.start, word.end) == pytest.approx((40.0, 40.3))  # not 10.7 -> 40.3
    assert placed.start <= word.start and word.end <= placed.end
    # one timed 0.6-1.2 s lies in the first region, its end held to that region's
    [word] = JOINED.placed(
        Segment(0.2, 2.0, "so", [7], (0.0, 3.0), [Word(" so", 0.6, 1.2, 0.9)])
    ).words
    assert (word.start, word.end) == pytest.approx((10.6, 11.0))


@pytest.mark.fast
def test_segments_whose_words_overrun_their_timestamps_do_not_overlap() -> None:
    # Whisper's shared timestamp 0.55 s lies before the joint's padding, and the first
    # segment's last word runs 50 ms past it: the second's words all lie in the later region
    first = Segment(0.0, 0.55, "one", [7], (0.0, 3.0), [Word(" one", 0.2, 0.6, 0.9)])
    second = Segment(0.55, 2.0, "two", [7], (0.0, 3.0), [Word(" two", 1.1, 1.5, 0.8)])
    a, b = JOINED.placed(first), JOINED.placed(second)
    assert (a.start, a.end) == pytest.approx((10.2, 10.6))
    assert (b.start, b.end) == pytest.approx((40.1, 40.5))  # not from 10.55, over left-out audio
    # within one region too: a segment does not end after the next one starts
    whole = Chunk.whole(np.zeros(5 * SR, np.float32))
    first = Segment(0.0, 2.0, "one", [7], (0.0, 5.0), [Word(" one", 0.3, 2.06, 0.9)])
    second = Segment(2.0, 4.0, "two", [7], (0.0, 5.0), [Word(" two", 2.2, 2.6, 0.8)])
    assert whole.placed(first).end <= whole.placed(second).start


@pytest.mark.fast
def test_placed_segments_hold_their_words_in_order_and_never_overlap() -> None:
    # random chunks of regions with gaps, decoded as segments with whole-second timestamps
    # (as tiny.en gives them) and words that run past them, contiguous on the chunk's clock
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.uniform(0.5, 4.0, size=rng.integers(1, 5))
        starts = np.cumsum(rng.uniform(0.1, 10.0, size=lengths.size) + np.r_[0, lengths[:-1]])
        regions = [
            (round(a * SR), round((a + n) * SR)) for a, n in zip(starts, lengths, strict=True)
        ]
        chunk = Chunk(tuple(regions))
        audio = sum(b - a for a, b in regions) / SR
        # on the encoder's 20 ms grid, within the chunk's audio
        edges = np.sort(
            np.floor(rng.uniform(0, audio, size=rng.integers(2, 12)) * 50) / 50
        ).tolist()
        words = [Word(f" w{k}", a, b, 0.9) for k, (a, b) in enumerate(pairwise(edges))]
        cuts = sorted(rng.choice(len(words), size=rng.integers(0, len(words)), replace=False))
        placed = []
        for group in np.split(np.array(words), cuts):
            if group.size:
                ts = (np.floor(group[0].start), min(np.floor(group[-1].end) + 0.5, audio))
                placed.append(chunk.placed(Segment(*ts, "x", [7], (0.0, audio), list(group))))
        for seg in placed:
            assert all(seg.start <= w.start <= w.end <= seg.end for w in seg.words)
        assert all(s.end <= t.start for s, t in pairwise(placed))
        flat = [w for seg in placed for w in seg.words]
        for w, was in zip(flat, words, strict=True):
            # in one region, no longer than on the chunk's clock, and of some length if it had
            assert any(a / SR <= w.start and w.end <= b / SR for a, b in regions)
            assert w.end - w.start <= was.end - was.start + 1e-9
            assert (w.end > w.start) == (was.end > was.start)
        times = [t for w in flat for t in (w.start, w.end)]
        assert times == sorted(times)


@pytest.mark.fast
def test_times_in_the_padding_where_regions_meet_keep_to_the_speech() -> None:
    # a segment that opens 70 ms before the joint starts the second region, not the first
    placed = JOINED.placed(Segment(0.93, 2.0, "two", [7], (0.0, 3.0)))
    assert (placed.start, placed.end) == pytest.approx((40.0, 41.0))
    # one that closes 100 ms after it ends the first region, not 29 s later
    assert JOINED.placed(Segment(0.2, 1.1, "one", [7], (0.0, 3.0))).end == pytest.approx(11.0)
    # farther from the joint than a pad, times are the speech's own
    assert SPEECH_PAD_MS < 500
    assert JOINED.recording_seconds(0.5) == pytest.approx(10.5)
    assert JOINED.recording_seconds(1.5, end=True) == pytest.approx(40.5)
    # a segment wholly in that padding keeps its length, in the region of its middle
    short = JOINED.placed(Segment(0.85, 0.95, "uh", [7], (0.0, 3.0)))
    assert (short.start, short.end) == pytest.approx((10.85, 10.95))


@pytest.mark.fast
def test_silero_finds_no_speech_in_silence_and_noise() -> None:
    pytest.importorskip("silero_vad")
    pytest.importorskip("onnxruntime")
    from asrforge.model.vad import speech_chunks

    rng = np.random.default_rng(0)
    quiet = np.concatenate([np.zeros(3 * SR), 0.01 * rng.standard_normal(3 * SR)])
    assert speech_chunks(quiet.astype(np.float32), SR, 30.0) == []


@pytest.mark.fast
def test_a_window_too_short_for_padded_regions_is_a_user_error() -> None:
    from asrforge.errors import UserError
    from asrforge.model.vad import speech_chunks

    with pytest.raises(UserError, match="window of 0.4 s is too short"):
        speech_chunks(np.zeros(SR, np.float32), SR, 0.4)


def without_modules(monkeypatch, *names: str) -> None:
    """``importlib.util.find_spec`` finds none of ``names``, as if not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a)
    )


@pytest.mark.fast
def test_vad_asked_for_without_its_packages_is_one_line(monkeypatch, tmp_path, capsys) -> None:
    from asrforge.cli import main

    argv = ["transcribe", str(tmp_path / "none"), str(tmp_path / "a.wav"), "--vad"]
    without_modules(monkeypatch, "onnxruntime")
    assert main(argv) == 2
    assert "--vad: needs the package onnxruntime (pip install" in capsys.readouterr().err
    without_modules(monkeypatch, "silero_vad")
    assert main(argv) == 2
    assert "--vad: needs the packages silero-vad and onnxruntime" in capsys.readouterr().err


@pytest.mark.fast
def test_vad_with_previous_text_conditioning_is_refused_naming_both(tmp_path, capsys) -> None:
    from asrforge.cli import main

    argv = ["transcribe", str(tmp_path / "none"), str(tmp_path / "a.wav"), "--json"]
    assert main([*argv, "--vad", "--condition-on-previous-text"]) == 2
    err = capsys.readouterr().err
    assert "--vad and --condition-on-previous-text: VAD chunks are decoded apart" in err
    assert "Traceback" not in err
    assert main([*argv, "--no-vad", "--condition-on-previous-text"]) == 2
    assert "--vad and" not in capsys.readouterr().err


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
        return [Chunk(((SR, 2 * SR),))]  # one second of it, one window (2 s) at most

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
def test_long_audio_without_vads_packages_says_once_that_it_decodes_sequentially(
    monkeypatch, caplog, tmp_path, tones_dir
) -> None:
    import logging

    from asrforge.bundle import options
    from asrforge.bundle.export import bundle_from_checkpoint

    bundle = bundle_from_checkpoint(save_english_only_model(tmp_path, tones_dir))
    long = np.zeros(round(2.5 * bundle.window_seconds * SR), np.float32)
    without_modules(monkeypatch, "onnxruntime")
    options._say_sequential_without_vad.cache_clear()
    with caplog.at_level(logging.INFO, logger="asrforge.bundle.options"):
        assert not options.use_vad(bundle, None, long, previous_text=False)
        assert not options.use_vad(bundle, None, long, previous_text=False)
        assert not options.use_vad(bundle, None, long[: SR // 2], previous_text=False)  # a clip
    said = [r.getMessage() for r in caplog.records if "decode sequentially" in r.getMessage()]
    assert said == [
        "long recordings decode sequentially: VAD: needs the package onnxruntime "
        "(pip install 'asrforge[vad]')"
    ]


@pytest.mark.fast
def test_eval_longform_vad_without_the_package_is_a_config_error(monkeypatch, tmp_path) -> None:
    from asrforge.config import load_config

    without_modules(monkeypatch, "silero_vad")
    with pytest.raises(Exception, match="longform_vad: needs the package silero-vad"):
        load_config(data={"output_dir": str(tmp_path), "data": {"path": str(tmp_path)},
                          "eval": {"longform_vad": True}})  # fmt: skip


@pytest.mark.fast
def test_evaluate_longform_vad_needs_long_recordings(tmp_path, capsys) -> None:
    from asrforge.cli import main

    argv = ["evaluate", str(tmp_path / "none"), "--data", str(tmp_path), "--longform-vad"]
    assert main(argv) == 2
    assert "--longform-vad: needs --longform-items" in capsys.readouterr().err


@pytest.fixture
def broken_onnxruntime(monkeypatch, tmp_path) -> Iterator[str]:
    """An onnxruntime that is installed but fails to import (its shared library is missing):
    a package of that name first on ``sys.path``; the real one is put back after the test."""
    import sys

    why = "libonnxruntime.so.1: cannot open shared object file"
    fake = tmp_path / "broken-site" / "onnxruntime"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ImportError({why!r})\n")
    monkeypatch.syspath_prepend(str(fake.parent))
    for name in [m for m in sys.modules if m == "onnxruntime" or m.startswith("onnxruntime.")]:
        monkeypatch.delitem(sys.modules, name)
    # each import is tried once a process: the broken one here, the real one after
    from asrforge.config.schema import _import_error

    _import_error.cache_clear()
    yield why
    _import_error.cache_clear()


@pytest.mark.fast
def test_a_vad_package_that_fails_to_import_is_named_with_its_error(broken_onnxruntime) -> None:
    from asrforge.config import vad_problem

    problem = vad_problem("--vad")
    assert problem is not None
    assert "onnxruntime" in problem and broken_onnxruntime in problem and "ImportError" in problem
    assert "silero" not in problem


@pytest.mark.fast
def test_a_long_recording_with_a_broken_onnxruntime_decodes_sequentially(
    broken_onnxruntime: str,
    tiny_bundle: Path,  # noqa: F811
    tmp_path: Path,
    capsys,
    caplog,
) -> None:
    import json
    import logging

    from asrforge.bundle import options
    from asrforge.cli import main

    audio = clip(tmp_path / "long.wav", seconds=5.0)  # the tiny model's window is 2 s
    options._say_sequential_without_vad.cache_clear()
    with caplog.at_level(logging.INFO, logger="asrforge.bundle.options"):
        assert main(["transcribe", str(tiny_bundle), audio, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["vad"] is False and out["seconds"] == pytest.approx(5.0)
    said = [r.getMessage() for r in caplog.records if "decode sequentially" in r.getMessage()]
    assert len(said) == 1 and broken_onnxruntime in said[0]
    # asked for by name, it is refused before anything is decoded, naming the way round it
    assert main(["transcribe", str(tiny_bundle), audio, "--vad"]) == 2
    err = capsys.readouterr().err
    assert "--vad: " in err and "onnxruntime" in err and broken_onnxruntime in err
    assert "--no-vad" in err and "Traceback" not in err
