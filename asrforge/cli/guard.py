"""``asrforge guard build``: clips joined into a guard set that ``eval.guard.path`` reads."""

from __future__ import annotations

import argparse
import shlex
from collections import Counter
from pathlib import Path

from asrforge.cli.open_model import open_model
from asrforge.errors import UserError

# The guard set's code decodes audio with torch and the model loads transformers: imported
# inside the handler, so building the parser (`asrforge --help`) does not wait for them.


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``asrforge guard build``."""
    parser = subparsers.add_parser(
        "guard",
        help="build a forgetting guard set from audio",
        description="The forgetting guard's data: speech the starting model already "
        "transcribes well (see docs/guard.md).",
    )
    sub = parser.add_subparsers(dest="guard_command", required=True, metavar="ACTION")
    b = sub.add_parser(
        "build",
        help="join clips into ~28 s recordings and write them with a manifest",
        description="Join clips, one language per recording, into recordings that fit one "
        "model window, and write them with a validation.jsonl manifest into --out: give "
        "--out as eval.guard.path. Without --model or --references the set has no "
        "references and the guard measures drift from the starting model.",
    )
    b.add_argument("audio", type=Path, nargs="+", metavar="AUDIO",
                   help="audio files, or directories of them (their audio files, name order)")  # fmt: skip
    b.add_argument("--out", type=Path, required=True, help="the guard set's directory (new)")
    b.add_argument(
        "--language",
        action="append",
        default=[],
        help="the clips' language (code, name or locale): once for every input, or once per "
        "input in their order; default none (the guard takes the run's language)",
    )
    b.add_argument(
        "--model",
        type=str,
        help="the starting model (a bundle, a run or checkpoint, a transformers directory, or a "
        "Hub id): its transcripts are stored as the references (with --references: of the clips "
        "it has none for)",
    )
    b.add_argument(
        "--references",
        type=Path,
        help="clip path -> text: a TSV (path<TAB>text[<TAB>language], or a header naming "
        "path/sentence/locale as Common Voice's) or a .jsonl of {path, text, language}; "
        "every clip needs one unless --model gives the others theirs",
    )
    b.add_argument("--window-seconds", type=float,
                   help="longest joined recording, at most 30 (default 28)")  # fmt: skip
    b.add_argument("--gap-seconds", type=float, help="silence between clips (default 0.5)")
    b.add_argument("--batch-size", type=int, default=8, help="recordings per batch with --model")
    b.add_argument("--max-new-tokens", type=int, default=224,
                   help="cap per recording with --model (default 224, half the decoder's 448)")  # fmt: skip
    b.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``asrforge guard build``; UserErrors propagate for the CLI to print."""
    from asrforge.data.guard_set import (
        GUARD_GAP_SECONDS,
        GUARD_WINDOW_SECONDS,
        check_out,
        plan_windows,
        read_clips,
        write_guard_set,
    )
    from asrforge.evaluation.guard import attach_model_references

    window = GUARD_WINDOW_SECONDS if args.window_seconds is None else args.window_seconds
    gap = GUARD_GAP_SECONDS if args.gap_seconds is None else args.gap_seconds
    if not 0 < window <= 30:
        raise UserError(f"--window-seconds: must be in (0, 30], got {window}")
    # nan, inf and a gap no window holds would each fail later, as a crash or gigabytes of zeros
    if not 0 <= gap < window:
        raise UserError(f"--gap-seconds: must be >= 0 and below the window ({window:g} s), "
                        f"got {gap}")
    for flag, value in (("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise UserError(f"{flag}: must be >= 1, got {value}")
    check_out(args.out)
    others = "--model" if args.model is not None else None
    clips = read_clips(args.audio, args.language, args.references, others_from=others)
    bundle = open_model(args.model, option="--model") if args.model is not None else None
    if bundle is not None and window > bundle.window_seconds:
        raise UserError(f"--window-seconds {window}: longer than the model's window "
                        f"({bundle.window_seconds:g} s)")  # fmt: skip
    windows = plan_windows(clips, window, gap)
    given = sum(w.text is not None for w in windows)
    if bundle is not None:
        attach_model_references(bundle, windows, args.batch_size, args.max_new_tokens)
    write_guard_set(args.out, windows)
    languages = Counter(w.language or "no language (the run's)" for w in windows)
    seconds = sum(w.seconds for w in windows)
    refs = sum(w.text is not None for w in windows)
    mixed = f" ({given} from --references, {refs - given} from --model)" if 0 < given < refs else ""
    print(
        f"wrote {args.out}: {len(clips)} clips joined into {len(windows)} recordings "
        f"({seconds:.0f} s; {', '.join(f'{k} {n}' for k, n in languages.items())}), "
        f"{refs} with references{mixed}"
        + ("" if refs else " (the guard measures drift from the starting model)")
    )
    # quoted as a shell reads it, so that the line pastes whole for a path with a space
    print(f"use it with {shlex.quote(f'eval.guard.path={args.out}')}")
    return 0
