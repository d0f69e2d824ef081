"""Sentences for the synthetic speech corpus, drawn from the word lists ``wordfreq`` ships.

No text is downloaded and none is copied into the repository: each sentence is a random draw
of 4-10 frequent words of one language (``wordfreq.top_n_list``), deterministic per seed. The
draws are weighted by ``1 / sqrt(rank)``, flatter than the words' real (Zipf) frequencies, so
that sentences mix function words with content words instead of repeating "the of and". The
sentences mean nothing; they are speech material, not language.

Words are kept only when they are written wholly in the language's dominant script (found from
its word list), so English loanwords in a Russian list, digits and symbols are dropped; so are
one-letter words outside the most frequent few.
Japanese keeps kana-only words (espeak-ng does not read kanji).
"""

from __future__ import annotations

import math
import random
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from asrforge.errors import UserError
from asrforge.text.languages import UNSPACED_LANGUAGES

RULES_VERSION = 2
"""Bumped whenever a change here changes the sentences drawn for a seed."""
POOL_SIZE = 3000
"""Words per language to draw from (the most frequent, after filtering)."""
SINGLE_LETTER_RANK = 40
"""A one-letter word of a cased alphabet is kept only among this many most frequent words
(English "a" and "I", Spanish "y"); further down they are letters, units and clipped
contractions ("m", "s", "t") that espeak-ng spells out."""
MIN_WORDS, MAX_WORDS = 4, 10
"""Words per sentence (inclusive bounds)."""

_KANA = {"HIRAGANA", "KATAKANA"}


def wordfreq_languages() -> set[str]:
    """Language codes ``wordfreq`` has a word list for (never its English fallback)."""
    import wordfreq

    return set(wordfreq.available_languages())


def _script(ch: str) -> str:
    """The Unicode script of a letter, from its name: ``"LATIN"``, ``"CYRILLIC"``, ``"CJK"``..."""
    name = unicodedata.name(ch, "")
    return name.split(" ", 1)[0] if name else ""


def _is_word(word: str) -> bool:
    # letters and combining marks only (Devanagari vowel signs are marks, not letters)
    return bool(word) and all(unicodedata.category(c)[0] in "LM" for c in word)


@lru_cache(maxsize=64)
def word_pool(
    wordfreq_code: str, size: int = POOL_SIZE, kana_only: bool = False
) -> tuple[str, ...]:
    """The ``size`` most frequent usable words of a language, most frequent first.

    Args:
        wordfreq_code: a code of :func:`wordfreq_languages` (``"en"``, ``"nb"``, ``"zh"``...).
        size: how many words to keep.
        kana_only: keep only words written in hiragana/katakana (for Japanese).

    Raises:
        UserError: wordfreq has no list for the language, or too few usable words.
    """
    import wordfreq

    if wordfreq_code not in wordfreq_languages():
        raise UserError(f"wordfreq has no word list for {wordfreq_code!r}")
    words = [
        w
        for rank, w in enumerate(wordfreq.top_n_list(wordfreq_code, size * 4))
        if _is_word(w) and (len(w) > 1 or rank < SINGLE_LETTER_RANK or w.upper() == w.lower())
    ]
    if kana_only:
        allowed = _KANA
    else:
        counts = Counter(
            _script(c) for w in words[:500] for c in w if unicodedata.category(c)[0] == "L"
        )
        allowed = {counts.most_common(1)[0][0]} if counts else set()
    pool = [
        w
        for w in words
        if all(_script(c) in allowed for c in w if unicodedata.category(c)[0] == "L")
    ][:size]
    if len(pool) < 100:
        raise UserError(
            f"wordfreq's {wordfreq_code!r} list has only {len(pool)} words in script(s) "
            f"{sorted(allowed)}; too few to make sentences from"
        )
    return tuple(pool)


def make_sentence(
    pool: tuple[str, ...],
    rng: random.Random,
    language: str,
    min_words: int = MIN_WORDS,
    max_words: int = MAX_WORDS,
) -> str:
    """One sentence: ``min_words``..``max_words`` words of ``pool``, weighted by 1/sqrt(rank),
    no word twice in a row, capitalized, with a final full stop."""
    weights = _weights(len(pool))
    n = rng.randint(min_words, max_words)
    words: list[str] = []
    while len(words) < n:
        w = rng.choices(pool, cum_weights=weights)[0]
        if not words or w != words[-1]:
            words.append(w)
    # of the unspaced languages the corpus builds only Chinese and Japanese (corpus_languages)
    if language in UNSPACED_LANGUAGES:
        return "".join(words) + "。"
    text = " ".join(words)
    if language == "en":  # English writes the pronoun capitalized anywhere
        text = " ".join("I" if w == "i" else w for w in text.split())
    return text[0].upper() + text[1:] + "."


