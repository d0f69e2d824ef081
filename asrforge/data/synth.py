"""A small deterministic speech-like data set made of tones, for tests and the tiny config.

Each word is a short two-tone chord of its own pitch, words are separated by silence, so audio
and text are tied by a rule a tiny model can learn in a minute on a CPU. The real speech corpus
(espeak-ng) lives in :mod:`asrforge.recipes.corpus`.
"""

from __future__ import annotations

import io
import logging
import random
from pathlib import Path

import numpy as np
import soundfile as sf

from asrforge.data.sample_rate import SAMPLE_RATE
from asrforge.errors import UserError
from asrforge.io.atomic import atomic_directory, directory_problem, remove_path, temporaries_of
from asrforge.io.locks import exclusive

log = logging.getLogger(__name__)

WORDS = {
    "en": ["red", "blue", "cat", "dog", "sun", "one", "two", "go", "stop", "yes", "no", "hat"],
    "es": ["sol", "mar", "gato", "uno", "dos", "rojo", "azul", "si", "pan", "luz"],
}
SPLITS = {"train": 160, "validation": 24, "test": 24}
WORD_SECONDS = 0.2
GAP_SECONDS = 0.06
PITCH = {w: 300.0 + 90.0 * i for i, w in enumerate(sorted({w for ws in WORDS.values() for w in ws}))}


def tone_audio(text: str, rng: np.random.Generator) -> np.ndarray:
    """float32 waveform at 16 kHz: a chord (pitch and its fifth) per word, silence between
    words, light noise."""
    n_word = int(WORD_SECONDS * SAMPLE_RATE)
    t = np.arange(n_word) / SAMPLE_RATE
    fade = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01)
    pieces = [np.zeros(int(0.1 * SAMPLE_RATE))]
    for word in text.split():
        f = PITCH[word]
        pieces.append(0.3 * (np.sin(2 * np.pi * f * t) + np.sin(3 * np.pi * f * t)) * fade)
        pieces.append(np.zeros(int(GAP_SECONDS * SAMPLE_RATE)))
    pieces.append(np.zeros(int(0.1 * SAMPLE_RATE)))
    wave = np.concatenate(pieces)
    wave += 0.01 * rng.standard_normal(wave.shape)
    return wave.astype(np.float32)


def make_tones_dataset(path: Path, seed: int = 1234, sizes: dict[str, int] | None = None) -> Path:
    """Write the tones data set as an Arrow ``DatasetDict`` at ``path`` (atomically), unless it
    is there: runs started together build it once, under a lock beside it (``<path>.lock``),
    and the others wait and read what the first wrote. A data set once written is never
    removed here, since another run may be reading it."""
    path = Path(path)
    if problem := directory_problem(path):  # a file, a broken symlink or a loop in the way
        raise UserError(f"data.path: {problem}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(path.with_name(path.name + ".lock")):
        if path.exists():
            log.info("the tones data set at %s is there already (another run made it)", path)
            return path
        # Holding the lock makes this the only writer of `path`, so a temporary is a dead one's.
        for leftover in temporaries_of(path):
            remove_path(leftover)
        splits = tone_splits(seed, sizes)
        with atomic_directory(path) as tmp:
            splits.save_to_disk(str(tmp))
    log.info("generated the tones data set at %s (%s)", path, {k: len(v) for k, v in splits.items()})
    return path


def tone_splits(seed: int = 1234, sizes: dict[str, int] | None = None):
    """The tones data set as a ``DatasetDict`` in memory: ``sizes`` rows per split."""
    import datasets
    from datasets import Audio, Dataset, DatasetDict, Features, Value

    datasets.disable_progress_bars()
    rng = np.random.default_rng(seed)
    pyrng = random.Random(seed)
    # Written as plain {bytes, path} structs and cast to Audio: datasets' own encoder needs
    # torchcodec, which we do not depend on (we decode with soundfile).
    feats = Features(
        {"id": Value("string"), "audio": {"bytes": Value("binary"), "path": Value("string")},
         "text": Value("string"), "language": Value("string")}
    )
    splits = {}
    for split, n in (sizes or SPLITS).items():
        rows = {"id": [], "audio": [], "text": [], "language": []}
        for i in range(n):
            lang = "en" if i % 3 else "es"
            text = " ".join(pyrng.choice(WORDS[lang]) for _ in range(pyrng.randint(1, 4)))
            buf = io.BytesIO()
            sf.write(buf, tone_audio(text, rng), SAMPLE_RATE, format="WAV", subtype="PCM_16")
            rows["id"].append(f"{split}-{i:05d}")
            rows["audio"].append({"bytes": buf.getvalue(), "path": None})
            rows["text"].append(text)
            rows["language"].append(lang)
        ds = Dataset.from_dict(rows, features=feats)
        splits[split] = ds.cast_column("audio", Audio(sampling_rate=SAMPLE_RATE, decode=False))
    return DatasetDict(splits)
