"""``asrforge transcribe``: audio files of any length transcribed with a bundle.

Bad input (a missing file, unreadable audio, an altered bundle, an unknown language) raises
:class:`~asrforge.errors.UserError`: the CLI prints one line and exits 2. Every input is checked
(audio by its header) before anything is decoded; each group of files is read just before it is
decoded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asrforge.cli.lm_options import add_lm_options, lm_fusion
from asrforge.cli.open_model import open_model
from asrforge.cli.problems import attempt, positive, raise_problems
from asrforge.io.atomic import atomic_write_text, file_target_problem
from asrforge.io.directories import nearest_existing_parent, real_directory, symlink_problem

# The subtitle writers load the decoding code (torch): imported inside the handler, so building
# the parser (`asrforge --help`) does not wait for them.

OUTPUT_FORMATS = ("text", "json", "srt", "vtt")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``transcribe``."""
    p = subparsers.add_parser(
        "transcribe",
        help="transcribe audio files with a bundle",
        description="Transcribe wav/flac/ogg/opus/mp3 files (any sample rate, any length) with a "
        "bundle, a training checkpoint or run, or a transformers Whisper directory. Long audio is "
        "decoded in sequential 30 s windows moved by the model's timestamps (as openai-whisper "
        "and faster-whisper do), or cut at silences for models without timestamp tokens.",
    )
    p.add_argument(
        "bundle",
        type=str,
        help="a bundle directory (asrforge export), a checkpoint or run directory, a "
        "transformers Whisper directory (not verified: no manifest), or the Hugging Face Hub id "
        "of a pushed bundle or a model (org/name[@revision])",
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
        help="write <audio name>.<format> files here instead of printing, each as soon as its "
        "group of --batch-size files is decoded",
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
        help="beams per window (openai-whisper uses 5); 1: greedy decoding (default), "
        "without a bundle's n-gram LM, which beam search fuses",
    )
    p.add_argument(
        "--temperature-fallback",
        action="store_true",
        help="decode a window that looks like a repetition loop again at temperatures 0.2 ... "
        "1.0 (seeded sampling), as openai-whisper does",
    )
    p.add_argument(
        "--word-timestamps",
        action="store_true",
        help="time every word (cross-attention of the alignment heads aligned by dynamic time "
        "warping, less the heads' lag `asrforge align-heads` measured): json gets a words list "
        "per segment (start, end, probability); srt and vtt get one cue per word; refused with "
        "text output, which has no times",
    )
    p.add_argument(
        "--vad",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode only the speech Silero VAD finds (packages silero-vad, onnxruntime), joined "
        "into chunks of at most 26 s of speech (for a 30 s window) decoded as a batch; --no-vad: "
        "sequential windows over the whole recording. Default: VAD for recordings longer than "
        "30 s when the packages are installed, without --condition-on-previous-text (refused "
        "with --vad: chunks are decoded apart)",
    )
    p.add_argument(
        "--no-speech-threshold",
        type=optional_float,
        default=0.6,
        metavar="P|none",
        help="a window whose no-speech probability is above P yields no text, unless its "
        "average log-probability is above --logprob-threshold, as openai-whisper (default "
        "0.6); none: every window is decoded to text",
    )
    p.add_argument(
        "--logprob-threshold",
        type=optional_float,
        default=-1.0,
        metavar="L|none",
        help="see --no-speech-threshold; also where --temperature-fallback decodes a window "
        "again (default -1.0); none: the no-speech probability alone skips a window",
    )
    add_lm_options(p)
    p.set_defaults(func=run)


