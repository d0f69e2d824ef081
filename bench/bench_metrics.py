"""WER/CER: asrforge's ``wer``/``cer``/``edit_counts`` against jiwer 4 on one corpus.

Both sides read the same references and hypotheses: sentences of word-list words with random
substitutions, deletions and insertions (a seeded generator), short utterances (5-30 words) as
in evaluation and long ones (300-600 words) as in long-form scoring. Each side is timed over
``--repeats`` runs (median); the results must be equal, or the script exits 1.

    .venv/bin/python bench/bench_metrics.py [--utterances 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

import jiwer

from asrforge.text.metrics import cer, edit_counts, wer

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or "
    "one had by word but not what all were we when your can said there use an each which she do "
    "how their if will up other about out many then them these so some her would make like him "
    "into time has look two more write go see number no way could people my than first water"
).split()


def corpus(n: int, lo: int, hi: int, seed: int) -> tuple[list[str], list[str]]:
    """``n`` (reference, hypothesis) pairs of ``lo``..``hi`` words, about 15% of words edited."""
    rng = random.Random(seed)
    refs, hyps = [], []
    for _ in range(n):
        ref = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
        hyp = []
        for w in ref:
            r = rng.random()
            if r < 0.05:
                continue  # deletion
            hyp.append(rng.choice(WORDS) if r < 0.10 else w)
            if r > 0.95:
                hyp.append(rng.choice(WORDS))  # insertion
        refs.append(" ".join(ref))
        hyps.append(" ".join(hyp))
    return refs, hyps


def timed(fn: Callable[[], object], repeats: int) -> tuple[object, float]:
    """The result of ``fn`` and its median wall time over ``repeats`` calls."""
    times, result = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return result, statistics.median(times)


def compare(
    name: str, ours: Callable[[], object], peer: Callable[[], object], repeats: int
) -> bool:
    a, ta = timed(ours, repeats)
    b, tb = timed(peer, repeats)
    equal = abs(a - b) < 1e-9 if isinstance(a, float) else a == b
    print(
        f"{name:<34} asrforge {ta * 1e3:8.1f} ms  jiwer {tb * 1e3:8.1f} ms  "
        f"ratio {tb / ta:5.2f}x  {'equal' if equal else f'DIFFERENT: {a} vs {b}'}"
    )
    return equal


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--utterances", type=int, default=2000, help="short utterances (long: 1/20)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    short = corpus(args.utterances, 5, 30, seed=0)
    long = corpus(max(args.utterances // 20, 1), 300, 600, seed=1)

    def total_errors(refs: list[str], hyps: list[str], unit: str) -> int:
        return sum(edit_counts(r, h, unit).errors for r, h in zip(refs, hyps, strict=True))

    def jiwer_errors(refs: list[str], hyps: list[str], unit: str) -> int:
        out = (jiwer.process_words if unit == "word" else jiwer.process_characters)(refs, hyps)
        return out.substitutions + out.deletions + out.insertions

    ok = all(
        [
            compare(
                "wer, short utterances",
                lambda: wer(*short),
                lambda: jiwer.wer(*short),
                args.repeats,
            ),
            compare(
                "cer, short utterances",
                lambda: cer(*short),
                lambda: jiwer.cer(*short),
                args.repeats,
            ),
            compare(
                "wer, long utterances", lambda: wer(*long), lambda: jiwer.wer(*long), args.repeats
            ),
            compare(
                "edit counts (words), short",
                lambda: total_errors(*short, "word"),
                lambda: jiwer_errors(*short, "word"),
                args.repeats,
            ),
        ]
    )
    print(f"RESULT metrics utterances={args.utterances} equal={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
