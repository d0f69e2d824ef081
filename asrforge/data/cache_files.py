"""The data files of the on-disk caches (encoder states, log-mels): written once, never in place.

A cache directory holds ``index.json`` naming its current data file. A build writes the old
rows and the new ones to a fresh ``<stem>-<id>.npy`` with :func:`write_rows`, then replaces
``index.json`` atomically, then removes data files no index names (``remove_stale``).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np

from asrforge.checkpoint.atomic import fsync_dir


def write_rows(directory: Path, stem: str, old: np.ndarray | None, new: list[np.ndarray]) -> str:
    """Write ``old`` (None for a first build; a memory map is fine) followed by every array of
    ``new`` (each continuing the first axis) as one float32 ``.npy`` under a fresh name in
    ``directory``, durably (fsynced, renamed into place, the directory fsynced).

    Returns:
        The new file's name, for ``index.json`` to name.
    """
    parts = ([old] if old is not None else []) + list(new)
    total = sum(p.shape[0] for p in parts)
    name = f"{stem}-{secrets.token_hex(6)}.npy"
    tmp = Path(directory) / f".{name}"
    out = np.lib.format.open_memmap(
        tmp, mode="w+", dtype=np.float32, shape=(total, *parts[0].shape[1:])
    )
    pos = 0
    for p in parts:
        out[pos : pos + p.shape[0]] = p
        pos += p.shape[0]
    out.flush()
    del out, parts
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, Path(directory) / name)
    fsync_dir(Path(directory))
    return name
