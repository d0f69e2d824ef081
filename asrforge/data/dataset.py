"""ASR datasets: an Arrow split -> its usable utterances -> (log-mel, prompt, labels) batches.

:func:`prepare_split` reads the split's metadata columns (text, language, a duration when the
data has one) with Arrow, never the audio: the language filter, empty text and durations out of
range are skipped up front with their ids, and a language the tokenizer has no token for stops
the run (:func:`check_language_tokens`) instead of dropping all of its utterances. What needs
the audio or the tokenizer (labels longer than the decoder allows, missing, unreadable, empty or
over-long audio) is either checked in full up front too (the evaluation split; packing and the
caches, which need every clip's duration, tokens or audio key; cached by fingerprint,
:mod:`asrforge.data.prepared`), or, for a lazily prepared training split, in the DataLoader
workers. The usable rows are an :class:`~asrforge.data.utterances.UtteranceTable` (numpy
columns, no Python object per row).

Log-mels are computed in DataLoader workers; a clip that turns out unusable there (NaN/inf
samples, a failed decode, or the lazy checks) is dropped from its batch with its id and the
skip report's reason (``Collator``), and reported by the loop (``skipped-<split>.json``) and by
evaluation.

The ``language`` column and ``data.languages`` are resolved alike (:func:`data_language`): codes,
English names and locales (``en``, ``English``, ``en-US``) are one language.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from asrforge.config import DataConfig
from asrforge.data import prepared
from asrforge.data.audio import SAMPLE_RATE
from asrforge.data.augment import AugmentError
from asrforge.data.utterances import (
    EMPTY_TEXT,
    NOT_FOUND,
    UnusableAudio,
    Utterance,  # noqa: F401 - importers of the data set's Utterance find it here
    UtteranceRules,
    UtteranceTable,
    arrow_columns,
    audio_source,
    column_seconds,
    dictionary_encoded,
    file_problem,
    header_seconds,
    named,
    read_audio,
    row_uids,
)
from asrforge.errors import CheckpointSaveError, UserError
from asrforge.io.atomic import atomic_write_text
from asrforge.text.languages import find_language_code

log = logging.getLogger(__name__)

IGNORE = -100  # label id the loss skips
TEXT_COLUMNS = ("text", "language")
"""Columns that must hold strings (or nulls, which are skipped as empty)."""


def load_arrow(path: Path):
    """``datasets.load_from_disk`` with audio left undecoded (we decode with soundfile)."""
    import datasets
    from datasets import Audio

    datasets.disable_progress_bars()
    path = Path(path)
    if not path.exists():
        raise UserError(f"data.path: {path} does not exist (set data.generate: tones to make a small one)")
    dd = load_saved(path)
    if isinstance(dd, datasets.Dataset):
        raise UserError(f"data.path: {path} holds one split; save a DatasetDict with named splits")
    for name, split in dd.items():
        missing = {"audio", "text", "language"} - set(split.column_names)
        if missing:
            raise UserError(f"data.path: split {name!r} lacks columns {sorted(missing)}")
        for column in TEXT_COLUMNS:
            dtype = getattr(split.features[column], "dtype", type(split.features[column]).__name__)
            if dtype not in ("string", "large_string", "null"):
                raise UserError(
                    f"data.path: {path} split {name!r}: column {column!r} holds {dtype}, "
                    "expected strings"
                )
        if isinstance(split.features["audio"], Audio):
            dd[name] = split.cast_column("audio", Audio(decode=False))
    return dd


def load_saved(path: Path):
    """``datasets.load_from_disk(path)``: a ``DatasetDict`` or one ``Dataset``.

    Raises:
        UserError: a split saved without rows, or not a ``save_to_disk`` directory.
    """
    import datasets

    empty = _empty_splits(path)
    if empty:  # datasets' load_from_disk fails on them with an IndexError
        raise UserError(
            f"data.path: {path}: split(s) {', '.join(map(repr, empty))} have no rows; "
            "add rows or leave the split out of the saved DatasetDict"
        )
    try:
        return datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"data.path: {path} is not a dataset saved with save_to_disk: {e}") from None


def _empty_splits(path: Path) -> list[str]:
    """Splits of the ``save_to_disk`` directory ``path`` that were saved without rows (no data
    files), read from its JSON files; [] when they cannot be read (load_from_disk reports it)."""
    try:
        names = json.loads((path / "dataset_dict.json").read_text())["splits"]
        states = {n: json.loads((path / n / "state.json").read_text()) for n in names}
        return [n for n, state in states.items() if not state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


@lru_cache(maxsize=1024)
def data_language(value: str | None) -> str:
    """The language code of a ``language`` value (``"English"``, ``"en-US"`` -> ``"en"``;
    ``"zh-HK"`` -> ``"yue"``), or the value itself when it names no known language."""
    text = "" if value is None else str(value)
    return find_language_code(text) or text


def split_languages(split) -> set[str]:
    """The language codes of ``split``'s ``language`` column (its distinct values, read with
    Arrow; a value that names no language as it is)."""
    values, _ = dictionary_encoded(arrow_columns(split, ["language"]).column("language"))
    return {data_language(v) for v in values if v}


def language_filter(languages: list[str] | None, where: str = "data.languages") -> set[str] | None:
    """The codes of ``languages`` (codes, names or locales), or None for "all".

    Raises:
        UserError: an entry names no known language (by its path, e.g. ``data.languages.1``).
    """
    if not languages:
        return None
    unknown = [f"{where}.{i}: unknown language {x!r}" for i, x in enumerate(languages)
               if find_language_code(x) is None]  # fmt: skip
    if unknown:
        raise UserError("; ".join(unknown) + " (give an ISO or Whisper code or an English name)")
    return {find_language_code(x) for x in languages}


@dataclass
class SkipReport:
    """What filtering dropped, by reason, and what ``data.languages`` left out on purpose (counts
    per language code: not a defect of the data, so not in ``skipped-<split>.json``)."""

    split: str
    total: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)
    left_out: dict[str, int] = field(default_factory=dict)

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
        for reason, uids in dropped.items():
            have = merged.setdefault(reason, [])
            seen = set(have)
            have += [u for u in dict.fromkeys(uids) if u not in seen]
        return SkipReport(self.split, self.total, merged, dict(self.left_out))

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
        if not self.n_skipped:
            log.info("split %s: %d utterances%s none skipped", self.split, self.total,
                     share or ",")  # fmt: skip
            return
        counts = ", ".join(f"{len(v)} {k}" for k, v in self.skipped.items())
        ids = [u for v in self.skipped.values() for u in v]
        shown = ", ".join(ids[:20]) + (f" ... (+{len(ids) - 20})" if len(ids) > 20 else "")
        target = self.write(out_dir) if out_dir is not None else None
        where = f"; all ids in {target}" if target is not None else ""
        if share:
            log.warning(
                "split %s: %d utterances%s %d skipped%s (%s): %s%s",
                self.split, self.total, share, self.n_skipped, when, counts, shown, where,
            )  # fmt: skip
            return
        log.warning(
            "split %s: skipped %d of %d utterances%s (%s): %s%s",
            self.split, self.n_skipped, self.total, when, counts, shown, where,
        )

    def nothing_usable(self, path: Path, languages: list[str] | None) -> UserError:
        """The error of a split with no usable utterance; when ``data.languages`` left rows out,
        it names the languages the split has."""
        message = f"data: no usable utterances in split {self.split!r} of {Path(path)}"
        if self.left_out:
            has = ", ".join(f"{lang} ({n})" for lang, n in sorted(self.left_out.items()))
            message += (
                f": data.languages {languages} leaves out {self.n_left_out} of its "
                f"{self.total} utterances, whose languages are {has}"
            )
            if self.n_skipped:
                message += f", and {self.n_skipped} were skipped"
        return UserError(message)


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
        cache: a directory for the result of the full check (:mod:`asrforge.data.prepared`),
            read back when the split, tokenizer and limits are the same; None: no cache.
    """
    rules = UtteranceRules(tokenizer, specials, cfg.task, max_target_positions, max_seconds)
    key = prepared.fingerprint(split, cfg, rules) if cache is not None and not lazy else None
    stored = prepared.load(cache, key, split, name, rules) if key is not None else None
    if stored is not None:
        table, skipped, total, left_out = stored
        log.info("split %s: checked in full before, read from %s", name, Path(cache) / key)
        _log_language_tokens(name, table, specials)
        return table, SkipReport(name, total, skipped, left_out)
    report = SkipReport(split=name, total=len(split))
    table = _metadata_table(split, name, rules, cfg, report, training)
    if not lazy:
        table = check_in_full(table, report)
    if key is not None:
        try:
            prepared.save(cache, key, table, report.skipped, report.total, report.left_out)
        except CheckpointSaveError as e:  # the run goes on; the next one checks again
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
                              _ids(split, name, unnamed[:10]))  # fmt: skip
    if training:
        check_english_only(by_value, name, rules.specials, language_filter(cfg.languages))
    codes = [data_language(v) for v in values]
    languages = sorted(set(codes))
    code_of_value = np.asarray([languages.index(c) for c in codes], dtype=np.int16)
    language_index = code_of_value[value_index]
    keep_langs = language_filter(cfg.languages)
    wanted = np.ones(len(split), dtype=bool)
    if keep_langs is not None:  # left out on purpose: counted per language, not skipped
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
    reason = np.zeros(len(split), dtype=np.int8)  # 0: kept; else the index in `reasons`, + 1
    by_seconds = rules.seconds_problems(seconds)
    reasons = [EMPTY_TEXT, *by_seconds]
    for k, rows in enumerate(by_seconds.values(), start=2):
        reason[rows] = k
    # Empty text is named over a duration's problem because utterance_problem checks it first.
    reason[empty] = 1
    reason[~wanted] = 0
    for k, why in enumerate(reasons, start=1):
        rows = np.flatnonzero(reason == k)
        for uid in _ids(split, name, rows):
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


