"""``asrforge evaluate``: WER/CER/loss of a checkpoint or bundle on a data split."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from asrforge.cli.data_options import (
    DATA_OPTIONS_HELP,
    SPLIT_HELP,
    add_data_argument,
    data_options,
)
from asrforge.cli.lm_options import add_lm_options, lm_fusion
from asrforge.cli.open_model import open_model
from asrforge.cli.problems import attempt, positive, raise_problems
from asrforge.config import NormalizerConfig
from asrforge.data.sources import reads_whole
from asrforge.io.atomic import file_target_problem
from asrforge.text.metrics import strict_json_metrics

# Evaluating loads torch and transformers: imported inside the handlers, so building the parser
# (`asrforge --help`) does not wait for them.


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``evaluate``."""
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
        type=str,
        help="a checkpoint, run or bundle directory, a transformers Whisper directory, or the "
        "Hugging Face Hub id of a model or a pushed bundle (org/name[@revision])",
    )
    add_data_argument(p)
    p.add_argument(
        "--split", default=None, help=SPLIT_HELP.format(default="validation; train with --carve")
    )
    p.add_argument(
        "--carve",
        type=Path,
        default=None,
        metavar="EVAL_CARVE",
        help="score only the rows a run held out of --split with data.eval_carve, as its "
        "figures are: the run directory's eval_carve.json (or the run directory)",
    )
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.add_argument(
        "--remove-diacritics",
        action="store_true",
        help="score without accents and other combining marks, in every language (as "
        "eval.normalizer.remove_diacritics)",
    )
    p.add_argument(
        "--numbers",
        choices=["standard", "as_written"],
        default="standard",
        help="standard: English spoken numbers read as digits (Whisper's normalizer); "
        "as_written: numbers scored as written, in every language (as eval.normalizer.numbers)",
    )
    p.add_argument(
        "--predictions",
        type=Path,
        default=None,
        metavar="FILE",
        help="write what the model heard: one JSON line per utterance (id, language, "
        "reference, hypothesis, and both as normalized for scoring)",
    )
    p.add_argument(
        "--languages",
        type=lambda text: [x.strip() for x in text.split(",") if x.strip()],
        default=None,
        metavar="CODES",
        help="score only these languages' utterances, comma-separated (e.g. en,es); the others "
        "are counted as left out (default: every utterance)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the model's")
    p.add_argument("--max-samples", type=int, default=None, help="the first N utterances only")
    p.add_argument(
        "--beam-size",
        type=int,
        default=1,
        help="beams per utterance for the split (not the long-form recordings); 1: greedy, "
        "without a bundle's n-gram LM, which beam search fuses",
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
        "--longform-vad",
        action="store_true",
        help="decode the long recordings as `transcribe --vad` does: only the speech Silero VAD "
        "finds (packages silero-vad, onnxruntime); default: sequential windows, as training "
        "evaluates",
    )
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
    add_lm_options(p)
    p.set_defaults(func=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    problems = [
        positive("--batch-size", args.batch_size),
        positive("--max-new-tokens", args.max_new_tokens),
        positive("--max-samples", args.max_samples),
        positive("--beam-size", args.beam_size),
    ]
    if args.predictions is not None:
        if problem := file_target_problem(args.predictions):
            problems.append(f"--predictions {problem}")
        elif not args.predictions.parent.is_dir():
            problems.append(f"--predictions {args.predictions}: its directory does not exist")
    args.split = args.split or ("train" if args.carve is not None else "validation")
    if args.carve is not None:
        from asrforge.run_layout import RunLayout

        if args.carve.is_dir():
            args.carve = RunLayout(args.carve).carve
        if not args.carve.is_file():
            problems.append(f"--carve {args.carve}: no such file (a run's eval_carve.json)")
        if args.longform_items:
            problems.append("--carve scores the held-out rows: --longform-items does not apply")
    if args.languages is not None:
        from asrforge.data.rules import language_filter

        attempt(lambda: language_filter(args.languages, where="--languages"), problems)
    if args.longform_vad and not args.longform_items:
        problems.append("--longform-vad: needs --longform-items")
    if args.longform_vad:
        from asrforge.config import vad_problem

        problem = vad_problem("--longform-vad")
        if problem is not None:
            problems.append(problem)
    if args.longform_items < 0:
        problems.append(f"--longform-items: must be >= 0, got {args.longform_items}")
    if not 0 < args.longform_min_seconds <= args.longform_max_seconds:
        problems.append(
            "--longform-min-seconds/--longform-max-seconds: need 0 < min <= max, got "
            f"{args.longform_min_seconds:g} and {args.longform_max_seconds:g}"
        )
    from asrforge.evaluation.evaluate import evaluate_split
    from asrforge.model.decoding import DecodeOptions, capture_for

    # the model first, then the data: every problem in one message
    bundle = attempt(lambda: open_model(args.model, args.weights, option="model"), problems)
    data = attempt(lambda: data_options(args), problems)
    raise_problems(problems)
    fusion = lm_fusion(bundle, args)
    normalizer = NormalizerConfig(remove_diacritics=args.remove_diacritics, numbers=args.numbers)
    metrics, preds, report = evaluate_split(
        bundle,
        data,
        args.split,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens or bundle.config.eval.max_new_tokens,
        languages=args.languages,
        max_samples=args.max_samples,
        options=DecodeOptions(
            beam_size=args.beam_size,
            fusion=fusion,
            capture=capture_for("auto", bundle.device),
        ),
        normalizer=normalizer,
        carve=args.carve,
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
            options=_long_options(args.temperature_fallback),
            vad=args.longform_vad,
            languages=args.languages,
        )
        metrics.update(long_metrics)
    language = language_line(bundle.specials.multilingual)
    skipped = {reason: len(ids) for reason, ids in report.skipped.items()}
    # data of one split is read whole, so no split name describes what was scored
    split = None if reads_whole(data.path) else args.split
    if args.carve is not None:
        split = f"the rows {args.carve} held out of {split or 'it'}"
    if args.json:
        record = {
            "model": str(args.model),
            "data": str(args.data),
            "split": split,
            **strict_json_metrics(metrics),
            "skipped": skipped,
            "left_out": dict(report.left_out),
            "language_mode": "forced" if bundle.specials.multilingual else "english-only",
        }
        print(json.dumps(record, ensure_ascii=False))
    else:
        print(
            f"{args.model} on {args.data} ({split or 'read whole'}): {metrics['n']} utterances"
            + (f", skipped {skipped}" if skipped else "")
            + (f", left out by --languages {dict(report.left_out)}" if report.left_out else "")
        )
        print(format_table(metrics))
        print(language)
        print(f"normalizer: {metrics['normalizer']}")
        if args.longform_items:
            print(format_longform(metrics))
    if args.predictions is not None:
        from asrforge.evaluation.records import prediction_records
        from asrforge.io.atomic import atomic_write_text

        # after the metrics are printed: a write that fails does not throw them away
        sys.stdout.flush()
        lines = [
            json.dumps(r, ensure_ascii=False)
            for r in prediction_records(preds, bundle.specials, normalizer)
        ]
        atomic_write_text(args.predictions, "".join(f"{line}\n" for line in lines))
        if not args.json:
            print(f"predictions: {len(preds)} utterance(s) in {args.predictions}")
    return 0


def language_line(multilingual: bool) -> str:
    """How the table's languages were decoded: each utterance's language from the data was
    forced into its prompt (evaluation never detects), or an English-only model has none."""
    if multilingual:
        return "language: forced from the data (each utterance's own), not detected"
    return "language: English (an English-only model's prompt has no language token)"


def _long_options(fallback: bool):
    """How long-form evaluation decodes each window: greedily, with the temperature fallback
    when asked."""
    from asrforge.model.decoding import DecodeOptions
    from asrforge.model.fallback import Fallback

    return DecodeOptions(fallback=Fallback() if fallback else None)


def format_longform(metrics: dict[str, Any]) -> str:
    """The long-form line under the table: WER/CER in %, recordings, seconds, chunking."""

    def pct(v: Any) -> str:
        return f"{100 * v:.2f}" if isinstance(v, int | float) and math.isfinite(v) else "-"

    return (
        f"long-form: WER {pct(metrics.get('longform_wer'))} % CER "
        f"{pct(metrics.get('longform_cer'))} % on {metrics.get('longform_n', 0)} recordings "
        f"({metrics.get('longform_seconds', 0):.0f} s, chunking {metrics.get('longform_chunking')})"
    )


def format_table(metrics: dict[str, Any]) -> str:
    """WER/CER in % (normalized, then raw: on the strings as decoded and as written), loss, n and
    rep-trap count, overall and per language."""

    def pct(v: Any) -> str:
        return f"{100 * v:7.2f}" if isinstance(v, int | float) and math.isfinite(v) else "      -"

    def row(name: str, m: dict[str, Any]) -> str:
        loss = m.get("loss")
        loss_s = (
            f"{loss:7.4f}" if isinstance(loss, int | float) and math.isfinite(loss) else "      -"
        )
        return (
            f"{name:<10} {m.get('n', 0):>6} {pct(m.get('wer'))} {pct(m.get('cer'))} "
            f"{pct(m.get('wer_raw'))} {pct(m.get('cer_raw'))} {loss_s} {m.get('rep_trap_count', 0):>8}"
        )

    lines = [
        f"{'language':<10} {'n':>6} {'WER %':>7} {'CER %':>7} {'raw WER':>7} {'raw CER':>7} "
        f"{'loss':>7} {'rep-trap':>8}"
    ]
    lines.append(row("all", metrics))
    for lang, m in (metrics.get("per_language") or {}).items():
        lines.append(row(lang, m))
    return "\n".join(lines)
