"""Text normalization before scoring, after openai/whisper's ``normalizers``.

How it works: docs/evaluation.md, "Normalization before scoring (`text/normalizers.py`)".
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from importlib import resources

from asrforge.text.languages import resolve_language

# Whisper's own bracket rules: a parenthesized span needs at least one character.
_BRACKETED = re.compile(r"[<\[][^>\]]*[>\]]")
_PARENTHESIZED = re.compile(r"\(([^)]+?)\)")
_INVISIBLE = str.maketrans({"\u200b": " ", "\ufeff": None, "\u2060": None})
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'"})


def normalize(text: str, language: str) -> str:
    """Normalize a transcript (reference or hypothesis) of ``language`` for scoring.

    Args:
        text: the transcript.
        language: a code or English name (``"en"``, ``"english"``, ``"de"``, ``"hindi"``).

    Returns:
        The normalized text: words separated by single spaces, no leading or trailing space.

    Raises:
        UserError: the language is unknown.
    """
    if resolve_language(language) == "en":
        return _normalize_english(text)
    return _normalize_basic(text)


def _normalize_basic(text: str) -> str:
    # Whisper's BasicTextNormalizer, step for step, except that combining marks (M*) are kept
    # and case is folded rather than lowered.
    text = text.translate(_INVISIBLE).casefold()
    text = _PARENTHESIZED.sub("", _BRACKETED.sub("", text))
    text = unicodedata.normalize("NFKC", text)
    text = "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in text).casefold()
    return " ".join(text.split())


def _normalize_english(text: str) -> str:
    # Whisper's rewrites feed each other ("o1" -> "0 one" -> "one", "o¢" -> "o" -> "0"), so the
    # pass repeats until the text settles: normalized text must normalize to itself.
    text = text.translate(_INVISIBLE).translate(_APOSTROPHES)
    for _ in range(4):
        once = " ".join(_whisper_english()(text).split())
        if once == text:
            break
        text = once
    return text


@functools.cache
def _whisper_english():
    """Whisper's ``EnglishTextNormalizer`` as transformers ships it, with Whisper's British ->
    American spelling map from the whisper-normalizer package (transformers is imported on
    first use: the CLI's quick paths never load it)."""
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    spellings = resources.files("whisper_normalizer").joinpath("normalizers/english.json")
    return EnglishTextNormalizer(json.loads(spellings.read_text(encoding="utf-8")))
