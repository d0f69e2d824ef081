"""The rules that decide whether an utterance can be trained on, their skip reasons, and the
skip report.

:class:`UtteranceRules` are the checks ``prepare_split`` applies up front and a DataLoader worker
applies to a split prepared lazily (:func:`utterance_problem`, :func:`read_audio`): the same
rules, with the same reason strings, so the skip report (:class:`SkipReport`) reads alike either
way. A language the tokenizer has no token for stops the run (:func:`check_language_tokens`)
instead of dropping all of its utterances.

The ``language`` column and ``data.languages`` are resolved alike
(:func:`~asrforge.text.languages.resolve_language`): codes, English names and locales (``en``,
``English``, ``en-US``) are one language.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from asrforge.data.audio import (
    SAMPLE_RATE,
    audio_info,
    audio_problem,
    is_special_file,
    open_audio,
)
from asrforge.data.columns import language_codes
from asrforge.data.ids import audio_source
from asrforge.errors import UserError
from asrforge.io.atomic import atomic_write_text
from asrforge.text.languages import resolve_language

log = logging.getLogger(__name__)


EMPTY_TEXT = "empty text"


EMPTY_AUDIO = "empty audio (0 samples)"


NOT_FOUND = "audio file not found"


UNREADABLE = "unreadable audio"


NOT_A_FILE = "audio path is not a regular file"


NEGATIVE_DURATION = "negative duration in the data"


def long_audio(max_seconds: float) -> str:
    """The skip reason of audio longer than ``max_seconds``."""
    return f"audio longer than {max_seconds:g} s"


class UnusableAudio(UserError):
    """Audio that cannot be trained or evaluated on; ``reason`` is the skip report's."""

    def __init__(self, reason: str, source: bytes | str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.source = source


@dataclass(frozen=True)
class UtteranceRules:
    """What an utterance must satisfy, and how its decoder tokens are made."""

    tokenizer: Any
    # The SpecialTokens that give a language's prompt.
    specials: Any
    task: str
    max_positions: int
    """The decoder's positions (``max_target_positions``): prompt + text + end of text."""
    max_seconds: float
    """The model's window."""

    @property
    def long_labels(self) -> str:
        return f"labels longer than {self.max_positions} tokens"

    @property
    def long_audio(self) -> str:
        return long_audio(self.max_seconds)

    @cached_property
    def max_text_chars(self) -> int:
        """Characters past which a text has more tokens than the decoder holds, whatever they
        are: no token covers more characters than the vocabulary's longest entry has."""
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return self.max_positions * max(longest, 1)

    def _label_text(self, text: str) -> str:
        # A text too long by its length alone is tokenized only as far as shows it: its count
        # still passes the limit, and a 20 MB transcript no longer costs gigabytes.
        return " " + text.strip()[: self.max_text_chars]

    def text_ids(self, text: str) -> list[int]:
        """The text's tokens; past :attr:`max_text_chars` those of its start only (too many
        either way)."""
        return self.tokenizer.encode(self._label_text(text), add_special_tokens=False)

    def count_tokens(self, texts: list[str]) -> np.ndarray:
        """Text tokens of each of ``texts`` (one batched call of the fast tokenizer), as
        :meth:`text_ids` counts them."""
        if not texts:
            return np.zeros(0, dtype=np.int32)
        ids = self.tokenizer([self._label_text(t) for t in texts], add_special_tokens=False)
        return np.fromiter((len(x) for x in ids["input_ids"]), dtype=np.int32, count=len(texts))

    def prompt(self, language: str) -> list[int]:
        return self.specials.prompt(language, self.task)

    def seconds_problems(self, seconds: np.ndarray) -> dict[str, np.ndarray]:
        """Reason -> boolean mask of the durations ``seconds`` (a data set's ``duration`` column
        or headers) it applies to; NaN (not known) is in none."""
        seconds = np.asarray(seconds, dtype=np.float64)
        return {
            NEGATIVE_DURATION: seconds < 0,
            EMPTY_AUDIO: seconds == 0,
            self.long_audio: seconds > self.max_seconds,
        }

    def seconds_problem(self, seconds: float) -> str | None:
        """Why audio of ``seconds`` is unusable, or None (NaN: not known, nothing to say)."""
        found = self.seconds_problems(np.asarray([seconds]))
        return next((why for why, rows in found.items() if rows[0]), None)


def utterance_problem(
    rules: UtteranceRules,
    *,
    text: str | None,
    n_prompt: int,
    n_text: int,
    seconds: float = math.nan,
) -> str | None:
    """Why an utterance cannot be trained on, from what is known without its audio, or None.

    Args:
        text: the transcript (None or blank: empty text).
        n_prompt: tokens of its prompt (``rules.prompt(language)``).
        n_text: tokens of its text (``rules.text_ids(text)``).
        seconds: its duration when known (metadata or header), else NaN.
    """
    if text is None or not text.strip():
        return EMPTY_TEXT
    if n_prompt + n_text + 1 > rules.max_positions:
        return rules.long_labels
    return None if math.isnan(seconds) else rules.seconds_problem(seconds)


def file_problem(source) -> str | None:
    """Why the audio file ``source`` cannot be opened (missing, or no regular file: a FIFO would
    block its reader), or None (bytes, or a regular file)."""
    if not isinstance(source, str):
        return None
    if not Path(source).exists():
        return NOT_FOUND
    return NOT_A_FILE if is_special_file(source) else None


def read_audio(audio, max_seconds: float | None = None) -> np.ndarray:
    """Decode an undecoded ``Audio`` value: (n_samples,) float32 at 16 kHz.

    Args:
        max_seconds: refuse audio longer than this (its header read first: a duration given by
            the data may understate a file hours long, which is then never decoded).

    Raises:
        UnusableAudio: the file is missing, no regular file, unreadable, empty, NaN/inf or too
            long.
    """
    src = audio_source(audio)
    if src is None:
        raise UnusableAudio(UNREADABLE)
    try:
        with open_audio(src) as opened:
            too_long = max_seconds is not None and opened.seconds > max_seconds
            wave = None if too_long else opened.decode()
    except UserError:
        raise UnusableAudio(file_problem(src) or UNREADABLE, src) from None
    if wave is None:
        raise UnusableAudio(long_audio(max_seconds), src)
    problem = audio_problem(wave)
    if problem is not None:
        raise UnusableAudio(problem, src)
    if max_seconds is not None and wave.shape[0] > max_seconds * SAMPLE_RATE:
        raise UnusableAudio(long_audio(max_seconds), src)
    return wave


def header_seconds(audio) -> float:
    """The audio's duration from its header.

    Raises:
        UnusableAudio: the file is missing, no regular file, or unreadable.
    """
    src = audio_source(audio)
    try:
        if src is None:
            raise ValueError("no audio")
        return audio_info(src)[1]
    except Exception:  # noqa: BLE001 - any decoder failure means the same: unreadable
        raise UnusableAudio(file_problem(src) or UNREADABLE, src) from None


def language_filter(languages: list[str] | None, where: str = "data.languages") -> set[str] | None:
    """The codes of ``languages`` (codes, names or locales), or None for "all".

    Raises:
        UserError: an entry names no known language (by its path, e.g. ``data.languages.1``).
    """
    if not languages:
        return None
    codes, unknown = set(), []
    for i, x in enumerate(languages):
        try:
            codes.add(resolve_language(x, f"{where}.{i}"))
        except UserError as e:
            unknown.append(str(e))
    if unknown:
        raise UserError("; ".join(unknown))
    return codes


def unheard_languages(
    languages: list[str] | None, counts: Mapping[str, int], where: str = "data.languages"
) -> list[str]:
    """The entries of ``languages`` (``where``, e.g. ``data.languages``: codes, names or
    locales) whose language no row of ``counts`` (rows by language code, of the training split
    as kept) holds."""
    if not languages:
        return []
    return [x for i, x in enumerate(languages)
            if not counts.get(resolve_language(x, f"{where}.{i}"))]  # fmt: skip


CHECKED_AS_READ = "each row is checked as it is read"
"""A streamed split's checks: none of them is made before training reads the row."""
AUDIO_CHECKED_AS_READ = "audio and label lengths are checked as the rows are read"
"""A lazily prepared split's checks left to training: its metadata was checked up front."""


@dataclass
class SkipReport:
    """What filtering dropped, by reason, and what ``data.languages`` left out on purpose (counts
    per language code: not a defect of the data, so not in ``skipped-<split>.json``)."""

    split: str
    total: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)
    left_out: dict[str, int] = field(default_factory=dict)
    read_checks: str = ""
    """The checks made only as training reads the rows, as the log says it (a stream's
    :data:`CHECKED_AS_READ`, a lazily prepared split's :data:`AUDIO_CHECKED_AS_READ`); empty: the
    split was checked in full. What they skip is added at each save (:meth:`with_dropped`)."""

    def add(self, reason: str, uid: str) -> None:
        self.skipped.setdefault(reason, []).append(uid)

    @property
    def n_skipped(self) -> int:
        return sum(len(v) for v in self.skipped.values())

    @property
    def n_left_out(self) -> int:
        return sum(self.left_out.values())

    def with_dropped(self, dropped: dict[str, list[str]]) -> SkipReport:
        """This report and the clips the workers dropped since (each id once per reason)."""
        merged = {k: list(v) for k, v in self.skipped.items()}
        SkipReport.merge(merged, dropped)
        return SkipReport(self.split, self.total, merged, dict(self.left_out))

    @staticmethod
    def merge(skipped: dict[str, list[str]], dropped: dict[str, list[str]]) -> list[str]:
        """Add ``dropped`` (ids by reason) to ``skipped`` in place, each id once per reason: a
        clip is dropped again every epoch, and every rank's drops are gathered into each one.

        Returns:
            The ids added, reason by reason in ``dropped``'s order (one id may be added under
            two reasons).
        """
        added = []
        for reason, uids in dropped.items():
            have = skipped.setdefault(reason, [])
            seen = set(have)
            new = [u for u in dict.fromkeys(uids) if u not in seen]
            have += new
            added += new
        return added

    def write(self, out_dir: Path) -> Path | None:
        """``out_dir/skipped-<split>.json`` (atomically), when anything was skipped."""
        if not self.n_skipped:
            return None
        target = Path(out_dir) / f"skipped-{self.split}.json"
        atomic_write_text(target, json.dumps(self.skipped, indent=1))
        return target

    def log(self, out_dir: Path | None, when: str = "") -> None:
        """Log the counts kept, left out by ``data.languages`` and skipped, and the skipped ids
        (and write them to ``out_dir``); ``when``: what the counts cover, e.g. "up to step
        200"."""
        kept = self.total - self.n_skipped - self.n_left_out
        # with data.languages: "40 utterances: 18 kept, 20 left out by data.languages (es 20), "
        share = ""
        if self.left_out:
            per_language = ", ".join(f"{lang} {n}" for lang, n in sorted(self.left_out.items()))
            share = f": {kept} kept, {self.n_left_out} left out by data.languages ({per_language}),"
        # a split checked as it is read knows only what its checks up front skipped
        later = f"; {self.read_checks}, and what that skips is reported at each save"
        later, up_front = (later, " up front") if self.read_checks else ("", "")
        if not self.n_skipped:
            log.info("split %s: %d utterances%s none skipped%s%s", self.split, self.total,
                     share or ",", up_front, later)  # fmt: skip
            return
        counts = ", ".join(f"{len(v)} {k}" for k, v in self.skipped.items())
        ids = [u for v in self.skipped.values() for u in v]
        shown = ", ".join(ids[:20]) + (f" ... (+{len(ids) - 20})" if len(ids) > 20 else "")
        target = self.write(out_dir) if out_dir is not None else None
        where = f"; all ids in {target}" if target is not None else ""
        if share:
            log.warning(
                "split %s: %d utterances%s %d skipped%s%s (%s): %s%s%s",
                self.split, self.total, share, self.n_skipped, up_front, when, counts, shown,
                where, later,
            )  # fmt: skip
            return
        log.warning(
            "split %s: skipped %d of %d utterances%s%s (%s): %s%s%s",
            self.split, self.n_skipped, self.total, up_front, when, counts, shown, where, later,
        )  # fmt: skip

    def nothing_usable(self, path: Path, languages: list[str] | None) -> UserError:
        """The error of a split with no usable utterance; when ``data.languages`` left rows out,
        it names the languages the split has, and it names skipped clips by reason."""
        message = f"data: no usable utterances in split {self.split!r} of {Path(path)}"
        if self.left_out:
            has = ", ".join(f"{lang} ({n})" for lang, n in sorted(self.left_out.items()))
            message += (
                f": data.languages {languages} leaves out {self.n_left_out} of its "
                f"{self.total} utterances, whose languages are {has}"
            )
            if self.n_skipped:
                message += f", and {self.n_skipped} were skipped ({skip_examples(self.skipped)})"
            return UserError(message)
        return no_usable_clips(self.split, Path(path), self.skipped)


