"""Inputs that used to hang a run or cost gigabytes before being dropped: a FIFO given as audio
or as the data, a transcript of megabytes, an hours-long file whose manifest says a second, and
a negative duration, which map and stream modes judged differently."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from asrforge.config import DataConfig
from asrforge.data import rules as data_rules
from asrforge.data.audio import SAMPLE_RATE, AudioFile, audio_info, decode_audio
from asrforge.data.dataset import SpeechDataset
from asrforge.data.prepare import prepare_split
from asrforge.data.rules import NEGATIVE_DURATION, NOT_A_FILE, UtteranceRules
from asrforge.data.sources import load_source
from asrforge.data.stream import RowRules, StreamedSplit, check_row
from asrforge.errors import UserError
from asrforge.model.tokenizer import SpecialTokens, train_bpe_tokenizer

pytestmark = pytest.mark.fast

MAX_SECONDS = 30.0
MAX_POSITIONS = 64


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(["la la tone beep boop"] * 20, 300)


def manifest(tmp_path: Path, clips: list[dict], extra: list[dict]) -> Path:
    """A JSONL manifest of the training clips plus the ``extra`` rows."""
    rows = [
        {"audio_filepath": c["file"], "text": c["text"], "language": c["language"]}
        for c in clips
        if c["split"] == "train"
    ]
    path = tmp_path / "corpus" / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + extra))
    return path


def prepare(path: Path, tokenizer, *, lazy: bool = False):
    split = load_source(DataConfig(path=path)).splits["train"]
    specials = SpecialTokens.from_tokenizer(tokenizer, True)
    return prepare_split(
        split, "train", cfg=DataConfig(path=path), tokenizer=tokenizer, specials=specials,
        max_target_positions=MAX_POSITIONS, max_seconds=MAX_SECONDS, lazy=lazy,
    )  # fmt: skip


def row_rules(tokenizer) -> RowRules:
    specials = SpecialTokens.from_tokenizer(tokenizer, True)
    rules = UtteranceRules(tokenizer, specials, "transcribe", MAX_POSITIONS, MAX_SECONDS)
    return RowRules(rules, "train", None)


class Features:
    """A stand-in feature extractor: one window of zeros."""

    def __call__(self, wave, **_):
        return type("Out", (), {"input_features": [np.zeros((80, 10), np.float32)]})


def lazy_reasons(table) -> dict[str, str]:
    """uid -> reason of every clip a DataLoader worker drops from a lazily prepared ``table``."""
    ds = SpeechDataset(table.split, table, Features(), eot=0)
    items = [ds[i] for i in range(len(table))]
    return {it["dropped"]: it["reason"] for it in items if "dropped" in it}


class Unblocker:
    """Opens ``fifo`` for writing and closes it at once whenever a reader waits on it, after
    ``after`` seconds, so code that opens a FIFO fails the test instead of hanging it."""

    def __init__(self, fifo: Path, after: float = 3.0):
        self.fifo, self.after, self.done = fifo, after, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        start = time.monotonic()
        while not self.done.wait(0.05):
            if time.monotonic() - start < self.after:
                continue
            try:
                os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as e:  # no reader yet
                assert e.errno == errno.ENXIO

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def test_a_fifo_given_as_audio_is_skipped_as_no_regular_file_without_being_opened(
    tmp_path, clips, tokenizer
):
    fifo = tmp_path / "corpus" / "clips" / "pipe.wav"
    os.mkfifo(fifo)
    path = manifest(tmp_path, clips, [{"audio_filepath": "clips/pipe.wav", "text": "la",
                                       "language": "en", "id": "pipe"}])  # fmt: skip
    with Unblocker(fifo):
        started = time.monotonic()
        _, report = prepare(path, tokenizer)
        table, _ = prepare(path, tokenizer, lazy=True)
        dropped = lazy_reasons(table)
        stream_reason = check_row(
            {"audio": {"bytes": None, "path": str(fifo)}, "text": "la", "language": "en"},
            "pipe", row_rules(tokenizer),
        )  # fmt: skip
    assert time.monotonic() - started < 3.0  # never waited for a writer
    assert report.skipped == {NOT_A_FILE: [report.skipped[NOT_A_FILE][0]]}
    assert "pipe" in report.skipped[NOT_A_FILE][0]
    assert list(dropped.values()) == [NOT_A_FILE]
    assert stream_reason == NOT_A_FILE


def test_a_fifo_given_as_data_path_is_an_error_naming_it(tmp_path):
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    with Unblocker(fifo), pytest.raises(UserError, match="not a regular file") as err:
        load_source(DataConfig(path=fifo))
    assert str(fifo) in str(err.value)
    with Unblocker(fifo), pytest.raises(UserError, match="not a regular file"):
        StreamedSplit(DataConfig(path=fifo, stream={"enabled": True}), seed=0)
    # a directory's data file too, not skipped as if it were not there
    with Unblocker(fifo), pytest.raises(UserError, match="not a regular file") as err:
        load_source(DataConfig(path=tmp_path))
    assert str(fifo) in str(err.value)


def test_a_transcript_far_past_the_label_limit_is_skipped_without_tokenizing_it_whole(
    tmp_path, clips, tokenizer, monkeypatch
):
    huge = "la " * 300_000
    first = clips[0]["file"]
    path = manifest(tmp_path, clips, [{"audio_filepath": first, "text": huge, "language": "en",
                                       "id": "huge"}])  # fmt: skip
    longest = []
    encode, batch = type(tokenizer).encode, type(tokenizer).__call__

    def encode_spy(self, text, *args, **kwargs):
        longest.append(len(text))
        return encode(self, text, *args, **kwargs)

    def batch_spy(self, texts, *args, **kwargs):
        longest.extend(len(t) for t in texts)
        return batch(self, texts, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "encode", encode_spy)
    monkeypatch.setattr(type(tokenizer), "__call__", batch_spy)
    rules = row_rules(tokenizer)
    long_labels = rules.utterance.long_labels
    _, report = prepare(path, tokenizer)
    table, _ = prepare(path, tokenizer, lazy=True)
    dropped = lazy_reasons(table)
    streamed = check_row(
        {"audio": {"bytes": None, "path": str(path.parent / first)}, "text": huge,
         "language": "en"}, "huge", rules,
    )  # fmt: skip
    assert report.skipped == {long_labels: ["huge"]}
    assert dropped == {"huge": long_labels}
    assert streamed == long_labels
    assert max(longest) < len(huge) // 10


def test_an_hours_long_file_said_to_be_short_is_skipped_from_its_header_not_decoded(
    tmp_path, clips, tokenizer, monkeypatch
):
    long_file = tmp_path / "corpus" / "clips" / "long.wav"
    sf.write(long_file, np.zeros(int(2 * MAX_SECONDS * SAMPLE_RATE), np.int16), SAMPLE_RATE)
    path = manifest(tmp_path, clips, [{"audio_filepath": "clips/long.wav", "text": "la",
                                       "language": "en", "id": "long", "duration": 1.24}])  # fmt: skip
    decode = AudioFile.decode
    decoded = []

    def recording(self, *args, **kwargs):
        decoded.append(self.name)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(AudioFile, "decode", recording)
    for lazy in (False, True):
        table, _ = prepare(path, tokenizer, lazy=lazy)
        long_row = [i for i, uid in enumerate(table.uids()) if uid == "long"]
        ds = SpeechDataset(table.split, table, Features(), eot=0)
        assert ds[long_row[0]] == {
            "dropped": "long",
            "reason": f"audio longer than {MAX_SECONDS:g} s",
        }
        ds[next(i for i in range(len(table)) if i != long_row[0])]  # the spy sees a decode
    assert decoded and not [s for s in decoded if s.endswith("long.wav")]


def test_reading_a_clip_opens_it_once_and_stats_no_path(tmp_path, monkeypatch):
    clip = tmp_path / "clip.wav"
    sf.write(clip, np.zeros(SAMPLE_RATE, np.int16), SAMPLE_RATE)
    opened, stats = [], []
    real_sound, real_stat = sf.SoundFile, os.stat

    def sound(*args, **kwargs):
        opened.append(args[0])
        return real_sound(*args, **kwargs)

    def stat(path, *args, **kwargs):
        stats.append(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(sf, "SoundFile", sound)
    monkeypatch.setattr(os, "stat", stat)
    wave = data_rules.read_audio({"bytes": None, "path": str(clip)}, MAX_SECONDS)
    assert wave.shape == (SAMPLE_RATE,)
    assert len(opened) == 1  # the header and the samples from one open file
    assert [s for s in stats if str(s) == str(clip)] == []


def test_a_fifo_is_refused_by_the_decoder_and_the_header_reader_without_waiting(tmp_path):
    fifo = tmp_path / "pipe.wav"
    os.mkfifo(fifo)
    with Unblocker(fifo):
        started = time.monotonic()
        for read in (decode_audio, audio_info, lambda s: data_rules.read_audio({"path": s}, 1.0)):
            with pytest.raises(UserError, match="not a regular file"):
                read(str(fifo))
    assert time.monotonic() - started < 3.0  # never waited for a writer


def test_a_negative_duration_is_one_reason_in_map_and_stream_modes(tmp_path, clips, tokenizer):
    first = clips[0]["file"]
    path = manifest(tmp_path, clips, [{"audio_filepath": first, "text": "la", "language": "en",
                                       "id": "backwards", "duration": -1.5}])  # fmt: skip
    _, report = prepare(path, tokenizer)
    streamed = check_row(
        {"audio": {"bytes": None, "path": str(path.parent / first)}, "text": "la",
         "language": "en", "duration": -1.5}, "backwards", row_rules(tokenizer),
    )  # fmt: skip
    assert report.skipped == {NEGATIVE_DURATION: ["backwards"]}
    assert streamed == NEGATIVE_DURATION


def flac_claiming(total_frames: int, seconds: float = 1.0, rate: int = SAMPLE_RATE) -> bytes:
    """A FLAC of ``seconds`` of tone whose STREAMINFO claims ``total_frames`` samples."""
    import io

    buf = io.BytesIO()
    tone = (0.3 * np.sin(np.arange(int(seconds * rate)) / 10)).astype(np.float32)
    sf.write(buf, tone, rate, format="FLAC")
    data = bytearray(buf.getvalue())
    # STREAMINFO starts at byte 8; its 36-bit sample count at bit 108 (byte 13, low nibble)
    data[21] = (data[21] & 0xF0) | ((total_frames >> 32) & 0x0F)
    data[22:26] = (total_frames & 0xFFFFFFFF).to_bytes(4, "big")
    return bytes(data)


@pytest.mark.parametrize("claimed", [1 << 35, (1 << 36) - 1, 10 * 3600 * SAMPLE_RATE])
def test_a_header_claiming_hours_of_samples_allocates_nothing_of_that_size(
    tmp_path, monkeypatch, claimed
):
    """decode never sizes an array from the header: a lie of 2^35 samples is a UserError naming
    the file (or the real samples), not a 128 GiB allocation."""
    path = tmp_path / "liar.flac"
    path.write_bytes(flac_claiming(claimed))
    assert audio_info(str(path))[1] == claimed / SAMPLE_RATE
    real_empty = sf.SoundFile._create_empty_array
    asked = []

    def watched(self, frames, *args, **kwargs):
        asked.append(frames)
        return real_empty(self, frames, *args, **kwargs)

    monkeypatch.setattr(sf.SoundFile, "_create_empty_array", watched)
    try:
        wave = decode_audio(str(path))
    except UserError as e:
        assert str(path) in str(e) and "\n" not in str(e)
    else:
        assert wave.shape[0] <= 2 * SAMPLE_RATE
    assert max(asked, default=0) <= 1 << 18  # blocks, not the claim
    # training skips it from its header, never decoding
    with pytest.raises(data_rules.UnusableAudio, match="longer than"):
        data_rules.read_audio({"bytes": None, "path": str(path)}, MAX_SECONDS)


@pytest.mark.parametrize("channels, rate", [(1, SAMPLE_RATE), (2, 44_100), (3, 8_000)])
def test_block_decoding_gives_the_samples_a_whole_read_gives(tmp_path, channels, rate):
    from asrforge.data.audio import resample

    rng = np.random.default_rng(channels)
    samples = (0.2 * rng.standard_normal((int(2.7 * rate), channels))).astype(np.float32)
    path = tmp_path / "clip.flac"
    sf.write(path, samples, rate, subtype="PCM_24")
    whole, _ = sf.read(path, dtype="float32", always_2d=True)
    want = resample(whole.mean(axis=1) if channels > 1 else whole[:, 0], rate, SAMPLE_RATE)
    np.testing.assert_array_equal(decode_audio(str(path)), want)


def test_audio_longer_than_the_decode_limit_is_refused_by_name(tmp_path, monkeypatch):
    from asrforge.data import audio as audio_module

    monkeypatch.setattr(audio_module, "MAX_DECODE_SECONDS", 3600)
    monkeypatch.setattr(audio_module, "_BLOCK_FRAMES", 4000)
    path = tmp_path / "long.wav"
    sf.write(path, np.zeros(8000, np.int16), 2)  # 4000 s at 2 Hz: longer than the hour
    with pytest.raises(UserError, match="long.wav: longer than 1 hours"):
        decode_audio(str(path))


@pytest.mark.parametrize("name", ["clips/bad\u0000name.wav", "\u0000", "clips/x.wav\u0000.txt"])
def test_an_audio_path_with_a_nul_byte_is_a_missing_file_named_in_both_modes(
    tmp_path, clips, tokenizer, name
):
    path = manifest(tmp_path, clips, [{"audio_filepath": name, "text": "la", "language": "en",
                                       "id": "nul"}])  # fmt: skip
    table, report = prepare(path, tokenizer, lazy=False)
    assert "nul" not in table.uids()
    assert any(u.startswith("nul") for u in report.skipped["audio file not found"])
    table, _ = prepare(path, tokenizer, lazy=True)
    reasons = lazy_reasons(table)
    assert [r for uid, r in reasons.items() if uid.startswith("nul")] == ["audio file not found"]
    with pytest.raises(UserError, match="a NUL byte in its path"):
        decode_audio(str(tmp_path / name))
