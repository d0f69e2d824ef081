"""A guard set: clips joined into recordings that fit one model window, written as data the
forgetting guard (``eval.guard.path``) reads: the recordings and a ``validation.jsonl``
manifest (``id``, ``audio``, ``language``, ``duration``, ``clips``, and ``text`` when every
clip of a recording has one). How to build and choose one: docs/guard.md."""

from __future__ import annotations

import csv
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from asrforge.data.audio import SAMPLE_RATE, audio_info, decode_audio
from asrforge.errors import UserError
from asrforge.io.atomic import atomic_directory, empty_directory_problem
from asrforge.text.languages import resolve_language

AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aiff", ".aif")
"""Files a guard directory contributes (others are ignored)."""
GUARD_WINDOW_SECONDS = 28.0
"""Longest joined guard recording: one model window (30 s) with room to spare."""
GUARD_GAP_SECONDS = 0.5
"""Silence between the prompts of a joined guard recording."""
MANIFEST = "validation.jsonl"
"""The guard set's manifest: named for the split the guard reads by default."""
PATH_COLUMNS = ("path", "audio", "audio_filepath", "file")
"""Columns of a references file that name the clip (Common Voice: ``path``)."""
TEXT_COLUMNS = ("text", "sentence", "transcript")
"""Columns of a references file that hold the transcript (Common Voice: ``sentence``)."""
LANGUAGE_COLUMNS = ("language", "lang", "locale")
"""Columns of a references file that give the clip's language."""


def guard_windows(prompts: list[tuple[str, float]], window_seconds: float,
                  gap_seconds: float) -> list[list[str]]:  # fmt: skip
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


def join_waves(waves: Sequence[np.ndarray], gap_seconds: float) -> np.ndarray:
    """(n_samples,) float32 at 16 kHz: ``waves`` (each at 16 kHz) in order, ``gap_seconds`` of
    silence between them."""
    gap = np.zeros(round(gap_seconds * SAMPLE_RATE), dtype=np.float32)
    return np.concatenate([x for w in waves for x in (gap, w)][1:])


@dataclass(frozen=True)
class GuardClip:
    """One recording given to ``asrforge guard build``."""

    path: Path
    seconds: float
    language: str | None
    """Its language code; None: the run's (the guard's default)."""
    reference: str | None


@dataclass
class GuardWindow:
    """One recording of the guard set: clips of one language joined in order."""

    id: str
    language: str | None
    clips: list[GuardClip]
    wave: np.ndarray
    """(n_samples,) float32 at 16 kHz."""
    text: str | None = None
    """Its reference: the clips' references joined, or the starting model's transcript."""

    @property
    def seconds(self) -> float:
        return self.wave.shape[0] / SAMPLE_RATE


def audio_files(inputs: Sequence[Path]) -> list[tuple[int, Path]]:
    """``(input index, file)`` for every audio file the inputs name: a file as it is, a
    directory's audio files (:data:`AUDIO_SUFFIXES`, directly in it, in name order).

    Raises:
        UserError: an input does not exist, or a directory holds no audio file, naming it.
    """
    found = []
    for k, path in enumerate(inputs):
        if path.is_dir():
            files = sorted(p for p in path.iterdir()
                           if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES)  # fmt: skip
            if not files:
                raise UserError(f"AUDIO {path}: a directory without audio files "
                                f"({', '.join(AUDIO_SUFFIXES)})")  # fmt: skip
            found += [(k, f) for f in files]
        elif path.exists():
            found.append((k, path))
        else:
            raise UserError(f"AUDIO {path}: no such file or directory")
    return found


def read_clips(inputs: Sequence[Path], languages: Sequence[str] = (),
               references: Path | None = None, *,
               others_from: str | None = None) -> list[GuardClip]:  # fmt: skip
    """The clips the inputs name, each with its length (from its header), language and
    reference.

    Args:
        inputs: audio files and directories of them (:func:`audio_files`).
        languages: none (the run's language), one for every input, or one per input.
        references: a TSV or JSONL file of clip path -> text (:func:`read_references`); every
            clip must have one, unless ``others_from`` names where the others get theirs. A
            language column there overrides ``languages``.
        others_from: what gives the clips the file has no reference for theirs (``--model``);
            None: none may lack one.

    Raises:
        UserError: a missing input, a file that is not audio, a count of languages that fits
            neither rule, a language that names none, or a clip without a reference.
    """
    if len(languages) not in (0, 1, len(inputs)):
        raise UserError(f"--language: give one for every input or one per input "
                        f"({len(inputs)}), got {len(languages)}")  # fmt: skip
    codes = [resolve_language(v, "--language") for v in languages]
    refs = read_references(references) if references is not None else None
    files = audio_files(inputs)
    # a file name two inputs share names neither: by name, both would get one clip's text
    names = Counter(path.name for _, path in files)
    shared = {name for name, n in names.items() if n > 1}
    clips = []
    for k, path in files:
        try:
            _, seconds = audio_info(path)
        except UserError as e:
            raise UserError(f"AUDIO {inputs[k]}: {e}") from None
        language = codes[0] if len(codes) == 1 else codes[k] if codes else None
        reference = None
        if refs is not None:
            found = refs.find(path, by_name=path.name not in shared)
            if found is None and others_from is None:
                also = (" (its file name is another input's too, so only its path names it)"
                        if path.name in shared else "")  # fmt: skip
                raise UserError(f"--references {references}: no reference for {path}{also}")
            if found is not None:
                reference, language = found[0], found[1] or language
        clips.append(GuardClip(path, seconds, language, reference))
    return clips