def no_usable_clips(
    split: str,
    where,
    skipped: dict[str, list[str]],
    counts: dict[str, int] | None = None,
    how: str = "skipped",
) -> UserError:
    """The error of a split none of whose clips can be used, found up front or as they are read:
    the split, what holds it (``where``), and its clips by reason (:func:`skip_examples`)."""
    n = sum(counts.values()) if counts is not None else sum(len(v) for v in skipped.values())
    message = f"data: no usable utterances in split {split!r} of {where}"
    if n:
        message += f": all {n} clips were {how} ({skip_examples(skipped, counts)})"
    return UserError(message)


def skip_examples(
    skipped: dict[str, list[str]], counts: dict[str, int] | None = None, shown: int = 3
) -> str:
    """Skipped clips by reason, a few ids of each: ``2 unreadable audio: a.wav, b.wav``.

    Args:
        counts: clips per reason where ``skipped`` holds only some of their ids.
    """
    parts = []
    for reason, uids in skipped.items():
        n = counts[reason] if counts is not None else len(uids)
        more = f" ... (+{n - shown})" if n > shown else ""
        parts.append(f"{n} {reason}: {', '.join(uids[:shown])}{more}")
    return "; ".join(parts)


def check_language_tokens(
    counts: Counter, split: str, specials, keep: set[str] | None,
    unnamed_ids: list[str] | None = None,
) -> None:
    """Refuse a language (a value of the ``language`` column) the tokenizer has no token for:
    training would otherwise drop every one of its utterances.

    Args:
        counts: utterances per value of the ``language`` column.
        unnamed_ids: ids of (some of) the rows that give no language, to name them.

    Raises:
        UserError: naming each such value, its utterance count and the ways to fix it; rows
            without a language by their ids.
    """
    tokenless: dict[str | None, int] = {}
    for value, n in counts.items():
        code = resolve_language(value, strict=False)
        if (keep is None or code in keep) and specials.token_language(code) is None:
            tokenless[value] = n
    if not tokenless:
        return
    problems = []
    unnamed = sum(n for v, n in tokenless.items() if not v)
    if unnamed:
        problems.append(_no_language(unnamed, unnamed_ids))
    found = ", ".join(_language_value(v, n) for v, n in tokenless.items() if v)
    if found:
        problems.append(
            f"language {found} has no token in this tokenizer. Map it to an existing token "
            "(data.language_tokens, e.g. {lg: sw}), add its token with `asrforge vocab build`, "
            "or leave it out (data.languages); a value that names no language: give ISO codes, "
            "English names or locales (data.columns.language names the column)"
        )
    raise UserError(f"data: split {split!r}: " + "; and ".join(problems))


