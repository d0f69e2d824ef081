"""A split checked in full (``prepare_split(lazy=False)``: every audio header, every text
tokenized), kept on disk under a fingerprint so a resume, the other ranks and the next run
read it instead of repeating the pass.

The fingerprint covers what the result depends on: the split (``datasets``' fingerprint of it,
which follows its files and every transform, a carve's row selection included, and its row
count), the data config fields that filter (``languages``, ``task``, ``language_tokens``), the
tokenizer (its serialized form), the window and the decoder's positions. The audio files are
not re-read: a file edited in place keeps its old duration until the cache directory is removed.

Layout: ``<root>/<fingerprint>/table.npz`` (the table's columns, loaded without pickle) and
``meta.json`` (languages, the skip report), written as one directory atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from asrforge.data.utterances import UtteranceRules, UtteranceTable
from asrforge.io.atomic import atomic_directory

log = logging.getLogger(__name__)

VERSION = 2
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


def fingerprint(split, cfg, rules: UtteranceRules) -> str | None:
    """The key of ``split`` prepared in full under ``cfg`` (a ``DataConfig``) and ``rules``, or
    None when ``datasets`` gives the split no fingerprint."""
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


def load(root: Path, key: str, split, name: str, rules: UtteranceRules):
    """``(table, skipped by reason, total, rows left out by data.languages per language)``
    stored under ``key``, or None when there is none (or it cannot be read, or was stored
    without the left-out counts: it is recomputed)."""
    directory = Path(root) / key
    try:
        meta = json.loads((directory / "meta.json").read_text())
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


def save(
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
