"""``asrforge export``, ``asrforge transcribe`` and ``asrforge evaluate``.

Imported when the ``asrforge`` parser is built, so everything heavy is imported inside the
handlers. Bad input (a missing file, unreadable audio, an altered bundle, an unknown language)
raises :class:`~asrforge.errors.UserError`: the CLI prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asrforge.cli.data_options import DATA_HELP, DATA_OPTIONS_HELP, SPLIT_HELP, data_options
from asrforge.errors import UserError
from asrforge.io.atomic import directory_problem

OUTPUT_FORMATS = ("text", "json", "srt", "vtt")


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Register ``export``, ``transcribe`` and ``evaluate``."""
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
    p.set_defaults(func=run_export)

    p = subparsers.add_parser(
        "transcribe",
        help="transcribe audio files with a bundle",
        description="Transcribe wav/flac/mp3 files (any sample rate, any length) with a bundle, "
        "a training checkpoint or run, or a transformers Whisper directory. Long audio is "
        "decoded in sequential 30 s windows moved by the model's timestamps (as openai-whisper "
        "and faster-whisper do), or cut at silences for models without timestamp tokens.",
    )
    p.add_argument(
        "bundle",
        type=Path,
        help="a bundle directory (asrforge export), a checkpoint or run directory, or a "
        "transformers Whisper directory (not verified: no manifest)",
    )
    p.add_argument("audio", type=Path, nargs="+", help="audio files")
    p.add_argument("--language", default=None, help="ISO code; default: detected")
    p.add_argument(
        "--format",
        dest="fmt",
        choices=OUTPUT_FORMATS,
        default=None,
        help="text (default), json (text, language, seconds and timed segments), srt or vtt",
    )
    p.add_argument("--json", action="store_true", help="the same as --format json")
    p.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="write <audio name>.<format> files here instead of printing",
    )
    p.add_argument(
        "--chunking",
        choices=["timestamps", "silence"],
        default=None,
        help="long audio: timestamp-driven windows (default when the model has timestamp "
        "tokens) or cuts at silences (default otherwise)",
    )
    p.add_argument(
        "--condition-on-previous-text",
        action="store_true",
        help="timestamps: prompt each window with the text before it (<|startofprev|>)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="windows decoded at once")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap per 30 s window")
    p.add_argument(
        "--beam-size",
        type=int,
        default=1,
        help="beams per window (openai-whisper uses 5); 1: greedy decoding (default)",
    )
    p.add_argument(
        "--temperature-fallback",
        action="store_true",
        help="decode a window that looks like a repetition loop again at temperatures 0.2 ... "
        "1.0 (seeded sampling), as openai-whisper does",
    )
    _add_lm_options(p)
    p.set_defaults(func=run_transcribe)

    p = subparsers.add_parser(
        "evaluate",
        help="WER/CER/loss of a checkpoint or bundle on a data split",
        description="Evaluate a training checkpoint or a bundle on a split of a data set, in any "
        "form training reads (the training loop's evaluation: teacher-forced loss and greedy "
        "decoding).",
        epilog=DATA_OPTIONS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        type=Path,
        help="a checkpoint, run or bundle directory, or a transformers Whisper directory",
    )
    p.add_argument("--data", type=Path, required=True, help=DATA_HELP)
    p.add_argument("--split", default="validation", help=SPLIT_HELP.format(default="validation"))
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the model's")
    p.add_argument("--max-samples", type=int, default=None, help="the first N utterances only")
    p.add_argument(
        "--beam-size",
        type=int,
        default=1,
        help="beams per utterance for the split (not the long-form recordings); 1: greedy",
    )
    p.add_argument(
        "--longform-items",
        type=int,
        default=0,
        help="also join utterances of the split into this many long recordings, transcribe them "
        "as `transcribe` does and report longform_wer/longform_cer (default 0: off)",
    )
    p.add_argument("--longform-min-seconds", type=float, default=60.0)
    p.add_argument("--longform-max-seconds", type=float, default=120.0)
    p.add_argument(
        "--chunking",
        choices=["timestamps", "silence"],
        default=None,
        help="long-form: how long audio is decoded (default: as transcribe would)",
    )
    p.add_argument("--seed", type=int, default=0, help="long-form: which utterances are joined")
    p.add_argument(
        "--temperature-fallback",
        action="store_true",
        help="long-form: decode a window that looks like a repetition loop again at higher "
        "temperatures, as transcribe --temperature-fallback does",
    )
    p.add_argument(
        "--weights",
        choices=["ema", "raw"],
        default=None,
        help="checkpoints: which weights (default ema when present, as the loop evaluates)",
    )
    _add_lm_options(p)
    p.set_defaults(func=run_evaluate, accepts_overrides=True)


def _add_lm_options(p: argparse.ArgumentParser) -> None:
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


def _positive(name: str, value: int | None) -> str | None:
    """The problem with an option that must be >= 1 (None: unset), or None."""
    return f"{name}: must be >= 1, got {value}" if value is not None and value < 1 else None


