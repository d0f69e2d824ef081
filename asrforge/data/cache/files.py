"""The data files of the on-disk caches (encoder states, log-mels): written once, never in place.

A cache directory holds ``index.json`` naming its current data file. A build streams the old
rows and the new ones into a fresh ``<stem>-<id>.<suffix>`` (:class:`NewDataFile`: rows are
written as they are computed, so a build never holds a data set's worth of features in memory),
then replaces ``index.json`` atomically, then removes the data files nobody uses
(:func:`remove_unused`).

"Uses" is a shared ``flock`` on the file: a reader takes one when it opens a data file
(:class:`SharedData`) and keeps it while it may read; a writer takes one on its file from
creation until ``index.json`` names it. Runs of a matrix that share a cache directory therefore
never lose a file they still read (their DataLoader workers reopen it by name every epoch), and
the files of killed builds and superseded indexes are removed by the next build.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import numpy as np

from asrforge.io.atomic import atomic_write_text, fsync_dir
from asrforge.io.locks import hold_shared, try_lock

CHUNK_ROWS = 256  # rows copied at a time from the previous file (bounded memory)


class NewDataFile:
    """A cache data file being written: ``with NewDataFile(directory, stem, suffix) as new``,
    write ``new.tmp`` (created empty and share-locked), then :meth:`publish` it. The lock is held
    until the ``with`` block ends, so take the reader's lock on the published file inside the
    block; a file not published is deleted at the end of the block."""

    def __init__(self, directory: Path, stem: str, suffix: str):
        self.directory = Path(directory)
        self.name = f"{stem}-{secrets.token_hex(6)}.{suffix}"
        self.tmp = self.directory / f".{self.name}"
        self.published = False

    def __enter__(self) -> NewDataFile:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tmp.touch()
        self._fd = hold_shared(self.tmp)
        return self

    def publish(self, index_file: Path, meta: dict) -> None:
        """fsync the file, rename it into place, then replace ``index_file`` with ``meta`` (which
        names it) atomically: an index only ever names a complete file."""
        with open(self.tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.directory / self.name)
        fsync_dir(self.directory)
        self.published = True
        atomic_write_text(index_file, json.dumps(meta))

    def __exit__(self, *exc) -> None:
        if not self.published:
            self.tmp.unlink(missing_ok=True)
        os.close(self._fd)


def remove_unused(directory: Path, pattern: str, keep: str) -> list[str]:
    """Delete the files matching ``pattern`` (and the temporaries ``.<pattern>``) in
    ``directory`` except ``keep`` that no process holds a shared lock on; returns their names."""
    removed = []
    directory = Path(directory)
    for p in [*directory.glob(pattern), *directory.glob("." + pattern)]:
        if p.name == keep:
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            unused = try_lock(fd)
        except OSError:
            # A file whose use cannot be told is kept.
            unused = False
        if not unused:  # a reader or a writer still uses it
            os.close(fd)
            continue
        try:
            p.unlink()
            removed.append(p.name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


class SharedData:
    """A cache data file opened for reading (``kind``: ``"npy"``, or ``"f32"`` for raw float32),
    memory-mapped and share-locked from the first access until :meth:`close` or garbage
    collection. Pickles without its handles: a DataLoader worker reopens and relocks the file by
    name; a forked worker shares the parent's lock."""

    def __init__(self, path: Path, kind: str):
        self.path, self.kind = Path(path), kind
        self._fd: int | None = None
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._fd = hold_shared(self.path)
            if self.kind == "npy":
                self._array = np.load(self.path, mmap_mode="r")
            elif os.path.getsize(self.path) == 0:  # every stored row empty (all silence)
                self._array = np.zeros(0, dtype=np.float32)
            else:
                self._array = np.memmap(self.path, dtype=np.float32, mode="r")
        return self._array

    def close(self) -> None:
        self._array = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __getstate__(self):
        return {**self.__dict__, "_fd": None, "_array": None}

    def __del__(self):
        self.close()


def copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:len(src)] = src`` a chunk at a time (``src`` is usually a memory map)."""
    for start in range(0, src.shape[0], CHUNK_ROWS):
        dst[start : start + CHUNK_ROWS] = src[start : start + CHUNK_ROWS]