def _ids(split, name: str, rows: np.ndarray) -> list[str]:
    """The ids of ``rows`` of ``split`` (``<name>-<row>`` where there is none)."""
    return row_uids(split, name, rows)


def check_in_full(table: UtteranceTable, report: SkipReport, block: int = 1024) -> UtteranceTable:
    """``table`` without the utterances whose audio or labels are unusable (added to
    ``report``): audio headers read where the duration is not known (a file's existence
    checked where it is), every text tokenized; ``n_tokens`` filled in."""
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
                if np.isnan(seconds[i]):
                    seconds[i] = header_seconds(audio)
                elif problem := file_problem(src := audio_source(audio)):
                    raise UnusableAudio(problem, src)
            except UnusableAudio as e:
                uid = table.uid_of_row({"id": records.get("id", [None] * len(rows))[k]}, row)
                report.add(e.reason, named(uid, e.source) if e.reason == NOT_FOUND else uid)
                ok[i] = False
                continue
            problem = rules.seconds_problem(seconds[i])
            if problem is None and prompt_lengths[i] + n_tokens[i] + 1 > rules.max_positions:
                problem = rules.long_labels
            if problem is not None:
                uid = table.uid_of_row({"id": records.get("id", [None] * len(rows))[k]}, row)
                report.add(problem, uid)
                ok[i] = False
    full = UtteranceTable(
        table.split, table.name, rules, rows=table.rows, languages=table.languages,
        language_index=table.language_index, seconds=seconds, n_tokens=n_tokens,
    )  # fmt: skip
    return full.subset(ok)


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
        code = data_language(value)
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


