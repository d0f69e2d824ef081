"""Speech for tests: English (or any espeak-ng voice) synthesized with espeak-ng at 16 kHz.

espeak-ng is a system program (Debian/Ubuntu: ``apt-get install espeak-ng``). Tests that need
it call :func:`synthesize` (or use :data:`requires_espeak`) and are skipped with a reason when
it is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from asrforge.data.audio import SAMPLE_RATE, decode_audio

ESPEAK = shutil.which("espeak-ng")
requires_espeak = pytest.mark.skipif(
    ESPEAK is None, reason="espeak-ng is not installed (apt-get install espeak-ng)"
)


def synthesize(text: str, voice: str = "en-us", words_per_minute: int = 150) -> np.ndarray:
    """Speak ``text`` with espeak-ng; skips the calling test when espeak-ng is missing.

    Args:
        text: what to say.
        voice: an espeak-ng voice (``espeak-ng --voices`` lists them).
        words_per_minute: speaking rate.

    Returns:
        (n_samples,) float32 waveform at 16 kHz (espeak-ng speaks at 22.05 kHz; resampled).
    """
    if ESPEAK is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")
    return _synthesize(text, voice, words_per_minute).copy()


@lru_cache(maxsize=64)
def _synthesize(text: str, voice: str, words_per_minute: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run(
            [ESPEAK, "-v", voice, "-s", str(words_per_minute), "-w", str(wav), text],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wave = decode_audio(wav, SAMPLE_RATE)
    return wave.astype(np.float32)
