"""The data files of the on-disk caches (encoder states, log-mels): written once, never in place.

A cache directory holds ``index.json`` naming its current data file. A build streams the old
rows and the new ones into a fresh ``<stem>-<id>.<suffix>`` (:func:`new_data_file`: rows are
written as they are computed, so a build never holds a data set's worth of features in memory),
then replaces ``index.json`` atomically, then removes data files no index names
(``asrforge.checkpoint.atomic.remove_stale``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from asrforge.checkpoint.atomic import fsync_dir

CHUNK_ROWS = 256  # rows copied at a time from the previous file (bounded memory)


@contextlib.contextmanager
def new_data_file(directory: Path, stem: str, suffix: str) -> Iterator[tuple[Path, str]]:
    """``(path to write, final name)``: the body writes ``path``; on a clean exit the file is
    fsynced and renamed to ``directory/<final name>``; on an exception it is deleted."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{stem}-{secrets.token_hex(6)}.{suffix}"
    tmp = directory / f".{name}"
    try:
        yield tmp, name
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
        fsync_dir(directory)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:len(src)] = src`` a chunk at a time (``src`` is usually a memory map)."""
    for start in range(0, src.shape[0], CHUNK_ROWS):
        dst[start : start + CHUNK_ROWS] = src[start : start + CHUNK_ROWS]
