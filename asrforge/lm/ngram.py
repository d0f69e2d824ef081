"""A word n-gram language model with interpolated modified Kneser–Ney smoothing, written and
read as ARPA text (what KenLM's ``lmplz`` writes and its ``kenlm`` module queries).

How it works: docs/decoding.md, "The n-gram LM's estimation and ARPA file (`lm/ngram.py`)".
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asrforge.config.units import short_repr
from asrforge.errors import CheckpointCorruptError
from asrforge.io.atomic import atomic_write_text
from asrforge.io.small_files import parse_json, read_text

log = logging.getLogger(__name__)

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
HEADER = "asrforge-lm "
"""Prefix of the ARPA file's first line, after ``# `` (KenLM skips only comment lines before
``\\data\\``; files written before that have none): the build facts as JSON."""
NORMALIZERS = ("english", "basic", "by-language")
"""The ``normalizer`` values the header may record: Whisper's English normalizer, the basic one,
or each language's own (:func:`asrforge.lm.build.normalizer_name` picks one)."""
ARPA_BYTES = 2 * 2**30
"""Largest ARPA file read: its n-grams are held as Python dicts, some ten times its size."""
FALLBACK_DISCOUNTS = (0.5, 1.0, 1.5)
"""KenLM's ``--discount_fallback`` defaults, for orders whose counts of counts give none."""
NEVER = -99.0
"""log10 probability ARPA files give ``<s>`` (never predicted)."""

Gram = tuple[str, ...]


