"""``asrforge export``: a checkpoint, run or transformers directory as an inference bundle."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asrforge.cli.problems import attempt, positive, raise_problems
from asrforge.config import parse_size
from asrforge.io.atomic import directory_problem
from asrforge.io.directories import symlink_problem
from asrforge.selection.guard_gate import WITHIN_GUARD_SHARES

# The bundle code loads torch and transformers: it is imported inside the handler, so building the
# parser (`asrforge --help`) does not wait for it.


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``export``."""
    p = subparsers.add_parser(
        "export",
        help="export a checkpoint or run as an inference bundle",
        description="Write an inference bundle (safetensors weights, configs, tokenizer, "
        "sha256 manifest) from a training checkpoint, a run directory (checkpoints/best, else "
        "checkpoints/latest) or a pretrained transformers Whisper directory; or convert a "
        "bundle to --format ct2 or ggml.",
    )
    p.add_argument(
        "source",
        type=Path,
        help="checkpoint, run or transformers model directory, or a Hub model id "
        "(org/name[@revision]); with --format ct2 or ggml also a bundle, converted with its "
        "LM and records; with --push-to-hub a bundle, uploaded as it is",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the bundle directory to write (required); an existing bundle there is refused, "
        "naming what it holds, unless --overwrite",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a bundle at --out, and all it holds (its align-heads record, its LM and "
        "lm tune weights, its format)",
    )
    p.add_argument(
        "--weights",
        choices=["ema", "raw", "average"],
        default=None,
        help="default: ema when the checkpoint has EMA weights, else raw",
    )
    p.add_argument(
        "--format",
        dest="fmt",
        choices=["hf", "ct2", "ggml"],
        default="hf",
        help="hf: transformers (default); ct2: CTranslate2 (faster-whisper); ggml: whisper.cpp",
    )
    p.add_argument(
        "--k", type=int, default=None, help="--weights average: how many checkpoints (default 5)"
    )
    p.add_argument(
        "--metric", default=None, help="--weights average: rank checkpoints by this (default wer)"
    )
    p.add_argument(
        "--quantization",
        default=None,
        help="--format ct2: int8, int8_float32, int8_float16, int8_bfloat16, int16, float16, "
        "bfloat16 or float32; --format ggml: float16 (its only one)",
    )
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
        "--push-to-hub",
        metavar="ORG/NAME",
        default=None,
        help="upload the verified bundle to this Hugging Face Hub model repository (its "
        "README.md is the model card); the token is HF_TOKEN's or your `hf auth login`",
    )
    p.add_argument("--private", action="store_true", help="--push-to-hub: create it private")
    p.add_argument(
        "--dry-run", action="store_true", help="--push-to-hub: list what would be uploaded"
    )
    p.add_argument(
        "--lm",
        type=Path,
        default=None,
        help="an ARPA word n-gram LM (`asrforge lm build`) to carry for beam search; "
        "transformers and CTranslate2 ignore it",
    )
    p.add_argument(
        "--within-guard",
        action="store_true",
        help="a run trained with eval.guard: interpolate its fine-tuned weights "
        "(checkpoints/best-unguarded, else the checkpoint exported) with the starting model's "
        "and export the largest share of them whose guard stays within the tolerance "
        "(WiSE-FT; the starting weights: the step-0 checkpoint, else model.pretrained)",
    )
    p.add_argument(
        "--shares",
        type=_shares,
        help="--within-guard: the shares of the fine-tuned weights to try, comma-separated "
        "(default 1.0,0.9,...,0.1; the largest within the guard is exported)",
    )
    p.set_defaults(func=run)


def _shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
    if not shares or not all(0.0 < s <= 1.0 for s in shares):
        raise argparse.ArgumentTypeError(f"each share must be in (0, 1], got {text!r}")
    return shares