def raise_problems(problems: list[str | None]) -> None:
    """One UserError listing every problem (as config errors do); nothing when all are None."""
    problems = [p for p in problems if p]
    if len(problems) == 1:
        raise UserError(problems[0])
    if problems:
        raise UserError(f"{len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems))


def audio_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as an audio file, or None (the decoder judges its contents)."""
    if path.is_dir():
        return f"{path}: a directory, not an audio file"
    if not path.exists():
        return f"{path}: no such audio file"
    if not path.is_file():
        return f"{path}: not a regular file"
    return None


def run_export(args: argparse.Namespace) -> int:
    from asrforge.bundle.export import export_bundle, resolve_source

    problems = [_positive("--k", args.k)]
    shard_size = None if str(args.max_shard_size).strip() == "0" else args.max_shard_size
    if shard_size is not None:
        from asrforge.config import parse_size

        try:
            parse_size(shard_size)
        except ValueError as e:
            problems.append(f"--max-shard-size: {e}")
    _kind, path = _attempt(lambda: resolve_source(args.source), problems) or (None, None)
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


def open_model(path: Path, weights: str | None = None):
    """A :class:`~asrforge.bundle.Bundle` from a bundle (verified by ``load_bundle``), a training
    checkpoint or run (verified against its manifest), or a plain transformers Whisper
    directory, which has no manifest and is loaded unverified (said on stderr)."""
    from asrforge.bundle.export import bundle_from_checkpoint, resolve_source
    from asrforge.bundle.load import load_bundle
    from asrforge.bundle.schema import INFERENCE_CONFIG

    if not path.is_dir():
        raise UserError(f"{path}: no such directory")
    if (path / INFERENCE_CONFIG).is_file():
        if weights is not None:
            raise UserError("--weights applies to checkpoints; a bundle has one set of weights")
        return load_bundle(path)
    kind, _resolved = resolve_source(path)
    if kind == "pretrained":
        print(
            f"asrforge: {path}: a transformers directory, not a bundle: loaded without "
            "verification (no manifest); `asrforge export` makes a verified bundle",
            file=sys.stderr,
        )
    return bundle_from_checkpoint(path, weights)


def run_transcribe(args: argparse.Namespace) -> int:
    from asrforge.bundle.subtitles import to_srt, to_vtt

    problems = [
        _positive("--batch-size", args.batch_size),
        _positive("--max-new-tokens", args.max_new_tokens),
        _positive("--beam-size", args.beam_size),
    ]
    if args.json and args.fmt not in (None, "json"):
        problems.append(f"--json and --format {args.fmt}: choose one")
    fmt = "json" if args.json else args.fmt or "text"
    if fmt in ("srt", "vtt") and len(args.audio) > 1 and args.output_dir is None:
        problems.append(f"--format {fmt} with {len(args.audio)} files: give --output-dir")
    if args.output_dir is not None:
        if args.output_dir.exists() and not args.output_dir.is_dir():
            problems.append(f"--output-dir {args.output_dir}: not a directory")
        stems = [p.stem for p in args.audio]
        twice = sorted({s for s in stems if stems.count(s) > 1})
        if twice:  # one output file would overwrite the other
            problems.append(f"--output-dir: several audio files are named {twice[0]!r}")
    # the model first, then every audio file: all the problems in one message
    bundle = _attempt(lambda: open_model(args.bundle), problems)
    problems += [audio_problem(path) for path in args.audio]
    raise_problems(problems)
    chunking, why = bundle.chunking_for(args.chunking)
    if args.condition_on_previous_text and chunking != "timestamps":
        raise UserError("--condition-on-previous-text needs --chunking timestamps")
    waves = [bundle.load_audio(p) for p in args.audio]
    fusion = lm_fusion(bundle, args)
    results = bundle.recognize(
        waves,
        args.language,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        chunking=chunking,
        condition_on_previous_text=args.condition_on_previous_text,
        beam_size=args.beam_size,
        temperature_fallback=args.temperature_fallback,
        use_lm=fusion is not None,
        lm_alpha=fusion.alpha if fusion is not None else None,
        lm_beta=fusion.beta if fusion is not None else None,
    )
    if args.chunking is None and chunking == "silence":  # after the errors: one line each
        print(f"asrforge: {why}", file=sys.stderr)
    for path, r in zip(args.audio, results, strict=True):
        if fmt == "json":
            record = {
                "path": str(path),
                "text": r.text,
                "language": r.language,
                "seconds": round(r.seconds, 3),
                "chunking": r.chunking,
                "segments": [s.to_dict() for s in r.segments],
            }
            out = json.dumps(record, ensure_ascii=False)
        elif fmt == "srt":
            out = to_srt(r.segments)
        elif fmt == "vtt":
            out = to_vtt(r.segments)
        else:
            out = r.text
        if args.output_dir is not None:
            from asrforge.io.atomic import atomic_write_text

            args.output_dir.mkdir(parents=True, exist_ok=True)
            target = args.output_dir / f"{path.stem}.{'txt' if fmt == 'text' else fmt}"
            atomic_write_text(target, out if out.endswith("\n") else out + "\n")
            print(f"wrote {target}", file=sys.stderr)
        elif fmt == "text" and len(args.audio) > 1:
            print(f"{path}\t{out}")
        else:
            print(out)
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    problems = [
        _positive("--batch-size", args.batch_size),
        _positive("--max-new-tokens", args.max_new_tokens),
        _positive("--max-samples", args.max_samples),
        _positive("--beam-size", args.beam_size),
    ]
    if args.longform_items < 0:
        problems.append(f"--longform-items: must be >= 0, got {args.longform_items}")
    if not 0 < args.longform_min_seconds <= args.longform_max_seconds:
        problems.append(
            "--longform-min-seconds/--longform-max-seconds: need 0 < min <= max, got "
            f"{args.longform_min_seconds:g} and {args.longform_max_seconds:g}"
        )
    # These pull in numpy and torch, which every `asrforge --help` would otherwise wait for.
    from asrforge.data.sources import reads_whole
    from asrforge.evaluation.evaluate import evaluate_split

    # the model first, then the data: every problem in one message
    bundle = _attempt(lambda: open_model(args.model, args.weights), problems)
    data = _attempt(lambda: data_options(args), problems)
    raise_problems(problems)
    fusion = lm_fusion(bundle, args)
    metrics, _preds, report = evaluate_split(
        bundle,
        data,
        args.split,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens or bundle.config.eval.max_new_tokens,
        max_samples=args.max_samples,
        beam_size=args.beam_size,
        fusion=fusion,
    )
    if args.longform_items:
        from asrforge.evaluation.longform import evaluate_split_longform

        long_metrics, _records = evaluate_split_longform(
            bundle,
            data,
            args.split,
            count=args.longform_items,
            min_seconds=args.longform_min_seconds,
            max_seconds=args.longform_max_seconds,
            seed=args.seed,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens or bundle.config.eval.max_new_tokens,
            chunking=args.chunking,
            fallback=_fallback(args.temperature_fallback),
        )
        metrics.update(long_metrics)
    skipped = {reason: len(ids) for reason, ids in report.skipped.items()}
    # data of one split is read whole, so no split name describes what was scored
    split = None if reads_whole(args.data) else args.split
    if args.json:
        record = {
            "model": str(args.model),
            "data": str(args.data),
            "split": split,
            **_plain(metrics),
            "skipped": skipped,
        }
        print(json.dumps(record, ensure_ascii=False))
    else:
        print(
            f"{args.model} on {args.data} ({split or 'read whole'}): {metrics['n']} utterances"
            + (f", skipped {skipped}" if skipped else "")
        )
        print(format_table(metrics))
        if args.longform_items:
            print(format_longform(metrics))
    return 0


def _fallback(on: bool):
    from asrforge.model.fallback import Fallback

    return Fallback() if on else None


def _attempt(load: Callable[[], Any], problems: list[str]) -> Any:
    """``load()``, or None with its UserError's message appended to ``problems``."""
    try:
        return load()
    except UserError as e:
        problems.append(str(e))
        return None


def format_longform(metrics: dict[str, Any]) -> str:
    """The long-form line under the table: WER/CER in %, recordings, seconds, chunking."""

    def pct(v: Any) -> str:
        return f"{100 * v:.2f}" if isinstance(v, int | float) and math.isfinite(v) else "-"

    return (
        f"long-form: WER {pct(metrics.get('longform_wer'))} % CER "
        f"{pct(metrics.get('longform_cer'))} % on {metrics.get('longform_n', 0)} recordings "
        f"({metrics.get('longform_seconds', 0):.0f} s, chunking {metrics.get('longform_chunking')})"
    )


def _plain(value: Any) -> Any:
    """Metrics as strict JSON: NaN and infinities become null."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def format_table(metrics: dict[str, Any]) -> str:
    """WER/CER in %, loss, n and rep-trap count, overall and per language."""

    def pct(v: Any) -> str:
        return f"{100 * v:7.2f}" if isinstance(v, int | float) and math.isfinite(v) else "      -"

    def row(name: str, m: dict[str, Any]) -> str:
        loss = m.get("loss")
        loss_s = (
            f"{loss:7.4f}" if isinstance(loss, int | float) and math.isfinite(loss) else "      -"
        )
        return (
            f"{name:<10} {m.get('n', 0):>6} {pct(m.get('wer'))} {pct(m.get('cer'))} "
            f"{loss_s} {m.get('rep_trap_count', 0):>8}"
        )

    lines = [f"{'language':<10} {'n':>6} {'WER %':>7} {'CER %':>7} {'loss':>7} {'rep-trap':>8}"]
    lines.append(row("all", metrics))
    for lang, m in (metrics.get("per_language") or {}).items():
        lines.append(row(lang, m))
    return "\n".join(lines)