@lru_cache(maxsize=16)
def _weights(n: int) -> list[float]:
    cum, total = [], 0.0
    for rank in range(1, n + 1):
        total += 1.0 / math.sqrt(rank)
        cum.append(total)
    return cum


def make_sentences(
    pool: tuple[str, ...],
    n: int,
    language: str,
    seed: int,
    min_words: int = MIN_WORDS,
    max_words: int = MAX_WORDS,
    exclude: set[str] | None = None,
) -> list[str]:
    """``n`` distinct sentences (none in ``exclude``), deterministic for ``(language, seed)``.

    Raises:
        UserError: ``n`` distinct sentences cannot be drawn (a pool far too small).
    """
    rng = random.Random(f"asrforge-sentences/{language}/{seed}")
    seen = set(exclude or ())
    out: list[str] = []
    tries = 0
    while len(out) < n:
        s = make_sentence(pool, rng, language, min_words, max_words)
        tries += 1
        if s in seen:
            if tries > 20 * n + 100:
                raise UserError(f"{language}: cannot draw {n} distinct sentences")
            continue
        seen.add(s)
        out.append(s)
    return out


# ---------------------------------------------------------------------------------------------
# Natural sentences: Debian's fortune collections

FORTUNES_ROOT = Path("/usr/share/games/fortunes")
"""Where Debian's ``fortunes*`` packages install their collections."""
NATURAL_RULES_VERSION = 1
"""Bumped whenever a change here changes the natural sentences of a language."""


@dataclass(frozen=True)
class FortuneSource:
    """Where a language's fortune collections lie and which of them the corpus reads.

    Only the collections named are read (an allow list, by the files' names): the packages also
    hold ASCII art, program code, riddles in question/answer form, and collections unsuitable
    for a demo (the ``off/`` directories, and others about ethnic groups, sex, drugs and
    politics), none of which is read.
    """

    package: str
    """The Debian package that ships the collections."""
    collections: tuple[str, ...]
    """Paths under :data:`FORTUNES_ROOT`."""


FORTUNES: dict[str, FortuneSource] = {
    "en": FortuneSource("fortunes", (
        "cookie", "education", "food", "fortunes", "goedel", "humorists", "kids", "literature",
        "love", "magic", "miscellaneous", "paradoxum", "people", "pets", "platitudes", "science",
        "sports", "tao", "wisdom", "work",
    )),
    "de": FortuneSource("fortunes-de", tuple(f"de/{c}" for c in (
        "kinderzitate", "letzteworte", "lieberals", "mathematiker", "murphy", "regeln",
        "sprichworte", "sprichwortev", "sprueche", "tips", "wusstensie", "zitate",
    ))),
    "es": FortuneSource("fortunes-es", tuple(f"es/{c}.fortunes" for c in (
        "amistad", "arte", "asimov", "ciencia", "familia", "filosofia", "humanos", "lao-tse",
        "libertad", "proverbios", "refranes", "sabiduria", "sentimientos", "verdad", "vida",
    ))),
    "it": FortuneSource("fortunes-it", tuple(f"it/{c}" for c in (
        "adams", "definizioni", "formiche", "leggi",
    ))),
    "pl": FortuneSource("fortunes-pl", tuple(f"pl/{c}" for c in (
        "bajki", "dzieci", "milosc", "nauka", "puchatek", "sapkowski", "seneka", "zen",
    ))),
    "ru": FortuneSource("fortunes-ru", tuple(f"ru/{c}" for c in (
        "citates", "conscience", "education", "freewill", "friendship", "future", "happy",
        "innocence", "knowledge", "life", "success", "time", "truth", "wealth", "work",
    ))),
    "cs": FortuneSource("fortunes-cs", tuple(f"cs/{c}" for c in (
        "chesterton", "citace", "citat", "jerome", "murphy", "parkinson", "prislovi", "wikiquote",
    ))),
    "bg": FortuneSource("fortunes-bg", tuple(f"bg/{c}" for c in (
        "bgauthors", "bgproverb", "intauthors", "intproverb",
    ))),
    "pt": FortuneSource("fortunes-br", ("brasil",)),
    "zh": FortuneSource("fortunes-zh", ("chinese",)),
}  # fmt: skip
"""Languages with natural sentences, by Whisper code. Every other language draws its sentences
from word lists (:func:`make_sentences`)."""

