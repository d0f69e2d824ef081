"""Text normalization before scoring, after openai/whisper's ``normalizers``.

How it works: docs/evaluation.md, "Normalization before scoring (`text/normalizers.py`)".
"""

from __future__ import annotations

import functools
import re
import unicodedata

from asrforge.text.languages import resolve_language

_BRACKETED = re.compile(r"[<\[][^>\]]*[>\]]|\([^)]*\)")
_INVISIBLE = str.maketrans({"\u200b": " ", "\ufeff": None, "\u2060": None})
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'"})
_FILLERS = re.compile(r"\b(?:hmm|mm|mhm|mmm|uh|um)\b")

# Applied in order; a trailing space keeps an expansion apart from a following period.
_ENGLISH_REPLACEMENTS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(pattern), repl)
    for pattern, repl in [
        (r"\bwon't\b", "will not"),
        (r"\bcan't\b", "can not"),
        (r"\blet's\b", "let us"),
        (r"\bain't\b", "aint"),
        (r"\by'all\b", "you all"),
        (r"\bwanna\b", "want to"),
        (r"\bgotta\b", "got to"),
        (r"\bgonna\b", "going to"),
        (r"\bi'ma\b", "i am going to"),
        (r"\bimma\b", "i am going to"),
        (r"\bma'am\b", "madam"),
        (r"\bmr\b", "mister "),
        (r"\bmrs\b", "missus "),
        (r"\bst\b", "saint "),
        (r"\bdr\b", "doctor "),
        (r"\bprof\b", "professor "),
        (r"\bjr\b", "junior "),
        (r"\bsr\b", "senior "),
        (r"'d been\b", " had been"),
        (r"'s been\b", " has been"),
        (r"'d gone\b", " had gone"),
        (r"'s gone\b", " has gone"),
        (r"'s got\b", " has got"),
        (r"n't\b", " not"),
        (r"'re\b", " are"),
        (r"'s\b", " is"),
        (r"'d\b", " would"),
        (r"'ll\b", " will"),
        (r"'ve\b", " have"),
        (r"'m\b", " am"),
    ]
]

# Letters NFKD does not decompose into a base letter and a diacritic.
_EXTRA_FOLDS = str.maketrans(
    {"œ": "oe", "ø": "o", "æ": "ae", "ß": "ss", "đ": "d", "ð": "d", "þ": "th", "ł": "l"}
)

# A light British -> American subset (Whisper ships ~1700 pairs).
_SPELLINGS = {
    "colour": "color", "colours": "colors", "favour": "favor", "favourite": "favorite",
    "honour": "honor", "labour": "labor", "neighbour": "neighbor", "neighbours": "neighbors",
    "behaviour": "behavior", "humour": "humor", "flavour": "flavor", "harbour": "harbor",
    "centre": "center", "centres": "centers", "metre": "meter", "metres": "meters",
    "theatre": "theater", "litre": "liter", "litres": "liters", "fibre": "fiber",
    "organise": "organize", "organised": "organized", "realise": "realize",
    "realised": "realized", "recognise": "recognize", "recognised": "recognized",
    "apologise": "apologize", "analyse": "analyze", "travelled": "traveled",
    "travelling": "traveling", "cancelled": "canceled", "defence": "defense",
    "licence": "license", "offence": "offense", "grey": "gray", "programme": "program",
    "programmes": "programs", "catalogue": "catalog", "dialogue": "dialog",
    "cheque": "check", "tyre": "tire", "tyres": "tires", "aluminium": "aluminum",
    "jewellery": "jewelry", "plough": "plow", "mould": "mold",
}  # fmt: skip

_KEEP_IN_ENGLISH = ".%$¢€£"


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
    text = unicodedata.normalize("NFKC", text.translate(_INVISIBLE)).casefold()
    text = _BRACKETED.sub(" ", text)
    text = "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in text)
    return " ".join(text.split())


def _normalize_english(text: str) -> str:
    # A few rewrites feed each other ("o¢" -> "o" -> "0"; Whisper's "o1" -> "0 one" -> "one"),
    # so the pass repeats until the text settles: normalized text must normalize to itself.
    for _ in range(4):
        once = _normalize_english_once(text)
        if once == text:
            break
        text = once
    return text


def _normalize_english_once(text: str) -> str:
    # NFKC first, so compatibility forms ("𝐀", "ﬁ") are lower-cased like their plain letters
    text = unicodedata.normalize("NFKC", text)
    text = text.translate(_INVISIBLE).translate(_APOSTROPHES).lower()
    text = _BRACKETED.sub(" ", text)
    text = _FILLERS.sub("", text)
    text = re.sub(r"\s+'", "'", text)  # "don 't" -> "don't"
    for pattern, repl in _ENGLISH_REPLACEMENTS:
        text = pattern.sub(repl, text)
    text = re.sub(r"(\d),(\d)", r"\1\2", text)  # 1,000 -> 1000
    text = re.sub(r"\.(\D|$)", r" \1", text)  # a period not before a digit ends a sentence
    text = _strip_symbols_and_diacritics(text)
    # Stripping accents can make a filler again ("ÙM" -> "um").
    text = _FILLERS.sub("", text)
    text = _english_numbers()(text)  # "twenty five" -> "25", "press 1" -> "press one"
    text = " ".join(_SPELLINGS.get(w, w) for w in text.split())
    text = re.sub(r"([$¢€£])\s+(\d)", r"\1\2", text)  # "$ 5" -> "$5"
    text = re.sub(r"(\d)\s+%", r"\1%", text)  # "5 %" -> "5%"
    text = re.sub(r"[.$¢€£](\D|$)", r" \1", text)  # symbols not before a number
    text = re.sub(r"(^|\D)%", r"\1 ", text)  # % not after a number
    return " ".join(text.split())


@functools.cache
def _english_numbers():
    """Whisper's spoken-number rewriting, as transformers ships it (imported on first use: the
    CLI's quick paths never load transformers)."""
    from transformers.models.whisper.english_normalizer import EnglishNumberNormalizer

    return EnglishNumberNormalizer()


def _strip_symbols_and_diacritics(text: str) -> str:
    out = []
    for c in unicodedata.normalize("NFKD", text.translate(_EXTRA_FOLDS)):
        if c in _KEEP_IN_ENGLISH:
            out.append(c)
            continue
        cat = unicodedata.category(c)
        if cat == "Mn":
            # A diacritic is dropped ("café" -> "cafe").
            continue
        out.append(" " if cat[0] in "MSP" else c)
    return "".join(out)