class References:
    """Clip path -> ``(text, language or None)`` read from a references file; a clip is found by
    its path (a relative key: from the current directory or the file's) or, when no other key
    has it and no other input clip has it, its file name."""

    def __init__(self, rows: list[tuple[str, str, str | None]], where: Path):
        self.by_path: dict[Path, tuple[str, str | None]] = {}
        self.by_name: dict[str, tuple[str, str | None] | None] = {}
        for key, text, language in rows:
            value = (text, resolve_language(language, f"{where}: language") if language else None)
            for base in (Path.cwd(), where.parent):
                self.by_path[(base / key).resolve()] = value
            name = Path(key).name
            self.by_name[name] = None if name in self.by_name else value

    def find(self, path: Path, *, by_name: bool = True) -> tuple[str, str | None] | None:
        """``path``'s reference by its path, else (``by_name``) by its file name."""
        found = self.by_path.get(path.resolve())
        return found if found is not None or not by_name else self.by_name.get(path.name)


def read_references(path: Path) -> References:
    """A ``.jsonl`` file of objects, or a TSV (any other name): with a header row naming its
    columns (:data:`PATH_COLUMNS`, :data:`TEXT_COLUMNS`, optional :data:`LANGUAGE_COLUMNS`, as a
    Common Voice TSV has), else ``path<TAB>text[<TAB>language]`` per line.

    Raises:
        UserError: the file is missing or unreadable, or a row lacks its path or text.
    """
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--references {path}: cannot read it: {e}") from None
    if path.suffix.lower() == ".jsonl":
        try:
            records = [json.loads(line) for line in raw.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise UserError(f"--references {path}: not JSON lines: {e}") from None
    else:
        lines = list(csv.reader(raw.splitlines(), delimiter="\t", quoting=csv.QUOTE_NONE))
        lines = [line for line in lines if line]
        header = [c.strip().lower() for c in lines[0]] if lines else []
        if set(header) & set(PATH_COLUMNS) and set(header) & set(TEXT_COLUMNS):
            records = [dict(zip(header, line, strict=False)) for line in lines[1:]]
        else:
            records = [dict(zip(("path", "text", "language"), line, strict=False)) for line in lines]
    rows = []
    for n, record in enumerate(records, 1):
        key, text = _first(record, PATH_COLUMNS), _first(record, TEXT_COLUMNS)
        if key is None or text is None or not str(text).strip():
            raise UserError(f"--references {path}: row {n} has no clip path or no text "
                            f"(columns: {', '.join(PATH_COLUMNS)}; {', '.join(TEXT_COLUMNS)})")  # fmt: skip
        rows.append((str(key), str(text).strip(), _first(record, LANGUAGE_COLUMNS)))
    return References(rows, path)


def _first(record, names: Sequence[str]):
    """The value of the first of ``names`` that ``record`` (a row of a references file) fills."""
    if not isinstance(record, dict):
        return None
    return next((record[c] for c in names if record.get(c)), None)


def plan_windows(clips: Sequence[GuardClip], window_seconds: float = GUARD_WINDOW_SECONDS,
                 gap_seconds: float = GUARD_GAP_SECONDS) -> list[GuardWindow]:  # fmt: skip
    """The clips joined into recordings (decoded now), one language per recording, languages in
    the order they first appear, each clip once: clips in order while they fit in
    ``window_seconds`` with ``gap_seconds`` between them (:func:`guard_windows`); a clip longer
    than that is a recording of its own, which the guard cuts at pauses like any long one."""
    windows = []
    # Clips with a reference and clips without are never joined: a recording's reference is
    # wholly given or wholly the model's.
    for language, given in dict.fromkeys((c.language, c.reference is not None) for c in clips):
        group = [c for c in clips if c.language == language and (c.reference is not None) == given]
        fit = [(str(k), c.seconds) for k, c in enumerate(group)]
        names = guard_windows(fit, window_seconds, gap_seconds)
        names += [[str(k)] for k, c in enumerate(group) if c.seconds > window_seconds]
        for ids in names:
            members = [group[int(k)] for k in ids]
            wave = join_waves([_decode(c.path) for c in members], gap_seconds)
            refs = [c.reference for c in members]
            text = " ".join(refs) if all(refs) else None
            n = sum(w.language == language for w in windows)
            window_id = f"guard-{language}-{n:03d}" if language else f"guard-{n:03d}"
            windows.append(GuardWindow(window_id, language, members, wave, text))
    return windows


def _decode(path: Path) -> np.ndarray:
    wave = decode_audio(path, SAMPLE_RATE)
    if wave.size == 0:
        raise UserError(f"AUDIO {path}: empty audio (0 samples)")
    return wave


def check_out(out: Path) -> None:
    """Refuse an ``out`` that exists and is not an empty directory (checked before any work)."""
    if problem := empty_directory_problem(out):
        raise UserError(f"--out {problem}")


def write_guard_set(out: Path, windows: Sequence[GuardWindow]) -> Path:
    """Write the recordings (16 kHz 16-bit WAV) and :data:`MANIFEST` into ``out``, complete or
    not at all.

    Raises:
        UserError: ``out`` exists and is not an empty directory.
    """
    check_out(out)
    with atomic_directory(out) as tmp:
        rows = []
        for w in windows:
            sf.write(tmp / f"{w.id}.wav", w.wave, SAMPLE_RATE, subtype="PCM_16")
            # Relative to the manifest, as its audio is: valid whatever directory reads it.
            clips = [os.path.relpath(c.path.absolute(), out.absolute()) for c in w.clips]
            row = {"id": w.id, "audio": f"{w.id}.wav", "language": w.language,
                   "duration": round(w.seconds, 3), "clips": clips}  # fmt: skip
            if w.text is not None:
                row["text"] = w.text
            rows.append(json.dumps(row, ensure_ascii=False))
        (tmp / MANIFEST).write_text("\n".join(rows) + "\n", encoding="utf-8")
    return out
