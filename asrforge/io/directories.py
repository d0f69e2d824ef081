"""Directories asrforge writes into inside a run or matrix root: real directories, never a link.

``O_NOFOLLOW`` guards only the last component of a path, so a link standing for a directory
(``eval/`` pointing elsewhere) would carry every write under it out of the root. Before a run or
a launch writes, its root is walked once without following links: the only link allowed is one
naming a sibling by its bare name (``checkpoints/latest``), which stays inside the root.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePath

from asrforge.errors import UserError
from asrforge.io.append import SymlinkRefused


def hidden(rel: str | PurePath) -> bool:
    """Whether a path relative to a directory lies under a hidden name: ``.git/``, Finder's
    ``.DS_Store``, the ``._name`` files macOS writes on other file systems, the Hub's
    ``.gitattributes``. Tools leave these in a directory they pass through; they are no part of
    the bundle its manifest describes, so they are neither copied nor refused as unlisted."""
    return any(part.startswith(".") for part in PurePath(rel).parts)


def plain_name(name: object) -> bool:
    """Whether ``name`` is a plain name of an entry in a directory: a string naming no other
    directory (no separator, not ``.`` or ``..``), so that joined to a root it stays inside it."""
    return (isinstance(name, str) and name not in ("", ".", "..") and os.sep not in name
            and "\0" not in name)  # fmt: skip


def refuse_links_under(root: Path, *, not_walked: tuple[str, ...] = ()) -> None:
    """Walk ``root`` (not following links) and refuse any link to a directory that leads out of
    its own directory (files are guarded where they are opened: :mod:`asrforge.io.append`).

    ``root`` itself may be a link (the person named it); what is under it may not.
    ``not_walked``: top-level names whose trees asrforge never reads or writes into again (a
    matrix root's ``slurm/``, where each launch makes a directory of its own).

    Raises:
        SymlinkRefused: the first such link, named with its target.
    """
    root = Path(root)
    if not root.is_dir():
        return
    pending = [root]
    while pending:
        directory = pending.pop()
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if entry.is_symlink():
                target = os.readlink(entry.path)
                if entry.is_dir() and not plain_name(target):
                    raise SymlinkRefused(
                        f"{entry.path}: a symlink (to {target}) inside {root}; asrforge does not "
                        "write through a link to a directory it did not create: remove it"
                    )
            elif entry.is_dir(follow_symlinks=False):
                if directory != root or entry.name not in not_walked:
                    pending.append(Path(entry.path))


def real_directory(path: Path, *, under: Path) -> Path:
    """``path`` as a real directory: each component below ``under`` that exists must be a
    directory and not a link; missing ones are created. Returns ``path``.

    Raises:
        SymlinkRefused: a component is a link, named with its target.
        UserError: a component is not a directory.
    """
    path, under = Path(path), Path(under)
    parts = path.relative_to(under).parts
    current = under
    for part in parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            try:
                os.mkdir(current)
            except FileExistsError:
                pass
            mode = os.lstat(current).st_mode
        if stat.S_ISLNK(mode):
            raise SymlinkRefused(
                f"{current}: a symlink (to {os.readlink(current)}); asrforge writes only into "
                "real directories it made: remove it"
            )
        if not stat.S_ISDIR(mode):
            raise UserError(f"{current}: exists and is not a directory")
    return path


def symlink_problem(path: Path) -> str | None:
    """Why ``path``, a directory a command was told to write, is refused when it is a symlink
    (named with its target and the real path to give instead); None when it is not one."""
    path = Path(path)
    if not path.is_symlink():
        return None
    return f"{path}: a symlink (to {os.readlink(path)}); give the real path ({path.resolve()})"


def nearest_existing_parent(path: Path) -> Path:
    """The nearest parent of ``path`` that exists (or is a link): the directories below it are
    the ones a writer of ``path`` makes, with :func:`real_directory`."""
    parent = Path(path).parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    return parent
