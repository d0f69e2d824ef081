"""Training-time augmentation (data.augment): draws that are a pure function of (seed, utterance,
epoch), speed perturbation whose lengths packing can plan with, noise at the drawn SNR,
SpecAugment inside the audio only, user transforms behind the import flag, never in evaluation,
and exact resume with all of it on."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file

from asrforge.config import AugmentConfig, ConfigError, PackConfig
from asrforge.data import augment
from asrforge.data.audio import SAMPLE_RATE, decode_audio
from asrforge.data.augment import Augmenter, AugmentError, build_augmenter, mix_at_snr, spec_augment
from asrforge.data.targets import TIME_PRECISION
from asrforge.errors import UserError
from tests.conftest import tiny_config
from tests.test_packing import _packed, tones_parts  # noqa: F401 - tones_parts: a fixture
from tests.test_resume import assert_resume_is_bit_identical, run

WINDOW = 30.0


@pytest.fixture(scope="module")
def noise_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("noise")
    rng = np.random.default_rng(0)
    sf.write(d / "hum.wav", (0.1 * np.sin(np.arange(8000) / 7.0)).astype(np.float32), SAMPLE_RATE)
    (d / "sub").mkdir()
    sf.write(d / "sub" / "white.flac", rng.normal(0, 0.2, 12000).astype(np.float32), SAMPLE_RATE)
    (d / "README.txt").write_text("not audio")
    return d


def _augmenter(noise_dir, **extra) -> Augmenter:
    cfg = AugmentConfig.model_validate(
        {"speed": {}, "noise": {"path": str(noise_dir), "share": 1.0}, "spec_augment": {}, **extra}
    )
    return build_augmenter(cfg, seed=3, window_seconds=WINDOW)


def _speech(seconds: float = 1.5, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.normal(size=t.size)).astype(np.float32)


@pytest.mark.fast
def test_draws_are_a_pure_function_of_seed_utterance_and_epoch(noise_dir):
    aug, wave = _augmenter(noise_dir), _speech()
    again = _augmenter(noise_dir)  # a resumed run or another process builds its own
    assert np.array_equal(aug.wave(wave, "u1", 4), again.wave(wave, "u1", 4))
    feats = np.random.default_rng(1).normal(size=(80, 3000)).astype(np.float32)
    assert np.array_equal(aug.features(feats, "u1", 4, 1.5), again.features(feats, "u1", 4, 1.5))
    # other epochs and other utterances are augmented differently
    per_epoch = [aug.wave(wave, "u1", e) for e in range(6)]
    assert any(not np.array_equal(per_epoch[0], w) for w in per_epoch[1:])
    per_uid = [aug.wave(wave, f"u{i}", 4) for i in range(6)]
    assert any(not np.array_equal(per_uid[0], w) for w in per_uid[1:])
    other_seed = build_augmenter(aug.cfg, seed=4, window_seconds=WINDOW)
    assert any(not np.array_equal(aug.wave(wave, f"u{i}", 0), other_seed.wave(wave, f"u{i}", 0))
               for i in range(6))


@pytest.mark.fast
def test_speed_changes_the_length_as_planned_and_never_past_the_window():
    aug = build_augmenter(AugmentConfig(speed={"factors": [0.8, 1.25]}), seed=0, window_seconds=WINDOW)
    wave = _speech(2.0)
    factors = {aug.speed(f"u{i}", 0, 2.0) for i in range(20)}
    assert factors == {0.8, 1.25}
    for i in range(20):
        out = aug.wave(wave, f"u{i}", 0)
        # packing lays windows out with n_samples(): it must be the length wave() makes
        assert len(out) == aug.n_samples(f"u{i}", 0, len(wave))
        assert len(out) == pytest.approx(len(wave) / aug.speed(f"u{i}", 0, 2.0), abs=2)
    # a 29 s clip slowed by 0.8 would be 36 s: the factor rises just enough to fit 30 s
    slow = build_augmenter(AugmentConfig(speed={"factors": [0.8]}), seed=0, window_seconds=WINDOW)
    assert slow.speed("u", 0, 1.0) == 0.8 and slow.speed("u", 0, 29.0) == pytest.approx(29.0 / WINDOW)
    assert all(aug.n_samples(f"u{i}", 0, 29 * SAMPLE_RATE) <= WINDOW * SAMPLE_RATE for i in range(20))


@pytest.mark.fast
def test_speed_raised_to_fit_never_passes_the_window_and_resamples_cheaply():
    # a clip slowed down past the window gets the factor that just fits; the old rate
    # round(16000 * factor) could land a few samples past the window (441994 -> 480005) and
    # share no divisor with 16 kHz (a 16000-filter resampling bank, ~2 GB)
    aug = build_augmenter(AugmentConfig(speed={"factors": [0.9]}), seed=0, window_seconds=WINDOW)
    window = round(WINDOW * SAMPLE_RATE)
    for n in range(440_000, window + 1, 997):
        assert aug.n_samples("u", 0, n) <= window, n
        rate = aug._source_rate(aug.speed("u", 0, n / SAMPLE_RATE), n)
        assert SAMPLE_RATE // math.gcd(rate, SAMPLE_RATE) <= 160, (n, rate)
    wave = _speech(441_994 / SAMPLE_RATE)
    out = aug.wave(wave, "u", 0)
    assert len(out) == aug.n_samples("u", 0, len(wave)) <= window
    assert len(out) > 0.99 * window  # it still fills the window: the factor rose only to fit


@pytest.mark.fast
def test_noise_is_mixed_at_the_drawn_snr(noise_dir):
    wave = _speech()
    noise = np.random.default_rng(2).normal(0, 1.0, wave.size).astype(np.float32)
    mixed = mix_at_snr(wave, noise, 12.0)
    added = mixed.astype(np.float64) - wave
    snr = 10 * np.log10(np.mean(wave.astype(np.float64) ** 2) / np.mean(added**2))
    assert snr == pytest.approx(12.0, abs=0.01)
    assert np.array_equal(mix_at_snr(np.zeros(100, np.float32), noise[:100], 5.0), np.zeros(100))
    # through the augmenter: every clip (share 1.0) gets noise from the directory's two files
    cfg = AugmentConfig.model_validate({"noise": {"path": str(noise_dir), "snr_db": [5, 5], "share": 1}})
    aug = build_augmenter(cfg, seed=0, window_seconds=WINDOW)
    assert [p.name for p in aug.noise_files] == ["hum.wav", "white.flac"]
    out = aug.wave(wave, "u1", 0)
    snr = 10 * np.log10(np.mean(wave.astype(np.float64) ** 2) / np.mean((out - wave) ** 2.0))
    assert out.shape == wave.shape and snr == pytest.approx(5.0, abs=0.01)


@pytest.mark.fast
def test_spec_augment_masks_stay_within_the_audio_and_their_widths():
    feats = np.ones((80, 3000), dtype=np.float32)
    for seed in range(30):
        out = spec_augment(feats, np.random.default_rng(seed), freq_masks=2, freq_width=27,
                           time_masks=2, time_width=100, speech_frames=400)
        assert (out[:, 400:] == 1).all()  # the window's padding is never masked
        masked_bins = (out[:, :400] == 0).all(axis=1).sum()
        masked_frames = (out[:80] == 0).all(axis=0).sum()
        assert masked_bins <= 2 * 27 and masked_frames <= 2 * 100
    assert (feats == 1).all()  # the input is not changed in place
    # the augmenter caps a time mask at max_time_share of the audio: 1 s -> 20 frames
    aug = build_augmenter(AugmentConfig(spec_augment={"freq_masks": 0, "time_masks": 1}), seed=0,
                          window_seconds=WINDOW)
    widths = [(aug.features(feats, f"u{i}", 0, 1.0)[0] == 0).sum() for i in range(40)]
    assert max(widths) <= 20 and max(widths) > 0


def test_config_says_what_a_cache_cannot_serve(tmp_path, tones_dir):
    with pytest.raises(ConfigError, match="cache_features: .* augment.speed"):
        tiny_config(tmp_path, tones_dir, data={"cache_features": True, "augment": {"speed": {}}})
    with pytest.raises(ConfigError, match="cache_encoder: .* augment.spec_augment"):
        tiny_config(tmp_path, tones_dir, model={"freeze_encoder": True},
                    data={"cache_encoder": True, "augment": {"spec_augment": {}}})
    with pytest.raises(ConfigError, match="factors: each must be between 0.5 and 2, got 3"):
        tiny_config(tmp_path, tones_dir, data={"augment": {"speed": {"factors": [1.0, 3.0]}}})
    with pytest.raises(ConfigError, match=r"snr_db: must be \[min, max\]"):
        tiny_config(tmp_path, tones_dir, data={"augment": {"noise": {"path": "x", "snr_db": [30, 5]}}})
    # augmentation and packing draw from numpy seed sequences, which refuse a negative seed:
    # inside a worker that error read as a decoding failure and dropped every training clip
    with pytest.raises(ConfigError, match="seed: must be >= 0, got -1"):
        tiny_config(tmp_path, tones_dir, seed=-1, data={"augment": {"speed": {}}})
    # SpecAugment can read the log-mel cache: allowed
    tiny_config(tmp_path, tones_dir, data={"cache_features": True, "augment": {"spec_augment": {}}})


@pytest.mark.fast
def test_a_noise_directory_without_audio_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty holds no audio file"):
        build_augmenter(AugmentConfig(noise={"path": tmp_path / "empty"}), seed=0, window_seconds=WINDOW)
    with pytest.raises(UserError, match="missing is not a directory"):
        build_augmenter(AugmentConfig(noise={"path": tmp_path / "missing"}), seed=0, window_seconds=WINDOW)


def invert(wave: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A user transform for the tests (named as tests.test_augment:invert)."""
    return -wave


