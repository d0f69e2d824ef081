"""``asrforge align-heads``: the heads whose cross-attention follows the audio, found from
held-out clips and recorded in a bundle; on tiny.en they are mostly the heads Whisper ships."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from audio_fixtures import synthesize
from conftest import save_english_only_model
from test_bundle import one_thread  # noqa: F401  (autouse: one torch thread)
from test_ct2_import import ct2_tiny_en, hf_tiny_en  # noqa: F401  (session fixtures)

from asrforge.bundle.export import export_bundle
from asrforge.bundle.load import ALIGNMENT_HEADS_KEY, load_bundle
from asrforge.bundle.options import word_heads
from asrforge.bundle.write import update_bundle_manifest
from asrforge.errors import CheckpointCorruptError
from asrforge.model.head_timing import qualifying_heads, speech_onset

SR = 16_000


@pytest.mark.fast
def test_speech_onset_is_the_end_of_the_leading_silence() -> None:
    t = np.arange(SR) / SR
    wave = np.concatenate([np.zeros(int(0.37 * SR)), 0.5 * np.sin(2 * np.pi * 200 * t)])
    assert speech_onset(wave.astype(np.float32)) == pytest.approx(0.37, abs=0.011)
    assert speech_onset(np.zeros(5, np.float32)) == 0.0


@pytest.mark.fast
def test_joins_come_from_each_language_in_turn() -> None:
    from asrforge.bundle.heads import in_turn

    # a split sorted by language: the first joins are not all English
    groups = {"en": ["en1", "en2", "en3"], "es": ["es1"], "it": ["it1", "it2"]}
    assert in_turn(groups, 4) == ["en1", "es1", "it1", "en2"]
    assert in_turn(groups, 10) == ["en1", "es1", "it1", "en2", "it2", "en3"]
    assert in_turn({}, 3) == []


@pytest.mark.fast
def test_heads_qualify_by_median_error_best_first() -> None:
    heads = [(0, 0), (0, 1), (1, 0)]
    offsets = np.array([[0.05, 0.5, -0.15], [0.9, -0.4, 0.1], [-0.1, 0.3, 0.12]])
    # median errors 0.10, 0.40, 0.12, early or late alike: one bad join does not sink (0, 0)
    assert qualifying_heads(heads, offsets, limit=0.2) == [(0, 0), (1, 0)]
    assert qualifying_heads(heads, offsets, limit=0.11) == [(0, 0)]
    assert qualifying_heads(heads, offsets, limit=0.01) == []


@pytest.mark.fast
def test_a_recorded_head_the_model_lacks_is_refused(tmp_path, tones_dir) -> None:
    bundle = export_bundle(save_english_only_model(tmp_path, tones_dir), tmp_path / "b")
    update_bundle_manifest(bundle, {ALIGNMENT_HEADS_KEY: {"heads": [[1, 0], [1, 1]]}})
    assert load_bundle(bundle).alignment_heads == [(1, 0), (1, 1)]
    update_bundle_manifest(bundle, {ALIGNMENT_HEADS_KEY: {"heads": [[2, 0]]}})  # 2 layers
    with pytest.raises(CheckpointCorruptError, match="alignment_heads must hold heads"):
        load_bundle(bundle)


@pytest.mark.fast
def test_a_recorded_lag_is_loaded_and_one_that_is_no_time_is_refused(tmp_path, tones_dir):
    bundle = export_bundle(save_english_only_model(tmp_path, tones_dir), tmp_path / "b")
    assert load_bundle(bundle).word_lag == 0.0
    update_bundle_manifest(bundle, {ALIGNMENT_HEADS_KEY: {"heads": [[1, 0]], "lag_s": 0.055}})
    assert load_bundle(bundle).word_lag == 0.055
    for bad in ("0.05", None, -0.1, 1e9, float("nan"), 25.0):  # 25 s: every word at 0.0
        update_bundle_manifest(bundle, {ALIGNMENT_HEADS_KEY: {"heads": [[1, 0]], "lag_s": bad}})
        with pytest.raises(CheckpointCorruptError, match="lag_s must be seconds"):
            load_bundle(bundle)


SENTENCES = [
    "We will meet at the library tomorrow morning.",
    "It is a beautiful day in the park.",
    "Please send me the report before Friday.",
    "The train to the city leaves every hour.",
    "She bought fresh bread at the market.",
    "Turn left at the second traffic light.",
    "The weather forecast says it will rain.",
    "My brother plays the guitar in a band.",
]


def _validation_clips(root: Path) -> Path:
    """A data directory whose validation split is :data:`SENTENCES` in two espeak-ng voices."""
    data = root / "data"
    (data / "clips").mkdir(parents=True)
    lines = []
    for i, text in enumerate(SENTENCES):
        file = f"clips/{i}.wav"
        wave = synthesize(text, "en-gb" if i % 2 else "en-us")
        sf.write(data / file, wave, SR)
        lines.append(json.dumps({"audio_filepath": file, "text": text,
                                 "duration": wave.shape[0] / SR, "lang": "en"}))  # fmt: skip
    (data / "validation_manifest.json").write_text("\n".join(lines) + "\n")
    return data


def test_tiny_en_heads_found_from_clips_are_mostly_whispers_own(
    hf_tiny_en: Path,  # noqa: F811
    tmp_path: Path,
    capsys,
) -> None:
    from asrforge.cli import main

    data = _validation_clips(tmp_path)
    bundle_dir = export_bundle(hf_tiny_en, tmp_path / "tiny")
    # before the search, a loaded bundle aligns with the heads its generation config ships
    shipped = json.loads((bundle_dir / "generation_config.json").read_text())["alignment_heads"]
    assert load_bundle(bundle_dir).alignment_heads == [tuple(h) for h in shipped]
    assert main(["align-heads", str(bundle_dir), "--data", str(data), "--joins", "4"]) == 0
    assert "recorded" in capsys.readouterr().out
    bundle = load_bundle(bundle_dir)
    found = bundle.alignment_heads
    own = {tuple(h) for h in shipped}
    assert found and len(set(found) & own) >= len(found) / 2
    # and they time the words of clips the search never heard
    first = synthesize("The museum is closed on Mondays.")
    second = synthesize("Dinner will be ready in about twenty minutes.")
    onset = first.shape[0] / SR + 2.0
    wave = np.concatenate([first, np.zeros(2 * SR, np.float32), second])
    words = bundle.transcribe(wave, word_timestamps=True).words
    dinner = next(w for w in words if "dinner" in w.word.lower())
    assert abs(dinner.start - onset) < 0.3
    record = json.loads((bundle_dir / "manifest.json").read_text())[ALIGNMENT_HEADS_KEY]
    assert record["joins"] == 4 and len(record["median_error_s"]) == 4 * 6
    assert bundle.word_lag == record["lag_s"]


def test_tiny_en_words_come_on_time_once_the_shipped_heads_lag_is_taken_off(
    hf_tiny_en: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The heads Whisper ships place a sentence's start after a pause late on espeak-ng speech;
    the lag ``--keep-heads`` measures on the validation clips brings the starts of sentences
    it never heard closer."""
    from asrforge.cli import main

    bundle_dir = export_bundle(hf_tiny_en, tmp_path / "tiny")
    late = load_bundle(bundle_dir)
    data = _validation_clips(tmp_path)
    assert main(["align-heads", str(bundle_dir), "--data", str(data), "--keep-heads"]) == 0
    bundle = load_bundle(bundle_dir)
    assert bundle.alignment_heads == late.alignment_heads
    assert 0.02 < bundle.word_lag < 0.2
    held_out = [
        ("The museum is closed on Mondays.", "Dinner will be ready in about twenty minutes."),
        ("Our flight was delayed by two hours.", "Children are playing in the garden."),
        ("He forgot his umbrella on the bus.", "Nobody answered the phone this morning."),
        ("The coffee is too hot to drink.", "Several boats sailed across the lake."),
    ]
    offsets = {"shipped": [], "lag taken off": []}
    for first_text, second_text in held_out:
        first, second = synthesize(first_text), synthesize(second_text, "en-gb")
        onset = first.shape[0] / SR + 1.5 + speech_onset(second)
        wave = np.concatenate([first, np.zeros(int(1.5 * SR), np.float32), second])
        for name, b in (("shipped", late), ("lag taken off", bundle)):
            words = b.transcribe(wave, word_timestamps=True).words
            # the first sentence's words all start within its audio
            start = next(w.start for w in words if w.start >= first.shape[0] / SR)
            offsets[name].append(start - onset)
    before, after = (abs(float(np.median(offsets[n]))) for n in offsets)
    assert after < before - 0.02, offsets


