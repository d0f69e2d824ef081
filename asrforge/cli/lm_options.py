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
        help="a bundle with an n-gram LM: its weight in beam search, --beam-size > 1; greedy "
        "decoding runs without the LM (default: the one `asrforge lm tune` recorded, else the "
        "bundle's default)",
    )
    p.add_argument("--lm-beta", type=float, default=None, help="the LM's bonus per word")
    p.add_argument("--no-lm", action="store_true", help="decode without the bundle's n-gram LM")


def lm_fusion(bundle, args: argparse.Namespace):
    """The bundle's LM fusion the options ask for, or None (no LM, ``--no-lm``, or greedy
    decoding: ``--beam-size`` 1, which says once on stderr that the LM needs beams).

    Raises:
        UserError: ``--lm-alpha``/``--lm-beta`` for a model without an LM, or with greedy
            decoding, where they would change nothing.
    """
    weighted = args.lm_alpha is not None or args.lm_beta is not None
    if bundle.lm is None:
        if weighted:
            raise UserError("--lm-alpha/--lm-beta: this model has no n-gram LM (export --lm)")
        return None
    if args.no_lm:
        return None
    if args.beam_size == 1:
        if weighted:
            raise UserError(
                "--lm-alpha/--lm-beta: the n-gram LM is fused in beam search only; "
                "add --beam-size N > 1 (e.g. 5)"
            )
        # The bundle's module loads torch, which building the parser must not.
        from asrforge.bundle.options import GREEDY_WITHOUT_LM

        note = GREEDY_WITHOUT_LM.format(order=bundle.lm.order, beam="--beam-size")
        print(f"asrforge: {note}", file=sys.stderr)
        return None
    from asrforge.bundle import options

    fusion = options.fusion(bundle, args.lm_alpha, args.lm_beta)
    print(
        f"asrforge: fusing the bundle's {bundle.lm.order}-gram LM: alpha {fusion.alpha:g}, "
        f"beta {fusion.beta:g} (--no-lm: without it)",
        file=sys.stderr,
    )
    return fusion
