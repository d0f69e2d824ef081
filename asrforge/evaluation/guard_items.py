"""The forgetting guard's set, read as the windows the model takes (:class:`GuardItem`): audio
files, or data as ``data.path`` takes it, each recording cut at pauses into windows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asrforge.config import DataConfig, GuardConfig
from asrforge.data.audio import SAMPLE_RATE, decode_audio
from asrforge.data.guard_set import AUDIO_SUFFIXES, MANIFEST
from asrforge.data.locate import FILE_FORMATS, split_of
from asrforge.data.sources import read_split
from asrforge.errors import UserError
from asrforge.model.silence import segment
from asrforge.text.languages import resolve_language


@dataclass(frozen=True)
class GuardItem:
    """One window of guard audio."""

    id: str
    """``<file or row id>`` or ``<id>#<window>`` for the windows of a longer recording."""
    wave: np.ndarray
    """(n_samples,) float32 at 16 kHz, at most one model window long."""
    reference: str | None
    """The transcript, when the source has one (only for audio that fits one window)."""
    language: str
    language_given: bool = True
    """The source gave ``language`` (the data's language column, or ``eval.guard.language``
    over data without one); False for audio files and rows with an empty language, which took
    the guard's language: their language identification is not measured."""


def load_guard_items(
    cfg: GuardConfig, language: str, window_seconds: float, cache_dir: Path | None = None
) -> list[GuardItem]:
    """The guard set as windows the model takes, in a fixed order, at most ``cfg.max_items``.

    Args:
        language: of audio files, and of data without a language column.
        cache_dir: ``data.cache_dir``, for the Arrow copy of parquet/json/csv data.

    Raises:
        UserError: the path does not exist, holds no audio, lacks the split, an audio file does
            not decode, or ``mode: wer`` is asked of items without references.
    """
    path = Path(cfg.path)
    if not path.exists():
        raise UserError(f"eval.guard.path: {path} does not exist")
    if is_data_source(path):
        sources = _data_sources(cfg, language, cache_dir)
    else:
        sources = _file_sources(path, language)
    items: list[GuardItem] = []
    for uid, load, reference, lang, given in sources:
        wave = load()
        pieces = segment(wave, SAMPLE_RATE, window_seconds)
        for k, (a, b) in enumerate(pieces):
            # A sliver after the last pause holds nothing to transcribe.
            if b - a < SAMPLE_RATE // 10:
                continue
            ref = reference if len(pieces) == 1 else None
            uid_k = uid if len(pieces) == 1 else f"{uid}#{k}"
            items.append(GuardItem(uid_k, wave[a:b], ref, lang, given))
        if cfg.max_items is not None and len(items) >= cfg.max_items:
            break
    items = items[: cfg.max_items] if cfg.max_items is not None else items
    if not items:
        raise UserError(f"eval.guard.path: {path} holds no audio")
    if cfg.mode == "wer" and any(not i.reference for i in items):
        missing = [i.id for i in items if not i.reference][:5]
        raise UserError(
            f"eval.guard.mode: wer needs a reference for every item; {path} has none for "
            f"{missing} (recordings longer than one window have none either); use mode: drift"
        )
    return items


def guard_clip_files(cfg: GuardConfig, cache_dir: Path | None = None) -> set[Path]:
    """Every audio file the guard set reads, and the clips a guard set built by ``asrforge
    guard build`` was joined from (its manifest's ``clips``), resolved: what no run may train on.
    """
    path = Path(cfg.path)
    if not path.exists():
        raise UserError(f"eval.guard.path: {path} does not exist")
    if not is_data_source(path):
        files = [path] if path.is_file() else [
            p for p in path.iterdir() if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES
        ]  # fmt: skip
        return {f.resolve() for f in files}
    data = DataConfig(
        path=cfg.path, columns=cfg.columns, audio_dir=cfg.audio_dir, cache_dir=cache_dir
    )
    ds = read_split(data, cfg.split, option="eval.guard.split", section="eval.guard",
                    required=("audio",), default_language="en")  # fmt: skip
    found = set()
    for row in ds.select_columns(["audio"]):
        audio = row["audio"]
        if not audio.get("bytes") and audio.get("path"):
            found.add(Path(audio["path"]).resolve())
    manifest = path / MANIFEST if path.is_dir() else path
    if manifest.suffix == ".jsonl" and manifest.is_file():
        for line in manifest.read_text(encoding="utf-8").splitlines():
            record = json.loads(line) if line.strip() else {}
            clips = record.get("clips") if isinstance(record, dict) else None
            found |= {(manifest.parent / c).resolve() for c in clips or [] if isinstance(c, str)}
    return found


def _file_sources(path: Path, language: str):
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES)
    )
    for f in files:
        yield f.stem if path.is_dir() else f.name, lambda f=f: _decode(f), None, language, False


def is_data_source(path: Path) -> bool:
    """``path`` is data as ``data.path`` takes it (a saved data set, data files, a directory of
    them), not audio files: a file of a data format, a saved data set, a directory of
    recordings with a data file named by its split beside them (``validation.jsonl``), or a
    directory of data files and no recordings. A ``metadata.csv`` or ``notes.json`` beside
    recordings leaves them audio files, as they were before the guard read data."""
    if path.is_file():
        return path.suffix.lower() in FILE_FORMATS
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return True
    files = [p for p in path.iterdir() if p.is_file()]
    data = [p for p in files if p.suffix.lower() in FILE_FORMATS]
    if any(p.suffix.lower() in AUDIO_SUFFIXES for p in files):
        # data.path reads a directory's files only when their names say their split
        return any(split_of(p.name) is not None for p in data)
    if data:
        return True
    return any(p.suffix.lower() in FILE_FORMATS for p in path.glob("*/*"))  # a data/ folder


def _data_sources(cfg: GuardConfig, language: str, cache_dir: Path | None):
    """The rows of ``cfg.split`` of the data at ``cfg.path``, read as training reads its data
    (:mod:`asrforge.data.sources`); ``language`` for data without a language column."""
    data = DataConfig(
        path=cfg.path, columns=cfg.columns, audio_dir=cfg.audio_dir, cache_dir=cache_dir
    )
    ds = read_split(
        data,
        cfg.split,
        option="eval.guard.split",
        section="eval.guard",
        required=("audio",),
        default_language=language,
    )
    for i, row in enumerate(ds):
        uid = str(row.get("id") or i)
        ref = (row.get("text") or "").strip() or None
        audio = row["audio"]
        source = audio["bytes"] or audio["path"]
        own = resolve_language(row["language"], strict=False)
        yield uid, lambda b=source, u=uid: _decode(b, u), ref, own or language, own is not None


def _decode(source, name=None) -> np.ndarray:
    try:
        return decode_audio(source, SAMPLE_RATE)
    except Exception as e:
        # Any decoder error means the user's file is the problem.
        raise UserError(f"eval.guard: cannot decode {name or source}: {e}") from None
