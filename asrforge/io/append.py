"""Files asrforge opens in place rather than replacing atomically: appended logs (a run's
``train.log`` and ``metrics.jsonl``, a matrix's ``events.jsonl`` and job logs) and lock files;
and such a log read back whole before it is rewritten (:func:`read_appended`).

They are opened without following a symlink at the last component, so a link left in a run,
checkpoint or matrix directory is refused by name (:class:`SymlinkRefused`, exit code 2) instead
of being written through. Atomic writes (:mod:`asrforge.io.atomic`) replace such a link. A file
opened for writing must have one link: a hard link would carry the writes to another name.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TextIO

from asrforge.errors import UserError

APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT


class LinkRefused(UserError):
    """A file asrforge would write in place is a link (symbolic or hard) it did not create."""


class SymlinkRefused(LinkRefused):
    """A file asrforge would write in place is a symlink it did not create."""


class HardLinkRefused(LinkRefused):
    """A file asrforge would write in place has another name (a hard link) it did not make."""


def open_no_follow(path: str | Path, flags: int, mode: int = 0o666) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)``; a file it creates gets ``mode``
    less the umask, as ``open()`` gives.

    Raises:
        SymlinkRefused: ``path`` is a symlink (named with its target).
        HardLinkRefused: ``path`` is opened for writing and has more than one link.
        OSError: any other failure.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise SymlinkRefused(
                f"{path}: a symlink (to {os.readlink(path)}); asrforge does not write through a "
                "link it did not create: remove it"
            ) from None
        raise
    if flags & (os.O_WRONLY | os.O_RDWR):
        links = os.fstat(fd).st_nlink
        if links > 1:
            os.close(fd)
            raise HardLinkRefused(
                f"{path}: has {links} hard links; asrforge does not write into a file that "
                "another name shares: copy it to a file of its own"
            )
    return fd


def open_append(path: str | Path, encoding: str = "utf-8") -> TextIO:
    """``path`` opened for appending text (created if missing), never through a symlink.

    Raises:
        SymlinkRefused: ``path`` is a symlink.
        HardLinkRefused: ``path`` has more than one link.
    """
    return open(path, "a", encoding=encoding, opener=_no_follow_opener)


def _no_follow_opener(path: str, flags: int) -> int:
    # looked up when called, so a test can stand a full disk in for one file
    return open_no_follow(path, flags)


def read_appended(path: str | Path) -> bytes | None:
    """The bytes of a file asrforge appends to (None when it is missing), read before the file is
    replaced atomically; refused as :func:`open_append` refuses it, so that a link is never read
    through and then replaced by a copy.

    Raises:
        SymlinkRefused: ``path`` is a symlink.
        HardLinkRefused: ``path`` has more than one link.
    """
    try:
        # opened for writing too: open_no_follow checks the hard links of a file it may write
        fd = open_no_follow(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()
