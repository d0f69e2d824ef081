"""``asrforge lm build`` and ``asrforge lm tune``."""

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
from asrforge.errors import UserError

# Building and tuning an LM read data and decode with torch: imported inside the handlers, so
# building the parser (`asrforge --help`) does not wait for them.


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``lm`` with its ``build`` and ``tune`` commands."""
    lm = subparsers.add_parser(
        "lm",
        help="word n-gram language models for beam search (build, tune)",
        description="Build a word n-gram LM from training text, or tune its weights in a bundle.",
    )
    sub = lm.add_subparsers(dest="lm_command", required=True, metavar="LM_COMMAND")
    p = sub.add_parser(
        "build",
        help="build a Kneser-Ney word n-gram LM (ARPA) from text",
        description="Estimate a word n-gram LM with interpolated modified Kneser-Ney smoothing "
        "from a text file (one sentence per line) or the transcripts of a data set, "
        "normalized as evaluation normalizes them before WER, and write it as an ARPA file "
        "(readable by KenLM too). `asrforge export --lm` puts it in a bundle.",
        epilog=DATA_OPTIONS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--text", type=Path, default=None, help="a UTF-8 text file")
    add_data_argument(p, into=source, required=False)
    p.add_argument("--split", default="train", help=SPLIT_HELP.format(default="train"))
    p.add_argument(
        "--language",
        default=None,
        help="the text's language (required with --text: it decides the normalization); "
        "with --data: keep only this language's transcripts",
    )
    p.add_argument("--order", type=int, default=3, help="the n of the n-grams (default 3)")
    p.add_argument("--out", type=Path, required=True, help="the ARPA file to write")
    p.set_defaults(func=run_build, accepts_overrides=True)

    p = sub.add_parser(
        "tune",
        help="grid-search a bundle's LM weight and word bonus on a development split",
        description="Decode a split with beam search at every (alpha, beta) of a grid, (0, 0) "
        "(no LM) included, and record the pair with the lowest WER (CER for languages scored "
        "by characters) in the bundle's manifest, which transcribe and evaluate then use.",
        epilog=DATA_OPTIONS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("bundle", type=Path, help="a bundle directory with an LM (export --lm)")
    add_data_argument(p)
    p.add_argument("--split", default="validation", help=SPLIT_HELP.format(default="validation"))
    p.add_argument("--alphas", type=_floats, default=None, help="comma-separated LM weights")
    p.add_argument("--betas", type=_floats, default=None, help="comma-separated word bonuses")
    p.add_argument(
        "--beam-size",
        type=int,
        default=5,
        help="beams per utterance, >= 2: the LM is fused in beam search only; use the same "
        "--beam-size when you transcribe (default: 5)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-samples", type=int, default=None, help="the first N utterances only")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the bundle's")
    p.set_defaults(func=run_tune, accepts_overrides=True)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None


def run_build(args: argparse.Namespace) -> int:
    from asrforge.lm.build import build_lm_file

    if args.overrides and args.data is None:
        raise UserError(f"{args.overrides[0]}: data options go with --data")
    lm = build_lm_file(
        args.out,
        args.order,
        text=args.text,
        data=data_options(args) if args.data is not None else None,
        split=args.split,
        language=args.language,
    )
    counts = ", ".join(f"{len(p)} {n + 1}-grams" for n, p in enumerate(lm.probs))
    print(
        f"wrote {args.out}: order {lm.order}, vocabulary {lm.vocab_size}, {counts}; "
        f"normalizer {lm.normalizer}, languages {', '.join(lm.meta['languages'])}",
        file=sys.stderr,
    )
    return 0


def run_tune(args: argparse.Namespace) -> int:
    from asrforge.bundle.lm_tune import ALPHAS, BETAS, tune

    data = data_options(args)
    for name in ("batch_size", "max_samples", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    result = tune(
        args.bundle,
        data,
        args.split,
        alphas=ALPHAS if args.alphas is None else args.alphas,
        betas=BETAS if args.betas is None else args.betas,
        beam_size=args.beam_size,
        batch_size=args.batch_size,
        max_samples=args.max_samples,
        max_new_tokens=args.max_new_tokens,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    for point, value in result["table"].items():
        alpha, beta = point.split(",")
        print(
            f"alpha {alpha}, beta {beta}: {result['metric']} {100 * value:.2f} % "
            f"(beam search {result['seconds'][point]:.1f} s)"
        )
    print(
        f"recorded alpha {result['alpha']:g}, beta {result['beta']:g} in {args.bundle}: "
        f"{result['metric']} {100 * result['value']:.2f} % on {result['n']} utterances of "
        f"{args.split} (beam {result['beam_size']}; without the LM "
        f"{100 * result['without_lm']:.2f} %)"
    )
    return 0
