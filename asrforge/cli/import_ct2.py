"""``asrforge import-ct2``: a CTranslate2 Whisper model as a transformers directory."""

from __future__ import annotations

import argparse
from pathlib import Path

# The converter loads torch and transformers: imported inside the handler, so building the parser
# (`asrforge --help`) does not wait for it.

# The dtypes `import_ct2` writes (its DTYPES, whose values are torch dtypes).
DTYPES = ("bfloat16", "float16", "float32")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``asrforge import-ct2 CT2_DIR --out HF_DIR [--dtype float32]``."""
    parser = subparsers.add_parser(
        "import-ct2",
        help="convert a CTranslate2 (faster-whisper) Whisper model to a transformers directory",
        description="Turn a CTranslate2 Whisper directory into a transformers Whisper directory.",
    )
    parser.add_argument(
        "ct2_dir",
        type=str,
        metavar="CT2_DIR",
        help="directory with model.bin, config.json, tokenizer.json, vocabulary.*, or its "
        "Hugging Face Hub id (Systran/faster-whisper-base)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="HF_DIR",
        help="output directory (must not exist or be empty)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="dtype of the written weights (default: float32)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``import-ct2``; user errors propagate as :class:`UserError` for the CLI to print."""
    from asrforge.convert.ct2 import import_ct2

    out = import_ct2(args.ct2_dir, args.out, dtype=args.dtype)
    print(f"wrote a transformers Whisper model to {out}")
    return 0
