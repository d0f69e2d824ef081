"""Word and character error rates over a corpus, equal to jiwer 4's on the strings as given.

How it works: docs/evaluation.md, "Word and character error rates (`text/metrics.py`)".
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Literal, NamedTuple

from rapidfuzz.distance import Levenshtein

from asrforge.text.languages import is_unspaced, primary_metric
from asrforge.text.normalizers import normalize

Unit = Literal["word", "char"]


class EditCounts(NamedTuple):
    """Edits of one minimum alignment of a hypothesis against its reference."""

    subs: int
    dels: int
    ins: int
    n_ref: int
    """Reference units (words or characters)."""

    @property
    def errors(self) -> int:
        return self.subs + self.dels + self.ins


def split_units(text: str, unit: Unit) -> list[str]:
    """The units an error rate counts: words (``text.split()``) or characters of
    ``text.strip()``."""
    if unit == "word":
        return text.split()
    if unit == "char":
        return list(text.strip())
    raise ValueError(f"unit must be 'word' or 'char', got {unit!r}")


def edit_counts(ref: str, hyp: str, unit: Unit = "word") -> EditCounts:
    """Substitutions, deletions and insertions that turn ``ref`` into ``hyp``, for one utterance.

    Among the minimum alignments, the one rapidfuzz's ``editops`` picks; the total ``errors``
    does not depend on that choice.
    """
    a, b = split_units(ref, unit), split_units(hyp, unit)
    subs, dels, ins = _alignment_counts(a, b)
    return EditCounts(subs, dels, ins, len(a))


def corpus_error_rate(counts: Iterable[EditCounts]) -> float:
    """Total errors over total reference units (0.0 or ``inf`` when there are no reference
    units; see the module docstring)."""
    errors = n_ref = 0
    for c in counts:
        errors += c.errors
        n_ref += c.n_ref
    return _rate(errors, n_ref)


def wer(refs: str | Sequence[str], hyps: str | Sequence[str]) -> float:
    """Corpus word error rate of ``hyps`` against ``refs`` (paired by position).

    Raises:
        ValueError: ``refs`` and ``hyps`` differ in length.
    """
    return _error_rate(refs, hyps, "word")


def cer(refs: str | Sequence[str], hyps: str | Sequence[str]) -> float:
    """Corpus character error rate of ``hyps`` against ``refs`` (paired by position).

    Raises:
        ValueError: ``refs`` and ``hyps`` differ in length.
    """
    return _error_rate(refs, hyps, "char")


def error_rates(
    refs: Sequence[str], hyps: Sequence[str], language: str, *, normalized: bool = False
) -> dict[str, float | str | bool]:
    """WER and CER of one language's utterances the way this project reports them.

    Both sides are normalized with :func:`normalize` (unless ``normalized``). For scripts
    without spaces between words (:func:`is_unspaced`), CER ignores whitespace, since spaces
    there mark phrases, not words, and are placed inconsistently; WER is still computed but
    flagged unreliable.

    Returns:
        ``{"wer": float, "cer": float, "primary_metric": "wer" | "cer", "wer_reliable": bool}``.

    Raises:
        UserError: the language is unknown.
        ValueError: ``refs`` and ``hyps`` differ in length.
    """
    if not normalized:
        refs = [normalize(r, language) for r in refs]
        hyps = [normalize(h, language) for h in hyps]
    unspaced = is_unspaced(language)
    if unspaced:
        char_refs = ["".join(r.split()) for r in refs]
        char_hyps = ["".join(h.split()) for h in hyps]
    else:
        char_refs, char_hyps = list(refs), list(hyps)
    return {
        "wer": wer(refs, hyps),
        "cer": cer(char_refs, char_hyps),
        "primary_metric": primary_metric(language),
        "wer_reliable": not unspaced,
    }


def strict_json_metrics(value):
    """``value`` (metrics: a number, or a dict of them, nested) with NaN and infinities as None:
    strict JSON has no token for them."""
    if isinstance(value, dict):
        return {k: strict_json_metrics(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# ---------------------------------------------------------------------------------------------


def _error_rate(refs: str | Sequence[str], hyps: str | Sequence[str], unit: Unit) -> float:
    refs = [refs] if isinstance(refs, str) else list(refs)
    hyps = [hyps] if isinstance(hyps, str) else list(hyps)
    if len(refs) != len(hyps):
        raise ValueError(f"got {len(refs)} references but {len(hyps)} hypotheses")
    errors = n_ref = 0
    for ref, hyp in zip(refs, hyps, strict=True):
        a, b = split_units(ref, unit), split_units(hyp, unit)
        errors += Levenshtein.distance(a, b)
        n_ref += len(a)
    return _rate(errors, n_ref)


def _rate(errors: int, n_ref: int) -> float:
    if n_ref == 0:
        return 0.0 if errors == 0 else math.inf
    return errors / n_ref


def _alignment_counts(a: Sequence[Hashable], b: Sequence[Hashable]) -> tuple[int, int, int]:
    """(substitutions, deletions, insertions) of a minimum alignment of ``b`` to ``a``."""
    ops = Counter(op.tag for op in Levenshtein.editops(a, b))
    return ops["replace"], ops["delete"], ops["insert"]
