"""``asrforge align-heads``: find the decoder heads whose cross-attention follows the audio, from
held-out clips, and record them in a bundle for word timestamps."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asrforge.cli.data_options import (
    DATA_OPTIONS_HELP,
    SPLIT_HELP,
    add_data_argument,
    data_options,
)

# Measuring heads decodes with torch: imported inside the handler, so building the parser does
# not wait for it.


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``align-heads``."""
    p = subparsers.add_parser(
        "align-heads",
        help="measure word timing on held-out clips: the heads to align with, and their lag",
        description="Join consecutive utterances of a split with a second of silence, measure "
        "how far each decoder head's own alignment places the second's start, and record the "
        "heads within 0.2 s (median) in the bundle's manifest, with how late they place that "
        "start together (the lag). transcribe --word-timestamps then aligns with them and "
        "takes the lag off every word. Found heads are for a model whose alignment heads are "
        "unknown (built from scratch, or with an extended vocabulary); --keep-heads measures "
        "only the lag, for any fine-tuned model.",
        epilog=DATA_OPTIONS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("bundle", type=Path, help="a bundle directory (asrforge export)")
    add_data_argument(p)
    p.add_argument("--split", default="validation", help=SPLIT_HELP.format(default="validation"))
    p.add_argument(
        "--joins",
        type=int,
        default=8,
        help="pairs of utterances to measure on (default 8); fewer available is warned "
        "about, fewer than 3 is refused and nothing recorded",
    )
    p.add_argument(
        "--max-error",
        type=float,
        default=0.2,
        help="seconds: a head qualifies when its median error is within this (default 0.2)",
    )
    p.add_argument(
        "--keep-heads",
        action="store_true",
        help="do not search: keep the heads the bundle aligns with (its generation config's "
        "for Whisper's models) and only measure how late they place words",
    )
    p.set_defaults(func=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    from asrforge.bundle.heads import find_alignment_heads, lag_text

    record = find_alignment_heads(
        args.bundle, data_options(args), args.split, joins=args.joins, max_error=args.max_error,
        keep_heads=args.keep_heads,
    )  # fmt: skip
    if record["skipped"]:
        print(f"asrforge: skipped {record['skipped']}", file=sys.stderr)
    lag = f"; {lag_text(record)}"
    if args.keep_heads:
        heads = " ".join(f"{a},{b}" for a, b in record["heads"]) or (
            "none qualified, so the default ones"
        )
        print(f"kept the alignment heads of {args.bundle}: {heads} (measured on "
              f"{record['joins']} joins of {args.split}){lag}")  # fmt: skip
        return 0
    print(errors_line(record), file=sys.stderr)
    if record["heads"]:
        heads = " ".join(f"{a},{b}" for a, b in record["heads"])
        print(f"recorded {len(record['heads'])} alignment heads in {args.bundle}: {heads} "
              f"(median error within {record['limit_s']} s on {record['joins']} joins of "
              f"{args.split}){lag}")  # fmt: skip
    else:
        print(f"no head qualifies: none places an utterance's start within "
              f"{record['limit_s']} s (median of {record['joins']} joins of {args.split}); "
              f"recorded that in {args.bundle}, and word timestamps keep the default "
              f"heads{lag}")  # fmt: skip
    return 0


def errors_line(record: dict) -> str:
    """The median error of every head ``record`` holds, best first: all the recorded heads,
    and at least the best five when fewer (or none) qualified."""
    shown = max(5, len(record["heads"]))
    best = sorted(record["median_error_s"].items(), key=lambda kv: kv[1])[:shown]
    return "median error by head (layer,head): " + ", ".join(
        f"{h} {1000 * e:.0f} ms" for h, e in best
    )
