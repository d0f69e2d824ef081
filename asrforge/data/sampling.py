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
from dataclasses import dataclass, field

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


@dataclass
class ShardSampling:
    """``data.sampling`` for a streamed split: how many times each row appears in an epoch (its
    multiplicity), drawn from the languages' row counts per shard alone, so the stream keeps
    bounded memory, reads no audio up front and knows each epoch's length before it starts.

    A row of language ``l`` is expected ``rate_l = share_l * N / n_l`` times (``N`` rows kept by
    ``data.languages``, ``n_l`` of them in ``l``): ``floor(rate_l)`` copies each, and in each
    shard ``frac(rate_l) * n_{s,l}`` rows (rounded up with that remainder's probability) one
    more. Which rows get the extra copy is drawn per shard. Every draw is a pure function of
    (seed, epoch, shard), and a shard is a fixed range of the split's rows, so a row's
    multiplicity is one of (seed, epoch, its index). Unlike the whole reader's draw, a large
    language's rows are thinned independently per shard, not each once before any twice across
    epochs.
    """

    languages: list[str]
    """The languages drawn (sorted), those ``data.languages`` keeps; other rows appear 0 times."""
    counts: np.ndarray
    """(n_shards, n_languages) rows of each language in each shard."""
    rate: np.ndarray
    """(n_languages,) expected copies of a row of each language per epoch."""
    seed: int
    # (epoch, _extra(epoch)): every shard of a block and every step's epoch length reads it.
    _last: tuple[int, np.ndarray] | None = field(default=None, repr=False)

    @classmethod
    def of(
        cls, shard_counts: list[Counter], keep: set[str] | None, cfg: SamplingConfig, seed: int
    ) -> ShardSampling:
        """The draw for shards whose rows per language are ``shard_counts``; ``keep`` is
        ``data.languages``' codes (None: all).

        Raises:
            UserError: ``cfg.weights`` misses a kept language, or weighs them all 0.
        """
        totals = sum(shard_counts, Counter())
        kept = {lang: n for lang, n in totals.items() if n and (keep is None or lang in keep)}
        if not kept:  # nothing to draw from; setup reports the empty split by name
            return cls([], np.zeros((len(shard_counts), 0), np.int64), np.zeros(0), seed)
        shares = language_shares(kept, cfg)
        n = sum(kept.values())
        languages = sorted(kept)
        counts = np.asarray(
            [[c.get(lang, 0) for lang in languages] for c in shard_counts], dtype=np.int64
        ).reshape(len(shard_counts), len(languages))
        rate = np.asarray([shares[lang] * n / kept[lang] for lang in languages])
        log.info(
            "data.sampling: per streamed epoch of about %d rows, %s",
            n,
            ", ".join(
                f"{lang} {100 * shares[lang]:.1f}% (has {100 * kept[lang] / n:.1f}%, each row "
                f"{r:.2f} times)"
                for lang, r in zip(languages, rate, strict=True)
            ),  # fmt: skip
        )
        return cls(languages, counts, rate, seed)

    def _extra(self, epoch: int) -> np.ndarray:
        """(n_shards, n_languages) rows of each language in each shard with one more copy."""
        if self._last is not None and self._last[0] == epoch:
            return self._last[1]
        exact = self.counts * (self.rate - np.floor(self.rate))
        whole = np.floor(exact)
        u = np.random.default_rng([_SALT, self.seed, epoch]).random(exact.shape)
        extra = (whole + (u < exact - whole)).astype(np.int64)
        self._last = (epoch, extra)
        return extra

    def shard_rows(self, epoch: int) -> np.ndarray:
        """(n_shards,) rows each shard contributes to ``epoch``, copies counted."""
        base = self.counts * np.floor(self.rate).astype(np.int64)
        return (base + self._extra(epoch)).sum(axis=1)

    def multiplicity(self, epoch: int, shard: int, row_languages: np.ndarray) -> np.ndarray:
        """(rows,) how many times each row of shard ``shard`` appears in ``epoch``, given each
        row's language code (``row_languages``, a numpy array of str).

        Raises:
            UserError: the shard's languages are not the ones counted when the run started.
        """
        extra = self._extra(epoch)[shard]
        rng = np.random.default_rng([_SALT, self.seed, epoch, shard])
        times = np.zeros(len(row_languages), dtype=np.int64)
        for k, lang in enumerate(self.languages):
            rows = np.flatnonzero(row_languages == lang)
            if len(rows) != self.counts[shard, k]:
                raise UserError(
                    f"data.sampling: shard {shard} of the training split has {len(rows)} rows of "
                    f"language {lang}, {self.counts[shard, k]} when the run started: the data "
                    "changed while training"
                )
            times[rows] = int(self.rate[k])
            times[rng.permutation(rows)[: extra[k]]] += 1
        return times
