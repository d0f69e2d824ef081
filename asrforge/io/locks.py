"""Advisory file locks (``flock``) between processes: the caches' readers and builders, the
matrix's job claims and its shared data sets.

A lock belongs to an open file description: it is dropped when every descriptor of it is closed
(also by a killed process), and a forked child shares its parent's. Two ``open`` calls of one
file, even in one process, are two descriptions whose locks conflict.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from asrforge.io.append import open_no_follow

LOCKING_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)
"""``errno`` of a filesystem that cannot ``flock`` (some network and FUSE filesystems)."""


def hold_shared(path: Path) -> int:
    """Open ``path`` read-only and take a shared lock on it, waiting for an exclusive holder.

    Returns:
        The descriptor; closing it drops the lock.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_lock(fd: int, *, shared: bool = False) -> bool:
    """Take a lock on ``fd`` without waiting: False when another open file holds a conflicting
    one.

    Raises:
        OSError: the filesystem refused (``errno`` in :data:`LOCKING_UNSUPPORTED` where it cannot
            lock at all).
    """
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def unlock(fd: int) -> None:
    """Drop the lock held on ``fd`` (the file stays open)."""
    fcntl.flock(fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def exclusive(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if missing) for the ``with`` block,
    waiting for other holders first: one process at a time runs the block."""
    fd = open_no_follow(lock_file, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