def run(args: argparse.Namespace) -> int:
    from asrforge.bundle.export import export_bundle, out_problem, resolve_source
    from asrforge.bundle.schema import INFERENCE_CONFIG

    if args.push_to_hub is not None and (args.source / INFERENCE_CONFIG).is_file():
        return _push_written(args)
    problems = [positive("--k", args.k), *_format_problems(args)]
    if args.out is None:
        problems.append("--out: required (the bundle directory to write)")
    shard_size = None if str(args.max_shard_size).strip() == "0" else args.max_shard_size
    if shard_size is not None:
        try:
            parse_size(shard_size)
        except ValueError as e:
            problems.append(f"--max-shard-size: {e}")
    bundle_ok = args.fmt != "hf" and not args.within_guard
    _kind, path = attempt(
        lambda: resolve_source(args.source, bundle_ok=bundle_ok, lm=args.lm), problems
    ) or (None, None)
    if args.out is not None and args.out.exists() and (problem := symlink_problem(args.out)):
        # the bundle replaces the link's own entry, not the directory it points to
        problems.append(f"--out {problem}")
    elif args.out is not None and (problem := directory_problem(args.out)):
        problems.append(f"--out {problem}")
    elif args.out is not None and (
        problem := out_problem(
            args.out, args.source, overwrite=args.overwrite, names=("--out", "--overwrite")
        )
    ):
        problems.append(problem)
    if args.adapter_only and args.fmt != "hf":
        problems.append("--adapter-only writes peft's adapter files: --format does not apply")
    if args.adapter_only and args.lm is not None:
        problems.append("--adapter-only writes peft's adapter files: --lm does not apply")
    if args.lm is not None and not args.lm.is_file():
        problems.append(f"--lm {args.lm}: no such file")
    if (args.private or args.dry_run) and args.push_to_hub is None:
        problems.append("--private and --dry-run: only with --push-to-hub")
    if args.push_to_hub is not None and (args.adapter_only or args.fmt != "hf"):
        problems.append("--push-to-hub uploads an hf bundle: --adapter-only and --format ct2 "
                        "do not apply")  # fmt: skip
    problems += _push_problems(args)
    if args.shares is not None and not args.within_guard:
        problems.append("--shares: only with --within-guard (the shares it tries)")
    if args.within_guard and args.push_to_hub is not None:
        problems.append("--push-to-hub: not with --within-guard; upload its bundle afterwards "
                        "(`asrforge export BUNDLE --push-to-hub ORG/NAME`)")  # fmt: skip
    if args.within_guard and (args.adapter_only or args.weights == "average"):
        problems.append("--within-guard interpolates one checkpoint's whole weights: "
                        "--adapter-only and --weights average do not apply")  # fmt: skip
    raise_problems(problems)
    if args.within_guard:
        shares = WITHIN_GUARD_SHARES if args.shares is None else args.shares
        return _print_within_guard(args, shares, shard_size)
    if path != args.source:
        print(f"asrforge: exporting {path} (from {args.source})", file=sys.stderr)
    if args.fmt == "ct2":
        from transformers.utils import logging as hf_logging

        # CTranslate2's converter loads the model back with transformers, whose bar says nothing
        hf_logging.disable_progress_bar()
    if args.adapter_only:
        from asrforge.bundle.export import export_adapter

        out = export_adapter(path, args.out, args.weights, overwrite=args.overwrite)
        print(f"wrote the LoRA adapters of {path} to {out}")
        return 0
    out = export_bundle(
        # a Hub id, not its snapshot's directory, names a pretrained model or a pushed bundle
        args.source if _kind in ("pretrained", "bundle") else path,
        args.out,
        args.weights,
        args.fmt,
        average_k=5 if args.k is None else args.k,
        average_metric=args.metric or "wer",
        ct2_quantization=args.quantization,
        lm=args.lm,
        max_shard_size=shard_size,
        repo_id=args.push_to_hub,
        overwrite=args.overwrite,
    )
    _print_written(args, out)
    if args.push_to_hub is not None:
        _push(out, args)
    return 0


def _format_problems(args: argparse.Namespace) -> list[str]:
    """Options the chosen format or weights would ignore, or values they do not take."""
    from asrforge.bundle.write import CT2_QUANTIZATIONS, GGML_QUANTIZATIONS

    problems = []
    if args.quantization is not None and args.fmt == "hf":
        problems.append("--quantization: only with --format ct2 or ggml (hf writes the weights "
                        "as they are)")  # fmt: skip
    elif args.fmt == "ct2" and args.quantization not in (None, *CT2_QUANTIZATIONS):
        problems.append(f"--quantization {args.quantization}: --format ct2 takes "
                        f"{', '.join(CT2_QUANTIZATIONS)}")  # fmt: skip
    elif args.fmt == "ggml" and args.quantization not in GGML_QUANTIZATIONS:
        problems.append(f"--quantization {args.quantization}: --format ggml writes float16")
    given = [n for n, value in (("--k", args.k), ("--metric", args.metric)) if value is not None]
    if given and args.weights != "average":
        problems.append(f"{' and '.join(given)}: only with --weights average")
    return problems


