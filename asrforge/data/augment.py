"""Training-time augmentation (``data.augment``): speed perturbation, noise, SpecAugment and a
user's own waveform transforms, applied in the DataLoader workers.

How it works: docs/data.md, "Augmentation (`data/augment.py`)".
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from asrforge.config import ALLOW_EXTERNAL_HINT, AugmentConfig
from asrforge.data.audio import SAMPLE_RATE, decode_audio, resample
from asrforge.errors import UserError

log = logging.getLogger(__name__)

WaveTransform = Callable[[np.ndarray, np.random.Generator], np.ndarray]

# "AUG0" in ASCII keeps these draws apart from every other (seed, epoch) stream.
_SALT = 0x41554730
_SPEED, _NOISE, _USER, _SPEC = range(4)  # one independent stream per kind of draw
NOISE_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")
# Whisper's log-mel hop is 160 samples at 16 kHz.
FRAMES_PER_SECOND = 100
# Speed perturbation resamples from a multiple of this many Hz (see _source_rate).
RATE_STEP = 100

_REGISTRY: dict[str, WaveTransform] = {}


class AugmentError(UserError):
    """``data.augment`` itself failed (a noise file, a user transform). The datasets let it
    stop the run: caught as a decoding failure, it would drop every clip it touched and blame
    the clips' audio."""


def register_transform(name: str, transform: WaveTransform) -> None:
    """Make ``transform`` available to ``data.augment.transforms`` under ``name``."""
    _REGISTRY[name] = transform


def import_transforms(names: Sequence[str], *, allowed: bool) -> None:
    """Import each ``"module:function"`` of ``names`` into the registry (under that name).

    Raises:
        UserError: an import was not ``allowed`` (the caller's
            :func:`asrforge.config.external_code_allowed`), or it failed.
    """
    for i, name in enumerate(names):
        if ":" not in name or name in _REGISTRY:
            continue
        where = f"data.augment.transforms[{i}]"
        if not allowed:
            raise UserError(
                f"{where}: '{name}' imports code named in the config; {ALLOW_EXTERNAL_HINT}"
            )
        module, _, attr = name.partition(":")
        try:
            transform = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise UserError(f"{where}: cannot import '{name}': {e}") from None
        if not callable(transform):
            raise UserError(f"{where}: '{name}' is not a function")
        register_transform(name, transform)


def draws(seed: int, uid: str, epoch: int, stream: int) -> np.random.Generator:
    """The random stream of one kind of draw for one utterance in one epoch."""
    digest = hashlib.blake2b(uid.encode("utf-8"), digest_size=8).digest()
    return np.random.default_rng([_SALT, stream, seed, epoch, int.from_bytes(digest, "little")])


