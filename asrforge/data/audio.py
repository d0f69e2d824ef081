"""Reading audio: decode bytes or files with soundfile, downmix to mono, resample to 16 kHz;
any audio a caller hands over (a path, bytes, an array or tensor of samples) as one
(n_samples,) float32 wave at 16 kHz (:func:`as_wave`)."""

from __future__ import annotations

import io
import logging
import math
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from asrforge.data.sample_rate import SAMPLE_RATE
from asrforge.errors import UserError
from asrforge.io.small_files import open_regular

log = logging.getLogger(__name__)

MAX_DECODE_SECONDS = 6 * 3600
"""Longest audio decoded whole: a few kilobytes of FLAC can decode to days of silence."""
_BLOCK_FRAMES = 1 << 16
_CUT_SHORT = re.compile(r"^(?:data|SSND)\s*:\s*(\d+) \(should be (\d+)\)", re.MULTILINE)
"""libsndfile's log line for a data chunk shorter than its header says."""
READABLE = "wav, flac, ogg (vorbis, opus), mp3, aiff and the other formats libsndfile reads"
"""The audio this module decodes, for messages about a file it cannot."""
PCM_SCALE_PEAK = 2.0
"""A float sample above this in magnitude is taken for integer PCM stored as floats (float
audio is in [-1, 1]; resampling or a DSP chain overshoots it by a little, not by twice)."""

Audio = str | Path | bytes | np.ndarray | torch.Tensor
"""What :func:`as_wave` reads: a path, encoded bytes, or samples."""


def decode_audio(source: bytes | str | Path, target_sr: int = SAMPLE_RATE) -> np.ndarray:
    """Decode wav/flac/ogg/mp3 (whatever libsndfile reads) to mono float32 at ``target_sr``.

    Raises:
        UserError: the file is no regular file or cannot be read, naming it.
    """
    with open_audio(source) as audio:
        return audio.decode(target_sr)


class AudioFile:
    """An opened audio file or blob whose header is read and whose samples are not yet."""

    def __init__(self, sound: sf.SoundFile, source: bytes | str | Path):
        self.sound = sound
        self.source = source
        self.name = _source_name(source)

    @property
    def sample_rate(self) -> int:
        return int(self.sound.samplerate)

    @property
    def seconds(self) -> float:
        """The duration its header gives."""
        return float(self.sound.frames) / float(self.sound.samplerate)

    def decode(self, target_sr: int = SAMPLE_RATE) -> np.ndarray:
        """(n_samples,) mono float32 at ``target_sr``.

        Raises:
            UserError: the samples cannot be read, naming the file.
        """
        limit = int(MAX_DECODE_SECONDS * self.sample_rate)
        blocks, frames = [], 0
        try:
            # block by block: the header's frame count is a claim, not a size to allocate
            while True:
                block = self.sound.read(_BLOCK_FRAMES, dtype="float32", always_2d=True)
                if not len(block):
                    break
                frames += len(block)
                if frames > limit:
                    raise UserError(f"cannot read audio {self.name}: longer than "
                                    f"{MAX_DECODE_SECONDS // 3600} hours")
                blocks.append(block.mean(axis=1) if block.shape[1] > 1 else block[:, 0])
                if len(block) < _BLOCK_FRAMES:
                    break
        except (sf.LibsndfileError, RuntimeError, OSError, TypeError, MemoryError) as e:
            where = (f" after {frames / self.sample_rate:.1f} s of the {self.seconds:.1f} s its "
                     "header gives" if frames else "")  # fmt: skip
            raise UserError(f"cannot read audio {self.name}{where}: {e}") from None
        wave = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)
        return resample(wave, self.sample_rate, target_sr)

    def shortfall(self) -> str | None:
        """What is missing when the file's data ends before the length its header gives (a
        wav or aiff cut short: libsndfile reads what is there and notes the difference in its
        log), or None."""
        found = _CUT_SHORT.search(self.sound.extra_info or "")
        if found is None:
            return None
        claimed, there = int(found[1]), int(found[2])
        return (
            f"the audio data ends before the length its header gives ({there} of {claimed} "
            "bytes): the file looks cut short"
        )


