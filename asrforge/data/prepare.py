"""A split's usable utterances: an Arrow split -> an :class:`UtteranceTable` and a skip report.

:func:`prepare_split` reads the metadata columns (text, language, a duration when the data has
one) with Arrow, never the audio, and skips what they rule out up front with its ids. What needs
the audio or the tokenizer is checked in full up front too (the evaluation split; packing and
the caches), or, for a lazily prepared training split, in the DataLoader workers. A split checked
in full is kept on disk under a :func:`prepared_split_key` (``<root>/<fingerprint>/table.npz`` and
``meta.json``), so a resume, the other ranks and the next run read it instead of checking again.

The usable rows are a few numpy arrays (row, language, seconds, text tokens: about 20 bytes a
row), not a Python object per row; an :class:`Utterance` is built from its Arrow row on demand.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asrforge.config import DataConfig
from asrforge.data.columns import arrow_columns, column_seconds, dictionary_encoded, language_codes
from asrforge.data.ids import audio_key, keys_digest, named, relocatable_keys, row_id, row_uids
from asrforge.data.rules import (
    AUDIO_CHECKED_AS_READ,
    EMPTY_TEXT,
    NOT_FOUND,
    SkipReport,
    UnusableAudio,
    UtteranceRules,
    check_english_only,
    check_language_tokens,
    header_seconds,
    language_filter,
    not_english,
    row_language,
    utterance_problem,
)
from asrforge.errors import CheckpointSaveError, UserError
from asrforge.io.atomic import atomic_directory
from asrforge.io.small_files import RECORDS_BYTES, read_json

log = logging.getLogger(__name__)

VERSION = 3
"""Bumped when what is stored, or how it is computed, changes."""


def tokenizer_identity(tokenizer) -> str:
    """sha256 of what decides a text's tokens and the prompts' ids: a fast tokenizer's model,
    normalizer, pre-tokenizer and added tokens (its post-processor, which only adds special
    tokens, differs between a tokenizer trained in this process and the same one loaded from
    disk), else its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        full = json.loads(backend.to_str())
        used = {k: full.get(k) for k in ("model", "normalizer", "pre_tokenizer", "added_tokens")}
    else:
        used = sorted(tokenizer.get_vocab().items())
    text = json.dumps(used, sort_keys=True)
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{text}".encode()).hexdigest()