@pytest.mark.fast
def test_a_model_with_no_head_within_the_limit_says_so(tmp_path, tones_dir, capsys, caplog):
    from asrforge.cli import main

    bundle_dir = export_bundle(save_english_only_model(tmp_path, tones_dir), tmp_path / "b")
    argv = ["align-heads", str(bundle_dir), "--data", str(tones_dir), "--split", "train"]
    # an untrained model's best head is off by more than 5 ms (below one 20 ms frame)
    assert main([*argv, "--joins", "3", "--max-error", "0.005"]) == 0
    assert "no head qualifies" in capsys.readouterr().out
    record = json.loads((bundle_dir / "manifest.json").read_text())[ALIGNMENT_HEADS_KEY]
    assert record["heads"] == [] and record["joins"] >= 1
    assert sum(record["joins_by_language"].values()) == record["joins"]
    assert min(record["median_error_s"].values()) > record["limit_s"]
    bundle = load_bundle(bundle_dir)
    assert bundle.alignment_heads == []
    wave = np.random.default_rng(0).standard_normal(SR).astype(np.float32) * 0.1
    bundle.transcribe(wave, word_timestamps=True, max_new_tokens=4)
    # the warning is given only when there are words to time
    assert word_heads(bundle) is None
    assert "found no head that follows the audio" in caplog.text
    # measuring the lag alone keeps the finding that no head qualifies
    assert main([*argv, "--joins", "3", "--keep-heads"]) == 0
    assert "kept the alignment heads" in capsys.readouterr().out
    kept = json.loads((bundle_dir / "manifest.json").read_text())[ALIGNMENT_HEADS_KEY]
    assert kept["heads"] == [] and kept["joins"] == record["joins"] and kept["kept"]
    assert kept["median_error_s"] == record["median_error_s"]  # the search's evidence stays
    assert load_bundle(bundle_dir).word_lag == kept["lag_s"]
    assert kept["lag_s"] in (kept["onset_offset_s"], 0.0) and 0.0 <= kept["lag_s"] <= 0.2