@contextmanager
def open_audio(source: bytes | str | Path) -> Iterator[AudioFile]:
    """Open ``source`` once: its header is read, its samples only when asked for.

    A path is opened non-blocking and checked with ``fstat`` on that descriptor before anything
    is read, so a FIFO never waits for a writer and a device is never read without end.

    Raises:
        UserError: ``source`` is missing, no regular file, or its header cannot be read.
    """
    name = _source_name(source)
    fd = None if isinstance(source, bytes) else _open_regular(name)
    try:
        size = len(source) if fd is None else os.fstat(fd).st_size
        if size == 0:
            raise UserError(f"cannot read audio {name}: empty file (0 bytes)")
        try:
            sound = sf.SoundFile(io.BytesIO(source) if fd is None else fd, closefd=False)
        except (sf.LibsndfileError, RuntimeError, OSError, TypeError) as e:
            reason = e.error_string if isinstance(e, sf.LibsndfileError) else e
            if "not recognised" in str(reason):
                reason = (f"{reason} (readable: {READABLE}; convert others first, e.g. "
                          "`ffmpeg -i in.m4a out.wav`)")  # fmt: skip
            raise UserError(f"cannot read audio {name}: {reason}") from None
        with sound:
            if sound.samplerate <= 0:
                raise UserError(f"cannot read audio {name}: sample rate {sound.samplerate}")
            yield AudioFile(sound, source)
    finally:
        if fd is not None:
            os.close(fd)


def _source_name(source: bytes | str | Path) -> str:
    """How an error message names ``source``."""
    return "<bytes>" if isinstance(source, bytes) else str(source)


def _open_regular(path: str) -> int:
    """A blocking read descriptor of the regular file ``path``."""
    if "\0" in path:
        raise UserError(f"cannot read audio {path!r}: a NUL byte in its path names no file")
    try:
        return open_regular(Path(path))
    except ValueError as e:  # what it is, "a FIFO, not a regular file"
        raise UserError(f"cannot read audio {path}: {e}") from None
    except OSError as e:
        raise UserError(f"cannot read audio {path}: {e.strerror}") from None


def as_wave(
    audio: Audio, sampling_rate: int | None = None, *, told: set[str] | None = None
) -> np.ndarray:
    """A path (wav/flac/mp3/... at any rate), encoded bytes, or an array of mono samples
    (float in [-1, 1], or integer PCM such as int16, scaled by its type's range; a channel
    axis of size one, (1, n) or (n, 1), is dropped) -> (n_samples,) float32 at 16 kHz.
    Float samples above :data:`PCM_SCALE_PEAK` are kept as they are, with a warning.

    Args:
        sampling_rate: an array's rate in Hz (resampled to 16 kHz); default 16 kHz. Files
            and bytes carry their own rate.
        told: the warnings already given to the caller, by name: the PCM-scale one is given
            when ``"pcm-scale"`` is not in it, and then added (a bundle gives it once); None:
            every time.

    Raises:
        UserError: a missing or unreadable file, an array of several channels, or a rate
            that is not a positive whole number.
    """
    if isinstance(audio, torch.Tensor):
        # numpy has no bfloat16; integer PCM keeps its type for the scaling below
        tensor = audio.detach().cpu()
        audio = (tensor.float() if tensor.is_floating_point() else tensor).numpy()
    if isinstance(audio, np.ndarray):
        if audio.ndim == 2 and 1 in audio.shape:
            # one channel, as torchaudio.load (1, n) or soundfile's always_2d (n, 1) gives it
            audio = audio.reshape(-1)
        if audio.ndim != 1:
            # which axis holds the channels is not known, so a stereo array is not downmixed
            raise UserError(
                f"audio array must be 1-D (mono), got shape {audio.shape}: average its "
                "channels (files are downmixed as they are read)"
            )
        if np.issubdtype(audio.dtype, np.integer):
            # PCM samples (scipy.io.wavfile's int16, say): full scale is the type's range
            kind = np.iinfo(audio.dtype)
            middle, half = (kind.min + kind.max + 1) / 2, (kind.max - kind.min + 1) / 2
            audio = (audio.astype(np.float64) - middle) / half
        elif not np.issubdtype(audio.dtype, np.floating):
            raise UserError(f"audio array must hold integer or float samples, got {audio.dtype}")
        else:
            _say_if_pcm_scale(audio, told)
        rate = SAMPLE_RATE if sampling_rate is None else sampling_rate
        if isinstance(rate, float | np.floating) and float(rate).is_integer():
            rate = int(rate)  # 16000.0, as librosa and soundfile hand rates over
        if isinstance(rate, bool) or not isinstance(rate, int | np.integer) or rate <= 0:
            raise UserError(f"sampling_rate must be a positive integer (Hz), got {rate!r}")
        return resample(audio.astype(np.float32, copy=False), int(rate), SAMPLE_RATE)
    if isinstance(audio, bytes | bytearray):
        return decode_audio(bytes(audio), SAMPLE_RATE)
    if isinstance(audio, str | Path):
        return read_audio_file(Path(audio))
    raise UserError(
        f"audio must be a path, bytes, or a numpy array or torch tensor of samples, got "
        f"{type(audio).__name__}"
    )


