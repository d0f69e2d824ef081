"""Voice activity detection for long audio: Silero VAD's speech regions, merged into chunks of
at most one encoder window, which long-form decoding then decodes as a batch (WhisperX's way).

Silero VAD is the model the ``silero-vad`` package ships (``silero_vad.data``, loaded by
``silero_vad.load_silero_vad``); asrforge never fetches one. A region longer than a chunk is
split by Silero itself (at its longest pause, else just before the limit). Regions are merged in
order while the chunk, from its first region's start to its last one's end, fits the limit: the
pauses between merged regions stay in the chunk, the audio between chunks is never decoded.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from asrforge.errors import UserError

VAD_PACKAGE = "silero-vad"
SPEECH_THRESHOLD = 0.5
"""Silero's speech probability above which a 32 ms frame is speech (its default)."""
MIN_SILENCE_MS = 160
"""A pause shorter than this does not end a region."""
SPEECH_PAD_MS = 200
"""Audio kept each side of a region, so that a word's soft onset or tail is not cut off."""


def vad_available() -> bool:
    """Whether the ``silero-vad`` package can be imported."""
    return importlib.util.find_spec("silero_vad") is not None


@lru_cache(maxsize=1)
def silero_model():
    """The Silero VAD model the ``silero-vad`` package ships.

    Raises:
        UserError: the package is not installed.
    """
    if not vad_available():
        raise UserError(
            f"--vad needs the package {VAD_PACKAGE}: pip install 'asrforge[vad]' "
            "(or --no-vad for sequential long-form decoding)"
        )
    threads = torch.get_num_threads()
    try:
        # importing silero_vad sets torch's thread count to 1 for the whole process
        from silero_vad import load_silero_vad

        with warnings.catch_warnings():
            # the package's own loading (importlib.resources.path, torch.jit.load) is deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            return load_silero_vad()
    finally:
        torch.set_num_threads(threads)


def speech_regions(wave: np.ndarray, sample_rate: int, max_seconds: float) -> list[tuple[int, int]]:
    """Silero's speech regions of ``wave``: ``(start, end)`` sample offsets, in order, none
    longer than ``max_seconds``.

    Args:
        wave: (n_samples,) float32 audio at ``sample_rate`` (16 kHz).
    """
    from silero_vad import get_speech_timestamps

    model = silero_model()
    model.reset_states()
    threads = torch.get_num_threads()
    try:
        found = get_speech_timestamps(
            torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32)),
            model,
            threshold=SPEECH_THRESHOLD,
            sampling_rate=sample_rate,
            max_speech_duration_s=max_seconds - 2 * SPEECH_PAD_MS / 1000,
            min_silence_duration_ms=MIN_SILENCE_MS,
            speech_pad_ms=SPEECH_PAD_MS,
        )
    finally:
        torch.set_num_threads(threads)
    return [(int(r["start"]), int(r["end"])) for r in found]


def merge_regions(regions: Sequence[tuple[int, int]], max_samples: int) -> list[tuple[int, int]]:
    """Speech regions merged in order into chunks no longer than ``max_samples`` (a region that
    is longer on its own stays one chunk: :func:`speech_regions` keeps them shorter)."""
    chunks: list[tuple[int, int]] = []
    for start, end in regions:
        if chunks and end - chunks[-1][0] <= max_samples:
            chunks[-1] = (chunks[-1][0], max(end, chunks[-1][1]))
        else:
            chunks.append((start, end))
    return chunks


def speech_chunks(
    wave: np.ndarray, sample_rate: int, window_seconds: float
) -> list[tuple[int, int]]:
    """The chunks of ``wave`` to decode: its speech regions merged into pieces of at most one
    window, ``(start, end)`` in samples; none when Silero finds no speech."""
    regions = speech_regions(wave, sample_rate, window_seconds)
    return merge_regions(regions, round(window_seconds * sample_rate))