def _no_language(n: int, ids: list[str] | None) -> str:
    """What to say of the ``n`` rows whose ``language`` cell is empty (``ids``: some of them)."""
    which = ""
    if ids:
        which = f" (ids {', '.join(ids[:10])}{f' ... (+{n - 10})' if n > 10 else ''})"
    return (
        f"{n} utterance(s) give no language{which}. Fill in their language cells, set "
        "data.language (e.g. data.language=sw) when all of the data is one language, or name "
        "the column that holds it with data.columns.language"
    )


def check_english_only(counts: Counter, split: str, multilingual: bool, keep: set[str] | None) -> None:
    """Under an English-only model (``*.en``, not ``multilingual``: its prompt has no language
    slot), refuse a language other than English (a value of the ``language`` column): its
    utterances would train under the English prompt, and the bundle would then refuse to
    transcribe it. A row without a language is English's. Nothing to check for a multilingual
    model.

    Raises:
        UserError: naming each such value, its utterance count and the ways to fix it.
    """
    if multilingual or not (found := not_english(counts, keep)):
        return
    raise UserError(
        f"data: split {split!r}: English-only model: its prompt has no language slot, so it "
        f"cannot be taught {found}. Relabel the data as English (data.language: en) to train "
        "the English-only prompt on it, leave those utterances out (data.languages: [en]), or "
        "start from a multilingual Whisper (model.pretrained); asrforge does not turn an "
        "English-only model into a multilingual one"
    )


