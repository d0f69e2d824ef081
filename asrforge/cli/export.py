"""``asrforge export``: a checkpoint, run or transformers directory as an inference bundle."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asrforge.cli.problems import attempt, positive, raise_problems
from asrforge.config import parse_size
from asrforge.io.atomic import directory_problem

# The bundle code loads torch and transformers: it is imported inside the handler, so building the
# parser (`asrforge --help`) does not wait for it.


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``export``."""
    p = subparsers.add_parser(
        "export",
        help="export a checkpoint or run as an inference bundle",
        description="Write an inference bundle (safetensors weights, configs, tokenizer, "
        "sha256 manifest) from a training checkpoint, a run directory (checkpoints/best, else "
        "checkpoints/latest) or a pretrained transformers Whisper directory.",
    )
    p.add_argument("source", type=Path, help="checkpoint, run or transformers model directory")
    p.add_argument("--out", type=Path, required=True, help="the bundle directory to write")
    p.add_argument(
        "--weights",
        choices=["ema", "raw", "average"],
        default=None,
        help="default: ema when the checkpoint has EMA weights, else raw",
    )
    p.add_argument("--format", dest="fmt", choices=["hf", "ct2"], default="hf")
    p.add_argument("--k", type=int, default=5, help="--weights average: how many checkpoints")
    p.add_argument("--metric", default="wer", help="--weights average: rank checkpoints by this")
    p.add_argument("--quantization", default=None, help="--format ct2: e.g. int8, float16")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="weights larger than this are written as safetensors shards with an index, as "
        "transformers' save_pretrained does (e.g. 2GB, 500MB; 0: one file; default 5GB)",
    )
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a model.lora run: write its LoRA adapters alone (peft's adapter_model.safetensors "
        "+ adapter_config.json) instead of a bundle with the adapters merged in",
    )
    p.add_argument(
        "--lm",
        type=Path,
        default=None,
        help="an ARPA word n-gram LM (`asrforge lm build`) to carry for beam search; "
        "transformers and CTranslate2 ignore it",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from asrforge.bundle.export import export_bundle, resolve_source

    problems = [positive("--k", args.k)]
    shard_size = None if str(args.max_shard_size).strip() == "0" else args.max_shard_size
    if shard_size is not None:
        try:
            parse_size(shard_size)
        except ValueError as e:
            problems.append(f"--max-shard-size: {e}")
    _kind, path = attempt(lambda: resolve_source(args.source), problems) or (None, None)
    if out_problem := directory_problem(args.out):
        problems.append(f"--out {out_problem}")
    if args.adapter_only and args.fmt != "hf":
        problems.append("--adapter-only writes peft's adapter files: --format does not apply")
    if args.adapter_only and args.lm is not None:
        problems.append("--adapter-only writes peft's adapter files: --lm does not apply")
    if args.lm is not None and not args.lm.is_file():
        problems.append(f"--lm {args.lm}: no such file")
    raise_problems(problems)
    if path != args.source:
        print(f"asrforge: exporting {path} (from {args.source})", file=sys.stderr)
    if args.adapter_only:
        from asrforge.bundle.export import export_adapter

        out = export_adapter(path, args.out, args.weights)
        print(f"wrote the LoRA adapters of {path} to {out}")
        return 0
    out = export_bundle(
        path,
        args.out,
        args.weights,
        args.fmt,
        average_k=args.k,
        average_metric=args.metric,
        ct2_quantization=args.quantization,
        lm=args.lm,
        max_shard_size=shard_size,
    )
    info = json.loads((out / "inference_config.json").read_text())
    step = info["source"].get("step")
    print(
        f"wrote a {args.fmt} bundle to {out}: {info['weights']} weights"
        + (f" of step {step}" if step is not None else "")
        + f", languages {', '.join(info['languages'][:10])}"
        + (" ..." if len(info["languages"]) > 10 else "")
    )
    return 0
