"""Atomic file and directory writes: a reader sees the old version or the new one, never a mix.

The recipe is always the same: write a temporary sibling, fsync its contents, ``os.replace`` it
into place, fsync the parent directory (the rename itself lives in the parent's entries).
Temporaries are named ``.tmp-<name>-<pid>-<rand>``; a directory being replaced is first moved
aside to ``.old-<name>-<pid>-<rand>``. A name too long for that keeps its first bytes and a
hash (``<head>~<hash>``), so any name the filesystem accepts can be written. A process killed
at any moment leaves only such dot-names behind, and :func:`recover_interrupted` (run when a
:class:`CheckpointManager` starts) removes the temporaries and puts back an ``.old-`` directory
whose replacement never arrived.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from asrforge.errors import CheckpointSaveError
from asrforge.io.directories import symlink_problem

TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
NAME_MAX = 255
"""Bytes in one file name on Linux's and macOS's filesystems."""
_NAME_ROOM = NAME_MAX - 24
"""Bytes of a name a temporary keeps whole: the rest is the prefix, ``-<pid>-<rand>``."""
_SHORTENED = re.compile(r".*~[0-9a-f]{12}")


def _temp_stem(name: str) -> str:
    """``name`` as its temporaries carry it: whole, or its first bytes and a hash when the
    temporary's name would be longer than the filesystem allows."""
    raw = os.fsencode(name)
    if len(raw) <= _NAME_ROOM:
        return name
    head = raw[: _NAME_ROOM - 13].decode("utf-8", "ignore")
    return f"{head}~{hashlib.sha256(raw).hexdigest()[:12]}"


def temp_sibling(final: Path, prefix: str = TMP_PREFIX) -> Path:
    """A fresh hidden name next to ``final``: ``<prefix><name>-<pid>-<rand>`` (a long name
    shortened, see :func:`_temp_stem`)."""
    stem = _temp_stem(final.name)
    return final.parent / f"{prefix}{stem}-{os.getpid()}-{secrets.token_hex(4)}"


def temporaries_of(final: Path) -> list[Path]:
    """The temporaries that writers of ``final`` killed mid-write left beside it (the names
    :func:`temp_sibling` gives), for a caller that knows it is the only writer of ``final``."""
    final = Path(final)
    name = re.compile(rf"{re.escape(TMP_PREFIX + _temp_stem(final.name))}-\d+-[0-9a-f]{{8}}")
    return sorted(p for p in final.parent.glob(f"{TMP_PREFIX}*") if name.fullmatch(p.name))


def describe_os_error(e: OSError) -> str:
    """``"No space left on device (errno 28)"``-style text for an OSError."""
    reason = e.strerror or str(e)
    return f"{reason} (errno {e.errno})" if e.errno is not None else reason


def directory_problem(path: Path) -> str | None:
    """Why ``path`` cannot be created (or replaced) as a directory, or None when it can.

    Checked before a command writes there, so that a file, a broken symlink or a symlink loop in
    the way is named plainly instead of surfacing as an error from deep inside a write.
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if path.is_symlink():
            return f"{path}: a broken symlink (to {os.readlink(path)})"
        return None  # created, with its missing parents
    except NotADirectoryError:
        return f"{path}: a parent of it is a file, not a directory"
    except OSError as e:  # EACCES, ...
        if e.errno == errno.ELOOP:
            return f"{path}: a symlink loop ({describe_os_error(e)})"
        return f"{path}: {describe_os_error(e)}"
    if not stat.S_ISDIR(mode):
        return f"{path}: exists and is not a directory"
    return None


def empty_directory_problem(path: Path) -> str | None:
    """Why ``path`` cannot be written as a new directory, or None: :func:`symlink_problem`,
    :func:`directory_problem`, or a directory that already holds something (never written
    over)."""
    # a broken link is directory_problem's to name
    if problem := (Path(path).exists() and symlink_problem(path)) or directory_problem(path):
        return problem
    if Path(path).is_dir() and any(Path(path).iterdir()):
        return f"{path}: exists and is not empty"
    return None


def file_target_problem(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (by :func:`atomic_write_bytes`, its missing
    parent directories created), or None: a directory in the way, a name longer than the
    filesystem allows, a file where a parent should be, or a directory it may not create files
    in. Checked before a command spends its time on what it will write there.
    """
    path = Path(path)
    if len(os.fsencode(path.name)) > NAME_MAX:
        return f"{path}: its name is longer than {NAME_MAX} bytes"
    if path.is_dir():
        return f"{path}: a directory"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        what = "a file, not a directory" if parent.is_file() else "not a directory"
        return f"{path}: {parent} is {what}"
    probe = temp_sibling(parent / "probe")
    try:  # a real creation: permissions, ACLs, read-only and immutable directories all tell
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as e:
        return f"{path}: cannot create files in {parent} ({describe_os_error(e)})"
    return None


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (creations, renames, deletions in it) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems (network, FUSE) cannot fsync a directory; the data is still flushed.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush one file's data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replaced_from_temp(final: Path, verb: str) -> Iterator[Path]:
    """Yield a fresh temporary sibling of ``final`` for the block to create; then rename it over
    ``final`` and flush the parent directory.

    Raises:
        CheckpointSaveError: an OSError in the block or the rename (``could not <verb>
            <final>``); the temporary is removed and ``final`` is as it was.
    """
    tmp = temp_sibling(final)
    try:
        yield tmp
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise CheckpointSaveError(f"could not {verb} {final}: {describe_os_error(e)}") from e


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (temp sibling, fsync, rename, fsync parent).

    Raises:
        CheckpointSaveError: the write failed; ``path`` still holds its previous content.
    """
    with _replaced_from_temp(Path(path), "write") as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write_bytes` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_symlink(link: Path, target: str) -> None:
    """Point the symlink ``link`` at ``target`` (relative or absolute), replacing it atomically."""
    with _replaced_from_temp(Path(link), "update") as tmp:
        os.symlink(target, tmp)


def fsync_tree(root: Path, *, files: bool = True) -> None:
    """fsync every file under ``root`` (unless ``files`` is False), then every directory
    bottom-up (``root`` last)."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames if files else ():
            p = Path(dirpath, name)
            if not p.is_symlink():
                fsync_file(p)
        fsync_dir(Path(dirpath))