@dataclass
class NGramLM:
    """An ARPA back-off model: ``probs[n - 1][gram]`` and ``backoffs[n - 1][gram]`` are the log10
    probability and back-off weight of each n-gram of order ``n``; ``meta`` the build facts."""

    order: int
    probs: list[dict[Gram, float]]
    backoffs: list[dict[Gram, float]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        """Unigram entries: the words, ``<s>``, ``</s>`` and ``<unk>``."""
        return len(self.probs[0])

    @property
    def normalizer(self) -> str | None:
        return self.meta.get("normalizer")

    def log10_prob(self, word: str, context: Sequence[str]) -> float:
        """log10 p(``word`` | ``context``) with ARPA back-off; ``context`` is the words before
        it, oldest first (``<s>`` first at a sentence's start); unknown words are ``<unk>``."""
        if (word,) not in self.probs[0]:
            word = UNK
        context = tuple(context)[max(0, len(context) - self.order + 1) :]
        weight = 0.0
        for start in range(len(context) + 1):
            h = context[start:]
            p = self.probs[len(h)].get((*h, word))
            if p is not None:
                return p + weight
            weight += self.backoffs[len(h) - 1].get(h, 0.0)
        raise AssertionError("unreachable: <unk> is always a unigram")

    def score_sentence(self, words: Sequence[str]) -> float:
        """log10 p of a whole sentence, ``</s>`` included."""
        context: list[str] = [BOS]
        total = 0.0
        for w in [*words, EOS]:
            total += self.log10_prob(w, context)
            context.append(w)
        return total


# ---------------------------------------------------------------------------------------------
# Estimation


def count_ngrams(sentences: Iterable[Sequence[str]], order: int) -> Counter:
    """Raw counts of the highest-order n-grams of the padded sentences (shorter ones at a
    sentence's start, where fewer words precede: ``<s> w1`` in a trigram model)."""
    counts: Counter = Counter()
    for words in sentences:
        padded = (BOS, *words, EOS)
        for i in range(1, len(padded)):
            counts[padded[max(0, i - order + 1) : i + 1]] += 1
    return counts


def adjusted_counts(top: Counter, order: int) -> list[dict[Gram, int]]:
    """Each order's counts: raw for the highest order and for n-grams starting with ``<s>``,
    continuation counts (distinct words before) for the others."""
    adjusted: list[dict[Gram, int]] = [dict() for _ in range(order)]
    for gram, c in top.items():
        adjusted[len(gram) - 1][gram] = c  # highest order, or short at a sentence start
    for n in range(order, 1, -1):
        left: dict[Gram, set[str]] = defaultdict(set)
        for gram in adjusted[n - 1]:
            left[gram[1:]].add(gram[0])
        for suffix, before in left.items():
            if suffix[0] != BOS:
                adjusted[n - 2][suffix] = len(before)
    return adjusted


def discounts(counts: Iterable[int]) -> tuple[float, float, float] | None:
    """Modified Kneser–Ney's ``(D1, D2, D3+)`` from one order's counts, or None when the counts
    of counts do not determine valid ones."""
    t = Counter(c for c in counts if c <= 4)
    if any(t[k] == 0 for k in (1, 2, 3, 4)):
        return None
    y = t[1] / (t[1] + 2 * t[2])
    d = tuple(k - (k + 1) * y * t[k + 1] / t[k] for k in (1, 2, 3))
    if not all(0 < dk <= k for k, dk in zip((1, 2, 3), d, strict=True)):
        return None
    return d  # type: ignore[return-value]


def estimate(
    sentences: Iterable[Sequence[str]],
    order: int,
    *,
    fixed_discounts: Sequence[tuple[float, float, float]] | None = None,
    meta: dict[str, Any] | None = None,
) -> NGramLM:
    """Estimate an interpolated modified Kneser–Ney model (see the module docstring).

    Args:
        sentences: each a list of words (normalized, no ``<s>``/``</s>``).
        order: the n of the n-gram, >= 1.
        fixed_discounts: ``(D1, D2, D3+)`` per order, lowest first, instead of estimated.
        meta: build facts recorded in the ARPA header.
    """
    if order < 1:
        raise ValueError(f"order: must be >= 1, got {order}")
    adjusted = adjusted_counts(count_ngrams(sentences, order), order)
    words = {g[-1] for g in adjusted[0]} - {BOS}
    vocab = sorted(words | {EOS, UNK})
    used: list[tuple[float, float, float]] = []
    probs: list[dict[Gram, float]] = [dict() for _ in range(order)]
    backoffs: list[dict[Gram, float]] = [dict() for _ in range(order)]
    # The order-0 distribution is uniform over the vocabulary.
    lower: dict[Gram, float] = {(w,): 1.0 / len(vocab) for w in vocab}
    for n in range(1, order + 1):
        counts = {g: c for g, c in adjusted[n - 1].items() if g[-1] != BOS}
        d = fixed_discounts[n - 1] if fixed_discounts else discounts(counts.values())
        if d is None:
            log.info("order %d: too few n-grams to estimate discounts; using %s", n,
                     FALLBACK_DISCOUNTS)  # fmt: skip
            d = FALLBACK_DISCOUNTS
        used.append(tuple(d))
        by_context: dict[Gram, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # total, N1, N2, N3+
        for g, c in counts.items():
            s = by_context[g[:-1]]
            s[0] += c
            s[min(c, 3)] += 1
        gamma = {h: (d[0] * s[1] + d[1] * s[2] + d[2] * s[3]) / s[0] for h, s in by_context.items()}
        current: dict[Gram, float] = {}
        if n == 1:  # every word of the vocabulary, seen or not (<unk>)
            counts = {(w,): counts.get((w,), 0) for w in vocab}
        for g, c in counts.items():
            h = g[:-1]
            total = by_context[h][0]
            own = max(c - d[min(c, 3) - 1], 0.0) / total if c else 0.0
            current[g] = own + gamma[h] * lower[g[1:] if n > 1 else g]
        for g, p in current.items():
            probs[n - 1][g] = math.log10(p)
        if n > 1:
            for h, gm in gamma.items():
                backoffs[n - 2][h] = math.log10(gm)
        lower = current
    probs[0][(BOS,)] = NEVER
    for h in backoffs[0]:  # every context is an entry of its order (e.g. <s> among unigrams)
        probs[0].setdefault(h, NEVER)
    for n in range(2, order):
        for h in backoffs[n - 1]:
            if h not in probs[n - 1]:
                raise AssertionError(f"context {h} is not an n-gram of its order")
    facts = {"order": order, "discounts": [list(d) for d in used], **(meta or {})}
    return NGramLM(order, probs, backoffs, facts)


# ---------------------------------------------------------------------------------------------
# ARPA


def write_arpa(lm: NGramLM, path: Path) -> None:
    """Write ``lm`` as ARPA text (the build facts on a first line; see the module docstring),
    atomically: complete or absent."""
    lines = ["# " + HEADER + json.dumps(lm.meta, sort_keys=True, ensure_ascii=False), ""]
    lines.append("\\data\\")
    lines += [f"ngram {n}={len(lm.probs[n - 1])}" for n in range(1, lm.order + 1)]
    for n in range(1, lm.order + 1):
        lines += ["", f"\\{n}-grams:"]
        for gram in sorted(lm.probs[n - 1]):
            entry = f"{lm.probs[n - 1][gram]:.7f}\t{' '.join(gram)}"
            bo = lm.backoffs[n - 1].get(gram)
            lines.append(entry if bo is None or n == lm.order else f"{entry}\t{bo:.7f}")
    lines += ["", "\\end\\", ""]
    atomic_write_text(Path(path), "\n".join(lines))


# str.isdigit() accepts digits such as "¹" that int() then refuses, and int() refuses thousands
# of digits; no file holds 10**18 n-grams.
_COUNT = re.compile(r"[0-9]{1,18}")


def _quoted(value: Any) -> str:
    """``value`` as an error quotes it: a line or a list of counts of a file may run to
    megabytes, and a message stays one readable line."""
    return short_repr(value, 120)


def _header_problem(meta: Any) -> str | None:
    """Why the asrforge-lm line's facts cannot be used, or None: an LM is fused by its languages
    and normalizer, so those must be what ``asrforge lm build`` writes."""
    if not isinstance(meta, dict):
        return f"not a JSON object, got {type(meta).__name__}"
    languages = meta.get("languages")
    if languages is not None and not (
        isinstance(languages, list) and all(isinstance(c, str) for c in languages)
    ):
        return f"languages must be a list of language codes, got {languages!r:.60}"
    normalizer = meta.get("normalizer")
    if normalizer is not None and normalizer not in NORMALIZERS:
        return f"normalizer must be one of {', '.join(NORMALIZERS)}, got {normalizer!r:.60}"
    return None


def read_arpa(path: Path) -> NGramLM:
    """Read an ARPA file (ours or any other writer's).

    Raises:
        CheckpointCorruptError: not a regular file or too large, or a malformed file (a
            non-finite number, header facts asrforge cannot use included), naming the line and
            what is wrong.
    """
    path = Path(path)
    try:
        text = read_text(path, ARPA_BYTES)
    except OSError as e:
        raise CheckpointCorruptError(f"{path}: not a readable ARPA file ({e.strerror})") from None
    except ValueError as e:
        raise CheckpointCorruptError(f"{path}: not a readable ARPA file ({e})") from None
    lines = text.splitlines()
    meta: dict[str, Any] = {}

    def bad(i: int, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{path}: line {i + 1}: {what}")

    i = 0
    while i < len(lines) and lines[i].strip() != "\\data\\":
        facts = lines[i].removeprefix("# ")
        if facts.startswith(HEADER):
            try:
                meta = parse_json(facts[len(HEADER) :])
            except ValueError as e:
                raise bad(i, f"the asrforge-lm line is {e}") from None
            if problem := _header_problem(meta):
                raise bad(i, f"the asrforge-lm line: {problem}")
        i += 1
    if i == len(lines):
        raise CheckpointCorruptError(f"{path}: not an ARPA file (no \\data\\ line)")
    sizes: list[int] = []
    i += 1
    while i < len(lines) and lines[i].startswith("ngram "):
        n, _, size = lines[i][6:].partition("=")
        counts = _COUNT.fullmatch(n.strip()) and _COUNT.fullmatch(size.strip())
        if not counts or int(n) != len(sizes) + 1:
            raise bad(i, f"expected 'ngram {len(sizes) + 1}=COUNT', got {_quoted(lines[i])}")
        sizes.append(int(size))
        i += 1
    if not sizes:
        raise CheckpointCorruptError(f"{path}: the \\data\\ section lists no n-gram counts")
    order = len(sizes)
    probs: list[dict[Gram, float]] = [dict() for _ in range(order)]
    backoffs: list[dict[Gram, float]] = [dict() for _ in range(order)]
    n = 0
    for j in range(i, len(lines)):
        line = lines[j].strip()
        if not line:
            continue
        if line == "\\end\\":
            break
        if line.startswith("\\") and line.endswith("-grams:"):
            n = int(line[1:-7]) if _COUNT.fullmatch(line[1:-7]) else -1
            if not 1 <= n <= order:
                raise bad(j, f"an unexpected section {_quoted(line)}")
            continue
        parts = line.split("\t") if "\t" in line else line.split()
        if n == 0 or len(parts) < 2:
            raise bad(j, f"not an n-gram entry: {_quoted(line)}")
        try:
            p = float(parts[0])
            gram = tuple(parts[1].split()) if "\t" in line else tuple(parts[1 : 1 + n])
            rest = parts[2:] if "\t" in line else parts[1 + n :]
            bo = float(rest[0]) if rest else None
        except ValueError:
            raise bad(j, f"not a number in {_quoted(line)}") from None
        # float() reads nan and inf, which would turn every beam's score into nan
        if not (math.isfinite(p) and (bo is None or math.isfinite(bo))):
            what = "a log-probability or back-off that is not a finite number"
            raise bad(j, f"{what}: {_quoted(line)}")
        if len(gram) != n:
            raise bad(j, f"{len(gram)} words in the {n}-grams section")
        probs[n - 1][gram] = p
        if bo is not None:
            backoffs[n - 1][gram] = bo
    else:
        raise CheckpointCorruptError(f"{path}: truncated (no \\end\\ line)")
    got = [len(p) for p in probs]
    if got != sizes:
        # the first order that differs: a file may announce thousands of orders
        n = next(k for k in range(order) if got[k] != sizes[k]) + 1
        raise CheckpointCorruptError(
            f"{path}: the \\data\\ section announces {sizes[n - 1]} {n}-grams, the file holds "
            f"{got[n - 1]}"
        )
    if (UNK,) not in probs[0]:
        raise CheckpointCorruptError(f"{path}: no <unk> unigram (a closed vocabulary)")
    return NGramLM(order, probs, backoffs, meta)