@pytest.mark.fast
def test_user_transforms_need_registration_or_the_import_flag(tmp_path, tones_dir, monkeypatch):
    from asrforge.cli import main

    monkeypatch.setattr(augment, "_REGISTRY", {})
    cfg = AugmentConfig(transforms=["flip"])
    with pytest.raises(UserError, match=r"transforms\[0\]: 'flip' is not a known transform; register"):
        build_augmenter(cfg, seed=0, window_seconds=WINDOW)
    augment.register_transform("flip", invert)
    wave = _speech()
    assert np.array_equal(build_augmenter(cfg, seed=0, window_seconds=WINDOW).wave(wave, "u", 0), -wave)

    path = tmp_path / "c.yaml"
    cfg = tiny_config(tmp_path / "run", tones_dir,
                      data={"augment": {"transforms": ["tests.test_augment:invert"]}})
    path.write_text(cfg.to_yaml())
    assert main(["train", str(path)]) == 2  # importing code named in a config needs the flag
    assert not (tmp_path / "run" / "checkpoints").exists()
    augment.import_transforms(["tests.test_augment:invert"], allowed=True)
    imported = augment._REGISTRY["tests.test_augment:invert"]
    assert imported.__qualname__ == "invert" and np.array_equal(imported(wave, None), -wave)
    with pytest.raises(UserError, match="cannot import 'tests.nothing:x'"):
        augment.import_transforms(["tests.nothing:x"], allowed=True)