def remove_path(path: Path) -> None:
    """Delete a file, symlink or directory tree; a missing path is fine."""
    if path.is_symlink() or path.is_file():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(final: Path, *, fsync_files: bool = True) -> Iterator[Path]:
    """Build a directory under a temporary name and move it into place only when complete.

    Yields a fresh empty sibling directory to fill. On a clean exit every file in it is fsynced,
    it is renamed to ``final`` (an existing ``final`` is first moved aside, then deleted after the
    rename) and the parent is fsynced. On an exception the temporary is deleted and ``final`` is
    left as it was.

    Args:
        final: the directory to create or replace.
        fsync_files: False when the caller made its files durable itself (hard links of
            fsynced files); the directories are fsynced either way.

    Raises:
        CheckpointSaveError: an OSError (disk full, permissions, ...) while writing or renaming,
            with the path and the OS reason in the message. Other exceptions from the body pass
            through unchanged (after the cleanup).
    """
    final = Path(final)
    parent = final.parent
    tmp = temp_sibling(final)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise CheckpointSaveError(f"could not write {final}: {describe_os_error(e)}") from e
    try:
        yield tmp
        fsync_tree(tmp, files=fsync_files)
        _move_into_place(tmp, final)
    except BaseException as e:
        remove_path(tmp)
        if isinstance(e, OSError):
            raise CheckpointSaveError(f"could not write {final}: {describe_os_error(e)}") from e
        raise


def _move_into_place(tmp: Path, final: Path) -> None:
    parent = final.parent
    old = None
    if final.is_symlink() or final.is_file():
        # A file or symlink is replaced by os.replace directly: no moment without `final`.
        pass
    elif final.exists():
        old = temp_sibling(final, OLD_PREFIX)
        os.rename(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old is not None:
            os.rename(old, final)  # put the previous version back before reporting
        raise
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        with contextlib.suppress(OSError):
            fsync_dir(parent)


def recover_interrupted(parent: Path) -> list[str]:
    """Undo what a killed writer left in ``parent``; returns one line per action, for the log.

    An ``.old-<name>-*`` directory whose ``<name>`` is missing is renamed back (the kill came
    between moving the old version aside and renaming the new one in); otherwise it is deleted.
    Every ``.tmp-*`` entry is deleted: the directory is assumed to have one writer at a time.
    """
    parent = Path(parent)
    actions: list[str] = []
    if not parent.is_dir():
        return actions
    entries = sorted(parent.iterdir(), key=lambda p: p.name)
    for p in entries:
        if not p.name.startswith(OLD_PREFIX):
            continue
        name = p.name[len(OLD_PREFIX) :].rsplit("-", 2)[0]
        final = parent / name
        if _SHORTENED.fullmatch(name) and len(os.fsencode(name)) > _NAME_ROOM - 16:
            # the name it replaced was too long to record whole: put back by hand
            actions.append(f"kept {p.name}: the directory it replaced has a longer name")
            continue
        if name and not final.exists() and not final.is_symlink():
            os.rename(p, final)
            actions.append(f"restored {final} from interrupted replacement {p.name}")
        else:
            remove_path(p)
            actions.append(f"removed leftover {p.name}")
    for p in entries:
        if p.name.startswith(TMP_PREFIX) and (p.exists() or p.is_symlink()):
            remove_path(p)
            actions.append(f"removed leftover {p.name}")
    if actions:
        fsync_dir(parent)
    return actions

