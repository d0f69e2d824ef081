"""The run directory as a run found it, so that a run stopped before it began (before it
trained a clip or saved) by bad input (:class:`~asrforge.errors.UserError`, exit code 2) or by
Ctrl-C or SIGTERM (exit code 130) leaves no trace there.

What start-up adds is removed again: the whole directory (and the parents it made) when the run
created it; otherwise the entries start-up creates (:data:`STARTUP_ENTRIES`, ``skipped-*.json``,
and those the run's callbacks name in :meth:`~asrforge.train.events.Callback.run_entries`) that
were not there before, the lines appended to an existing ``train.log``, and an existing
``config.yaml`` start-up replaced (a refused resume). Nothing else is
touched: a run's earlier files, and what ``--start-over`` set aside, stay.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from asrforge.checkpoint.training import TOKENIZER_DIR
from asrforge.errors import CheckpointSaveError
from asrforge.io.append import LinkRefused, open_no_follow
from asrforge.io.atomic import atomic_write_bytes
from asrforge.run_layout import (
    CACHE,
    CARVE_FILE,
    CHECKPOINTS,
    CONFIG_FILE,
    EVAL,
    HUB_COMMITS_FILE,
    RUN_LOG,
)
from asrforge.train.run_log import detach_run_log

STARTUP_ENTRIES = frozenset(
    {RUN_LOG, CONFIG_FILE, HUB_COMMITS_FILE, CARVE_FILE, TOKENIZER_DIR, CACHE, CHECKPOINTS, EVAL}
)
"""Top-level names of a run directory that start-up creates (besides ``skipped-*.json`` and the
callbacks' files)."""


@dataclass(frozen=True)
class RunDirBefore:
    """What a run directory held when the run began looking at it."""

    path: Path
    created_from: Path | None
    """The topmost missing directory of ``path``: the run creates it. None: ``path`` existed."""
    entries: frozenset[str]
    log_size: int | None
    """``train.log``'s size, None when it was not there."""
    config: bytes | None = None
    """``config.yaml``'s bytes, None when it was not there."""
    ours: frozenset[str] = STARTUP_ENTRIES
    """Top-level names start-up may create: :data:`STARTUP_ENTRIES` and the callbacks'."""

    @classmethod
    def look(cls, path: Path, callback_entries: Iterable[str] = ()) -> RunDirBefore:
        """``path`` as it is now; ``callback_entries``: the names the run's callbacks create
        there (:meth:`~asrforge.train.events.Callback.run_entries`)."""
        path = Path(path).absolute()
        ours = STARTUP_ENTRIES | frozenset(callback_entries)
        missing, p = None, path
        while not os.path.lexists(p):
            missing, p = p, p.parent
        if missing is not None or not path.is_dir():
            return cls(path, missing, frozenset(), None, None, ours)
        log, config = path / RUN_LOG, path / CONFIG_FILE
        size = log.lstat().st_size if log.is_file() and not log.is_symlink() else None
        text = config.read_bytes() if config.is_file() and not config.is_symlink() else None
        return cls(path, None, frozenset(os.listdir(path)), size, text, ours)

    @property
    def holds_run(self) -> bool:
        """Whether a run started here before (its ``checkpoints/`` is there)."""
        return CHECKPOINTS in self.entries

    def restore(self) -> None:
        """Remove what start-up added since :meth:`look`; call it on rank zero only."""
        detach_run_log(self.path / RUN_LOG)
        if self.created_from is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            # another run started beside this one may have put its directory in the same parent
            d = self.path
            while d != self.created_from:
                d = d.parent
                try:
                    os.rmdir(d)
                except OSError:
                    break
            return
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        for name in names:
            ours = name in self.ours or re.fullmatch(r"skipped-.+\.json", name)
            if name in self.entries or not ours:
                continue
            p = self.path / name
            # best effort, as below: the error that stopped the run is the one to report
            with contextlib.suppress(OSError):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        if self.log_size is not None:
            # best effort: the error that stopped the run is the one to report
            with contextlib.suppress(OSError, LinkRefused):
                fd = open_no_follow(self.path / RUN_LOG, os.O_WRONLY)
                try:
                    os.ftruncate(fd, self.log_size)
                finally:
                    os.close(fd)
        if self.config is not None:
            with contextlib.suppress(OSError, CheckpointSaveError):
                if (self.path / CONFIG_FILE).read_bytes() != self.config:
                    atomic_write_bytes(self.path / CONFIG_FILE, self.config)
