"""``asrforge train``: one run from a YAML config, started or resumed."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from asrforge.cli.problems import raise_problems
from asrforge.config import external_code_allowed, load_config
from asrforge.config.reference import fields_epilog
from asrforge.errors import CheckpointSaveError, ExitCode, RunIOError
from asrforge.hub import hub_ref, model_dir_problem
from asrforge.io.atomic import directory_problem
from asrforge.run_layout import RunLayout
from asrforge.selection.policies import format_metrics
from asrforge.text.languages import config_language_problems
from asrforge.train.events import CriticalCallbackError
from asrforge.train.paths import local_path_problems
from asrforge.train.run_log import is_rank_zero

# The loop, the callbacks and torch are imported inside the handler once the config is read, so
# `asrforge --help` and a bad config answer without seconds of imports.


def add_parser(sub) -> None:
    """Register ``train``."""
    p = sub.add_parser(
        "train",
        help="train a model from a YAML config",
        description="Train from CONFIG.yaml; dotted.key=value overrides may come anywhere.",
        epilog=fields_epilog(),  # generated from the schema, every field's docstring
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="the YAML config file")
    p.add_argument(
        "--resume", action="store_true",
        help="continue from checkpoints/latest (refused when output_dir holds no run)",
    )
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
    p.set_defaults(func=run, accepts_overrides=True)


def run(args) -> int:
    t1 = time.perf_counter()
    cfg = load_config(args.config, args.overrides)  # a bad config answers before torch loads
    t_config = time.perf_counter() - t1
    problems = config_language_problems(cfg)  # not after seconds of start-up and data reads
    if problem := directory_problem(cfg.output_dir):  # a file or a symlink loop in the way
        problems.append(f"output_dir: {problem}")
    run_config = RunLayout(cfg.output_dir).config
    if not args.resume and run_config.is_file() and run_config.samefile(args.config):
        # a new run writes its resolved config there, which would replace the user's file
        problems.append(
            f"{args.config}: is the run's own config.yaml (output_dir {cfg.output_dir}), which a "
            "new run replaces with its resolved config; keep your config outside output_dir"
        )
    # A local pretrained model is checked before the data is read; a Hub id resolves later.
    if cfg.model.pretrained is not None and hub_ref(cfg.model.pretrained) is None:
        if problem := model_dir_problem(cfg.model.pretrained, Path(cfg.model.pretrained)):
            problems.append(f"model.pretrained: {problem}")
    problems += local_path_problems(cfg)
    if cfg.model.lora is not None:  # its names against the model's skeleton, before any data
        from asrforge.model.lora import target_problems

        problems += target_problems(cfg.model)
    raise_problems(problems)

    from asrforge.callbacks import build_callbacks
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
        return ExitCode.FAILED
    except (CheckpointSaveError, RunIOError) as e:  # the message names the file
        print(f"asrforge: run stopped: {e}", file=sys.stderr)
        return ExitCode.FAILED
    if not is_rank_zero():  # the console is rank zero's
        return ExitCode.FAILED if result.status == "diverged" else ExitCode.OK
    print(f"asrforge: {result.status} at step {result.step}: {result.reason}; run dir {result.output_dir}")
    if result.best_step is not None:
        print(f"asrforge: {_describe_best(result)}")
    if result.refused is not None:
        print(f"asrforge: {result.refused}")
    return {"diverged": ExitCode.FAILED, "interrupted": ExitCode.INTERRUPTED}.get(
        result.status, ExitCode.OK
    )


def _describe_best(result) -> str:
    """The best checkpoint's own evaluation, then the policy's bests over all evaluations that
    differ from it (named ``best_<metric>``: they may be other evaluations' numbers)."""
    best, tracked = result.best, result.tracked_bests
    own = format_metrics(best)
    others = ", ".join(
        f"{k} {v:.4f}" for k, v in tracked.items() if k.startswith("best_") and best.get(k[5:]) != v
    )
    line = f"best checkpoint at step {result.best_step}: {own or 'not evaluated'}"
    start = format_metrics(result.start)
    # With eval.at_start the starting model's metrics show what fine-tuning changed.
    if start and result.best_step != 0:
        line = f"{line} (the starting model at step 0: {start})"
    return f"{line}; the selection policy's bests over all evaluations: {others}" if others else line


def _seconds_since_process_start() -> float:
    # On Linux /proc/self is created with the process.
    try:
        return time.time() - os.stat("/proc/self").st_ctime
    except OSError:
        return 0.0
