"""A run's log (stderr, and the run directory's ``train.log`` on rank zero) and its start-up
record (seconds per phase up to the first optimizer step)."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from asrforge.io.append import open_append
from asrforge.run_layout import RunLayout

log = logging.getLogger("asrforge.train")


def is_rank_zero() -> bool:
    """Whether this process is rank zero of its launch, the one that owns the console and the run
    directory (torchrun and accelerate set ``RANK``; a process started alone is rank zero)."""
    return os.environ.get("RANK", "0") == "0"


def setup_logging(output_dir: Path | None, is_main: bool) -> logging.Handler | None:
    """Log to stderr and (main process) to ``output_dir/train.log``."""
    root = logging.getLogger("asrforge")
    root.setLevel(logging.INFO)
    if not any(getattr(h, "_asrforge", False) for h in root.handlers):
        h = _StderrHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        h._asrforge = True  # noqa: SLF001
        root.addHandler(h)
    # The console belongs to rank zero; the other ranks show only errors.
    for h in root.handlers:
        if getattr(h, "_asrforge", False):
            h.setLevel(logging.INFO if is_main else logging.ERROR)
    if output_dir is None or not is_main:
        return None
    fh = _RunLogFile(RunLayout(output_dir).log)
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(fh)
    return fh


def detach_run_log(path: Path) -> None:
    """Stop logging to the run log file ``path`` and close it (a run that failed to start has
    no :class:`~asrforge.train.setup.RunSetup` to close it)."""
    root = logging.getLogger("asrforge")
    for h in list(root.handlers):
        if isinstance(h, _RunLogFile) and Path(h.baseFilename) == Path(path).absolute():
            root.removeHandler(h)
            h.close()


class _RunLogFile(logging.FileHandler):
    """``train.log``, appended to, never through a symlink (refused by name). A write that
    fails (a full disk) is reported once, in one line, and the file is written no more;
    logging's default prints a traceback for every later record."""

    failed = False

    def _open(self):
        return open_append(self.baseFilename)

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if not self.failed:
            self.failed = True
            print(
                f"asrforge: cannot write {self.baseFilename} ({sys.exc_info()[1]}); the log "
                "goes on on stderr only",
                file=sys.stderr,
            )

    def close(self) -> None:
        try:
            super().close()
        except OSError:
            # Flushing what a failed write left was reported already and must not mask the error that
            # is ending the run.
            pass


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (test runners and
    notebooks replace it; a handler holding the old stream would write to a closed file)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class StartupClock:
    """The run's record of its start-up: seconds per phase, from the CLI's imports to the first
    optimizer step, logged once as the time-to-first-step breakdown.

    Args:
        before: phases timed before the run was built (the CLI's imports and config).
    """

    def __init__(self, before: dict[str, float] | None = None):
        self.phases: dict[str, float] = dict(before or {})
        self._t = time.perf_counter()
        self._first_step_logged = False

    def lap(self, name: str) -> None:
        """Record the seconds since the last lap (or :meth:`restart`) as phase ``name``."""
        now = time.perf_counter()
        self.phases[name] = now - self._t
        self._t = now

    def restart(self) -> None:
        """Start the next phase now (the time since the last lap is not a phase)."""
        self._t = time.perf_counter()

    def first_step_taken(self) -> None:
        """Record the ``first step`` phase and log the breakdown, once per run."""
        if self._first_step_logged:
            return
        self._first_step_logged = True
        self.lap("first step")
        log.info(
            "time to first step %.1f s: %s",
            sum(self.phases.values()),
            ", ".join(f"{k} {v:.2f}" for k, v in self.phases.items()),
        )
