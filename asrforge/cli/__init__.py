"""The ``asrforge`` command: the top-level parser, the exit codes and the one-line errors; each
command's parser and handler are a module of this package.

Exit codes: 0 success (also a run stopped early by a callback or the selection policy), 1 a run
that failed (diverged, a checkpoint or another file that could not be written, a critical
callback), 2 bad input (a config, a path, a file): one message naming what is wrong, no
traceback; 75 a run stopped by SIGTERM/SIGINT after saving its checkpoint,
which ``--resume`` continues (the matrix retries it); 130 Ctrl-C with nothing saved: a second
signal, or one before the run began (its start undone, as bad input's is) or during another
command; 141, and no message, when standard output's reader went away (``| head``)
(:class:`asrforge.errors.ExitCode` owns them).
"""

from __future__ import annotations

import argparse
import atexit
import errno
import os
import select
import sys
from typing import NoReturn

from asrforge.cli import (
    align_heads,
    average,
    config,
    corpus,
    demo,
    evaluate,
    export,
    guard,
    import_ct2,
    lm,
    matrix,
    report,
    train,
    transcribe,
    vocab,
)
from asrforge.cli.memory import keep_freed_memory
from asrforge.config.hf_names import flag_hint
from asrforge.errors import (
    CheckpointSaveError,
    ExitCode,
    UploadError,
    UserError,
    report_exit_code,
)
from asrforge.hub import pinned
from asrforge.io.atomic import describe_os_error

# Each command's module, in the order `asrforge --help` lists them; these modules import their
# heavy domain code only when the command runs, so every parser is built on each call.
COMMANDS = (
    train, config, matrix, report, export, transcribe, evaluate, demo, lm, average, import_ct2,
    vocab, corpus, guard, align_heads,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser, every command's sub-parser included."""
    parser = argparse.ArgumentParser(
        prog="asrforge",
        description="Fine-tune Whisper-family speech recognition models; evaluate, select, export.",
        epilog="Exit codes: " + ", ".join(f"{c:d} {c.meaning}" for c in ExitCode) + ".",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()
    try:
        code = int(_main(argv))
    except KeyboardInterrupt:  # before the command ran: while its parser was built
        code = _interrupted()
    report_exit_code(code)
    # Here the command's frames and its error's traceback are gone, so nothing keeps the group.
    if _process_group_open():
        from asrforge.train.ranks import close_process_group

        if not close_process_group():  # gloo's threads outlive the group's close
            leave_without_finalization(code)
    return code


def _process_group_open() -> bool:
    """Whether this process has a torch process group to close, read from the modules already
    loaded: a Ctrl-C in the middle of torch's import leaves parts of it in ``sys.modules``, and
    importing torch again then fails with a traceback."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or "torch" not in sys.modules:
        return False
    is_available = getattr(dist, "is_available", None)
    is_initialized = getattr(dist, "is_initialized", None)
    return bool(is_available and is_initialized and is_available() and is_initialized())


def leave_without_finalization(code: int) -> NoReturn:
    """Exit with ``code`` after the exit handlers a normal exit runs (logging's flush, workers'
    joins, temporary directories' removal), but without the interpreter's finalization, during
    which a gloo worker thread that asks for the GIL aborts the process."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    unknown = [a for a in extra if a not in overrides]
    if unknown or (overrides and not getattr(args, "accepts_overrides", False)):
        flags = [a for a in unknown if a.startswith("--")]
        takes_overrides = getattr(args, "accepts_overrides", False)
        hint = f" ({flag_hint(flags[0])})" if flags and takes_overrides else ""
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}{hint}")
    args.overrides = overrides
    try:
        # A command reads one commit of each Hub repository it names, however often it asks.
        with pinned():
            return int(args.func(args) or 0)
    except UserError as e:
        print(f"asrforge: error: {e}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except BrokenPipeError:
        if _stdout_closed():
            return _leave_output_closed()
        raise
    except UploadError as e:
        print(f"asrforge: error: {e}", file=sys.stderr)
        return ExitCode.FAILED
    except (CheckpointSaveError, OSError) as e:
        # A write (or read) the OS refused: export, average, a run's set-up, ... (a failed
        # checkpoint save is reported by `cli.train.run`). One line, no traceback; nothing
        # was half-written, as every write is atomic.
        print(f"asrforge: error: {_describe_write_failure(e)}", file=sys.stderr)
        return ExitCode.BAD_INPUT if _path_at_fault(e) else ExitCode.FAILED
    except KeyboardInterrupt:
        return _interrupted()


def _stdout_closed() -> bool:
    """Whether standard output's reader went away (a broken pipe elsewhere is an error)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # a stdout without a descriptor (a test's capture)
        return False
    if not hasattr(select, "poll"):
        return True  # no way to ask: a broken pipe at the top is stdout's, as Python's docs say
    # Flushing again proves nothing, as the failed write dropped what it held; a pipe or socket
    # with no reader polls as an error or a hang-up.
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _leave_output_closed() -> int:
    """End quietly after standard output's reader went away, as Unix tools do in a pipeline."""
    try:
        # Python flushes stdout once more at exit, which would print an ignored error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout without a descriptor (a test's capture)
        pass
    return ExitCode.OUTPUT_CLOSED


def _interrupted() -> int:
    print("asrforge: interrupted", file=sys.stderr)
    return ExitCode.CANCELLED


# The path the user named is at fault (exit 2), unlike a full disk or an I/O error (exit 1).
_PATH_ERRNOS = {
    errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENOENT, errno.EACCES,
    errno.EPERM, errno.EROFS, errno.ENAMETOOLONG,
}  # fmt: skip


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (itself, or what a CheckpointSaveError wraps)."""
    if isinstance(e, OSError):
        return e
    return e.__cause__ if isinstance(e.__cause__, OSError) else None


def _describe_write_failure(e: BaseException) -> str:
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename is not None else ""
        return f"{where}{describe_os_error(e)}"
    return str(e)


def _path_at_fault(e: BaseException) -> bool:
    cause = _os_error(e)
    return cause is not None and cause.errno in _PATH_ERRNOS


if __name__ == "__main__":
    sys.exit(main())