def _say_if_pcm_scale(audio: np.ndarray, told: set[str] | None) -> None:
    """Warn of float samples far outside [-1, 1], unless ``told`` holds the warning: integer PCM
    values stored as floats, which decode as noise; they are not rescaled, since a guess could
    be wrong."""
    if told is not None and "pcm-scale" in told:
        return
    peak = float(np.abs(audio).max(initial=0.0))
    if not PCM_SCALE_PEAK < peak < np.inf:
        return
    if told is not None:
        told.add("pcm-scale")
    log.warning(
        "float audio samples peak %.1f: samples are expected in [-1, 1] (integer PCM such as "
        "int16 values stored as floats must be divided by their full scale, 32768 for "
        "16-bit); transcribing them as they are",
        peak,
    )


def check_audio_file(path: Path) -> None:
    """Refuse ``path`` as :func:`read_audio_file` would, from its header alone (no samples
    are read, so every file of a long list is checked in moments).

    Raises:
        UserError: a directory, a missing path, no regular file, or a header that does not
            open as audio.
    """
    with _opened_audio_file(path):
        pass


def read_audio_file(path: Path) -> np.ndarray:
    """An audio file (wav/flac/mp3/... at any rate) -> (n_samples,) float32 at 16 kHz.

    Raises:
        UserError: a directory, a missing path, no regular file (a pipe would block its
            reader), or contents that do not decode as audio.
    """
    with _opened_audio_file(path) as audio:
        wave = audio.decode(SAMPLE_RATE)
        if (short := audio.shortfall()) is not None:
            log.warning("%s: %s; transcribing the audio that is there", path, short)
    return wave


def _opened_audio_file(path: Path):
    """:func:`open_audio` of ``path``, after the checks that name what the path is when it is
    no audio file."""
    if path.is_dir():
        raise UserError(f"{path}: a directory, not an audio file")
    if not path.exists():
        raise UserError(f"{path}: no such audio file")
    if not path.is_file():
        raise UserError(f"{path}: not a regular file")
    return open_audio(path)


def is_special_file(source: bytes | str | Path) -> bool:
    """Whether ``source`` names something that exists but is no regular file (a FIFO, a device,
    a socket, a directory): opening one can block forever or read without end."""
    if isinstance(source, bytes):
        return False
    try:
        return not stat.S_ISREG(os.stat(source).st_mode)
    except (OSError, ValueError):
        # A missing or unreachable file is left to the decoder, whose own error names it.
        return False


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
        UserError: ``source`` is missing, no regular file (it is never read), or unreadable.
    """
    with open_audio(source) as audio:
        return audio.sample_rate, audio.seconds


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
