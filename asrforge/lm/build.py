"""``asrforge lm build``: training text -> normalized word sentences -> a Kneser–Ney ARPA file.

The text is normalized as evaluation normalizes transcripts before WER
(:func:`asrforge.text.normalize`: Whisper's English normalizer for English, the basic one
elsewhere), so the LM's words are the words WER counts; the ARPA header records which
(``normalizer``: ``english``, ``basic`` or ``by-language`` for a mixed text) and the languages.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from asrforge.config import DataConfig
from asrforge.data.locate import data_ref, is_url
from asrforge.data.rules import language_filter
from asrforge.data.sources import data_config, read_split
from asrforge.errors import UserError
from asrforge.lm.ngram import NORMALIZERS, NGramLM, estimate, write_arpa
from asrforge.text import normalize
from asrforge.text.languages import resolve_language

log = logging.getLogger(__name__)

MAX_ORDER = 6


def normalizer_name(languages: list[str]) -> str:
    """What :func:`asrforge.text.normalize` does to text of these languages."""
    english, basic, by_language = NORMALIZERS
    if set(languages) == {"en"}:
        return english
    return basic if "en" not in languages else by_language


def text_sentences(path: Path, language: str) -> Iterator[tuple[str, str]]:
    """``(language, line)`` of each non-empty line of a UTF-8 text file."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield language, line
    except UnicodeDecodeError as e:
        raise UserError(f"--text {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def data_sentences(
    data: Path | DataConfig, split: str, languages: set[str] | None
) -> Iterator[tuple[str, str]]:
    """``(language, transcript)`` of each utterance of a split of a data set (a path or a data
    section, as :func:`asrforge.data.sources.read_split` takes it; audio is not read)."""
    ds = read_split(data, split, required=("text",))  # transcripts alone make an LM
    for row in ds.select_columns(["text", "language"]):
        code = resolve_language(row["language"], strict=False)
        if languages is None or code in languages:
            yield code, row["text"] or ""


def build_lm(
    sentences: Iterator[tuple[str, str]], order: int, source: str, recorded: str | None = None
) -> NGramLM:
    """Normalize each ``(language, text)`` and estimate the model; ``source`` names the text in
    messages, ``recorded`` (default ``source``) in the ARPA file's header, which a bundle
    carries to others.

    Raises:
        UserError: ``order`` out of range, or no words at all after normalization.
    """
    if not 1 <= order <= MAX_ORDER:
        raise UserError(f"--order: must be between 1 and {MAX_ORDER}, got {order}")
    words, seen = [], set()
    for language, text in sentences:
        normalized = normalize(text, language).split()
        if normalized:
            words.append(normalized)
            seen.add(language)
    if not words:
        raise UserError(f"{source}: no words to learn from (empty after normalization)")
    languages = sorted(seen)
    meta = {
        "normalizer": normalizer_name(languages),
        "languages": languages,
        "sentences": len(words),
        "words": sum(len(w) for w in words),
        "source": source if recorded is None else recorded,
    }
    lm = estimate(words, order, meta=meta)
    log.info(
        "%s: %d sentences, %d words, %d word types; %d-gram counts %s",
        source, len(words), meta["words"], lm.vocab_size - 3, order,
        [len(p) for p in lm.probs],
    )  # fmt: skip
    return lm


def build_lm_file(
    out: Path,
    order: int,
    *,
    text: Path | None = None,
    data: Path | DataConfig | None = None,
    split: str = "train",
    language: str | None = None,
) -> NGramLM:
    """``asrforge lm build``: write the ARPA file ``out`` from a text file or a data split.

    Args:
        text: one sentence per line, in ``language``.
        data: data in any form training reads (a path, or a data section naming its columns);
            its ``split``'s transcripts, each normalized for its language; ``language`` keeps
            only that language's rows.

    Raises:
        UserError: both or neither source, a missing source, no language for ``text``, or an
            ``out`` that is a directory.
    """
    if (text is None) == (data is None):
        raise UserError("give one of --text FILE or --data DIR")
    if out.is_dir():
        raise UserError(f"--out {out}: a directory; give the ARPA file to write")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: no directory {out.parent}")
    keep = language_filter([language], where="--language") if language else None
    if text is not None:
        if not text.is_file():
            raise UserError(f"--text {text}: no such file")
        if keep is None:
            raise UserError("--text: give its --language (it decides how words are normalized)")
        # a local file is recorded by its name: the directories above it are this machine's
        lm = build_lm(text_sentences(text, next(iter(keep))), order, str(text), text.name)
    else:
        cfg = data_config(data)
        path = cfg.path
        local = data_ref(cfg) is None and not is_url(path)
        if local and not Path(path).exists():  # a Hub id or a URL is checked where it is read
            raise UserError(f"--data {path}: no such file or directory")
        named = Path(path).name if local else path
        lm = build_lm(
            data_sentences(data, split, keep), order, f"{path} ({split})", f"{named} ({split})"
        )
    write_arpa(lm, out)
    return lm
