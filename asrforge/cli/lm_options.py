"""``--lm-alpha``, ``--lm-beta`` and ``--no-lm``: a bundle's n-gram LM in ``transcribe`` and
``evaluate``."""

from __future__ import annotations

import argparse
import sys

from asrforge.errors import UserError


def add_lm_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lm-alpha",
        type=float,
        default=None,
        help="a bundle with an n-gram LM: its weight in beam search (default: the one "
        "`asrforge lm tune` recorded, else the bundle's default)",
    )
    p.add_argument("--lm-beta", type=float, default=None, help="the LM's bonus per word")
    p.add_argument("--no-lm", action="store_true", help="decode without the bundle's n-gram LM")


def lm_fusion(bundle, args: argparse.Namespace):
    """The bundle's LM fusion the options ask for, or None (no LM, or ``--no-lm``)."""
    if bundle.lm is None:
        if args.lm_alpha is not None or args.lm_beta is not None:
            raise UserError("--lm-alpha/--lm-beta: this model has no n-gram LM (export --lm)")
        return None
    if args.no_lm:
        return None
    fusion = bundle.fusion(args.lm_alpha, args.lm_beta)
    print(
        f"asrforge: fusing the bundle's {bundle.lm.order}-gram LM: alpha {fusion.alpha:g}, "
        f"beta {fusion.beta:g} (--no-lm: without it)",
        file=sys.stderr,
    )
    return fusion