def not_english(counts: Counter, keep: set[str] | None = None, unit: str = "utterance") -> str:
    """The values of ``counts`` (``language`` values and how many ``unit`` each) an
    English-only model cannot be taught or asked to transcribe, as messages list them (``'es'
    (3 utterances)``; ``unit`` in the singular; ``keep``: only these codes count); ``""`` when
    there is none."""
    other = {value: n for value, n in counts.items()
             if value and not is_english(value) and (keep is None or resolve_language(value, strict=False) in keep)}  # fmt: skip
    return ", ".join(_language_value(v, n, unit) for v, n in other.items())


def row_language(value: str | None, multilingual: bool) -> str:
    """The language code a row's ``language`` value trains as (:func:`resolve_language`; a
    value that names no language as it is). A row without one is English's under an
    English-only model, whose prompt has no language slot; under a multilingual model it stays
    ``""``, which :func:`check_language_tokens` refuses."""
    code = resolve_language(value, strict=False)
    return code or ("" if multilingual else "en")


def kept_rows(column, keep: set[str] | None, multilingual: bool) -> np.ndarray:
    """Which rows of an Arrow column of language values ``data.languages`` keeps (``keep``, its
    codes from :func:`language_filter`; None keeps all), each row keyed as it trains
    (:func:`row_language`): a boolean mask."""
    codes, index = language_codes(column)
    if keep is None:
        return np.ones(len(index), dtype=bool)
    kept = np.asarray([row_language(c, multilingual) in keep for c in codes], dtype=bool)
    return kept[index]


def left_out_counts(counts: Counter, keep: set[str] | None) -> dict[str, int]:
    """Rows per language that ``data.languages`` leaves out (``keep``, :func:`language_filter`'s
    codes; None leaves none out), of ``counts`` keyed as the rows train
    (:func:`trained_languages`)."""
    if keep is None:
        return {}
    return {lang: n for lang, n in counts.items() if n and lang not in keep}


def trained_languages(counts: Counter, multilingual: bool) -> Counter:
    """``counts`` (rows per language code, ``""`` for none) keyed as rows train
    (:func:`row_language`)."""
    out: Counter = Counter()
    for code, n in counts.items():
        out[row_language(code, multilingual)] += n
    return out


def is_english(value: str | None) -> bool:
    """Whether a ``language`` value is English (or empty: an English-only model's every row)."""
    return not value or resolve_language(value, strict=False) == "en"


def _language_value(value: str, n: int, unit: str = "utterance") -> str:
    code = resolve_language(value, strict=False)
    return f"{value!r} ({n} {unit}{'s' * (n != 1)}{'' if code == value else f', code {code!r}'})"