def test_packed_windows_hold_the_sped_up_clips_where_their_timestamps_say(tones_parts):  # noqa: F811
    split, tok, _ = tones_parts
    cfg = PackConfig(enabled=True, single_share=0.0, timestamp_share=1.0, prev_text_share=0.0)
    packing, _ = _packed(tones_parts, multilingual=True, cfg=cfg)
    base = packing.base
    base.augment = build_augmenter(
        AugmentConfig(speed={"factors": [0.7, 1.3]}), seed=0, window_seconds=4.0
    )
    ds = packing.dataset(1)
    assert all(w.n_samples <= packing.max_samples for w in ds.windows)
    sped = 0
    for j, w in enumerate(ds.windows[:4]):
        wave, failed = ds._waveform(w)  # noqa: SLF001
        assert not failed and len(wave) == w.n_samples
        for p in w.pieces:
            u = base.utts[p.utt]
            clip = base.augment.wave(decode_audio(split[u.row]["audio"]["bytes"]), u.uid, 1)
            sped += len(clip) != round(u.seconds * SAMPLE_RATE)
            assert len(clip) == p.n_samples  # laid out with the length the workers make
            np.testing.assert_array_equal(wave[p.offset : p.offset + p.n_samples], clip)
        targets = [t for t in ds[j]["labels"].tolist() if t >= 0]
        got = tok.decode(targets, output_offsets=True)["offsets"]
        for seg, p in zip(got, w.pieces, strict=True):
            end = (p.offset + p.n_samples) / SAMPLE_RATE
            assert abs(seg["timestamp"][1] - end) <= TIME_PRECISION / 2 + 1e-9
    assert sped > 0  # the clips were sped up or slowed down