# A sentence ends at . ! ? (or the CJK full stops) before a space and a capital, or at the end.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[^\W\d_])|(?<=[。！？])")
_END_MARKS = ".!?。！？"
_SHORT_LINE = 45
"""Characters: a line this short that ends without punctuation does not run on."""
_ABBREVIATIONS = {
    "mr",
    "mrs",
    "ms",
    "dr",
    "st",
    "jr",
    "sr",
    "vs",
    "etc",
    "prof",
    "gen",
    "col",
    "lt",
    "sgt",
    "mt",
    "inc",
    "co",
    "no",
    "sen",
    "rep",
    "gov",
    "rev",
    "hr",
    "fr",
}
"""Words a full stop ends without ending the sentence (their sentence is cut there)."""
_INNER_MARKS = ",;'-，、"
"""Punctuation a speakable sentence may hold besides its final mark: no quotes, brackets,
colons, digits or symbols, which espeak-ng would read out or a reference could not match."""


def fortunes_available(language: str) -> bool:
    """Whether the fortune collections of ``language`` (a Whisper code) are installed."""
    source = FORTUNES.get(language)
    return source is not None and any((FORTUNES_ROOT / c).is_file() for c in source.collections)


def natural_sentences(
    language: str,
    min_words: int = MIN_WORDS,
    max_words: int = 16,
    root: Path | None = None,
) -> list[str]:
    """Every distinct speakable sentence of ``language``'s fortune collections, in file order.

    A cookie's attribution lines (``-- Author``) are dropped; a line break ends a sentence when
    the line has no punctuation and the next one starts with a capital (titles and verse). A
    sentence is kept when it has ``min_words``..``max_words`` words (characters/4 for unspaced
    scripts), starts with a capital (cased scripts), ends with . ! or ?, holds only letters,
    spaces and ``, ; ' -``, no word of capitals only but "I" (acronyms, shouting), and no quote
    made of apostrophes. A file that is not UTF-8 is skipped.

    Raises:
        UserError: ``language`` has no fortune collections, or none of them is installed.
    """
    source = FORTUNES.get(language)
    if source is None:
        raise UserError(
            f"{language}: no fortune collections known for this language "
            f"(known: {', '.join(sorted(FORTUNES))})"
        )
    root = FORTUNES_ROOT if root is None else root
    paths = [root / c for c in source.collections if (root / c).is_file()]
    if not paths:
        raise UserError(
            f"{language}: the natural sentences come from Debian's {source.package} "
            f"package, which is not installed (no {root / source.collections[0]}): "
            f"`sudo apt-get install {source.package}`"
        )
    seen: set[str] = set()
    out: list[str] = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for cookie in re.split(r"\n%\n", text):
            for sentence in _cookie_sentences(cookie):
                if sentence not in seen and _speakable(sentence, language, min_words, max_words):
                    seen.add(sentence)
                    out.append(sentence)
    return out


def _cookie_sentences(cookie: str) -> list[str]:
    lines = [ln.strip() for ln in cookie.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("--")]
    blocks, current, previous = [], "", ""
    for line in lines:
        # wrapped prose fills its lines; a short line without punctuation is a title or verse
        if (
            current
            and len(previous) < _SHORT_LINE
            and previous[-1] not in _END_MARKS + _INNER_MARKS
        ):
            blocks.append(current)
            current = line
        else:
            sep = "" if current and _is_cjk(current[-1]) else " "
            current = f"{current}{sep}{line}" if current else line
        previous = line
    if current:
        blocks.append(current)
    return [
        s.strip() for b in blocks for s in _SENTENCE_END.split(" ".join(b.split())) if s.strip()
    ]


def _is_cjk(ch: str) -> bool:
    return _script(ch) in ("CJK", "HIRAGANA", "KATAKANA")


def _speakable(sentence: str, language: str, min_words: int, max_words: int) -> bool:
    if sentence[-1] not in _END_MARKS:
        return False
    body = sentence[:-1]
    if any(not (unicodedata.category(c)[0] in "LM" or c == " " or c in _INNER_MARKS) for c in body):
        return False
    if language in UNSPACED_LANGUAGES:
        if any(not _is_cjk(c) and c not in _INNER_MARKS for c in body):
            return False  # Latin words and spaces inside a Chinese sentence
        n_words = len(body) / 4  # about four characters a word, for the same length bounds
    else:
        words = body.replace(",", " ").replace(";", " ").split()
        n_words = len(words)
        if not words or len(words[-1]) == 1 or words[-1].lower() in _ABBREVIATIONS:
            return False  # cut at an initial or an abbreviation ("R. A. Heinlein", "Mr.")
        if not body[0].isupper() and body[0].lower() != body[0].upper():
            return False
        if any(len(w) > 1 and w.isupper() for w in words):
            return False
        if any(w.startswith(("'", "-")) or w.endswith("-") for w in words):
            return False
        if any(w.endswith("'") and not w.endswith("s'") for w in words):
            return False  # a closing quote, or Italian "e'" written for "è"
    return min_words <= n_words <= max_words
