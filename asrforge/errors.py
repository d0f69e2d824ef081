"""Errors a user can act on. The CLI prints their message and exits with code 2, no traceback.

This module imports nothing of ours, so every layer may raise these.
"""


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


class RunIOError(RuntimeError):
    """A run stopped because a file could not be written (a full disk, permissions): the message
    names the file and the checkpoint a resume continues from."""


EXIT_INTERRUPTED = 75
"""Exit code of ``asrforge train`` stopped by SIGTERM/SIGINT after saving a checkpoint
(sysexits' EX_TEMPFAIL: try again later): ``--resume`` continues it, and the matrix retries it."""
