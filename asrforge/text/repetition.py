"""Repetition-trap diagnostics: hypotheses where greedy decoding looped.

How it works: docs/evaluation.md, "Repetition traps (`text/repetition.py`)".
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TypedDict


class RepetitionFlags(TypedDict):
    hit_cap: bool
    repetitive: bool
    rep_trap: bool
    rep_score: float


def repetition_score(units: Sequence[Hashable], ngram: int = 4) -> float:
    """Fraction of the ``ngram``-grams of ``units`` that occurred earlier in ``units``.

    0.0 for sequences shorter than ``ngram``.
    """
    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    total = len(units) - ngram + 1
    if total <= 0:
        return 0.0
    seen: set[tuple[Hashable, ...]] = set()
    repeated = 0
    for i in range(total):
        gram = tuple(units[i : i + ngram])
        if gram in seen:
            repeated += 1
        else:
            seen.add(gram)
    return repeated / total


def repetition_flags(
    hypothesis: str | Sequence[Hashable],
    n_tokens: int,
    max_new_tokens: int,
    *,
    ngram: int = 4,
    threshold: float = 0.5,
) -> RepetitionFlags:
    """Flags of one decoded hypothesis.

    Args:
        hypothesis: generated token ids (special and prompt tokens removed), or the decoded
            text (scored on whitespace words).
        n_tokens: tokens the decoder generated for this utterance.
        max_new_tokens: the generation cap (``eval.max_new_tokens``).
        ngram: n-gram length of the repetition score.
        threshold: ``rep_score`` at or above which the hypothesis is ``repetitive``.

    Returns:
        ``{"hit_cap", "repetitive", "rep_trap", "rep_score"}``.
    """
    units = hypothesis.split() if isinstance(hypothesis, str) else hypothesis
    score = repetition_score(units, ngram)
    hit_cap = n_tokens >= max_new_tokens
    repetitive = score >= threshold
    return {
        "hit_cap": hit_cap,
        "repetitive": repetitive,
        "rep_trap": hit_cap or repetitive,
        "rep_score": score,
    }


def summarize_flags(flags: Iterable[RepetitionFlags]) -> dict[str, float | int]:
    """Corpus counts and rates of :func:`repetition_flags` results.

    Returns:
        ``n``, ``rep_trap_count``, ``rep_trap_rate``, ``hit_cap_count``, ``hit_cap_rate``,
        ``repetitive_count``, ``repetitive_rate`` and ``mean_rep_score`` (rates are 0.0 for
        no utterances).
    """
    n = traps = caps = reps = 0
    score_sum = 0.0
    for f in flags:
        n += 1
        traps += f["rep_trap"]
        caps += f["hit_cap"]
        reps += f["repetitive"]
        score_sum += f["rep_score"]
    rate = (lambda k: k / n) if n else (lambda k: 0.0)
    return {
        "n": n,
        "rep_trap_count": traps,
        "rep_trap_rate": rate(traps),
        "hit_cap_count": caps,
        "hit_cap_rate": rate(caps),
        "repetitive_count": reps,
        "repetitive_rate": rate(reps),
        "mean_rep_score": rate(score_sum),
    }