def _raises(wave: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    raise RuntimeError("boom")


def _nan(wave: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.full_like(wave, np.nan)


def _stretch(wave: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.repeat(wave, 2)


@pytest.mark.fast
def test_an_augmentation_failure_stops_instead_of_dropping_clips_as_undecodable(
    tones_parts, tmp_path, monkeypatch  # noqa: F811 - the fixture imported above
):
    # a broken transform or noise file is no clip's fault: caught with the decoding failures,
    # it dropped every clip it touched as "failed to decode" (or mixed NaN into them)
    monkeypatch.setattr(augment, "_REGISTRY", {"boom": _raises, "nan": _nan, "slow": _stretch})
    cfg = PackConfig(enabled=True, single_share=0.5, timestamp_share=0.0, prev_text_share=0.0)
    packing, _ = _packed(tones_parts, multilingual=True, cfg=cfg)
    base = packing.base
    base.augment = build_augmenter(AugmentConfig(transforms=["boom"]), seed=0, window_seconds=4.0)
    with pytest.raises(AugmentError, match=r"transforms\[0\] \('boom'\) on utterance train-\d+ failed: "
                       "RuntimeError: boom"):
        base[0]
    windows = packing.dataset(0)
    packed = next(j for j, w in enumerate(windows.windows) if len(w.pieces) > 1)
    alone = next(j for j, w in enumerate(windows.windows) if w.alone)
    for j in (packed, alone):
        with pytest.raises(AugmentError, match="'boom'"):
            windows[j]
    base.augment = build_augmenter(AugmentConfig(transforms=["nan"]), seed=0, window_seconds=4.0)
    with pytest.raises(AugmentError, match="'nan'.*must return 1-D finite audio"):
        base[0]
    # a packed window placed the clip (and its end timestamp) by its length: it must keep it
    base.augment = build_augmenter(AugmentConfig(transforms=["slow"]), seed=0, window_seconds=4.0)
    with pytest.raises(AugmentError, match=r"'slow'.*returned \d+ samples for \d+; a transform keeps"):
        windows[packed]
    (tmp_path / "noise").mkdir()
    (tmp_path / "noise" / "bad.wav").write_bytes(b"RIFF not really")
    noisy = AugmentConfig(noise={"path": tmp_path / "noise", "share": 1.0})
    base.augment = build_augmenter(noisy, seed=0, window_seconds=4.0)
    with pytest.raises(AugmentError, match=r"data.augment.noise.path: cannot read audio .*bad.wav"):
        base[0]
    base.augment = None
    assert "input_features" in base[0]  # the clip itself was fine all along


SECTIONS = dict(
    data={"pack": {"enabled": True, "max_seconds": 2.0},
          "augment": {"speed": {}, "spec_augment": {"time_width": 20}}},
    model={"dropout": 0.1},
    train={"max_steps": 4, "grad_accum": 2},
    eval={"eval_steps": 2},
    checkpoint={"save_total_limit": 5},
)


def test_training_augments_never_evaluation(tmp_path, tones_dir, noise_dir, monkeypatch):
    seen: dict[str, set] = {"wave": set(), "features": set()}
    wave, features = Augmenter.wave, Augmenter.features

    def record_wave(self, w, uid, epoch):
        seen["wave"].add(uid)
        return wave(self, w, uid, epoch)

    def record_features(self, f, uid, epoch, seconds):
        seen["features"].add(uid)
        return features(self, f, uid, epoch, seconds)

    monkeypatch.setattr(Augmenter, "wave", record_wave)
    monkeypatch.setattr(Augmenter, "features", record_features)
    sections = {**SECTIONS, "train": {"max_steps": 2}, "model": {},
                "data": {"augment": {"speed": {}, "spec_augment": {}, "noise": {"path": str(noise_dir)}}}}
    _, result = run(tiny_config(tmp_path / "r", tones_dir, **sections), [])
    assert result.status == "completed", result.reason
    # the tones ids name their split: evaluation (validation-NNNNN) was never augmented
    assert seen["wave"] and seen["features"]
    assert all(uid.startswith("train-") for uid in seen["wave"] | seen["features"])
    log = (tmp_path / "r" / "train.log").read_text()
    assert "augmentation (training only): speed 0.9/1/1.1; noise from 2 file(s)" in log
    # it evaluated (else "evaluation was never augmented" would hold vacuously)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "eval" and "wer" in r for r in records)


def test_resume_with_augmentation_and_packing_is_bit_identical(tmp_path, tones_dir):
    assert_resume_is_bit_identical(tmp_path, tones_dir, SECTIONS)
    # and augmentation changed training: the same run without it trains otherwise
    full = load_file(tmp_path / "full" / "checkpoints" / "latest" / "model.safetensors")
    plain = {**SECTIONS, "data": {"pack": SECTIONS["data"]["pack"]}}
    run(tiny_config(tmp_path / "plain", tones_dir, **plain), [])
    without = load_file(tmp_path / "plain" / "checkpoints" / "latest" / "model.safetensors")
    assert any(not torch.equal(full[k], without[k]) for k in full)
