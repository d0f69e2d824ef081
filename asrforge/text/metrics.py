"""Word and character error rates over a corpus, equal to jiwer 4's on the strings as given.

An error rate is corpus-level: total edits (substitutions + deletions + insertions, a minimum
Levenshtein alignment per utterance) over total reference units. Units are:

* words: ``text.split()``, i.e. maximal runs of non-whitespace (any Unicode whitespace
  separates words). jiwer 4 collapses runs of two or more whitespace characters into one space,
  strips, and splits on ``" "`` only, so it would read ``"a\\tb"`` as one word; on text whose
  single separators are spaces (all normalized text) the two agree exactly.
* characters: the code points of ``text.strip()``, inner spaces included and not collapsed,
  exactly as jiwer 4's ``cer``. No Unicode normalization is applied here (see
  :func:`asrforge.text.normalize`).

Empty references: an utterance whose reference has no units contributes its hypothesis units as
insertions (as in jiwer). A corpus with no reference units at all has error rate 0.0 when the
hypotheses are empty too, and ``inf`` when they are not (errors over zero units; jiwer returns
the bare insertion count there, which is not a rate). ``inf`` compares as worse than any score,
so a selection policy never prefers such an evaluation.

jiwer is only a test dependency: the distance is computed here, with the bit-parallel algorithm
of Myers (1999) in Hyyrö's formulation (one pass of integer operations per hypothesis unit).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from typing import Literal, NamedTuple

from asrforge.text.normalizers import normalize
from asrforge.text.scripts import is_unspaced, primary_metric

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

    Among the minimum alignments, the one found by preferring substitution, then deletion, then
    insertion when tracing back; the total ``errors`` does not depend on that choice.
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


# ---------------------------------------------------------------------------------------------


def _error_rate(refs: str | Sequence[str], hyps: str | Sequence[str], unit: Unit) -> float:
    refs = [refs] if isinstance(refs, str) else list(refs)
    hyps = [hyps] if isinstance(hyps, str) else list(hyps)
    if len(refs) != len(hyps):
        raise ValueError(f"got {len(refs)} references but {len(hyps)} hypotheses")
    errors = n_ref = 0
    for ref, hyp in zip(refs, hyps, strict=True):
        a, b = split_units(ref, unit), split_units(hyp, unit)
        errors += _distance(a, b)
        n_ref += len(a)
    return _rate(errors, n_ref)


def _rate(errors: int, n_ref: int) -> float:
    if n_ref == 0:
        return 0.0 if errors == 0 else math.inf
    return errors / n_ref


def _trim(a: Sequence[Hashable], b: Sequence[Hashable]) -> tuple[Sequence, Sequence]:
    """Drop the common prefix and suffix (always matched by some minimum alignment)."""
    start = 0
    end_a, end_b = len(a), len(b)
    while start < end_a and start < end_b and a[start] == b[start]:
        start += 1
    while end_a > start and end_b > start and a[end_a - 1] == b[end_b - 1]:
        end_a -= 1
        end_b -= 1
    return a[start:end_a], b[start:end_b]


def _distance(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Levenshtein distance (unit costs) between two sequences of hashable units."""
    a, b = _trim(a, b)
    if len(a) < len(b):
        a, b = b, a  # the longer one becomes the bit vector: fewer Python-level iterations
    m = len(a)
    if not b:
        return m
    # Bit i of peq[u] is set where a[i] == u. Vertical deltas of the DP column are kept as
    # bit vectors pv (+1) and mv (-1); ``score`` tracks the bottom cell D[m][j].
    peq: dict[Hashable, int] = {}
    for i, u in enumerate(a):
        peq[u] = peq.get(u, 0) | (1 << i)
    full = (1 << m) - 1
    top = 1 << (m - 1)
    pv, mv, score = full, 0, m
    for u in b:
        eq = peq.get(u, 0)
        xv = eq | mv
        xh = (((eq & pv) + pv) ^ pv) | eq
        ph = mv | (~(xh | pv) & full)
        mh = pv & xh
        if ph & top:
            score += 1
        elif mh & top:
            score -= 1
        ph = (ph << 1) | 1  # D[0][j] = j: the top row always rises by one
        mh <<= 1
        pv = (mh | ~(xv | ph)) & full
        mv = ph & xv & full
    return score


def _alignment_counts(a: Sequence[Hashable], b: Sequence[Hashable]) -> tuple[int, int, int]:
    """(substitutions, deletions, insertions) of a minimum alignment of ``b`` to ``a``."""
    a, b = _trim(a, b)
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return 0, n, m
    rows = [list(range(m + 1))]
    for i in range(1, n + 1):
        prev, cur, ai = rows[-1], [i] * (m + 1), a[i - 1]
        for j in range(1, m + 1):
            cur[j] = min(prev[j - 1] + (ai != b[j - 1]), prev[j] + 1, cur[j - 1] + 1)
        rows.append(cur)
    subs = dels = ins = 0
    i, j = n, m
    while i > 0 or j > 0:
        d = rows[i][j]
        if i > 0 and j > 0 and d == rows[i - 1][j - 1] + (a[i - 1] != b[j - 1]):
            subs += a[i - 1] != b[j - 1]
            i, j = i - 1, j - 1
        elif i > 0 and d == rows[i - 1][j] + 1:
            dels += 1
            i -= 1
        else:
            ins += 1
            j -= 1
    return subs, dels, ins