def _push_problems(args: argparse.Namespace) -> list[str]:
    """What stops ``--push-to-hub`` before anything is written: an id that is not ``org/name``,
    or ``HF_HUB_OFFLINE`` set for a real upload."""
    if args.push_to_hub is None:
        return []
    from asrforge.hub import offline, repo_id_problem

    problems = []
    if (problem := repo_id_problem(args.push_to_hub)) is not None:
        problems.append(f"--push-to-hub {problem}")
    if offline() and not args.dry_run:
        problems.append(f"--push-to-hub {args.push_to_hub}: HF_HUB_OFFLINE is set, so nothing "
                        "can be uploaded: export without --push-to-hub now, and push the bundle "
                        "later (`asrforge export BUNDLE --push-to-hub ORG/NAME`)")  # fmt: skip
    return problems


def _push_written(args: argparse.Namespace) -> int:
    """``export BUNDLE --push-to-hub ORG/NAME``: upload a bundle written earlier, as it is."""
    given = {
        "--out": args.out is not None, "--weights": args.weights is not None,
        "--format": args.fmt != "hf", "--quantization": args.quantization is not None,
        "--adapter-only": args.adapter_only, "--lm": args.lm is not None,
        "--overwrite": args.overwrite,
        "--within-guard": args.within_guard, "--shares": args.shares is not None,
    }  # fmt: skip
    problems = _push_problems(args)
    if extra := [name for name, on in given.items() if on]:
        problems.append(f"{args.source}: a bundle is uploaded as it is: {', '.join(extra)} "
                        "do not apply")  # fmt: skip
    raise_problems(problems)
    _push(args.source, args)
    return 0


def _push(bundle: Path, args: argparse.Namespace) -> None:
    from asrforge.bundle.push import push_bundle

    url, files = push_bundle(bundle, args.push_to_hub, private=args.private, dry_run=args.dry_run)
    if args.dry_run:
        print(f"would upload {len(files)} files to {url}: {', '.join(files)}")
    else:
        print(f"uploaded {len(files)} files to {url}")


def _print_written(args: argparse.Namespace, out: Path) -> None:
    info = json.loads((out / "inference_config.json").read_text())
    step = info["source"].get("step")
    averaged = info["source"].get("averaged_steps")
    interpolated = info["source"].get("within_guard")
    print(
        f"wrote a {args.fmt} bundle to {out}: "
        + (f"{interpolated['share']:g} of the " if interpolated else "")
        + f"{info['weights']} weights"
        + (f" of step {step}" if step is not None else "")
        + (f" of steps {', '.join(map(str, averaged))}" if averaged else "")
        + (f" over {1 - interpolated['share']:g} of the starting model's" if interpolated else "")
        + f", languages {', '.join(info['languages'][:10])}"
        + (" ..." if len(info["languages"]) > 10 else "")
    )


def _print_within_guard(args: argparse.Namespace, shares: tuple[float, ...],
                        shard_size: str | None) -> int:  # fmt: skip
    """``--within-guard``: the export within the guard, and what it measured and wrote."""
    # torch and transformers load with it, so only when the command runs (as above).
    from asrforge.bundle.within_guard import export_within_guard

    out, facts, gate = export_within_guard(
        args.source, args.weights, shares, args.out, args.fmt, lm=args.lm,
        ct2_quantization=args.quantization, max_shard_size=shard_size,
        progress=lambda line: print(line, file=sys.stderr), say=print,
        overwrite=args.overwrite,
    )  # fmt: skip
    share = facts["share"]
    _print_written(args, out)
    print(
        f"asrforge: {share:g} of the fine-tuned weights (over {1 - share:g} of the starting "
        f"model's): guard {facts['guard']:.4f}, within start {gate.start:.4f} + tolerance "
        f"{gate.tolerance:g}"
    )
    return 0