def optional_float(text: str) -> float | None:
    """A number, or ``none`` for None (an option turned off)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or none, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from asrforge.bundle.languages import check_language
    from asrforge.bundle.options import VAD_WITH_PREVIOUS_TEXT, chunking_for
    from asrforge.data.audio import check_audio_file, read_audio_file

    problems = [
        positive("--batch-size", args.batch_size),
        positive("--max-new-tokens", args.max_new_tokens),
        positive("--beam-size", args.beam_size),
    ]
    if args.no_speech_threshold is not None and not 0 <= args.no_speech_threshold <= 1:
        problems.append(
            f"--no-speech-threshold: must be in [0, 1] or none, got {args.no_speech_threshold:g}"
        )
    if args.logprob_threshold is not None and not args.logprob_threshold <= 0:
        problems.append(
            f"--logprob-threshold: must be <= 0 or none, got {args.logprob_threshold:g}"
        )
    if args.json and args.fmt not in (None, "json"):
        problems.append(f"--json and --format {args.fmt}: choose one")
    fmt = "json" if args.json else args.fmt or "text"
    if args.word_timestamps and fmt == "text":
        # timing words costs a decoder pass per window, and text output has no place for times
        problems.append("--word-timestamps with --format text: give --format json, srt or vtt")
    if fmt in ("srt", "vtt") and len(args.audio) > 1 and args.output_dir is None:
        problems.append(f"--format {fmt} with {len(args.audio)} files: give --output-dir")
    targets = _output_targets(args.audio, args.output_dir, fmt, problems)
    # The directories below its nearest existing parent are asrforge's to make, so a link found
    # there when the outputs are written is refused.
    made_under = None if args.output_dir is None else nearest_existing_parent(args.output_dir)
    if args.vad and args.condition_on_previous_text:
        problems.append(
            VAD_WITH_PREVIOUS_TEXT.format(vad="--vad", previous="--condition-on-previous-text")
        )
    if args.vad:
        from asrforge.model.vad import vad_refusal

        refusal = vad_refusal("--vad")
        if refusal is not None:
            problems.append(refusal)
    # the model first, then every audio file's header: all the problems in one message
    bundle = attempt(lambda: open_model(args.bundle, option="bundle"), problems)
    chosen = (
        None if bundle is None else attempt(lambda: chunking_for(bundle, args.chunking), problems)
    )
    chunking, why = chosen or (None, None)
    if args.condition_on_previous_text and chosen and chunking != "timestamps":
        problems.append("--condition-on-previous-text needs --chunking timestamps")
    if bundle is not None and args.language is not None:  # before any group is decoded
        attempt(lambda: check_language(bundle, args.language), problems)
    for path in args.audio:
        attempt(lambda path=path: check_audio_file(path), problems)
    raise_problems(problems)
    fusion = lm_fusion(bundle, args)
    # The chunking notice comes after every error check, as one line.
    if args.chunking is None and chunking == "silence":
        print(f"asrforge: {why}", file=sys.stderr)
    # A group of files is read and decoded together (their windows share batches) and written
    # before the next is read, so memory holds one group's audio and an interrupted run keeps
    # what it finished.
    group = args.batch_size
    for g in range(0, len(args.audio), group):
        paths = args.audio[g : g + group]
        results = bundle.recognize(
            [read_audio_file(path) for path in paths],
            args.language,
            names=[str(p) for p in paths],
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            chunking=chunking,
            condition_on_previous_text=args.condition_on_previous_text,
            beam_size=args.beam_size,
            temperature_fallback=args.temperature_fallback,
            use_lm=fusion is not None,
            lm_alpha=fusion.alpha if fusion is not None else None,
            lm_beta=fusion.beta if fusion is not None else None,
            word_timestamps=args.word_timestamps,
            vad=args.vad,
            no_speech_threshold=args.no_speech_threshold,
            logprob_threshold=args.logprob_threshold,
        )
        for path, r in zip(paths, results, strict=True):
            out = _formatted(r, path, fmt, args.word_timestamps)
            if targets:
                target = targets[path]
                real_directory(target.parent, under=made_under)
                atomic_write_text(target, out if out.endswith("\n") else out + "\n")
                print(f"wrote {target}", file=sys.stderr)
            elif fmt == "text" and len(args.audio) > 1:
                print(f"{path}\t{out}", flush=True)
            else:
                print(out, flush=True)
    return 0


def _output_targets(
    audio: list[Path], output_dir: Path | None, fmt: str, problems: list[str | None]
) -> dict[Path, Path]:
    """Each audio file's output file in ``output_dir`` (none without it), with the problem of
    every target that could not be written appended to ``problems``, before any decoding."""
    if output_dir is None:
        return {}
    if problem := symlink_problem(output_dir):
        # the outputs would be written into the directory it points to
        problems.append(f"--output-dir {problem}")
        return {}
    if output_dir.exists() and not output_dir.is_dir():
        problems.append(f"--output-dir {output_dir}: not a directory")
        return {}
    targets = {p: output_dir / f"{p.stem}.{'txt' if fmt == 'text' else fmt}" for p in audio}
    by_stem: dict[str, list[Path]] = {}
    for p in audio:
        by_stem.setdefault(p.stem, []).append(p)
    for stem, paths in sorted(by_stem.items()):
        if len(paths) > 1:  # one output file would overwrite the other
            problems.append(
                f"--output-dir: several audio files are named {stem!r}: "
                + ", ".join(str(p) for p in paths)
            )
    for target in targets.values():
        if problem := file_target_problem(target):
            problems.append(f"--output-dir {problem}")
    return targets


def _formatted(r, path: Path, fmt: str, word_timestamps: bool) -> str:
    """One transcript ``r`` of ``path`` in the output format ``fmt``."""
    from asrforge.bundle.subtitles import to_srt, to_vtt, word_cues

    if fmt == "json":
        record = {
            "path": str(path),
            "text": r.text,
            "language": r.language,
            "seconds": round(r.seconds, 3),
            "chunking": r.chunking,
            "vad": r.vad,
            "segments": [s.to_dict() for s in r.segments],
        }
        return json.dumps(record, ensure_ascii=False)
    if fmt in ("srt", "vtt"):
        cues = word_cues(r.segments) if word_timestamps else r.segments
        return to_srt(cues) if fmt == "srt" else to_vtt(cues)
    return r.text
