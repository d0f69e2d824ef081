"""The ``asrforge`` command.

Exit codes: 0 success (also a run stopped early by a callback or the selection policy), 1 a run
that failed (diverged, a checkpoint or another file that could not be written, a critical
callback), 2 bad input (a config, a path, a file): one message naming what is wrong, no
traceback; 75 (``EXIT_INTERRUPTED``) a run stopped by SIGTERM/SIGINT after saving its checkpoint,
which ``--resume`` continues (the matrix retries it); 130 a second signal that stopped it unsaved.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
import time
from collections.abc import Callable

from asrforge.config_hf import flag_hint
from asrforge.config_reference import fields_epilog
from asrforge.errors import EXIT_INTERRUPTED, CheckpointSaveError, RunIOError, UserError
from asrforge.io.atomic import describe_os_error, directory_problem
from asrforge.train.run_log import is_rank_zero

# Sub-commands that live next to the code they drive (each module has ``add_cli``).
EXTERNAL_COMMANDS = [
    "asrforge.cli.config",
    "asrforge.cli.matrix",
    "asrforge.cli.bundle",
    "asrforge.cli.demo",
    "asrforge.cli.lm",
]
# Those whose modules import torch or transformers at the top are imported only when their
# command is named, so `asrforge --help` and a mistyped line answer without seconds of imports;
# their one-line help is repeated here (a test keeps it equal to the module's).
HEAVY_COMMANDS = {
    "average": ("asrforge.cli.average", "average the k best checkpoints of a run by a metric"),
    "import-ct2": (
        "asrforge.cli.import_ct2",
        "convert a CTranslate2 (faster-whisper) Whisper model to a transformers directory",
    ),
    "vocab": ("asrforge.cli.vocab", "per-language vocabulary extension"),
    "corpus": ("asrforge.cli.corpus", "synthesize a multilingual speech corpus with espeak-ng"),
}


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model from a YAML config",
        description="Train from CONFIG.yaml; dotted.key=value overrides may come anywhere.",
        epilog=fields_epilog(),  # generated from the schema, every field's docstring
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="the YAML config file")
    p.add_argument("--resume", action="store_true", help="continue from checkpoints/latest")
    p.add_argument(
        "--start-over", action="store_true",
        help="train from step 0 when the run's checkpoints exist but none verifies (they are kept "
        "in checkpoints.damaged-<time>/); without it such a run is refused",
    )
    p.add_argument(
        "--allow-external-callbacks", action="store_true",
        help="allow callbacks named by `_target_` and augmentation transforms named "
        "'module:function' (imports and runs that code; or set "
        "ASRFORGE_ALLOW_EXTERNAL_CALLBACKS=1); a file can never allow it",
    )
    p.set_defaults(func=_run_train, accepts_overrides=True)


def _run_train(args) -> int:
    from asrforge.config import external_code_allowed, load_config

    t1 = time.perf_counter()
    cfg = load_config(args.config, args.overrides)  # a bad config answers before torch loads
    t_config = time.perf_counter() - t1
    if problem := directory_problem(cfg.output_dir):  # a file or a symlink loop in the way
        raise UserError(f"output_dir: {problem}")

    from asrforge.callbacks import build_callbacks
    from asrforge.train.events import CriticalCallbackError
    from asrforge.train.loop import Trainer

    allowed = external_code_allowed(args.allow_external_callbacks)
    callbacks = build_callbacks(cfg, allow_external=allowed, source=args.config)
    if cfg.data.augment.transforms:  # the same permission as callbacks' _target_
        from asrforge.data.augment import import_transforms

        import_transforms(cfg.data.augment.transforms, allowed=allowed)
    startup = {"imports": _seconds_since_process_start() - t_config, "config": t_config}
    try:
        result = Trainer(cfg, callbacks, startup=startup).fit(resume=args.resume, start_over=args.start_over)
    except CriticalCallbackError as e:
        print(f"asrforge: run stopped: {e}", file=sys.stderr)
        return 1
    except (CheckpointSaveError, RunIOError) as e:  # the message names the file
        print(f"asrforge: run stopped: {e}", file=sys.stderr)
        return 1
    _close_process_group()
    if not is_rank_zero():  # the console is rank zero's
        return 1 if result.status == "diverged" else 0
    print(f"asrforge: {result.status} at step {result.step}: {result.reason}; run dir {result.output_dir}")
    if result.best_step is not None:
        print(f"asrforge: {_describe_best(result)}")
    return {"diverged": 1, "interrupted": EXIT_INTERRUPTED}.get(result.status, 0)


def _close_process_group() -> None:
    """End this process's part in a finished multi-process run, every rank having passed the
    run's last barrier: a process group left to the interpreter's exit can abort the process
    from gloo's threads ("terminate called without an active exception")."""
    import torch.distributed as dist  # torch is loaded by now: the run used it

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _describe_best(result) -> str:
    """The best checkpoint's own evaluation, then the policy's bests over all evaluations that
    differ from it (named ``best_<metric>``: they may be other evaluations' numbers)."""
    from asrforge.selection import format_metrics

    best, tracked = result.best, result.tracked_bests
    own = format_metrics(best)
    others = ", ".join(
        f"{k} {v:.4f}" for k, v in tracked.items() if k.startswith("best_") and best.get(k[5:]) != v
    )
    line = f"best checkpoint at step {result.best_step}: {own or 'not evaluated'}"
    start = format_metrics(result.start)
    if start and result.best_step != 0:  # eval.at_start: what fine-tuning changed
        line = f"{line} (the starting model at step 0: {start})"
    return f"{line}; the selection policy's bests over all evaluations: {others}" if others else line


def _seconds_since_process_start() -> float:
    try:  # Linux: /proc/self was created with the process
        return time.time() - os.stat("/proc/self").st_ctime
    except OSError:
        return 0.0


BUILTIN_COMMANDS: list[Callable] = [_add_train]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. ``command``: the sub-command on the line (``""``: none), whose module is
    imported even when it is heavy; None imports every command's module (complete parsers)."""
    parser = argparse.ArgumentParser(
        prog="asrforge",
        description="Fine-tune Whisper-family speech recognition models; evaluate, select, export.",
        epilog=(
            "Exit codes: 0 done, 1 a run failed, 2 bad input (config, path, file), "
            f"{EXIT_INTERRUPTED} a run stopped by SIGTERM/SIGINT after saving (--resume continues it)."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in BUILTIN_COMMANDS:
        add(sub)
    for name in EXTERNAL_COMMANDS:
        mod = importlib.import_module(name)  # a broken command module must fail loudly
        if hasattr(mod, "add_cli"):
            mod.add_cli(sub)
    for name, (module, summary) in HEAVY_COMMANDS.items():
        if command is None or command == name:
            importlib.import_module(module).add_cli(sub)
        else:  # listed in --help; named on a line, its real parser is built instead
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(next((a for a in argv if not a.startswith("-")), ""))
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
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"asrforge: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointSaveError, OSError) as e:
        # A write (or read) the OS refused: export, average, a run's set-up, ... (a failed
        # checkpoint save is reported by `_run_train`). One line, no traceback; nothing
        # was half-written, as every write is atomic.
        print(f"asrforge: error: {_describe_write_failure(e)}", file=sys.stderr)
        return 2 if _path_at_fault(e) else 1
    except KeyboardInterrupt:
        print("asrforge: interrupted", file=sys.stderr)
        return 130


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