def prepared_split_key(split, cfg, rules: UtteranceRules) -> str | None:
    """The key of ``split`` prepared in full under ``cfg`` (a ``DataConfig``) and ``rules``, or
    None when ``datasets`` gives the split no fingerprint.

    It covers the split (``datasets``' fingerprint follows its files and every transform, a
    carve's row selection included) and its row count, the data fields that filter, the
    tokenizer, the window and the decoder's positions. Not the audio files: one edited in place
    keeps its old duration until the cache directory is removed."""
    split_id = getattr(split, "_fingerprint", None)
    if not split_id:
        return None
    parts = {
        "version": VERSION,
        "split": split_id,
        "rows": len(split),
        "languages": cfg.languages,
        "task": cfg.task,
        "language_tokens": cfg.language_tokens,
        "multilingual": bool(rules.specials.multilingual),
        "tokenizer": tokenizer_identity(rules.tokenizer),
        "max_seconds": rules.max_seconds,
        "max_positions": rules.max_positions,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load_prepared(root: Path, key: str, split, name: str, rules: UtteranceRules):
    """``(table, skipped by reason, total, rows left out by data.languages per language)``
    stored under ``key``, or None when there is none (or it cannot be read, or was stored
    without the left-out counts: it is recomputed)."""
    directory = Path(root) / key
    try:
        meta = read_json(directory / "meta.json", RECORDS_BYTES, error=ValueError)
        with np.load(directory / "table.npz", allow_pickle=False) as columns:
            table = UtteranceTable(
                split,
                name,
                rules,
                rows=columns["rows"],
                languages=meta["languages"],
                language_index=columns["language_index"],
                seconds=columns["seconds"],
                n_tokens=columns["n_tokens"],
            )
        left_out = meta["left_out"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as e:
        log.warning("prepared split %s unusable (%s): checking the split again", directory, e)
        return None
    return table, meta["skipped"], meta["total"], left_out


def save_prepared(
    root: Path,
    key: str,
    table: UtteranceTable,
    skipped: dict,
    total: int,
    left_out: dict[str, int] | None = None,
) -> Path:
    """Store a table checked in full and its skip report under ``key`` (atomically).

    Raises:
        CheckpointSaveError: the directory could not be written (nothing is left half-written).
    """
    directory = Path(root) / key
    with atomic_directory(directory) as tmp:
        np.savez(
            tmp / "table.npz",
            rows=table.rows,
            language_index=table.language_index,
            seconds=table.seconds,
            n_tokens=table.n_tokens,
        )
        meta = {
            "languages": table.languages,
            "skipped": skipped,
            "total": total,
            "left_out": dict(left_out or {}),
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
    return directory


@dataclass
class Utterance:
    row: int  # row in the Arrow split
    uid: str
    language: str
    text: str
    prompt: list[int]
    text_ids: list[int]
    audio_key: str = ""  # the feature and encoder caches' key (see audio_key)
    # The audio's duration from its metadata or header, NaN where not known yet.
    seconds: float = 0.0


FINGERPRINT_KEYS = 2
"""The keys :meth:`UtteranceTable.fingerprint` digests now: each row's id (else its audio file's
name) and its text, so that a transcript edited under its id is other data. A fingerprint
without ``keys`` is of 1: the id alone where there is one."""
FINGERPRINT_KEYS_COMPARED = {
    1: "by id, else audio file name and text",
    2: "by id and text, else audio file name and text",
}
"""What a fingerprint of each kind of keys compares, as a refused resume says it."""


def fingerprint_compares(fingerprint: dict) -> str:
    """What ``fingerprint`` (:meth:`UtteranceTable.fingerprint`) tells utterances apart by."""
    return FINGERPRINT_KEYS_COMPARED[fingerprint.get("keys", 1)]


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

    def uids(self) -> list[str]:
        """Every utterance's id (reads the ids' column; for the few uses that need them all)."""
        return row_uids(self.split, self.name, self.rows)

    def fingerprint(self, keys: int = FINGERPRINT_KEYS) -> dict[str, int | str]:
        """What identifies these utterances in their order, without reading audio: their count
        (``utterances``), the sha256 of their rows' keys (``sha256``; :func:`relocatable_keys`,
        wherever the data was moved) and which keys those are (``keys``, of
        :data:`FINGERPRINT_KEYS_COMPARED`). ``keys``: 1 gives the fingerprint an older
        checkpoint recorded (no ``keys`` field), to compare with it."""
        with_text = keys >= FINGERPRINT_KEYS
        digest = keys_digest(relocatable_keys(self.split, self.rows, with_text=with_text))
        fingerprint = {"utterances": len(self), "sha256": digest}
        return {**fingerprint, "keys": keys} if with_text else fingerprint

    def fingerprint_as(self, recorded: dict, where: Path) -> dict[str, int | str]:
        """This table's fingerprint made as the checkpoint ``where``'s ``recorded`` one was (an
        older one's from ids alone), to compare with it.

        Raises:
            UserError: ``recorded`` names keys this asrforge does not know (a newer one's).
        """
        keys = recorded.get("keys", 1)
        if keys not in FINGERPRINT_KEYS_COMPARED:
            raise UserError(
                f"--resume: {where} records a fingerprint of its training data made from keys "
                f"{keys!r}, which this asrforge does not know: resume with the asrforge that "
                "saved it"
            )
        return self.fingerprint(keys)

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
            uid=row_id(record.get("id"), self.name, row),
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


def split_languages(split) -> set[str]:
    """The language codes of ``split``'s ``language`` column (its distinct values, read with
    Arrow; a value that names no language as it is)."""
    codes, _ = language_codes(arrow_columns(split, ["language"]).column("language"))
    return {code for code in codes if code}


def language_value_counts(split) -> Counter:
    """Rows per value of ``split``'s ``language`` column (read with Arrow; values as given)."""
    values, value_index = dictionary_encoded(arrow_columns(split, ["language"]).column("language"))
    counts = np.bincount(value_index, minlength=len(values)).tolist()
    return Counter(dict(zip(values, counts, strict=True)))


def prepare_split(
    split,
    name: str,
    *,
    cfg: DataConfig,
    tokenizer,
    specials,
    max_target_positions: int,
    max_seconds: float,
    lazy: bool = False,
    cache: Path | None = None,
    training: bool = True,
) -> tuple[UtteranceTable, SkipReport]:
    """The usable utterances of ``split`` and a report of the skipped ones.

    Up front, from metadata only (columns read with Arrow, no pass over the audio): the
    language filter (``data.languages``), the language-token check, empty text, and durations
    out of range when the data gives them (a ``duration`` column). Then, unless ``lazy``, every
    remaining row is checked in full: audio header (duration, missing or unreadable files) and
    label length. ``lazy`` leaves those to the DataLoader workers (``SpeechDataset``), which
    drop such a clip from its batch with the same reason.

    Args:
        training: the split trains or selects a run's checkpoints: an English-only model then
            refuses other languages (:func:`check_english_only`); ``asrforge evaluate`` scores
            whatever it is given.
        cache: a directory for the result of the full check (see the module docstring),
            read back when the split, tokenizer and limits are the same; None: no cache.
    """
    rules = UtteranceRules(tokenizer, specials, cfg.task, max_target_positions, max_seconds)
    key = prepared_split_key(split, cfg, rules) if cache is not None and not lazy else None
    stored = load_prepared(cache, key, split, name, rules) if key is not None else None
    if stored is not None:
        table, skipped, total, left_out = stored
        log.info("split %s: checked in full before, read from %s", name, Path(cache) / key)
        _log_language_tokens(name, table, specials)
        return table, SkipReport(name, total, skipped, left_out)
    report = SkipReport(split=name, total=len(split))
    table = _metadata_table(split, name, rules, cfg, report, training)
    if lazy:
        report.read_checks = AUDIO_CHECKED_AS_READ
    else:
        table = check_in_full(table, report)
    if key is not None:
        try:
            save_prepared(cache, key, table, report.skipped, report.total, report.left_out)
        except CheckpointSaveError as e:
            # The run goes on, and the next one checks the split again.
            log.warning("split %s: the checked split is not cached: %s", name, e)
    _log_language_tokens(name, table, specials)
    return table, report


def _metadata_table(split, name: str, rules: UtteranceRules, cfg: DataConfig,
                    report: SkipReport, training: bool = True) -> UtteranceTable:  # fmt: skip
    """The rows of ``split`` that pass the checks metadata allows (see :func:`prepare_split`),
    the others added to ``report``."""
    import pyarrow.compute as pc

    columns = ["text", "language"] + (["duration"] if "duration" in split.column_names else [])
    meta = arrow_columns(split, columns)
    values, value_index = dictionary_encoded(meta.column("language"))
    counts = np.bincount(value_index, minlength=len(values))
    by_value = Counter(dict(zip(values, counts.tolist(), strict=True)))
    if rules.specials.multilingual:
        unnamed = np.flatnonzero(np.isin(value_index, [k for k, v in enumerate(values) if not v]))
        check_language_tokens(by_value, name, rules.specials, language_filter(cfg.languages),
                              row_uids(split, name, unnamed[:10]))  # fmt: skip
    if training:
        check_english_only(
            by_value, name, rules.specials.multilingual, language_filter(cfg.languages)
        )
    elif not rules.specials.multilingual and (
        found := not_english(by_value, language_filter(cfg.languages))
    ):
        # scored all the same: how an English-only model fares on other speech is a measure too
        log.warning(
            "%s: English-only model: %s decoded with the English prompt (leave them out of "
            "the data, as evaluate --languages en does)", name, found,
        )  # fmt: skip
    codes = [row_language(v, rules.specials.multilingual) for v in values]
    languages = sorted(set(codes))
    code_of_value = np.asarray([languages.index(c) for c in codes], dtype=np.int16)
    language_index = code_of_value[value_index]
    keep_langs = language_filter(cfg.languages)
    wanted = np.ones(len(split), dtype=bool)
    # Rows left out on purpose are counted per language, not skipped.
    if keep_langs is not None:
        allowed = np.asarray([lang in keep_langs for lang in languages], dtype=bool)
        wanted = allowed[language_index]
        per_language = np.bincount(language_index[~wanted], minlength=len(languages))
        report.left_out = {lang: int(n) for lang, n in zip(languages, per_language, strict=True)
                           if n}  # fmt: skip
    text = meta.column("text")
    # "" or whitespace only, as str.strip() sees it; bitmaps, not a trimmed copy of every text
    blank = pc.or_(pc.equal(text, ""), pc.utf8_is_space(text))
    empty = pc.fill_null(blank, True).to_numpy(zero_copy_only=False)
    seconds = np.full(len(split), np.nan)
    if "duration" in columns:
        seconds = column_seconds(meta.column("duration"))
    # 0 for a kept row, else the index of its reason in `reasons` plus 1.
    reason = np.zeros(len(split), dtype=np.int8)
    by_seconds = rules.seconds_problems(seconds)
    reasons = [EMPTY_TEXT, *by_seconds]
    for k, rows in enumerate(by_seconds.values(), start=2):
        reason[rows] = k
    # Empty text is named over a duration's problem because utterance_problem checks it first.
    reason[empty] = 1
    reason[~wanted] = 0
    for k, why in enumerate(reasons, start=1):
        rows = np.flatnonzero(reason == k)
        for uid in row_uids(split, name, rows):
            report.add(why, uid)
    keep = wanted & (reason == 0)
    del meta, text  # the metadata columns are not kept
    used = np.unique(language_index[keep])  # the languages left out are not the table's
    renumber = np.zeros(len(languages), dtype=np.int16)
    renumber[used] = np.arange(len(used))
    return UtteranceTable(
        split, name, rules, rows=np.flatnonzero(keep), languages=[languages[k] for k in used],
        language_index=renumber[language_index[keep]], seconds=seconds[keep],
    )  # fmt: skip


def check_in_full(table: UtteranceTable, report: SkipReport, block: int = 1024) -> UtteranceTable:
    """``table`` without the utterances whose audio or labels are unusable (added to
    ``report``): every clip's audio header read (missing, no regular file or unreadable; its
    duration taken where the data gives none, the data's kept where it does), every text
    tokenized; ``n_tokens`` filled in."""
    rules = table.rules
    seconds = table.seconds.copy()
    n_tokens = np.zeros(len(table), dtype=np.int32)
    ok = np.ones(len(table), dtype=bool)
    prompt_lengths = table.prompt_lengths()
    source = table.split.select_columns(
        ["audio", "text"] + (["id"] if "id" in table.split.column_names else [])
    )
    for start in range(0, len(table), block):
        rows = table.rows[start : start + block]
        records = source[rows.tolist()] if len(rows) else {"audio": [], "text": []}
        n_tokens[start : start + len(rows)] = rules.count_tokens(records["text"])
        for k, (row, audio) in enumerate(zip(rows.tolist(), records["audio"], strict=True)):
            i = start + k
            try:
                # Every header is read, a known duration's too: a file that exists but holds
                # no audio it can read would otherwise pass and be dropped at every read.
                header = header_seconds(audio)
                if np.isnan(seconds[i]):
                    seconds[i] = header
            except UnusableAudio as e:
                uid = row_id(records.get("id", [None] * len(rows))[k], table.name, row)
                report.add(e.reason, named(uid, e.source) if e.reason == NOT_FOUND else uid)
                ok[i] = False
                continue
            problem = rules.seconds_problem(seconds[i])
            if problem is None and prompt_lengths[i] + n_tokens[i] + 1 > rules.max_positions:
                problem = rules.long_labels
            if problem is not None:
                uid = row_id(records.get("id", [None] * len(rows))[k], table.name, row)
                report.add(problem, uid)
                ok[i] = False
    full = UtteranceTable(
        table.split, table.name, rules, rows=table.rows, languages=table.languages,
        language_index=table.language_index, seconds=seconds, n_tokens=n_tokens,
    )  # fmt: skip
    return full.subset(ok)


def _log_language_tokens(name: str, table: UtteranceTable, specials) -> None:
    """Say which languages decode under another's token."""
    if not specials.multilingual:
        return
    for lang in sorted(set(table.language_counts()) & set(specials.token_of)):
        log.info(
            "split %s: language %s is decoded with <|%s|> (the tokenizer has no <|%s|>); "
            "checkpoint selection still goes by %s",
            name, lang, specials.token_of[lang], lang, lang,
        )
