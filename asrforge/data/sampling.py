"""Language sampling (``data.sampling``): each epoch's utterances drawn by language, at shares
given by per-language weights or by a temperature over the languages' sizes (as multilingual
pretraining balances its languages), instead of each utterance once.

An epoch keeps the training set's length: language ``l`` gets ``share_l * n`` places (largest
remainders), filled from its utterances in whole permutations then part of one more (each once
before any twice, so a small language is repeated and a large one thinned), and the places are
shuffled together. The order is a pure function of (seed, epoch), so resume at batch ``k``
replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np

from asrforge.config import SamplingConfig
from asrforge.data.prepare import UtteranceTable
from asrforge.data.replay import ReplayUtterances
from asrforge.errors import UserError

log = logging.getLogger(__name__)

# "SMPL" in ASCII keeps this stream apart from the run's other (seed, epoch) streams.
_SALT = 0x534D504C


def language_shares(counts: dict[str, int], cfg: SamplingConfig) -> dict[str, float]:
    """Each language's share of an epoch: its weight over the weights' sum (``weights``), or
    ``n_l ** (1 / temperature)`` over their sum (``temperature``: 1 keeps the sizes' shares, a
    larger one moves toward equal shares).

    Raises:
        UserError: ``weights`` misses a language of the training set, or leaves every one at 0.
    """
    if cfg.weights is not None:
        missing = sorted(set(counts) - set(cfg.weights))
        if missing:
            raise UserError(
                f"data.sampling.weights: no weight for language(s) {', '.join(missing)} of the "
                f"training set (it has {', '.join(sorted(counts))}): give each one a weight (0 "
                "leaves a language out)"
            )
        unused = sorted(set(cfg.weights) - set(counts))
        if unused:
            log.warning("data.sampling.weights: language(s) %s are not in the training set",
                        ", ".join(unused))  # fmt: skip
        raw = {lang: float(cfg.weights[lang]) for lang in counts}
    else:
        raw = {lang: n ** (1.0 / cfg.temperature) for lang, n in counts.items()}
    total = sum(raw.values())
    if total <= 0:
        raise UserError("data.sampling.weights: every language of the training set weighs 0")
    return {lang: w / total for lang, w in raw.items()}


def utterance_languages(utts) -> tuple[list[str], np.ndarray]:
    """The languages of ``utts`` and each utterance's index into them."""
    if isinstance(utts, UtteranceTable):
        return list(utts.languages), np.asarray(utts.language_index, dtype=np.int64)
    if isinstance(utts, ReplayUtterances):  # each part from its table's columns
        languages, train = utterance_languages(utts.train)
        replay_languages, replay = utterance_languages(utts.replay)
        codes = {lang: k for k, lang in enumerate(languages)}
        for lang in replay_languages:
            codes.setdefault(lang, len(codes))
        shift = np.asarray([codes[lang] for lang in replay_languages], dtype=np.int64)
        drawn = shift[replay[np.asarray(utts.picks, dtype=np.int64)]] if len(shift) else replay
        return list(codes), np.concatenate([train, drawn])
    codes: dict[str, int] = {}
    index = [codes.setdefault(u.language, len(codes)) for u in utts]
    return list(codes), np.asarray(index, dtype=np.int64)


@dataclass
class LanguageSampling:
    """The training utterances' languages and the shares each epoch draws them at."""

    languages: list[str]
    index: np.ndarray
    """(n,) each utterance's index into ``languages``."""
    shares: dict[str, float]
    seed: int

    @classmethod
    def of(cls, utts, cfg: SamplingConfig, seed: int) -> LanguageSampling:
        languages, index = utterance_languages(utts)
        present = np.bincount(index, minlength=len(languages))
        counts = {lang: int(present[k]) for k, lang in enumerate(languages) if present[k]}
        shares = language_shares(counts, cfg)
        n = len(index)
        log.info(
            "data.sampling: per epoch of %d utterances, %s",
            n,
            ", ".join(
                f"{lang} {100 * s:.1f}% (has {100 * counts[lang] / n:.1f}%)"
                for lang, s in sorted(shares.items())
            ),  # fmt: skip
        )
        return cls(languages, index, shares, seed)

    def counts(self) -> Counter:
        """Places of each language in an epoch (largest remainders; they add up to ``n``)."""
        n = len(self.index)
        exact = {lang: s * n for lang, s in self.shares.items()}
        places = {lang: int(x) for lang, x in exact.items()}
        by_remainder = sorted(exact, key=lambda lang: (-(exact[lang] - places[lang]), lang))
        for lang in by_remainder[: n - sum(places.values())]:
            places[lang] += 1
        return Counter(places)

    def order(self, epoch: int) -> np.ndarray:
        """(n,) the utterances of ``epoch`` in order: a pure function of (seed, epoch)."""
        rng = np.random.default_rng([_SALT, self.seed, epoch])
        drawn = []
        for lang, places in sorted(self.counts().items()):
            pool = np.flatnonzero(self.index == self.languages.index(lang))
            if not places or not len(pool):
                continue
            rounds = -(-places // len(pool))
            drawn.append(np.concatenate([rng.permutation(pool) for _ in range(rounds)])[:places])
        order = np.concatenate(drawn) if drawn else np.zeros(0, dtype=np.int64)
        return order[rng.permutation(len(order))]
