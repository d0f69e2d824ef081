"""A guard set: clips joined into recordings that fit one model window."""

from __future__ import annotations

AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aiff", ".aif")
"""Files a guard directory contributes (others are ignored)."""
GUARD_WINDOW_SECONDS = 28.0
"""Longest joined guard recording: one model window (30 s) with room to spare."""
GUARD_GAP_SECONDS = 0.5
"""Silence between the prompts of a joined guard recording."""


def guard_windows(prompts: list[tuple[str, float]], window_seconds: float,
                  gap_seconds: float) -> list[list[str]]:
    """The prompts (``(name, seconds)``, in the order given) grouped into windows: each window
    takes prompts in order while they fit in ``window_seconds`` with ``gap_seconds`` between
    them; a prompt longer than a window is left out."""
    windows: list[list[str]] = []
    current: list[str] = []
    used = 0.0
    for name, seconds in prompts:
        if seconds > window_seconds:
            continue
        need = seconds + (gap_seconds if current else 0.0)
        if current and used + need > window_seconds:
            windows.append(current)
            current, used, need = [], 0.0, seconds
        current.append(name)
        used += need
    if current:
        windows.append(current)
    return windows