def check_english_only(counts: Counter, split: str, specials, keep: set[str] | None) -> None:
    """Under an English-only model (``*.en``: its prompt carries no language token), refuse a
    language other than English (a value of the ``language`` column): its utterances would
    train under the English prompt, and the bundle would then refuse to transcribe it. A row
    without a language is English's. Nothing to check for a multilingual model.

    Raises:
        UserError: naming each such value, its utterance count and the ways to fix it.
    """
    if specials.multilingual:
        return
    other = {value: n for value, n in counts.items()
             if value and not is_english(value) and (keep is None or data_language(value) in keep)}  # fmt: skip
    if not other:
        return
    found = ", ".join(_language_value(v, n) for v, n in other.items())
    raise UserError(
        f"data: split {split!r}: the model is English-only (its tokenizer has no language "
        f"tokens), but the data has language {found}: they would train under the English "
        "prompt. Leave them out (data.languages: [en]) or fine-tune a multilingual model "
        "(model.pretrained)"
    )


def is_english(value: str | None) -> bool:
    """Whether a ``language`` value is English (or empty: an English-only model's every row)."""
    return not value or data_language(value) == "en"


def _language_value(value: str, n: int) -> str:
    code = data_language(value)
    return f"{value!r} ({n} utterances{'' if code == value else f', code {code!r}'})"


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


