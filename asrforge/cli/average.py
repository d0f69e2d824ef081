"""``asrforge average``: the k best checkpoints of a run averaged into one."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from asrforge.errors import UserError
from asrforge.io.directories import symlink_problem

# Averaging loads torch: imported inside the handler, so building the parser (`asrforge --help`)
# does not wait for it.


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``average``."""
    p = subparsers.add_parser(
        "average",
        help="average the k best checkpoints of a run by a metric",
        description="Average the weights of the k best checkpoints of a run (by a metric stored "
        "in their manifests) into <checkpoints>/<metric>.ave_<k>best/.",
    )
    p.add_argument("run_dir", type=Path, help="a run directory or its checkpoints/ directory")
    p.add_argument("--metric", default="wer", help="metric name as in the manifests (default wer)")
    p.add_argument("--k", type=int, default=5, help="how many checkpoints (default 5)")
    p.add_argument(
        "--mode",
        choices=["min", "max"],
        default=None,
        help="default: max for acc/bleu/f1, else min",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory")
    p.add_argument(
        "--weights",
        choices=["ema", "raw"],
        default=None,
        help="ema: each checkpoint's EMA weights, as export takes them; raw: the weights as "
        "trained (default: ema when the checkpoints have EMA weights)",
    )
    p.add_argument(
        "--weights-file",
        default=None,
        help="instead, average one safetensors file as it is (e.g. ema.safetensors alone)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``asrforge average``; user errors raise :class:`UserError` subclasses."""
    from asrforge.checkpoint.average import average_top_k
    from asrforge.checkpoint.manifest import read_manifest

    if args.k < 1:
        raise UserError(f"--k: must be >= 1, got {args.k}")
    if args.out is not None and args.out.exists() and (problem := symlink_problem(args.out)):
        raise UserError(f"--out {problem}")
    out = average_top_k(
        args.run_dir,
        args.metric,
        args.k,
        args.out,
        mode=args.mode,
        weights=args.weights,
        weights_file=args.weights_file,
    )
    manifest = read_manifest(out)
    print(describe_average(manifest, args.k, out))
    return 0


def describe_average(manifest: dict[str, Any], k: int, out: Path) -> str:
    """Which steps an average holds, each with its metric value and directory, best first."""
    metric, steps = manifest.get("metric"), manifest.get("steps") or []
    weights = manifest.get("weights")
    what = f"the {weights.upper() if weights == 'ema' else weights} weights of " if weights else ""
    plural = "" if len(steps) == 1 else "s"
    lines = [
        f"averaged {what}{len(steps)} checkpoint{plural}, the best by {metric} "
        f"({manifest.get('mode')}), -> {out}: steps {', '.join(str(s) for s in steps)}"
    ]
    if len(steps) < k:
        have = "have" if len(steps) > 1 else "has"
        where = "their manifests" if len(steps) > 1 else "its manifest"
        refused = manifest.get("guard_refused") or []
        guarded = (
            f" (the forgetting guard refused step(s) {', '.join(map(str, refused))})"
            if refused
            else ""
        )
        lines.append(
            f"  only {len(steps)} of the {k} requested {have} {metric} in {where}{guarded}"
        )
    for step, value, src in zip(
        steps, manifest.get("values") or [], manifest.get("averaged_from") or [], strict=False
    ):
        lines.append(f"  step {step}: {metric} {value:.6g} ({src})")
    return "\n".join(lines)
