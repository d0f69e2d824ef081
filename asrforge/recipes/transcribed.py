"""A bundle's transcripts made as ``asrforge transcribe`` makes them (the language detected among
the bundle's, never given), scored per language against references: what the demos report of
real use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from asrforge.text import normalize, wer

MAX_NEW_TOKENS = 96
"""Cap per 30 s window when the demos transcribe (a full window of speech holds about 80
tokens)."""


@dataclass
class Scores:
    """One language's transcripts of one set, scored against its references."""

    wer: float
    n: int
    detected: float
    """The share of recordings whose detected language is theirs."""
    hyps: list[str]


def score(bundle, audios: Sequence, refs: Sequence[str], languages: Sequence[str],
          batch_size: int, max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, Scores]:  # fmt: skip
    """Each language's WER of ``bundle``'s transcripts of ``audios`` (paths or encoded bytes)
    made as ``asrforge transcribe`` makes them, the language detected among the bundle's, each
    normalized as its reference's language; ``max_new_tokens`` per window."""
    results = bundle.recognize(list(audios), None, batch_size=batch_size,
                               max_new_tokens=max_new_tokens)  # fmt: skip
    by_language: dict[str, Scores] = {}
    for lang in dict.fromkeys(languages):
        mine = [k for k, x in enumerate(languages) if x == lang]
        r = [normalize(refs[k], lang) for k in mine]
        h = [normalize(results[k].text, lang) for k in mine]
        right = sum(results[k].language == lang for k in mine)
        by_language[lang] = Scores(float(wer(r, h)), len(mine), right / len(mine),
                                   [results[k].text for k in mine])  # fmt: skip
    return by_language
