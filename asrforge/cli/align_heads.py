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
        help="find the heads word timestamps align with, from held-out clips",
        description="For a model whose alignment heads are unknown (built from scratch, or "
        "with an extended vocabulary): join consecutive utterances of a split with a second of "
        "silence, measure how far each decoder head's own alignment places the second's start, "
        "and record the heads within 0.2 s (median) in the bundle's manifest. "
        "transcribe --word-timestamps then aligns with them.",
        epilog=DATA_OPTIONS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("bundle", type=Path, help="a bundle directory (asrforge export)")
    add_data_argument(p)
    p.add_argument("--split", default="validation", help=SPLIT_HELP.format(default="validation"))
    p.add_argument("--joins", type=int, default=8, help="pairs of utterances to measure on")
    p.add_argument(
        "--max-error",
        type=float,
        default=0.2,
        help="seconds: a head qualifies when its median error is within this (default 0.2)",
    )
    p.set_defaults(func=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    from asrforge.bundle.heads import find_alignment_heads

    record = find_alignment_heads(
        args.bundle, data_options(args), args.split, joins=args.joins, max_error=args.max_error
    )
    best = sorted(record["median_error_s"].items(), key=lambda kv: kv[1])[:5]
    print(
        "median error by head (layer,head): "
        + ", ".join(f"{h} {1000 * e:.0f} ms" for h, e in best),
        file=sys.stderr,
    )
    if record["heads"]:
        heads = " ".join(f"{a},{b}" for a, b in record["heads"])
        print(f"recorded {len(record['heads'])} alignment heads in {args.bundle}: {heads} "
              f"(median error within {record['limit_s']} s on {record['joins']} joins of "
              f"{args.split})")  # fmt: skip
    else:
        print(f"no head qualifies: none places an utterance's start within "
              f"{record['limit_s']} s (median of {record['joins']} joins of {args.split}); "
              f"recorded that in {args.bundle}, and word timestamps keep the default heads")  # fmt: skip
    return 0
