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
import unicodedata
from collections import Counter
from functools import lru_cache

from asrforge.errors import UserError

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

# Languages written without spaces between words: their words are joined with no separator.
_UNSPACED = {"zh", "ja"}
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
    if language in _UNSPACED:
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
