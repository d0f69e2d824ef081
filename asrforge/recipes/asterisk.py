"""Real human speech in five languages: the prompts of Debian's ``asterisk-core-sounds-XX-wav``
packages (one professional speaker per language, telephone prompts) with the transcripts their
``asterisk-core-sounds-XX`` siblings ship (``core-sounds-XX.txt.gz``, lines ``name: text``).

The multilingual demo guards each language with some of them and rehearses with others
(:func:`split_prompts`); no prompt is in both.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from asrforge.data.audio import audio_info
from asrforge.data.guard_set import (
    GUARD_GAP_SECONDS,
    GUARD_WINDOW_SECONDS,
    MANIFEST,
    GuardClip,
    guard_windows,
    plan_windows,
    write_guard_set,
)
from asrforge.errors import UserError
from asrforge.io.atomic import atomic_write_text

SOUNDS_ROOT = Path("/usr/share/asterisk/sounds")
DOC_ROOT = Path("/usr/share/doc")
VOICES = {
    "en": "en_US_f_Allison",
    "es": "es_MX_f_Allison",
    "fr": "fr_CA_f_June",
    "it": "it_IT_m_Carlo",
    "ru": "ru_RU_f_IvrvoiceRU",
}
"""Language -> the directory of its speaker's prompts under :data:`SOUNDS_ROOT`."""
SENTENCE_SECONDS = (2.0, 15.0)
"""Prompts of this length (seconds) are used: sentences and phrases, not single words."""


@dataclass(frozen=True)
class Prompt:
    """One recorded prompt and its transcript."""

    name: str
    path: Path
    text: str
    seconds: float
    language: str


def packages(language: str) -> tuple[str, str]:
    """``(audio package, transcript package)`` of ``language``'s prompts."""
    return f"asterisk-core-sounds-{language}-wav", f"asterisk-core-sounds-{language}"


def sounds_dir(language: str) -> Path:
    """Where ``language``'s prompts are (:data:`SOUNDS_ROOT` as set when called)."""
    return SOUNDS_ROOT / VOICES[language]


def transcripts_file(language: str) -> Path:
    """``language``'s transcripts (:data:`DOC_ROOT` as set when called)."""
    return DOC_ROOT / packages(language)[1] / f"core-sounds-{language}.txt.gz"


def require(languages: list[str]) -> None:
    """Check, before anything runs, that every language's two packages are installed.

    Raises:
        UserError: naming each missing package and the command that installs them.
    """
    missing = []
    for lang in languages:
        audio, text = packages(lang)
        if not sounds_dir(lang).is_dir():
            missing.append(audio)
        if not transcripts_file(lang).is_file():
            missing.append(text)
    if missing:
        raise UserError(
            f"demo: the real speech comes from Debian's {', '.join(missing)}, not installed: "
            f"`sudo apt-get install {' '.join(missing)}` (`make demo-data` installs them when "
            "it may)"
        )


def read_transcripts(path: Path) -> dict[str, str]:
    """Prompt name -> text from a ``core-sounds-XX.txt.gz`` (``;`` comments and tones, the
    ``[bracketed]`` lines, left out).

    Raises:
        UserError: the file cannot be read.
    """
    try:
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read it: {e}") from None
    texts = {}
    for line in lines:
        name, sep, text = line.partition(":")
        text = text.strip()
        if not sep or line.startswith(";") or not text or text.startswith("["):
            continue
        texts[name.strip()] = text
    return texts


def prompts(language: str, seconds: tuple[float, float] | None = None) -> list[Prompt]:
    """``language``'s prompts with a transcript and a length within ``seconds`` (default
    :data:`SENTENCE_SECONDS`), in name order (those directly in the speaker's directory: its
    sub-directories hold digits and letters)."""
    texts = read_transcripts(transcripts_file(language))
    lo, hi = seconds or SENTENCE_SECONDS
    found = []
    for path in sorted(sounds_dir(language).glob("*.wav")):
        text = texts.get(path.stem)
        if text is None:
            continue
        _, length = audio_info(path)
        if lo <= length <= hi:
            found.append(Prompt(path.stem, path, text, length, language))
    return found


def split_prompts(found: list[Prompt], guard_windows_n: int) -> tuple[list[Prompt], list[Prompt]]:
    """``(guard, rest)``: every other prompt goes to the guard until its prompts fill
    ``guard_windows_n`` joined recordings (:func:`~asrforge.data.guard_set.guard_windows`), so
    the guard samples the whole package; the rest (rehearsal, a real test set) never meets it."""
    candidates = found[::2]
    windows = guard_windows(
        [(str(k), p.seconds) for k, p in enumerate(candidates)],
        GUARD_WINDOW_SECONDS,
        GUARD_GAP_SECONDS,
    )[:guard_windows_n]
    guard = [candidates[int(k)] for w in windows for k in w]
    taken = {p.name for p in guard}
    return guard, [p for p in found if p.name not in taken]


def ensure_guard(dest: Path, guard: list[Prompt]) -> Path:
    """A guard set at ``dest`` of the prompts joined per language, each recording with its real
    reference (:mod:`asrforge.data.guard_set`); kept when it already holds exactly these
    prompts."""
    manifest = dest / MANIFEST
    wanted = sorted(str(p.path) for p in guard)
    if manifest.is_file():
        rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
        held = sorted(str((dest / c).resolve()) for r in rows for c in r.get("clips", []))
        if held == sorted(str(Path(w).resolve()) for w in wanted):
            return dest
        # A guard of other prompts (another version of the demo) is rebuilt.
        for path in dest.iterdir():
            path.unlink()
        dest.rmdir()
    clips = [GuardClip(p.path, p.seconds, p.language, p.text) for p in guard]
    return write_guard_set(dest, plan_windows(clips))


def write_manifest(dest: Path, rows: list[Prompt]) -> Path:
    """A JSONL manifest of the prompts (``audio``, ``text``, ``language``, ``duration``), as
    ``data.path`` or ``data.replay.path`` reads it."""
    lines = [
        json.dumps({"id": f"{p.language}-{p.name}", "audio": str(p.path), "text": p.text,
                    "language": p.language, "duration": round(p.seconds, 3)},
                   ensure_ascii=False)
        for p in rows
    ]  # fmt: skip
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(dest, "\n".join(lines) + "\n")
    return dest
