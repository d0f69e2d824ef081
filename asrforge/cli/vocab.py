"""``asrforge vocab build`` and ``asrforge vocab report``."""

from __future__ import annotations

import argparse
import json
from itertools import chain
from pathlib import Path

from asrforge.cli.data_options import add_data_argument, data_options
from asrforge.errors import UserError
from asrforge.text.languages import resolve_language

# The tokenizer code loads transformers: imported inside the handler, so building the parser
# (`asrforge --help`) does not wait for it.


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``asrforge vocab build`` and ``asrforge vocab report``."""
    parser = subparsers.add_parser(
        "vocab",
        help="per-language vocabulary extension",
        description="Per-language vocabulary extension: merge a language BPE into Whisper's, "
        "warm-start the rows.",
    )
    sub = parser.add_subparsers(dest="vocab_command", required=True, metavar="ACTION")
    b = sub.add_parser("build", help="train a language BPE and merge it into a Whisper tokenizer")
    add_data_argument(
        b,
        help="the data, in any form data.path takes (its transcripts are read); data.columns.*, "
        "data.language, data.cache_dir as in `asrforge evaluate --help`",
    )
    b.add_argument(
        "--language", required=True, help="the language (code, name or locale) to extend for"
    )
    b.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help="size of the language BPE (256 bytes + merges)",
    )
    b.add_argument("--text", type=Path, help="extra UTF-8 text of the language, one line each")
    b.add_argument("--max-text-lines", type=int, help="read at most this many lines of --text")
    b.add_argument("--out", type=Path, required=True, help="the extended tokenizer directory")
    b.add_argument(
        "--base",
        type=Path,
        required=True,
        help="the base Whisper tokenizer (or model) directory, or a Hub model id "
        "(org/name[@revision]; its tokenizer and config files only)",
    )
    b.add_argument(
        "--split", default="train", help="split of --data to read (default train; a file: whole)"
    )
    b.set_defaults(func=run, accepts_overrides=True)
    r = sub.add_parser("report", help="tokens per utterance before and after an extension")
    add_data_argument(r, help="as for vocab build")
    r.add_argument("--language", required=True)
    r.add_argument("--tokenizer", type=Path, required=True, help="the extended tokenizer")
    r.add_argument(
        "--base", type=Path, help="base tokenizer (or a Hub model id); default the one recorded"
    )
    r.add_argument("--split", default="train")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.set_defaults(func=run, accepts_overrides=True)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``vocab build`` or ``vocab report``; UserErrors propagate for the CLI to print."""
    from asrforge.model.build import has_language_slot
    from asrforge.model.tokenizer import load_tokenizer
    from asrforge.model.vocab import (
        VocabExtension,
        build_extended_tokenizer,
        compare_tokenizers,
        iter_text_file,
        load_extended_tokenizer,
        read_transcripts,
        tokenizer_sha256,
    )

    data = data_options(args)
    if args.vocab_command == "build":
        if args.vocab_size <= 256:
            raise UserError(f"--vocab-size must be > 256 (the byte tokens), got {args.vocab_size}")
        texts = read_transcripts(data, args.language, args.split)
        extra = iter_text_file(args.text, args.max_text_lines) if args.text else iter(())
        base = base_directory(args.base)
        ext = build_extended_tokenizer(
            base,
            chain(texts, extra),
            language=args.language,
            vocab_size=args.vocab_size,
            out=args.out,
        )
        print(
            f"wrote {args.out}: {ext.added()}, "
            f"{ext.base_vocab_size} -> {ext.vocab_size} ({len(texts)} transcripts)"
        )
        code = resolve_language(args.language, strict=False)
        if code != "en" and not has_language_slot(base, ext.base_vocab_size):
            print(english_only_notice(args.base, code))
        return 0
    ext_tok = load_extended_tokenizer(args.tokenizer)
    ext = VocabExtension.read(args.tokenizer)
    base_dir = base_directory(args.base) if args.base else (Path(ext.base) if ext.base else None)
    if base_dir is None or not Path(base_dir).is_dir():
        raise UserError(f"the base tokenizer {base_dir} is not there; pass --base")
    base_tok = load_tokenizer(base_dir)
    if tokenizer_sha256(base_tok) != ext.base_tokenizer_sha256:
        raise UserError(
            f"--base {base_dir}: not the tokenizer {args.tokenizer} was extended from "
            "(sha256 differs from vocab_extension.json)"
        )
    report = compare_tokenizers(
        base_tok, ext_tok, read_transcripts(data, args.language, args.split)
    )
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['n']} {args.language} utterances, tokens per utterance:")
    print(f"  {'':8}{'mean':>9}{'p50':>8}{'p95':>8}{'total':>10}")
    for key in ("before", "after"):
        s = report[key]
        print(f"  {key:8}{s['mean']:9.2f}{s['p50']:8.1f}{s['p95']:8.1f}{s['total']:10d}")
    print(
        f"decode steps saved: {report['decode_steps_saved']} of "
        f"{report['decode_steps_before']} ({report['decode_steps_saved_pct']:.1f}%)"
    )
    return 0


def base_directory(value: Path) -> Path:
    """``--base`` as a directory: itself, or the snapshot of the Hub model id it names (its
    tokenizer and config files, no weights), resolved as ``model.pretrained`` is."""
    from asrforge.hub import MODEL_FILES, resolve

    patterns = tuple(p for p in MODEL_FILES if p != "*.safetensors")
    return resolve(value, field="--base", patterns=patterns).path


def english_only_notice(base: Path, code: str) -> str:
    """What an extension of an English-only base (its prompt has no language slot) will take."""
    return (
        f"note: {base} is an English-only Whisper: its prompt has no language slot. The new "
        f"tokens extend its vocabulary, but the model still decodes every utterance under the "
        f"English prompt, so train the {code!r} data as English (data.language: en) with "
        f"model.tokenizer: the extended tokenizer. To teach {code!r} under its own language "
        "token, extend and train a multilingual Whisper instead: asrforge does not turn an "
        "English-only model into a multilingual one"
    )
