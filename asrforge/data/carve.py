"""The evaluation split carved out of the training split (``data.eval_carve``) when the data has
none: stratified by language (:func:`carve_rows`); the rows are written to the run directory
(``eval_carve.json``) and a resumed run reads them back.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np

from asrforge.config import CarveConfig, DataConfig
from asrforge.data.columns import arrow_columns, language_codes
from asrforge.data.ids import copy_keys, keys_digest, row_keys
from asrforge.data.sources import load_source
from asrforge.errors import UserError
from asrforge.io.atomic import atomic_write_text
from asrforge.io.small_files import RECORDS_BYTES, read_json
from asrforge.run_layout import CARVE_FILE

log = logging.getLogger(__name__)



def training_splits(cfg: DataConfig, *, run_dir: Path, resuming: bool, is_main: bool):
    """(train, eval) splits for a run: from ``data.path``, the evaluation split carved out of the
    training split with ``data.eval_carve`` (see :func:`carve_eval`).

    Raises:
        UserError: a split is missing or empty, or a carve does not fit the data.
    """
    source = load_source(cfg)
    splits, where = source.splits, source.where
    if cfg.train_split not in splits:
        raise UserError(
            f"data: split {cfg.train_split!r} not in {where} (has {sorted(splits)}); name the "
            "training split with data.train_split"
        )
    train = splits[cfg.train_split]
    if cfg.eval_carve is not None:
        if cfg.eval_split in splits:
            raise UserError(
                f"data.eval_carve: {where} has a {cfg.eval_split!r} split already; use it (leave "
                "data.eval_carve out) or carve into another name (data.eval_split)"
            )
        train, evaluation = carve_eval(train, cfg.eval_carve, run_dir=run_dir, resuming=resuming,
                                       is_main=is_main, where=str(where))  # fmt: skip
        splits = {**splits, cfg.train_split: train, cfg.eval_split: evaluation}
    for split in (cfg.train_split, cfg.eval_split):
        if split not in splits:
            hint = (
                "; name the evaluation split with data.eval_split, or hold one out of the "
                "training split with data.eval_carve: {size: 0.05}"
            )
            raise UserError(
                f"data: split {split!r} not in {where} (has {sorted(splits)})"
                + (hint if split == cfg.eval_split else "")
            )
        if len(splits[split]) == 0:
            raise UserError(f"data: split {split!r} of {where} has no rows")
    return splits[cfg.train_split], splits[cfg.eval_split]


def carve_rows(languages: list[str] | int, carve: CarveConfig) -> np.ndarray:
    """The rows (sorted) of a training split held out for evaluation, stratified by language: a
    pure function of (the rows' languages, ``carve.size``, ``carve.seed``).

    Each language gets its share of the held-out rows (largest remainders), at least one when it
    has two rows or more, and keeps at least one training row; a language of one row is not held
    out. With one language (or an ``int``: that many rows of one) the draw is the unstratified one.

    Args:
        languages: the language code of each row.

    Raises:
        UserError: the carve would leave no training rows or hold out none.
    """
    langs = np.zeros(languages, dtype=int) if isinstance(languages, int) else np.asarray(languages)
    n_rows = len(langs)
    k = round(carve.size * n_rows) if carve.size < 1 else int(carve.size)
    if not 0 < k < n_rows:
        raise UserError(
            f"data.eval_carve.size: {carve.size:g} of {n_rows} training rows holds out "
            f"{k}: it must leave at least one row on each side"
        )
    groups = {lang: np.flatnonzero(langs == lang) for lang in sorted(set(langs.tolist()))}
    shares = language_shares({lang: len(rows) for lang, rows in groups.items()}, k)
    rng = np.random.default_rng(carve.seed)
    held = np.concatenate([rng.permutation(rows)[: shares[lang]] for lang, rows in groups.items()])
    if not len(held):
        raise UserError(
            f"data.eval_carve: every language of the {n_rows} training rows has one row only: "
            "none can be held out and still train (give an evaluation split, data.eval_split)"
        )
    return np.sort(held)


def with_repeats(rows: np.ndarray, copies: list[str | None]) -> np.ndarray:
    """``rows`` (sorted) and the other rows that are copies of one of them (``copies``:
    :func:`copy_keys`, the same id, audio file and text), so a duplicated row is held out whole
    instead of being scored on what trained. Rows that share only an id (FLEURS names a sentence
    so in every voice and language) or only a text are other utterances and stay apart.

    Raises:
        UserError: the copies leave no training row.
    """
    held = {copies[i] for i in rows} - {None}
    repeats = [i for i, key in enumerate(copies) if key in held]
    out = np.union1d(rows, np.asarray(repeats, dtype=np.int64))
    if len(out) > len(rows):
        log.warning(
            "data.eval_carve: %d more training rows are copies of held-out ones (the same id, "
            "audio file and text) and are held out with them; the training split repeats "
            "rows (a duplicated file or row?)", len(out) - len(rows),
        )  # fmt: skip
    if len(out) >= len(copies):
        raise UserError(
            f"data.eval_carve: with their copies, the held-out rows are all {len(copies)} "
            "training rows; the split repeats its rows"
        )
    return out


def language_shares(counts: dict[str, int], k: int) -> dict[str, int]:
    """How many of ``k`` held-out rows each language gives (``counts``: its rows): in proportion
    (largest remainders, ties in the order of ``counts``), at least 1 and at most all but one of
    its rows."""
    total = sum(counts.values())
    exact = {lang: k * n / total for lang, n in counts.items()}
    shares = {lang: int(x) for lang, x in exact.items()}
    by_remainder = sorted(counts, key=lambda lang: -(exact[lang] - shares[lang]))
    for lang in by_remainder[: k - sum(shares.values())]:
        shares[lang] += 1
    return {lang: min(max(shares[lang], 1), n - 1) for lang, n in counts.items()}


def carve_eval(train, carve: CarveConfig, *, run_dir: Path, resuming: bool, is_main: bool,
               where: str):  # fmt: skip
    """(train without the held-out rows, the held-out rows), disjoint.

    A run records the rows in ``run_dir/eval_carve.json`` with fingerprints of the held-out rows'
    keys and of the whole split's (:func:`row_keys`); resuming reads the rows back (a changed
    ``data.eval_carve`` does not move rows between the splits mid-run) once the fingerprints
    show the data is the one the run was carved from.

    Raises:
        UserError: resuming on a training split other than the recorded one (another size, or
            its rows reordered or replaced).
    """
    record = Path(run_dir) / CARVE_FILE
    languages = _row_languages(train)
    rows = None
    if resuming and record.exists():
        saved = json.loads(record.read_text())
        rows = np.asarray(saved["rows"], dtype=np.int64)
        check_carved_data(saved, train, rows, record=record, where=where)
        if (saved["size"], saved["seed"]) != (carve.size, carve.seed):
            log.warning("data.eval_carve: the run keeps the split it started with (size %g, seed "
                        "%d; %s)", saved["size"], saved["seed"], record)  # fmt: skip
    if rows is None:
        keys = row_keys(train)
        rows = with_repeats(carve_rows(languages, carve), copy_keys(train))
        if is_main:
            record.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(record, json.dumps({
                "size": carve.size, "seed": carve.seed, "train_rows": len(train),
                "rows": rows.tolist(), "held_out_sha256": keys_digest(keys[i] for i in rows),
                "split_sha256": keys_digest(keys),
            }))  # fmt: skip
    held = np.zeros(len(train), dtype=bool)
    held[rows] = True
    log.info("data.eval_carve: %d of %d training rows held out for evaluation (seed %d, %s)",
             len(rows), len(train), carve.seed, record)  # fmt: skip
    _log_carve_languages(languages, rows)
    return train.select(np.flatnonzero(~held)), train.select(rows)


def _row_languages(split) -> list[str]:
    """The language code of each row (``""`` for none: the carve keeps such rows a group of
    their own, whatever the model). Read as an Arrow column: ``split["language"]`` formats
    every row through the split's transform (54 s for a million rows)."""
    if "language" not in split.column_names:
        return [""] * len(split)
    codes, index = language_codes(arrow_columns(split, ["language"]).column("language"))
    return [codes[i] for i in index.tolist()]


