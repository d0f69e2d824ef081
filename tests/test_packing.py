"""Packed training windows (data.pack): layout limits, determinism, timestamp and previous-text
targets against the audio offsets, tokenizers without timestamps, exact resume with packing."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asrforge.config import ConfigError, PackConfig
from asrforge.data.audio import SAMPLE_RATE, AudioFile, decode_audio
from asrforge.data.dataset import IGNORE, Collator, SpeechDataset
from asrforge.data.packing import (
    PackItems,
    Window,
    build_packing,
    compose_windows,
    positions,
)
from asrforge.data.prepare import prepare_split
from asrforge.data.sources import load_arrow
from asrforge.data.targets import TIME_PRECISION, TimestampTokens
from asrforge.errors import UserError
from asrforge.model.build import WhisperFeatureExtractor
from asrforge.model.tokenizer import SpecialTokens, train_bpe_tokenizer
from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config
from tests.test_resume import assert_resume_is_bit_identical

WINDOW = 4.0  # seconds: the tones clips are 0.46-1.24 s, so a window holds two to six


def _items(n: int, seed: int, languages=("en", "es", "de")) -> PackItems:
    rng = np.random.default_rng(seed)
    return PackItems(
        languages=[languages[i] for i in rng.integers(0, len(languages), n)],
        n_samples=rng.integers(SAMPLE_RATE // 4, 3 * SAMPLE_RATE, n).tolist(),
        n_text_tokens=rng.integers(1, 12, n).tolist(),
        prompt_lengths=[4] * n,
    )


@pytest.mark.fast
@given(
    n=st.integers(1, 120),
    data_seed=st.integers(0, 10_000),
    seed=st.integers(0, 10_000),
    epoch=st.integers(0, 50),
    single=st.floats(0, 1),
    gap=st.tuples(st.floats(0, 0.5), st.floats(0, 0.5)).map(sorted),
    max_positions=st.integers(24, 80),
)
def test_windows_fit_never_mix_languages_and_hold_every_utterance_once(
    n, data_seed, seed, epoch, single, gap, max_positions
):
    items = _items(n, data_seed)
    cfg = PackConfig(enabled=True, single_share=single, gap_seconds=tuple(gap), timestamp_share=0.5)
    max_samples = int(WINDOW * SAMPLE_RATE)
    windows, stats = compose_windows(
        items,
        cfg,
        max_samples=max_samples,
        max_positions=max_positions,
        seed=seed,
        epoch=epoch,
        timestamps=True,
    )
    placed = sorted(p.utt for w in windows for p in w.pieces)
    assert placed == list(range(n))
    lo, hi = (round(g * SAMPLE_RATE) for g in gap)
    for w in windows:
        assert w.n_samples <= max_samples
        assert len({items.languages[p.utt] for p in w.pieces}) == 1
        tokens = [items.n_text_tokens[p.utt] for p in w.pieces]
        assert positions(4, tokens, w.timestamps) <= max_positions
        for a, b in zip(w.pieces, w.pieces[1:], strict=False):  # in order, a gap between
            assert lo <= b.offset - (a.offset + a.n_samples) <= hi
        if w.prev:
            assert {items.languages[u] for u in w.prev} == {items.languages[w.pieces[0].utt]}
    assert stats.windows == len(windows) and stats.utterances == n
    assert stats.timestamp_windows == sum(w.timestamps for w in windows)


@pytest.mark.fast
def test_composition_is_a_pure_function_of_seed_and_epoch():
    items = _items(200, 0)
    cfg = PackConfig(enabled=True)
    kw = dict(max_samples=int(WINDOW * SAMPLE_RATE), max_positions=64, timestamps=True)
    first, _ = compose_windows(items, cfg, seed=3, epoch=1, **kw)
    again, _ = compose_windows(items, cfg, seed=3, epoch=1, **kw)
    assert first == again
    assert compose_windows(items, cfg, seed=3, epoch=2, **kw)[0] != first
    assert compose_windows(items, cfg, seed=4, epoch=1, **kw)[0] != first
    # the shares are honoured roughly
    assert 0.3 < sum(w.timestamps for w in first) / len(first) < 0.7
    assert 0.1 < sum(w.prev != () for w in first) / len(first) < 0.3


@pytest.mark.fast
def test_short_clips_fill_whisper_windows():
    # 1-5 s clips (the demo's average 3 s) in 30 s windows: about 8 fit with their gaps
    rng = np.random.default_rng(0)
    n = 300
    items = PackItems(
        ["en"] * n, rng.integers(SAMPLE_RATE, 5 * SAMPLE_RATE, n).tolist(), [12] * n, [2] * n
    )
    cfg = PackConfig(enabled=True, single_share=0.1, gap_seconds=(0.1, 0.6))
    windows, stats = compose_windows(
        items,
        cfg,
        max_samples=30 * SAMPLE_RATE,
        max_positions=448,
        seed=0,
        epoch=0,
        timestamps=True,
    )
    packed = [w for w in windows if len(w.pieces) > 1]
    assert sum(len(w.pieces) for w in packed) / len(packed) > 7
    assert sum(w.n_samples for w in packed) / (len(packed) * 30 * SAMPLE_RATE) > 0.9
    singles = [w for w in windows if len(w.pieces) == 1]
    assert all(w.alone for w in singles)
    assert 0.05 < len(singles) / len(windows) < 0.15  # the single share, of windows


@pytest.mark.fast
def test_a_window_too_long_for_timestamps_trains_in_text_mode_and_says_so():
    # one utterance of 60 text tokens: 4 + 60 + 1 fits 65 positions, with timestamps 66 do not
    items = PackItems(
        languages=["en"], n_samples=[SAMPLE_RATE], n_text_tokens=[60], prompt_lengths=[4]
    )
    cfg = PackConfig(enabled=True, single_share=1.0, timestamp_share=1.0)
    windows, stats = compose_windows(
        items,
        cfg,
        max_samples=int(WINDOW * SAMPLE_RATE),
        max_positions=65,
        seed=0,
        epoch=0,
        timestamps=True,
    )
    assert windows == [Window(windows[0].pieces, timestamps=False)]
    assert stats.timestamp_fallbacks == 1 and "text mode" in stats.line()


@pytest.fixture(scope="module")
def tones_parts(tones_dir):
    dd = load_arrow(tones_dir)
    split = dd["train"]
    tok = train_bpe_tokenizer(split["text"], 300, timestamp_seconds=WINDOW)
    fe = WhisperFeatureExtractor(
        feature_size=80,
        sampling_rate=SAMPLE_RATE,
        hop_length=160,
        chunk_length=int(WINDOW),
        n_fft=400,
    )
    return split, tok, fe


def _packed(tones_parts, *, multilingual: bool, cfg: PackConfig, max_positions: int = 64):
    split, tok, fe = tones_parts
    specials = SpecialTokens.from_tokenizer(tok, multilingual)
    from asrforge.config import DataConfig

    utts, _ = prepare_split(
        split,
        "train",
        # an English-only model trains on the English rows only (the others are refused)
        cfg=DataConfig(path="unused", languages=None if multilingual else ["en"]),
        tokenizer=tok,
        specials=specials,
        max_target_positions=max_positions,
        max_seconds=WINDOW,
    )
    base = SpeechDataset(split, utts, fe, specials.eot)
    packing = build_packing(
        cfg,
        base,
        tokenizer=tok,
        no_timestamps=specials.no_timestamps,
        seed=0,
        window_seconds=WINDOW,
        max_positions=max_positions,
    )
    return packing, specials


@pytest.mark.fast
@pytest.mark.parametrize("multilingual", [True, False], ids=["multilingual", "english-only"])
def test_timestamp_targets_match_the_offsets_and_decode_back(tones_parts, multilingual):
    split, tok, _ = tones_parts
    cfg = PackConfig(enabled=True, single_share=0.0, timestamp_share=1.0, prev_text_share=0.0)
    packing, specials = _packed(tones_parts, multilingual=multilingual, cfg=cfg)
    ds = packing.dataset(0)
    stamps = TimestampTokens.from_tokenizer(tok, specials.no_timestamps)
    assert stamps == packing.timestamps and stamps.max_seconds == WINDOW
    assert any(len(w.pieces) >= 3 for w in ds.windows)
    for j, w in enumerate(ds.windows):
        item = ds[j]
        dec, labels = item["decoder_input_ids"].tolist(), item["labels"].tolist()
        lang = packing.base.utts[w.pieces[0].utt].language
        prompt = [specials.sot, specials.languages[lang], specials.tasks["transcribe"]]
        prompt = prompt if multilingual else [specials.sot]  # no <|notimestamps|> either way
        assert dec[: len(prompt)] == prompt and specials.no_timestamps not in dec
        # the prompt is never a target: its positions but the last are ignored
        assert labels[: len(prompt) - 1] == [IGNORE] * (len(prompt) - 1)
        targets = [t for t in labels if t != IGNORE]
        assert targets[-1] == specials.eot and dec[len(prompt) :] == targets[:-1]
        # transformers' Whisper tokenizer reads the segments back: text and times
        got = tok.decode(targets, output_offsets=True)["offsets"]
        assert len(got) == len(w.pieces)
        for seg, p in zip(got, w.pieces, strict=True):
            u = packing.base.utts[p.utt]
            assert seg["text"].strip() == u.text
            start, end = p.offset / SAMPLE_RATE, (p.offset + p.n_samples) / SAMPLE_RATE
            assert abs(seg["timestamp"][0] - start) <= TIME_PRECISION / 2 + 1e-9
            assert abs(seg["timestamp"][1] - end) <= TIME_PRECISION / 2 + 1e-9
        assert item["text"] == " ".join(packing.base.utts[p.utt].text for p in w.pieces)
        # the audio is where the timestamps say: each clip's samples at its offset
        if j < 3:
            wave, failed = ds._waveform(w)  # noqa: SLF001
            assert not failed and len(wave) == w.n_samples <= WINDOW * SAMPLE_RATE
            for p in w.pieces:
                row = split[packing.base.utts[p.utt].row]["audio"]
                clip = decode_audio(row["bytes"])
                assert len(clip) == p.n_samples
                np.testing.assert_array_equal(wave[p.offset : p.offset + p.n_samples], clip)
            assert item["input_features"].shape == (80, int(WINDOW * 100))


@pytest.mark.fast
def test_text_mode_and_previous_text_are_context_not_targets(tones_parts):
    cfg = PackConfig(enabled=True, single_share=0.0, timestamp_share=0.0, prev_text_share=1.0)
    packing, specials = _packed(tones_parts, multilingual=True, cfg=cfg, max_positions=48)
    ds = packing.dataset(0)
    prev_id = ds.start_of_prev
    with_prev = [j for j, w in enumerate(ds.windows) if w.prev]
    assert len(with_prev) >= len(ds.windows) - 2  # all but each language's first window
    for j in with_prev:
        w = ds.windows[j]
        dec, labels = ds.sequences(w)
        assert len(dec) == len(labels) and len(dec) + 1 <= 48
        assert dec[0] == prev_id
        sot = dec.index(specials.sot)
        prev_text = [t for u in w.prev for t in packing.base.utts[u].text_ids]
        assert dec[1:sot] == prev_text[-(sot - 1) :] and sot - 1 <= 48 // 2 - 1
        lang = packing.base.utts[w.pieces[0].utt].language
        assert dec[sot : sot + 4] == specials.prompt(lang)  # text mode: <|notimestamps|>
        assert labels[: sot + 3] == [IGNORE] * (sot + 3)  # previous text and prompt ignored
        joined = [t for p in w.pieces for t in packing.base.utts[p.utt].text_ids]
        assert labels[sot + 3 :] == joined + [specials.eot]


@pytest.mark.fast
def test_a_clip_that_fails_to_decode_is_reported_and_the_window_trains(tones_parts, monkeypatch):
    cfg = PackConfig(enabled=True, single_share=0.0, timestamp_share=1.0, prev_text_share=0.0)
    packing, specials = _packed(tones_parts, multilingual=True, cfg=cfg)
    ds = packing.dataset(0)
    j = next(j for j, w in enumerate(ds.windows) if len(w.pieces) >= 2)
    w = ds.windows[j]
    bad = packing.base.utts[w.pieces[0].utt]
    real = AudioFile.decode

    def failing(self, *args, **kwargs):
        if self.source == packing.base.split[bad.row]["audio"]["bytes"]:
            raise UserError("cannot read audio <bytes>: broken")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AudioFile, "decode", failing)
    batch = Collator(pad_id=specials.eot)([ds[j]])
    assert batch["dropped"] == [bad.uid] and batch["size"] == 1
    kept = [packing.base.utts[p.utt] for p in w.pieces[1:]]
    assert batch["text"] == [" ".join(u.text for u in kept)]
    targets = [t for t in batch["labels"][0].tolist() if t != IGNORE]
    segments = tones_parts[1].decode(targets, output_offsets=True)["offsets"]
    # the kept utterances keep their places (the failed clip's span is silence)
    assert [s["text"].strip() for s in segments] == [u.text for u in kept]
    assert abs(segments[0]["timestamp"][0] - w.pieces[1].offset / SAMPLE_RATE) <= TIME_PRECISION


@pytest.mark.fast
def test_a_tokenizer_without_timestamps_turns_timestamp_mode_off_and_says_so(tones_parts, caplog):
    split, _, fe = tones_parts
    plain = train_bpe_tokenizer(split["text"], 300)  # as before: no timestamp tokens
    specials = SpecialTokens.from_tokenizer(plain, True)
    assert TimestampTokens.from_tokenizer(plain, specials.no_timestamps) is None
    base = SpeechDataset(split, [], fe, specials.eot)
    with caplog.at_level(logging.WARNING, logger="asrforge"):
        packing = build_packing(
            PackConfig(enabled=True, timestamp_share=0.5),
            base,
            tokenizer=plain,
            no_timestamps=specials.no_timestamps,
            seed=0,
            window_seconds=WINDOW,
            max_positions=64,
        )
    assert packing.timestamps is None and packing.cfg.timestamp_share == 0
    assert "timestamp mode is off" in caplog.text
    with pytest.raises(UserError, match="data.pack.max_seconds: 5 s exceeds the model's 4 s"):
        build_packing(
            PackConfig(enabled=True, max_seconds=5),
            base,
            tokenizer=plain,
            no_timestamps=specials.no_timestamps,
            seed=0,
            window_seconds=WINDOW,
            max_positions=64,
        )


@pytest.mark.fast
def test_pack_config_names_a_bad_gap_range(tmp_path, tones_dir):
    with pytest.raises(ConfigError, match=r"data.pack.gap_seconds: must be \[min, max\]"):
        tiny_config(tmp_path, tones_dir, data={"pack": {"gap_seconds": [0.5, 0.1]}})


PACKED = dict(
    model={"max_source_positions": 200, "max_target_positions": 64, "dropout": 0.1},
    data={"batch_size": 4, "pack": {"enabled": True, "gap_seconds": [0.05, 0.3]}},
)


def test_resume_with_packing_is_bit_identical(tmp_path, tones_dir):
    # grad accumulation across an epoch boundary, dropout on, evaluation in between
    sections = dict(
        **PACKED,
        train={"max_steps": 4, "grad_accum": 2},
        eval={"eval_steps": 2},
        checkpoint={"save_total_limit": 5},
    )
    assert_resume_is_bit_identical(tmp_path, tones_dir, sections)
    state = json.loads(
        (tmp_path / "split" / "checkpoints" / "latest" / "train_state.json").read_text()
    )
    assert state["epoch"] >= 1  # the resumed run crossed into a newly composed epoch
    log = (tmp_path / "split" / "train.log").read_text()
    assert "packing, epoch 0:" in log and "timestamp mode" in log
    tok = json.loads((tmp_path / "split" / "tokenizer" / "tokenizer.json").read_text())
    assert any(t["content"] == "<|4.00|>" for t in tok["added_tokens"])  # trained here: 4 s window


def test_packing_trains_and_says_where_a_cache_cannot_serve(tmp_path, tones_dir, caplog):
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        **{**PACKED, "data": {**PACKED["data"], "cache_features": True}},
        train={"max_steps": 8},
        eval={"eval_steps": None, "at_end": False},
    )
    losses = {}

    class Losses(Callback):
        name = "losses"

        def on_step_end(self, state, *, metrics):
            losses[state.step] = metrics["loss"]

    with caplog.at_level(logging.INFO, logger="asrforge"):
        result = Trainer(cfg, [Losses()]).fit()
    assert result.status == "completed"
    assert losses[7] + losses[8] < losses[1] + losses[2]
    assert "packed windows are computed from audio" in caplog.text


def test_max_epochs_with_packing_ends_at_the_last_batch_of_windows(tmp_path, tones_dir):
    # the run's end is known at the epoch's last batch of *windows*: that step is saved once,
    # by the end-of-run evaluation, not also as a plain step checkpoint before it (the epoch
    # was counted in utterances, ~3x the batches here, so the end was never seen coming)
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        **PACKED,
        train={"max_steps": 1000, "max_epochs": 1},
        eval={"eval_steps": None, "at_end": True},
        checkpoint={"checkpoint_every": 1, "save_total_limit": 2},
    )
    saves = []

    class Saves(Callback):
        name = "saves"

        def on_save(self, state, *, path, kind):
            saves.append((state.step, kind))

    result = Trainer(cfg, [Saves()]).fit()
    assert result.status == "completed", result.reason
    last = [kind for step, kind in saves if step == result.step]
    assert len(last) == 1 and last[0] != "step", saves
    assert result.step < 48 // 4  # fewer batches than the utterances would make


@pytest.mark.fast
def test_an_utterance_longer_than_max_seconds_stays_alone_in_its_mode():
    # 3 s clips, windows of 2 s (shorter than the model's): each clip alone, timestamps kept
    items = PackItems(["en"] * 3, [3 * SAMPLE_RATE] * 3, [5] * 3, [4] * 3)
    cfg = PackConfig(enabled=True, single_share=0.0, timestamp_share=1.0)
    windows, stats = compose_windows(
        items, cfg, max_samples=2 * SAMPLE_RATE, max_positions=64, seed=0, epoch=0, timestamps=True
    )
    assert [len(w.pieces) for w in windows] == [1, 1, 1]
    assert all(w.timestamps for w in windows) and stats.timestamp_fallbacks == 0


@pytest.mark.fast
def test_tokens_appended_after_the_timestamps_are_not_timestamps(tones_parts):
    # an extended vocabulary (asrforge vocab build) appends its tokens after the base's last id,
    # i.e. after <|30.00|> for Whisper; the timestamp range must stop before them
    split, tok, _ = tones_parts
    extended = train_bpe_tokenizer(split["text"], 300, timestamp_seconds=WINDOW)
    extended.add_tokens(["ქართ", "ული"])
    specials = SpecialTokens.from_tokenizer(extended, True)
    stamps = TimestampTokens.from_tokenizer(extended, specials.no_timestamps)
    assert stamps.count == round(WINDOW / TIME_PRECISION) + 1
    new = extended.convert_tokens_to_ids("ქართ")
    assert new == stamps.begin + stamps.count and new not in stamps
    assert stamps.id_of(WINDOW) == new - 1
    with pytest.raises(ValueError, match="outside the timestamp tokens"):
        stamps.id_of(WINDOW + TIME_PRECISION)


@pytest.mark.fast
def test_the_encoder_cache_is_off_with_packing_and_the_log_says_why(tmp_path, tones_dir, caplog):
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        model={**PACKED["model"], "freeze_encoder": True},
        data={**PACKED["data"], "cache_encoder": True},
        train={"max_steps": 1},
        eval={"eval_steps": None, "at_end": False},
    )
    with caplog.at_level(logging.INFO, logger="asrforge"):
        result = Trainer(cfg, []).fit()
    assert result.status == "completed"
    assert "data.cache_encoder: off for training with data.pack.enabled" in caplog.text
    assert not (tmp_path / "run" / "cache" / "encoder").exists()