def mix_at_snr(wave: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    """``wave`` plus ``noise`` (as long as ``wave``) scaled to ``snr_db`` dB below it."""
    speech = float(np.mean(wave.astype(np.float64) ** 2))
    power = float(np.mean(noise.astype(np.float64) ** 2))
    # Silence has no signal-to-noise ratio, and a silent noise file adds nothing.
    if speech == 0.0 or power == 0.0:
        return wave
    gain = np.sqrt(speech / (power * 10.0 ** (snr_db / 10.0)))
    return (wave + gain * noise).astype(np.float32)


@lru_cache(maxsize=32)
def _noise_samples(path: Path) -> np.ndarray:
    # each worker decodes a noise file once (a few files are used over and over)
    try:
        samples = decode_audio(path)
    except UserError as e:
        raise AugmentError(f"data.augment.noise.path: {e}") from None
    if not np.isfinite(samples).all():  # it would turn every clip it is mixed into NaN
        raise AugmentError(f"data.augment.noise.path: {path} has NaN/inf samples")
    return samples


def spec_augment(
    feats: np.ndarray,
    rng: np.random.Generator,
    *,
    freq_masks: int,
    freq_width: int,
    time_masks: int,
    time_width: int,
    speech_frames: int,
) -> np.ndarray:
    """Zero ``freq_masks`` bands of up to ``freq_width`` mel bins and ``time_masks`` spans of up
    to ``time_width`` frames, both within the first ``speech_frames`` frames: the window's
    padding stays what the model always sees there. Zero is where transformers'
    ``apply_spec_augment`` puts its masks too."""
    out = feats.copy()
    n_mels, n_frames = out.shape
    speech_frames = min(speech_frames, n_frames)
    for _ in range(freq_masks):
        width = int(rng.integers(0, min(freq_width, n_mels) + 1))
        start = int(rng.integers(0, n_mels - width + 1))
        out[start : start + width, :speech_frames] = 0.0
    for _ in range(time_masks):
        width = int(rng.integers(0, min(time_width, speech_frames) + 1))
        start = int(rng.integers(0, speech_frames - width + 1))
        out[:, start : start + width] = 0.0
    return out


@dataclass
class Augmenter:
    """A run's ``data.augment``, ready for the workers (it pickles: paths and functions)."""

    cfg: AugmentConfig
    seed: int
    window_seconds: float
    noise_files: tuple[Path, ...] = ()
    transforms: tuple[WaveTransform, ...] = field(default_factory=tuple)

    def speed(self, uid: str, epoch: int, seconds: float) -> float:
        """The utterance's speed factor this epoch (1.0 without speed perturbation). A factor
        that would stretch the clip past the model's window is raised to just fit it."""
        speed = self.cfg.speed
        if speed is None:
            return 1.0
        factor = float(draws(self.seed, uid, epoch, _SPEED).choice(speed.factors))
        return max(factor, seconds / self.window_seconds)

    def n_samples(self, uid: str, epoch: int, n: int) -> int:
        """Samples of an ``n``-sample clip after this epoch's speed perturbation."""
        factor = self.speed(uid, epoch, n / SAMPLE_RATE)
        if factor == 1.0:
            return n
        return -(-n * SAMPLE_RATE // self._source_rate(factor, n))

    def _source_rate(self, factor: float, n: int) -> int:
        # Playing 16 kHz audio as if it were factor x 16 kHz makes it factor x faster (and
        # higher, as Kaldi's speed perturbation does); resampling back gives the new length.
        # The rate is a multiple of RATE_STEP: resample() builds 16000 / gcd(rate, 16000)
        # filters, and a factor raised to fit the window (29.3 / 30 -> 15627 Hz, gcd 1) would
        # build 16000 of 15600 taps (~2 GB). Rounded up when it fits the window, so the
        # rounding never stretches the clip past it.
        rate = RATE_STEP * round(SAMPLE_RATE * factor / RATE_STEP)
        window = round(self.window_seconds * SAMPLE_RATE)
        fit = -(-n * SAMPLE_RATE // window)  # the lowest rate that fits n samples into it
        return max(rate, RATE_STEP * -(-fit // RATE_STEP))

    def wave(self, wave: np.ndarray, uid: str, epoch: int) -> np.ndarray:
        """The utterance's training audio this epoch: speed, then noise, then user transforms."""
        factor = self.speed(uid, epoch, len(wave) / SAMPLE_RATE)
        if factor != 1.0:
            wave = resample(wave, self._source_rate(factor, len(wave)), SAMPLE_RATE)
        noise = self.cfg.noise
        if noise is not None and self.noise_files:
            rng = draws(self.seed, uid, epoch, _NOISE)
            if rng.random() < noise.share:
                wave = mix_at_snr(
                    wave, self._noise(rng, len(wave)), float(rng.uniform(*noise.snr_db))
                )
        if self.transforms:
            rng = draws(self.seed, uid, epoch, _USER)
            for k, transform in enumerate(self.transforms):
                wave = self._transformed(k, transform, wave, rng, uid)
        return wave

    def _transformed(
        self, k: int, transform: WaveTransform, wave: np.ndarray, rng: np.random.Generator, uid: str
    ) -> np.ndarray:
        """``transform(wave, rng)``, checked: finite 1-D audio of the same length (packing
        placed the clip, and its timestamps, by the length speed perturbation gives it).

        Raises:
            AugmentError: the transform raised, or returned something else.
        """
        where = f"data.augment.transforms[{k}] ('{self.cfg.transforms[k]}') on utterance {uid}"
        try:
            out = np.asarray(transform(wave, rng), dtype=np.float32)
        except Exception as e:  # noqa: BLE001 - the user's code: any failure is theirs to see
            raise AugmentError(f"{where} failed: {type(e).__name__}: {e}") from e
        if out.ndim != 1 or not np.isfinite(out).all():
            raise AugmentError(f"{where}: must return 1-D finite audio, got shape {out.shape}")
        if len(out) != len(wave):
            raise AugmentError(
                f"{where}: returned {len(out)} samples for {len(wave)}; a transform keeps the "
                "length (packed windows and their timestamps are laid out by it; "
                "data.augment.speed changes it)"
            )
        return out

    def _noise(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` samples of a drawn noise file from a drawn offset (looped when it is short)."""
        samples = _noise_samples(self.noise_files[int(rng.integers(len(self.noise_files)))])
        if len(samples) == 0:
            return np.zeros(n, dtype=np.float32)
        start = int(rng.integers(len(samples)))
        reps = -(-(start + n) // len(samples))
        return np.tile(samples, reps)[start : start + n]

    def features(
        self, feats: np.ndarray, uid: str, epoch: int, speech_seconds: float
    ) -> np.ndarray:
        """SpecAugment of a training window's log-mels ``(n_mels, n_frames)`` (unchanged when it
        is off); ``speech_seconds``: how much of the window is audio rather than padding."""
        spec = self.cfg.spec_augment
        if spec is None:
            return feats
        frames = int(np.ceil(speech_seconds * FRAMES_PER_SECOND))
        return spec_augment(
            feats,
            draws(self.seed, uid, epoch, _SPEC),
            freq_masks=spec.freq_masks,
            freq_width=spec.freq_width,
            time_masks=spec.time_masks,
            time_width=min(spec.time_width, int(spec.max_time_share * frames)),
            speech_frames=frames,
        )

    def describe(self) -> str:
        """One log line: what this run's augmentation does."""
        parts = []
        if self.cfg.speed is not None:
            parts.append("speed " + "/".join(f"{f:g}" for f in self.cfg.speed.factors))
        if self.cfg.noise is not None:
            lo, hi = self.cfg.noise.snr_db
            parts.append(
                f"noise from {len(self.noise_files)} file(s) at {lo:g}-{hi:g} dB SNR on "
                f"{self.cfg.noise.share:.0%} of the utterances"
            )
        if self.cfg.spec_augment is not None:
            s = self.cfg.spec_augment
            parts.append(
                f"SpecAugment {s.freq_masks}x up to {s.freq_width} mel bins, {s.time_masks}x up "
                f"to {s.time_width} frames"
            )
        if self.cfg.transforms:
            parts.append("transforms " + ", ".join(self.cfg.transforms))
        return "; ".join(parts)

    @property
    def changes_audio(self) -> bool:
        """Whether it changes the waveform (which no log-mel or encoder cache can serve)."""
        return bool(self.cfg.speed or self.cfg.noise or self.cfg.transforms)


def noise_files(directory: Path) -> tuple[Path, ...]:
    """The audio files under ``directory`` (recursively, sorted).

    Raises:
        UserError: not a directory, or it holds no audio file.
    """
    if not directory.is_dir():
        raise UserError(f"data.augment.noise.path: {directory} is not a directory")
    files = tuple(
        sorted(
            p for p in directory.rglob("*") if p.suffix.lower() in NOISE_SUFFIXES and p.is_file()
        )
    )
    if not files:
        raise UserError(
            f"data.augment.noise.path: {directory} holds no audio file "
            f"({', '.join(NOISE_SUFFIXES)})"
        )
    return files


def build_augmenter(cfg: AugmentConfig, *, seed: int, window_seconds: float) -> Augmenter | None:
    """The run's :class:`Augmenter`, or None when ``data.augment`` asks for nothing.

    Raises:
        UserError: a noise directory without audio, or a transform name nobody registered.
    """
    if not (cfg.speed or cfg.noise or cfg.spec_augment or cfg.transforms):
        return None
    transforms = []
    for i, name in enumerate(cfg.transforms):
        if name not in _REGISTRY:
            how = (
                "pass --allow-external-callbacks to import it"
                if ":" in name
                else "register it with asrforge.data.augment.register_transform, or name it as "
                "'module:function' and pass --allow-external-callbacks"
            )
            raise UserError(
                f"data.augment.transforms[{i}]: '{name}' is not a known transform; {how}"
            )
        transforms.append(_REGISTRY[name])
    files = noise_files(cfg.noise.path) if cfg.noise is not None else ()
    augmenter = Augmenter(cfg, seed, window_seconds, files, tuple(transforms))
    log.info("augmentation (training only): %s", augmenter.describe())
    return augmenter
