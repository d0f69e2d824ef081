"""``asrforge corpus``: a speech corpus synthesized with espeak-ng."""

from __future__ import annotations

import argparse
from pathlib import Path

from asrforge.errors import UserError
from asrforge.recipes.corpus_languages import LANGUAGES_TABLE, TEXT_SOURCES
from asrforge.recipes.extra import require_demo_extra
from asrforge.recipes.sentences import MAX_WORDS, MIN_WORDS

# The synthesis code loads numpy, soundfile and datasets: imported inside the handler, so building
# the parser (`asrforge --help`) does not wait for it.


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``asrforge corpus``."""
    langs = ", ".join(sorted(LANGUAGES_TABLE))
    p = subparsers.add_parser(
        "corpus",
        help="synthesize a multilingual speech corpus with espeak-ng",
        description=(
            "Synthesize a speech corpus with espeak-ng from natural sentences of Debian's "
            "fortunes packages (en, de, es, it, pl, ru, cs, bg, pt, zh) or sentences drawn "
            "from wordfreq's word lists: train/validation/test splits with disjoint sentences and speakers, saved as "
            "an Arrow dataset with a card (README.md, card.json). Clips are cached; a re-run "
            f"with the same arguments is near-instant. Languages: {langs}. Not available: "
            "km (espeak-ng has no Khmer voice); th, my, sw (no wordfreq list); ja only with "
            "--japanese-kana-only (espeak-ng does not read kanji); zh is read with the "
            "cmn-latn-pinyin voice."
        ),
    )
    p.add_argument("--languages", required=True, help="comma-separated codes, e.g. en,es,de")
    p.add_argument("--per-language", type=int, default=None, metavar="N",
                   help="utterances per language over all splits (80%% train, 10%% validation, "
                        "10%% test; at least 1 each)")
    p.add_argument("--split-sizes", default=None, metavar="train=N,validation=N,test=N",
                   help="utterances per language in each split (instead of --per-language)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="corpus directory")
    p.add_argument("--seed", type=int, default=0, help="seeds sentences and speakers (default 0)")
    p.add_argument("--min-words", type=int, default=MIN_WORDS, help="shortest sentence")
    p.add_argument("--max-words", type=int, default=MAX_WORDS, help="longest sentence")
    p.add_argument("--workers", type=int, default=None, help="espeak-ng processes (default: CPUs)")
    p.add_argument("--cache-dir", type=Path, default=None, help="clip cache (default DIR/.cache)")
    p.add_argument("--force", action="store_true", help="rebuild even if DIR holds this corpus")
    p.add_argument("--text", choices=TEXT_SOURCES, default="auto",
                   help="sentences from fortunes packages (natural), wordfreq (word draws), or "
                        "auto: fortunes where the language's package is installed (default)")
    p.add_argument("--japanese-kana-only", action="store_true",
                   help="allow ja: sentences of kana-written words only")
    p.set_defaults(func=run)
    return p


def split_sizes(per_language: int | None, sizes: str | None) -> dict[str, int]:
    """Sizes per split from ``--per-language`` or ``--split-sizes``.

    Raises:
        UserError: neither or both given, or a malformed value.
    """
    if (per_language is None) == (sizes is None):
        raise UserError("corpus: give exactly one of --per-language or --split-sizes")
    if per_language is not None:
        if per_language < 3:
            raise UserError(f"corpus --per-language: needs at least 3 (one per split), "
                            f"got {per_language}")
        val = test = max(1, round(per_language * 0.1))
        return {"train": per_language - val - test, "validation": val, "test": test}
    out = {}
    for item in sizes.split(","):
        name, sep, n = item.partition("=")
        if not sep or not n.strip().lstrip("-").isdigit():
            raise UserError(f"corpus --split-sizes: {item!r} is not split=N")
        out[name.strip()] = int(n)
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``asrforge corpus``."""
    require_demo_extra("corpus", ("wordfreq",))
    from asrforge.recipes.corpus import CorpusSpec, build_corpus, card_summary

    spec = CorpusSpec(
        languages=[s.strip() for s in args.languages.split(",") if s.strip()],
        sizes=split_sizes(args.per_language, args.split_sizes), seed=args.seed,
        min_words=args.min_words, max_words=args.max_words,
        japanese_kana_only=args.japanese_kana_only, text=args.text,
    )
    if args.workers is not None and args.workers < 1:
        raise UserError(f"corpus --workers: must be >= 1, got {args.workers}")
    card = build_corpus(spec, args.out, cache_dir=args.cache_dir, workers=args.workers,
                        force=args.force, progress=print)
    print(f"corpus card: {Path(args.out) / 'README.md'} ({card_summary(card)})")
    return 0
