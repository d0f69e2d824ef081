"""Text normalization before scoring, after openai/whisper's ``normalizers``.

How it works: docs/evaluation.md, "Normalization before scoring (`text/normalizers.py`)".
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from importlib import resources

from asrforge.config import NormalizerConfig
from asrforge.text.languages import resolve_language

# Whisper's own bracket rules: a parenthesized span needs at least one character.
_BRACKETED = re.compile(r"[<\[][^>\]]*[>\]]")
_PARENTHESIZED = re.compile(r"\(([^)]+?)\)")
_INVISIBLE = str.maketrans({"\u200b": " ", "\ufeff": None, "\u2060": None})
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'"})


def normalize(text: str, language: str, options: NormalizerConfig | None = None) -> str:
    """Normalize a transcript (reference or hypothesis) of ``language`` for scoring.

    Args:
        text: the transcript.
        language: a code or English name (``"en"``, ``"english"``, ``"de"``, ``"hindi"``).
        options: ``eval.normalizer`` (diacritics, numbers); default Whisper's normalizers.

    Returns:
        The normalized text: words separated by single spaces, no leading or trailing space.

    Raises:
        UserError: the language is unknown.
    """
    options = options or DEFAULT
    return _normalized(
        text, resolve_language(language), options.numbers == "standard", options.remove_diacritics
    )


def forget_normalized() -> None:
    """Empty :func:`normalize`'s cache, so that a benchmark's sides each start cold."""
    _normalized.cache_clear()


# Every evaluation of a run normalizes the same references again, and English's normalizer costs
# about a millisecond a transcript: on a GPU that was half of an evaluation's time.
@functools.lru_cache(maxsize=1 << 15)
def _normalized(text: str, code: str, numbers: bool, remove_diacritics: bool) -> str:
    text = _normalize_english(text, numbers=numbers) if code == "en" else _normalize_basic(text)
    return _without_diacritics(text) if remove_diacritics else text


DEFAULT = NormalizerConfig()
"""Whisper's normalizers as they are."""


def _without_diacritics(text: str) -> str:
    # Whisper's remove_symbols_and_diacritics, marks only: symbols were spaced out already.
    marks = _additional_diacritics()
    kept = "".join(
        c for c in unicodedata.normalize("NFKD", text) if unicodedata.category(c) != "Mn"
    )
    return " ".join("".join(marks.get(c, c) for c in kept).split())


@functools.cache
def _additional_diacritics() -> dict[str, str]:
    """Letters Whisper writes as ASCII beside the combining marks it drops (œ -> oe, ß -> ss)."""
    from transformers.models.whisper.english_normalizer import ADDITIONAL_DIACRITICS

    return dict(ADDITIONAL_DIACRITICS)


def _normalize_basic(text: str) -> str:
    # Whisper's BasicTextNormalizer, step for step, except that combining marks (M*) are kept
    # and case is folded rather than lowered.
    text = text.translate(_INVISIBLE).casefold()
    text = _PARENTHESIZED.sub("", _BRACKETED.sub("", text))
    text = unicodedata.normalize("NFKC", text)
    text = "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in text).casefold()
    return " ".join(text.split())


def _normalize_english(text: str, numbers: bool = True) -> str:
    # Whisper's rewrites feed each other ("o1" -> "0 one" -> "one", "o¢" -> "o" -> "0"), so the
    # pass repeats until the text settles: normalized text must normalize to itself.
    text = text.translate(_INVISIBLE).translate(_APOSTROPHES)
    for _ in range(4):
        once = " ".join(_whisper_english(numbers)(text).split())
        if once == text:
            break
        text = once
    return text


@functools.cache
def _whisper_english(numbers: bool = True):
    """Whisper's ``EnglishTextNormalizer`` as transformers ships it, with Whisper's British ->
    American spelling map from the whisper-normalizer package (transformers is imported on
    first use: the CLI's quick paths never load it); without ``numbers``, its rewriting of
    spoken numbers as digits is left out."""
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    spellings = resources.files("whisper_normalizer").joinpath("normalizers/english.json")
    normalizer = EnglishTextNormalizer(json.loads(spellings.read_text(encoding="utf-8")))
    if not numbers:
        normalizer.standardize_numbers = str
    return normalizer
