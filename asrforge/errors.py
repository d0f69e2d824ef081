"""Errors a user can act on. The CLI prints their message and exits with code 2, no traceback.
The exit codes (:class:`ExitCode`), and how the processes of a job under torchrun report theirs
to the matrix.

This module imports nothing of ours, so every layer may raise these.
"""

import os
from enum import IntEnum


class UserError(Exception):
    """Bad input from the user (a config, a path, a file): the message says what and where."""


class CheckpointError(UserError):
    """A checkpoint or bundle on disk cannot be used."""


class CheckpointCorruptError(CheckpointError):
    """A file is missing, truncated or does not match the sha256 in the manifest."""


class CheckpointNotSupportedError(CheckpointError):
    """A state dict's tensor names or shapes do not match the model the config describes."""


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions, ...). The previous one is intact."""


class UploadError(RuntimeError):
    """An upload the Hub could not take for want of the network or of the Hub itself, not of the
    input (exit 1: trying again may work); the message says nothing was uploaded."""


class RunIOError(RuntimeError):
    """A run stopped because a file could not be written (a full disk, permissions): the message
    names the file and the checkpoint a resume continues from."""


class ExitCode(IntEnum):
    """The exit codes of the ``asrforge`` command, of a training process and of a matrix launch."""

    OK = 0
    """Done, also a run stopped early by a callback or the selection policy."""
    FAILED = 1
    """A run that failed: diverged, a file that could not be written, a critical callback."""
    BAD_INPUT = 2
    """A config, a path or a file is wrong: one line names it, no traceback."""
    INTERRUPTED = 75
    """Stopped by SIGTERM/SIGINT after saving a checkpoint (sysexits' EX_TEMPFAIL: try again
    later): ``--resume`` continues it, and the matrix retries it."""
    CANCELLED = 130
    """Stopped by Ctrl-C without saving (128 + SIGINT, as a shell reports it): a second signal
    during a run, or one before it began (Ctrl-C or SIGTERM; its start is undone) or during
    another command."""
    OUTPUT_CLOSED = 141
    """Stopped quietly because what read its output went away (``| head``): 128 + SIGPIPE, as a
    shell reports a command the closed pipe ended."""

    @property
    def meaning(self) -> str:
        """What the code tells the person who ran the command, for the CLI's help."""
        return _MEANINGS[self]


_MEANINGS = {
    ExitCode.OK: "done",
    ExitCode.FAILED: "a run failed",
    ExitCode.BAD_INPUT: "bad input (config, path, file)",
    ExitCode.INTERRUPTED: "a run stopped by SIGTERM/SIGINT after saving (--resume continues it)",
    ExitCode.CANCELLED: "stopped by Ctrl-C with nothing saved (a second signal, or one before "
    "the run began, whose start is undone)",
    ExitCode.OUTPUT_CLOSED: "stopped quietly: its output's reader went away (| head)",
}


EXIT_DIR_ENV = "ASRFORGE_EXIT_DIR"
"""Environment variable naming a directory where each process of a job run under ``torchrun``
reports its exit code (:func:`report_exit_code`): torchrun itself exits 1 whatever its processes
exited with, and the matrix must tell bad input (2) and an interrupted run (75) from a crash."""


def report_exit_code(code: int) -> None:
    """Write ``code`` to ``rank-<RANK>`` in the directory :data:`EXIT_DIR_ENV` names, if any
    (the launcher made it; the file is created, never followed through a link)."""
    directory = os.environ.get(EXIT_DIR_ENV)
    if not directory:
        return
    path = os.path.join(directory, f"rank-{int(os.environ.get('RANK', '0'))}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError:
        return  # the code is a hint to the launcher; torchrun's own code still stands
    with os.fdopen(fd, "w") as f:
        f.write(f"{int(code)}\n")


def reported_exit_code(returncode: int | None, directory: str) -> int | None:
    """The exit code a job's processes reported in ``directory`` when its launcher (torchrun)
    failed with 1: 2 when any process exited for bad input, else 75 when any was interrupted after
    saving, else ``returncode``."""
    if returncode != 1 or not os.path.isdir(directory):
        return returncode
    codes = set()
    for name in os.listdir(directory):
        try:
            with open(os.path.join(directory, name)) as f:
                codes.add(int(f.read().strip()))
        except (OSError, ValueError):
            continue
    for code in (ExitCode.BAD_INPUT, ExitCode.INTERRUPTED):
        if code in codes:
            return code
    return returncode
