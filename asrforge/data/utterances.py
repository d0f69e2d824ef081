"""Utterances as columns, and the rules that decide whether one can be trained on.

A split's usable rows are held as a few numpy arrays (:class:`UtteranceTable`: row, language,
seconds and, once counted, text tokens; about 20 bytes a row), not a Python object per row, so
a million-row manifest costs megabytes. An :class:`Utterance` (id, text, tokens, audio key) is
built when one is asked for, from its row of the Arrow split.

:class:`UtteranceRules` are the checks ``prepare_split`` applies up front and a DataLoader worker
applies to a split prepared lazily (:func:`utterance_problem`, :func:`read_audio`): the same
rules, with the same reason strings, so the skip report reads alike either way.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
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
from asrforge.errors import UserError

EMPTY_TEXT = "empty text"
EMPTY_AUDIO = "empty audio (0 samples)"
NOT_FOUND = "audio file not found"
UNREADABLE = "unreadable audio"
NOT_A_FILE = "audio path is not a regular file"
NEGATIVE_DURATION = "negative duration in the data"


def long_audio(max_seconds: float) -> str:
    """The skip reason of audio longer than ``max_seconds``."""
    return f"audio longer than {max_seconds:g} s"


@dataclass
class Utterance:
    row: int  # row in the Arrow split
    uid: str
    language: str
    text: str
    prompt: list[int]
    text_ids: list[int]
    audio_key: str = ""  # the feature and encoder caches' key (see audio_key)
    seconds: float = 0.0  # the audio's duration (metadata or header; NaN: not known yet)


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
    specials: Any  # SpecialTokens: the prompt of a language
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


def audio_source(audio) -> bytes | str | None:
    """The encoded bytes of an undecoded ``Audio`` value, else its path (None: neither)."""
    if not isinstance(audio, dict):
        return None
    return audio.get("bytes") or audio.get("path") or None


def audio_key(audio) -> str:
    """The feature and encoder caches' key: sha256 of the audio's bytes, or of its path with the
    file's size and modification time (a file rewritten in place is other audio: the caches,
    which may outlive a run in ``data.cache_dir``, must not serve its old log-mels)."""
    src = audio_source(audio)
    if isinstance(src, bytes):
        return hashlib.sha256(src).hexdigest()
    name = str(src)
    try:
        stat = os.stat(name)
        name = f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}"
    except OSError:  # missing: the worker reports it when it reads the audio
        pass
    return hashlib.sha256(name.encode()).hexdigest()


def named(uid: str, source) -> str:
    """How the skip report names a clip whose file is missing: its id, and the path when the id
    does not say it."""
    return uid if not isinstance(source, str) or source.endswith(uid) else f"{uid} ({source})"


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


def arrow_columns(split, names: list[str]):
    """``names`` of the ``datasets`` split as one ``pyarrow.Table`` in the split's row order.

    A split selected from another (a carve) maps its rows through an indices table;
    ``with_format("arrow")[:]`` gathers such rows one slice at a time (25 s and 3 GB for a
    million), ``Table.take`` in one vectorized call.
    """
    table = split.data.table.select(names)
    indices = getattr(split, "_indices", None)  # datasets' row map of a select(); None: identity
    return table if indices is None else table.take(indices.column(0))


def dictionary_encoded(column) -> tuple[list, np.ndarray]:
    """(distinct values, each row's index into them) of an Arrow string column (nulls too)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(pa.chunked_array(column), null_encoding="encode")
    encoded = encoded.combine_chunks() if isinstance(encoded, pa.ChunkedArray) else encoded
    return encoded.dictionary.to_pylist(), encoded.indices.to_numpy(zero_copy_only=False)


def column_seconds(column) -> np.ndarray:
    """A ``duration`` column as float64 seconds, NaN where null.

    Raises:
        UserError: the column holds no numbers.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        numbers = pc.cast(column, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise UserError(
            f"data.columns.duration: the duration column holds {column.type}, expected seconds"
        ) from None
    return pc.fill_null(numbers, float("nan")).to_numpy()


def row_uids(split, name: str, rows: np.ndarray) -> list[str]:
    """The ids of ``rows`` of ``split``, as :meth:`UtteranceTable.uid_of_row` names one: the
    id the data gives (its ``id`` cell, or its audio path; :func:`~asrforge.data.sources.row_ids`),
    or ``<name>-<row>`` where it gives none or the cell is empty."""
    from asrforge.data.sources import row_ids

    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) == 0:
        return []
    ids = row_ids(split, rows)
    if ids is None:
        return [f"{name}-{r}" for r in rows.tolist()]
    return [f"{name}-{r}" if x is None else x for x, r in zip(ids, rows.tolist(), strict=True)]


class UtteranceTable(Sequence):
    """The usable utterances of an Arrow split, as columns; ``table[i]`` is an
    :class:`Utterance`, built from the split's row on demand (nothing per row is cached).

    Attributes:
        rows: (n,) int64 row of each utterance in ``split``.
        language_index: (n,) int16 index into ``languages`` (codes).
        seconds: (n,) float64 duration, NaN where not known (read when the audio is).
        n_tokens: (n,) int32 text tokens, or None when the split was prepared lazily (its
            labels are checked in the workers).
    """

    def __init__(
        self,
        split,
        name: str,
        rules: UtteranceRules,
        *,
        rows: np.ndarray,
        languages: list[str],
        language_index: np.ndarray,
        seconds: np.ndarray,
        n_tokens: np.ndarray | None = None,
    ):
        self.split, self.name, self.rules = split, name, rules
        self.rows = np.asarray(rows, dtype=np.int64)
        self.languages = list(languages)
        self.language_index = np.asarray(language_index, dtype=np.int16)
        self.seconds = np.asarray(seconds, dtype=np.float64)
        self.n_tokens = None if n_tokens is None else np.asarray(n_tokens, dtype=np.int32)

    @property
    def lazy(self) -> bool:
        """Labels and audio are checked when an item is built (see :func:`utterance_problem`)."""
        return self.n_tokens is None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.subset(np.arange(len(self))[i])
        return self.utterance(int(i))

    def subset(self, keep: np.ndarray) -> UtteranceTable:
        """The utterances at positions (or where the boolean mask) ``keep``, in its order."""
        return UtteranceTable(
            self.split,
            self.name,
            self.rules,
            rows=self.rows[keep],
            languages=self.languages,
            language_index=self.language_index[keep],
            seconds=self.seconds[keep],
            n_tokens=None if self.n_tokens is None else self.n_tokens[keep],
        )

    def language(self, i: int) -> str:
        return self.languages[self.language_index[i]]

    def language_counts(self) -> Counter:
        """Utterances per language code."""
        counts = np.bincount(self.language_index, minlength=len(self.languages))
        return Counter({lang: int(n) for lang, n in zip(self.languages, counts, strict=True) if n})

    def prompt_lengths(self) -> np.ndarray:
        """(n,) int32 tokens of each utterance's prompt (one per language)."""
        per_language = [len(self.rules.prompt(lang)) for lang in self.languages]
        return np.asarray(per_language, dtype=np.int32)[self.language_index]

    def uid_of_row(self, record: dict, row: int) -> str:
        return str(record["id"]) if record.get("id") is not None else f"{self.name}-{row}"

    def uids(self) -> list[str]:
        """Every utterance's id (reads the ids' column; for the few uses that need them all)."""
        return row_uids(self.split, self.name, self.rows)

    def record(self, i: int) -> dict:
        """Utterance ``i``'s row of the split (audio undecoded)."""
        return self.split[int(self.rows[i])]

    def utterance(self, i: int) -> Utterance:
        """Utterance ``i``: its row read, its text tokenized."""
        row = int(self.rows[i])
        record = self.split[row]
        language = self.language(i)
        text = (record["text"] or "").strip()
        return Utterance(
            row=row,
            uid=self.uid_of_row(record, row),
            language=language,
            text=text,
            prompt=self.rules.prompt(language),
            text_ids=self.rules.text_ids(text),
            audio_key=audio_key(record["audio"]),
            seconds=float(self.seconds[i]),
        )

    def problem(self, u: Utterance) -> str | None:
        """Why utterance ``u`` of a lazily prepared table cannot be trained on (None: it can, as
        far as its text and metadata tell)."""
        return utterance_problem(
            self.rules, text=u.text, n_prompt=len(u.prompt), n_text=len(u.text_ids),
            seconds=u.seconds,
        )  # fmt: skip
