"""Reading audio: decode bytes or files with soundfile, downmix to mono, resample to 16 kHz."""

from __future__ import annotations

import io
import math
import os
import stat
from functools import lru_cache
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from asrforge.errors import UserError

SAMPLE_RATE = 16_000


def decode_audio(source: bytes | str | Path, target_sr: int = SAMPLE_RATE) -> np.ndarray:
    """Decode wav/flac/ogg/mp3 (whatever libsndfile reads) to mono float32 at ``target_sr``.

    Raises:
        UserError: the file cannot be read, naming it.
    """
    name = "<bytes>" if isinstance(source, bytes) else str(source)
    refuse_special_file(source)
    try:
        handle = io.BytesIO(source) if isinstance(source, bytes) else str(source)
        wave, sr = sf.read(handle, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, OSError, TypeError) as e:
        raise UserError(f"cannot read audio {name}: {e}") from None
    wave = wave.mean(axis=1) if wave.shape[1] > 1 else wave[:, 0]
    return resample(wave, sr, target_sr)


def is_special_file(source: bytes | str | Path) -> bool:
    """Whether ``source`` names something that exists but is no regular file (a FIFO, a device,
    a socket, a directory): opening one can block forever or read without end."""
    if isinstance(source, bytes):
        return False
    try:
        return not stat.S_ISREG(os.stat(source).st_mode)
    except OSError:  # missing or unreachable: the decoder's own error names it
        return False


def refuse_special_file(source: bytes | str | Path) -> None:
    """Raise before ``source`` is opened when it is no regular file (see :func:`is_special_file`).

    Raises:
        UserError: naming the file.
    """
    if is_special_file(source):
        raise UserError(f"cannot read audio {source}: not a regular file")


def audio_problem(wave: np.ndarray) -> str | None:
    """Why decoded audio cannot be used, or None: no samples, or NaN/inf samples (a float file
    written from a diverged DSP chain decodes "fine" and turns every log-mel into NaN).

    Args:
        wave: (n_samples,) decoded audio.
    """
    if wave.size == 0:
        return "empty audio (0 samples)"
    if not np.isfinite(wave).all():
        return "non-finite audio (NaN/inf samples)"
    return None


def audio_info(source: bytes | str | Path) -> tuple[int, float]:
    """(sample rate, duration in seconds) from the header only.

    Raises:
        UserError: ``source`` is no regular file (it is never opened).
    """
    refuse_special_file(source)
    handle = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    info = sf.info(handle)
    return int(info.samplerate), float(info.frames) / float(info.samplerate)


def resample(wave: np.ndarray, sr_from: int, sr_to: int) -> np.ndarray:
    """Band-limited resampling (windowed sinc, Hann window, 6 zero crossings).

    Args:
        wave: (n_samples,) float32.
    """
    if sr_from == sr_to:
        return np.ascontiguousarray(wave, dtype=np.float32)
    g = math.gcd(sr_from, sr_to)
    up, down = sr_to // g, sr_from // g
    kernel, width = _sinc_kernel(down, up)
    x = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))[None, None]
    x = torch.nn.functional.pad(x, (width, width + down))
    y = torch.nn.functional.conv1d(x, kernel, stride=down)  # (1, up, frames)
    y = y.transpose(1, 2).reshape(-1)
    n_out = math.ceil(up * wave.shape[0] / down)
    return y[:n_out].numpy().astype(np.float32)


@lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int, zeros: int = 6, rolloff: float = 0.99) -> tuple[torch.Tensor, int]:
    # The polyphase construction torchaudio uses: `new` filters of length 2*width+orig.
    base = min(orig, new) * rolloff
    width = math.ceil(zeros * orig / base)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx
    t = (t * base).clamp(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    t = t * math.pi
    scale = base / orig
    kernels = torch.where(t == 0, torch.tensor(1.0, dtype=torch.float64), t.sin() / t)
    kernels = kernels * window * scale
    return kernels.to(torch.float32), width
