"""Long audio: cut a recording into windows the model can take, at the quietest moments.

A Whisper encoder sees a fixed window (30 s for the real models, shorter for tiny configs).
Longer audio is cut into consecutive, non-overlapping segments: each cut is placed in the last
quarter of a window, at the middle of the longest run of the quietest 50 ms frames there (short-
time energy), so that it falls in a pause and no word is split between two segments. Every
sample belongs to exactly one segment; decoding the segments in order and joining their texts
neither drops nor doubles words at the joins.
"""

from __future__ import annotations

import numpy as np

FRAME_SECONDS = 0.05
"""Length of the energy frames."""
HOP_SECONDS = 0.01
"""Step between energy frames."""
SEARCH_FRACTION = 0.25
"""The cut is searched in this last fraction of each window."""
QUIET_RATIO = 2.0
"""Frames within this factor of the quietest frame's energy count as equally quiet (3 dB)."""


def frame_energy(wave: np.ndarray, frame: int, hop: int) -> np.ndarray:
    """Mean square of each ``frame``-sample frame, frames ``hop`` samples apart.

    Args:
        wave: (n_samples,) float.

    Returns:
        (n_frames,) float64, ``n_frames = 1 + (n_samples - frame) // hop`` (0 when shorter).
    """
    if wave.shape[0] < frame:
        return np.zeros(0)
    squares = np.concatenate([[0.0], np.cumsum(wave.astype(np.float64) ** 2)])
    starts = np.arange(0, wave.shape[0] - frame + 1, hop)
    return (squares[starts + frame] - squares[starts]) / frame


def quietest_point(wave: np.ndarray, sample_rate: int) -> int:
    """Offset (samples) of the middle of the longest run of the quietest frames of ``wave``.

    Ties between runs of equal length go to the later one (longer segments, fewer windows).
    """
    frame = max(1, round(FRAME_SECONDS * sample_rate))
    hop = max(1, round(HOP_SECONDS * sample_rate))
    energy = frame_energy(wave, frame, hop)
    if energy.size == 0:
        return wave.shape[0]
    quiet = energy <= energy.min() * QUIET_RATIO + 1e-12
    best_len, best_mid, run_start = 0, 0.0, None
    for i, q in enumerate([*quiet.tolist(), False]):
        if q and run_start is None:
            run_start = i
        elif not q and run_start is not None:
            if i - run_start >= best_len:
                best_len, best_mid = i - run_start, (run_start + i - 1) / 2
            run_start = None
    return int(round(best_mid * hop + frame / 2))


def split_points(
    wave: np.ndarray,
    sample_rate: int,
    window_seconds: float,
    search_fraction: float = SEARCH_FRACTION,
) -> list[int]:
    """Where to cut ``wave`` so that each piece fits the model's window.

    Args:
        wave: (n_samples,) mono audio.
        sample_rate: Hz.
        window_seconds: the longest piece the model takes.
        search_fraction: the cut is searched in this last fraction of each window.

    Returns:
        Increasing sample offsets ``0 < c1 < c2 < ...`` (empty when ``wave`` fits one window).
    """
    window = int(window_seconds * sample_rate)
    if window <= 0:
        raise ValueError(f"window_seconds must be > 0, got {window_seconds}")
    search = max(1, int(window * search_fraction))
    cuts: list[int] = []
    start, n = 0, wave.shape[0]
    while n - start > window:
        lo = start + window - search
        cut = lo + quietest_point(wave[lo : start + window], sample_rate)
        cut = min(max(cut, lo), start + window)
        cuts.append(cut)
        start = cut
    return cuts


def segment(wave: np.ndarray, sample_rate: int, window_seconds: float) -> list[tuple[int, int]]:
    """``(start, end)`` sample ranges of the pieces: contiguous, covering ``wave`` exactly once,
    each at most ``window_seconds`` long."""
    bounds = [0, *split_points(wave, sample_rate, window_seconds), wave.shape[0]]
    return list(zip(bounds[:-1], bounds[1:], strict=True))