class SpeechDataset(Dataset):
    """Utterances -> dicts with ``input_features: (n_mels, n_frames)`` float32, ``decoder_input_ids``
    and ``labels`` (same length; the prompt's positions are ``IGNORE`` in labels).

    A clip that cannot be used yields ``{"dropped": uid, "reason": ...}`` (the collator drops it
    and records both), never an exception that would end the epoch: audio that fails to decode
    or has NaN/inf samples, and for a lazily prepared table (``UtteranceTable.lazy``) what
    ``prepare_split`` would have skipped up front (labels too long, a missing, unreadable,
    empty or over-long audio file), with the skip report's reason.

    Args:
        utterances: an :class:`UtteranceTable` (or a list of :class:`Utterance`).
    """

    def __init__(self, split, utterances, feature_extractor, eot: int):
        self.split = split
        self.utts = utterances
        self.fe = feature_extractor
        self.eot = eot
        self.encoder_cache = None  # an EncoderCache: yield encoder states instead of log-mels
        self.feature_cache = None  # a FeatureCache: read log-mels instead of computing them
        self.augment = None  # an Augmenter (training set only): data.augment
        self.epoch = 0  # the epoch being loaded: augmentation draws depend on it

    def __len__(self) -> int:
        return len(self.utts)

    def features_of(self, i: int) -> np.ndarray:
        """Log-mel features of utterance ``i``: (n_mels, n_frames) float32.

        Raises:
            UnusableAudio: the audio is missing, unreadable, has no samples or NaN/inf ones.
        """
        cache = self.feature_cache
        if cache is not None and self.utts[i].audio_key in cache:
            return cache.features(self.utts[i].audio_key)
        return self.log_mel(self.wave_of(i))

    def wave_of(self, i: int) -> np.ndarray:
        """Utterance ``i``'s audio, 16 kHz mono float32.

        Raises:
            UnusableAudio: the audio is missing, unreadable, has no samples or NaN/inf ones, or
                is longer than the window (its duration not known before, or the data's
                ``duration`` said less than it holds).
        """
        audio = self.split[self._row(i)]["audio"]
        return read_audio(audio, self._window_seconds())

    def _row(self, i: int) -> int:
        utts = self.utts
        return int(utts.rows[i]) if isinstance(utts, UtteranceTable) else utts[i].row

    def _window_seconds(self) -> float | None:
        """The window the decoded audio must fit (None: checked from its header already). A
        duration known up front may be the data's own ``duration``, not the file's: the
        decoded length is checked too, since the feature extractor would cut the audio and
        leave its whole transcript."""
        utts = self.utts
        return utts.rules.max_seconds if isinstance(utts, UtteranceTable) else None

    def log_mel(self, wave: np.ndarray) -> np.ndarray:
        """(n_mels, n_frames) float32 log-mel features of one window's audio."""
        feats = self.fe(wave, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
        return np.asarray(feats, dtype=np.float32)

    def training_features(self, i: int) -> np.ndarray:
        """Utterance ``i``'s log-mels as training sees them this epoch: its augmented audio
        (``data.augment``), else what :meth:`features_of` gives."""
        aug = self.augment
        if aug is None or not aug.changes_audio:
            return self.features_of(i)
        return self.log_mel(aug.wave(self.wave_of(i), self.utts[i].uid, self.epoch))

    def masked(self, feats: np.ndarray, i: int) -> np.ndarray:
        """SpecAugment of utterance ``i``'s window this epoch (unchanged without it)."""
        aug = self.augment
        if aug is None:
            return feats
        u = self.utts[i]
        seconds = u.seconds
        if np.isnan(seconds):  # prepared lazily, no duration in the data: the header says it
            seconds = header_seconds(self.split[u.row]["audio"])
        seconds = aug.n_samples(u.uid, self.epoch, round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        return aug.features(feats, u.uid, self.epoch, seconds)

    def __getitem__(self, i: int) -> dict | None:
        u = self.utts[i]
        if isinstance(self.utts, UtteranceTable) and self.utts.lazy:
            problem = self.utts.problem(u)
            if problem is not None:
                return {"dropped": u.uid, "reason": problem}
        cache, features = self.encoder_cache, self.feature_cache
        if cache is not None and u.audio_key in cache:
            inputs = {"encoder_hidden_states": torch.from_numpy(cache.row(u.audio_key))}
        elif features is not None and u.audio_key in features:  # a cache read error is no
            # decoding failure: it propagates instead of dropping every clip
            feats = self.masked(features.features(u.audio_key), i)
            inputs = {"input_features": torch.from_numpy(feats)}
        else:
            try:
                inputs = {"input_features": torch.from_numpy(self.masked(self.training_features(i), i))}
            except UnusableAudio as e:
                uid = named(u.uid, e.source) if e.reason == NOT_FOUND else u.uid
                return {"dropped": uid, "reason": e.reason}
            except AugmentError:  # the augmentation's own failure, not the clip's: it stops
                raise
            except Exception:  # noqa: BLE001 - any decoder failure: skip the clip, keep the epoch
                return {"dropped": u.uid, "reason": "failed to decode"}
        dec = u.prompt + u.text_ids
        labels = [IGNORE] * (len(u.prompt) - 1) + u.text_ids + [self.eot]
        return {
            **inputs,
            "decoder_input_ids": torch.tensor(dec, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "index": i,
            "uid": u.uid,
            "language": u.language,
            "text": u.text,
        }


@dataclass
class Collator:
    """Pads a list of items into a batch; ``pad_id`` pads decoder inputs, ``IGNORE`` pads labels."""

    pad_id: int

    def __call__(self, items: list[dict]) -> dict:
        dropped = [it["dropped"] for it in items if "dropped" in it]
        reasons = [it.get("reason", "failed to decode") for it in items if "dropped" in it]
        # a packed window's clips that failed (the rest of the window trains)
        for it in items:
            parts = it.get("dropped_parts", ())
            dropped += parts
            reasons += it.get("dropped_part_reasons") or ["failed to decode"] * len(parts)
        items = [it for it in items if "dropped" not in it]
        if not items:
            return {"size": 0, "dropped": dropped, "dropped_reasons": reasons}
        t = max(len(it["labels"]) for it in items)
        dec = torch.full((len(items), t), self.pad_id, dtype=torch.long)
        lab = torch.full((len(items), t), IGNORE, dtype=torch.long)
        for r, it in enumerate(items):
            n = len(it["labels"])
            dec[r, :n] = it["decoder_input_ids"]
            lab[r, :n] = it["labels"]
        key = "encoder_hidden_states" if "encoder_hidden_states" in items[0] else "input_features"
        return {
            key: torch.stack([it[key] for it in items]),
            "decoder_input_ids": dec,
            "labels": lab,
            "index": [it["index"] for it in items],
            "uid": [it["uid"] for it in items],
            "language": [it["language"] for it in items],
            "text": [it["text"] for it in items],
            "size": len(items),
            "dropped": dropped,
            "dropped_reasons": reasons,
        }


def dropped_by_reason(batch: dict) -> dict[str, list[str]]:
    """The ids a collated batch dropped, by reason (as :class:`SkipReport` groups them)."""
    out: dict[str, list[str]] = {}
    reasons = batch.get("dropped_reasons") or ["failed to decode"] * len(batch.get("dropped", []))
    for uid, reason in zip(batch.get("dropped", []), reasons, strict=True):
        out.setdefault(reason, []).append(uid)
    return out


class Batches(Sequence):
    """Batches of indices cut from one permutation, without a Python list per batch until one
    is read: ``batches[k]`` is a list of ints; slicing gives Batches again (a resume's
    ``[start:]``, a rank's ``[rank::world]``)."""

    def __init__(self, order: np.ndarray, batch_size: int, which: range | None = None):
        self.order, self.batch_size = order, batch_size
        self.which = which if which is not None else range(-(-len(order) // batch_size))

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return Batches(self.order, self.batch_size, self.which[k])
        start = self.which[k] * self.batch_size
        return self.order[start : start + self.batch_size].tolist()

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


def epoch_batches(
    n: int, batch_size: int, seed: int, epoch: int, rank: int = 0, world: int = 1
) -> Batches:
    """The shuffled batches of one epoch, a pure function of (seed, epoch): resuming at batch k
    of an epoch replays exactly the batches an uninterrupted run would have seen."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).numpy()
    return Batches(perm, batch_size)[rank::world]


def eval_batches(utts, batch_size: int) -> list[list[int]]:
    """Evaluation batches ordered by label length (longest first) so a batch decodes about as
    many steps as its members need. A lazily prepared table's texts are tokenized here (an
    evaluation split is small)."""
    if isinstance(utts, UtteranceTable) and utts.n_tokens is not None:
        order = np.argsort(-utts.n_tokens, kind="stable").tolist()
    else:
        order = sorted(range(len(utts)), key=lambda i: -len(utts[i].text_ids))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def language_counts(utts) -> Counter:
    """Utterances per language."""
    if isinstance(utts, UtteranceTable):
        return utts.language_counts()
    return Counter(u.language for u in utts)