@pytest.mark.fast
@pytest.mark.parametrize("offset, lag", [(0.07, 0.07), (-0.45, 0.0), (0.35, 0.0)])
def test_only_a_start_placed_late_within_the_limit_is_taken_as_the_lag(
    tmp_path, tones_dir, monkeypatch, caplog, offset, lag
):
    """Heads that give the pause before an utterance to its first word place its start early:
    that is where the pause went, not a lag, and taking it off would move every word late."""
    from asrforge.bundle import heads as heads_module

    bundle_dir = export_bundle(save_english_only_model(tmp_path, tones_dir), tmp_path / "b")
    monkeypatch.setattr(heads_module, "onset_offsets", lambda *a, **k: np.array([offset]))
    record = heads_module.find_alignment_heads(
        bundle_dir, tones_dir, "train", joins=3, keep_heads=True
    )
    assert record["onset_offset_s"] == offset and record["lag_s"] == lag
    assert load_bundle(bundle_dir).word_lag == lag
    said = heads_module.lag_text(record)
    if lag:
        assert "70 ms late; word timestamps take that off" in said
        assert "not how late words come" not in caplog.text
    else:
        assert "take no lag off" in said and "not how late words come" in caplog.text


def _tone_clips(root: Path, tones_dir: Path, count: int) -> Path:
    """A data directory whose validation split is (up to) ``count`` English tone clips and a
    row whose audio file is missing."""
    from asrforge.data.sources import read_split

    data = root / "data"
    (data / "clips").mkdir(parents=True)
    rows = [r for r in read_split(tones_dir, "train") if r["language"] == "en"][:count]
    lines = [json.dumps({"audio_filepath": "clips/missing.wav", "text": "gone", "lang": "en"})]
    for r in rows:
        (data / f"clips/{r['id']}.wav").write_bytes(r["audio"]["bytes"])
        lines.append(json.dumps({"audio_filepath": f"clips/{r['id']}.wav", "text": r["text"],
                                 "lang": "en"}))  # fmt: skip
    (data / "validation_manifest.json").write_text("\n".join(lines) + "\n")
    return data


@pytest.mark.fast
def test_too_few_joins_are_refused_and_fewer_than_asked_warned(tmp_path, tones_dir, capsys, caplog):
    from asrforge.cli import main

    bundle_dir = export_bundle(save_english_only_model(tmp_path, tones_dir), tmp_path / "b")
    manifest = (bundle_dir / "manifest.json").read_bytes()
    few = _tone_clips(tmp_path / "few", tones_dir, 2)  # one join
    assert main(["align-heads", str(bundle_dir), "--data", str(few)]) == 2
    err = capsys.readouterr().err
    assert "1 join(s) of two utterances of one language" in err
    assert "at least 3 are needed (skipped rows: {'audio file not found': 1}); nothing was" in err
    assert main(["align-heads", str(bundle_dir), "--data", str(few), "--joins", "2"]) == 2
    assert "--joins: must be >= 3" in capsys.readouterr().err
    assert (bundle_dir / "manifest.json").read_bytes() == manifest
    more = _tone_clips(tmp_path / "more", tones_dir, 100)
    argv = ["align-heads", str(bundle_dir), "--data", str(more), "--joins", "100"]
    assert main([*argv, "--max-error", "30"]) == 0
    out = capsys.readouterr()
    assert "asrforge: skipped {'audio file not found': 1}" in out.err
    record = json.loads((bundle_dir / "manifest.json").read_text())[ALIGNMENT_HEADS_KEY]
    assert f"measuring on {record['joins']} joins, not the 100 asked for" in caplog.text
    assert record["joins"] >= 3
    assert "median error by head (layer,head): " in out.err


@pytest.mark.fast
def test_every_recorded_head_is_printed_with_its_error():
    from asrforge.cli.align_heads import errors_line

    errors = {f"{a},{b}": 0.01 * (a + b) for a in range(3) for b in range(3)}
    heads = [[0, 0], [0, 1], [1, 0], [0, 2], [1, 1], [2, 0], [1, 2]]
    line = errors_line({"heads": heads, "median_error_s": errors})
    assert line.startswith("median error by head (layer,head): 0,0 0 ms, 0,1 10 ms")
    assert line.count(" ms") == 7
    assert errors_line({"heads": [], "median_error_s": errors}).count(" ms") == 5