def _log_carve_languages(languages: list[str], rows: np.ndarray) -> None:
    """Say how many rows of each language are held out; warn about languages with none (one
    row only, or a carve recorded before it was stratified)."""
    total = Counter(languages)
    held = Counter(languages[i] for i in rows)
    if len(total) < 2:
        return
    log.info("data.eval_carve: held out by language: %s",
             ", ".join(f"{lang or 'none'} {held[lang]}/{n}" for lang, n in sorted(total.items())))  # fmt: skip
    without = sorted(lang or "none" for lang in total if not held[lang])
    if without:
        log.warning("data.eval_carve: language(s) %s have no evaluation rows (%s): their WER is not "
                    "measured", ", ".join(without),
                    ", ".join(f"{lang or 'none'}: {total[lang]} row(s)" for lang in total if not held[lang]))  # fmt: skip


def held_out_rows(train, record: Path, *, where: str):
    """The rows of ``train`` a run held out for evaluation, as its ``eval_carve.json``
    (``record``) lists them, once its fingerprints show ``train`` is the split they were carved
    from (what ``asrforge evaluate --carve`` scores: the rows the run's figures are on).

    Raises:
        UserError: ``record`` is not a readable carve record, or was carved from other data.
    """
    try:
        saved = read_json(Path(record), RECORDS_BYTES, error=ValueError)
        rows = np.asarray(saved["rows"], dtype=np.int64)
        saved["train_rows"] = int(saved["train_rows"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = str(e).removeprefix(f"{record}: ")  # the reader names the file too
        raise UserError(f"--carve {record}: not a readable {CARVE_FILE} ({why})") from None
    check_carved_data(saved, train, rows, record=record, where=where,
                      remedy="Evaluate on the data the run was trained on")  # fmt: skip
    return train.select(rows)


def check_carved_data(saved: dict, train, rows: np.ndarray, *, record: Path, where: str,
                      remedy: str | None = None) -> None:  # fmt: skip
    """Refuse to resume a carve (``saved``: ``eval_carve.json``) on other data: the recorded row
    numbers would hold out other rows, some of them already trained on.

    Raises:
        UserError: naming ``record`` and what changed: the row count, the held-out rows, or the
            order or content of the rest.
    """
    if saved["train_rows"] != len(train):
        raise UserError(
            f"data.eval_carve: {record} held out rows of a {saved['train_rows']}-row training "
            f"split; {where} has {len(train)} rows now: "
            + (remedy or "resume on the data the run started with")
        )
    if "split_sha256" not in saved:  # carved before fingerprints were recorded
        log.warning("data.eval_carve: %s records no fingerprint of the data (an older asrforge "
                    "wrote it): only the row count (%d) is checked", record, len(train))  # fmt: skip
        return
    keys = row_keys(train)
    if keys_digest(keys[i] for i in rows) != saved["held_out_sha256"]:
        changed = f"the {len(rows)} held-out rows (by id, else audio path and text) are others"
    elif keys_digest(keys) != saved["split_sha256"]:
        changed = "the held-out rows are the same, but the other rows are reordered or replaced"
    else:
        return
    raise UserError(
        f"data.eval_carve: {record} was carved from other data than {where} holds now: {changed}, "
        "so the evaluation split would differ or hold rows already trained on. "
        + (remedy or "Resume on the data the run started with, or start a new run (another "
           "output_dir)")
    )  # fmt: skip
