"""Packed training windows: several utterances of one language per window, as Whisper trains.

How it works: docs/data.md, "Packed windows (`data/packing.py`)".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.utils.data import Dataset

from asrforge.config import PackConfig
from asrforge.data.audio import SAMPLE_RATE, open_audio
from asrforge.data.augment import AugmentError
from asrforge.data.dataset import SpeechDataset
from asrforge.data.prepare import UtteranceTable
from asrforge.data.replay import ReplayUtterances
from asrforge.data.sampling import LanguageSampling
from asrforge.data.targets import (
    Segment,
    TimestampTokens,
    decoder_sequences,
    previous_text,
    window_targets,
)
from asrforge.errors import UserError

log = logging.getLogger(__name__)

# "PACK" in ASCII keeps this stream apart from the other (seed, epoch) streams.
_SALT = 0x5041434B
LENGTH_SLACK = SAMPLE_RATE // 20
"""Samples a decoded clip may exceed the length its window was laid out by (0.05 s: durations
rounded in the data); a clip longer than that is dropped from the window, not cut."""
LONGER_THAN_DURATION = "audio longer than its duration"
OPEN_WINDOWS = 4
"""Windows of a language kept open at once: an utterance goes into the first that has room for
it, so a long one does not close a window a short one could still fill."""


@dataclass(frozen=True)
class Piece:
    """One utterance placed in a window."""

    utt: int
    """Index into the training utterances."""
    offset: int
    """First sample in the window (16 kHz)."""
    n_samples: int


@dataclass(frozen=True)
class Window:
    """One training window: its utterances in order, and how its targets are written."""

    pieces: tuple[Piece, ...]
    timestamps: bool
    """Timestamp mode: no ``<|notimestamps|>``, each utterance between its time tokens."""
    prev: tuple[int, ...] = ()
    """Utterances whose joined transcript is the previous text (empty: none)."""

    @property
    def n_samples(self) -> int:
        last = self.pieces[-1]
        return last.offset + last.n_samples

    @property
    def alone(self) -> bool:
        """A single utterance at offset 0: its audio is exactly the utterance's own window."""
        return len(self.pieces) == 1 and self.pieces[0].offset == 0


@dataclass(frozen=True)
class PackItems:
    """What composition needs of each utterance (index-aligned lists)."""

    languages: Sequence[str]
    n_samples: Sequence[int]
    n_text_tokens: Sequence[int]
    prompt_lengths: Sequence[int]
    """Forced prompt in text mode, ``<|notimestamps|>`` included."""

    @classmethod
    def of(cls, utts, augment=None, epoch: int = 0) -> PackItems:
        """From the training utterances (an ``UtteranceTable`` checked in full: its columns, no
        pass over the rows); with an :class:`~asrforge.data.augment.Augmenter`, their lengths
        after this epoch's speed perturbation."""
        if isinstance(utts, UtteranceTable):
            return cls.of_table(utts, augment, epoch)
        if isinstance(utts, ReplayUtterances):
            return cls.of_replay(utts, augment, epoch)
        n_samples = [round(u.seconds * SAMPLE_RATE) for u in utts]
        if augment is not None:
            n_samples = [
                augment.n_samples(u.uid, epoch, n) for u, n in zip(utts, n_samples, strict=True)
            ]
        return cls(
            languages=[u.language for u in utts],
            n_samples=n_samples,
            n_text_tokens=[len(u.text_ids) for u in utts],
            prompt_lengths=[len(u.prompt) for u in utts],
        )

    @classmethod
    def of_replay(cls, utts: ReplayUtterances, augment=None, epoch: int = 0) -> PackItems:
        """The training utterances' items, then the drawn replay utterances', each from its
        table's columns (no pass over the rows); speed perturbation keyed by the ids the data
        set gives them."""
        train = cls.of(utts.train, augment, epoch)
        replay = cls.of(utts.replay).drawn(utts.picks)
        n_samples = list(replay.n_samples)
        if augment is not None:
            uids = utts.replay_uids()
            n_samples = [
                augment.n_samples(uid, epoch, n) for uid, n in zip(uids, n_samples, strict=True)
            ]
        return cls(
            languages=[*train.languages, *replay.languages],
            n_samples=[*train.n_samples, *n_samples],
            n_text_tokens=[*train.n_text_tokens, *replay.n_text_tokens],
            prompt_lengths=[*train.prompt_lengths, *replay.prompt_lengths],
        )

    def drawn(self, order: np.ndarray) -> PackItems:
        """The items at the places of ``order`` (utterance indices, repeats allowed)."""
        at = order.tolist()
        return PackItems(
            languages=[self.languages[i] for i in at],
            n_samples=[self.n_samples[i] for i in at],
            n_text_tokens=[self.n_text_tokens[i] for i in at],
            prompt_lengths=[self.prompt_lengths[i] for i in at],
        )

    @classmethod
    def of_table(cls, table: UtteranceTable, augment=None, epoch: int = 0) -> PackItems:
        if table.n_tokens is None:
            raise ValueError("packing needs a table checked in full (prepare_split(lazy=False))")
        n_samples = np.round(table.seconds * SAMPLE_RATE).astype(np.int64).tolist()
        if augment is not None:
            n_samples = [augment.n_samples(uid, epoch, n)
                         for uid, n in zip(table.uids(), n_samples, strict=True)]  # fmt: skip
        return cls(
            languages=[table.languages[k] for k in table.language_index.tolist()],
            n_samples=n_samples,
            n_text_tokens=table.n_tokens.tolist(),
            prompt_lengths=table.prompt_lengths().tolist(),
        )


@dataclass
class PackStats:
    """What one epoch's composition made."""

    utterances: int = 0
    windows: int = 0
    packed: int = 0
    """Windows holding more than one utterance."""
    timestamp_windows: int = 0
    prev_windows: int = 0
    timestamp_fallbacks: int = 0
    """Windows drawn for timestamp mode whose tokens did not fit the decoder: text mode."""
    speech_samples: int = 0
    window_samples: int = 0

    def line(self) -> str:
        fill = self.speech_samples / self.window_samples if self.window_samples else 0.0
        text = (
            f"{self.utterances} utterances in {self.windows} windows "
            f"({self.utterances / max(1, self.windows):.2f} per window, {self.packed} packed, "
            f"{fill:.0%} of the audio is speech); timestamp mode {self.timestamp_windows}, "
            f"previous text {self.prev_windows}"
        )
        if self.timestamp_fallbacks:
            text += (
                f"; {self.timestamp_fallbacks} windows drawn for timestamp mode had too many "
                "tokens for the decoder and train in text mode"
            )
        return text


def positions(prompt_length: int, text_tokens: Sequence[int], timestamps: bool) -> int:
    """Decoder positions a window needs, counted as ``prepare_split`` counts them (prompt +
    targets + end of text)."""
    if timestamps:  # no <|notimestamps|>, two time tokens per utterance
        return prompt_length - 1 + sum(text_tokens) + 2 * len(text_tokens) + 1
    return prompt_length + sum(text_tokens) + 1


def prev_room(max_positions: int, used: int) -> int:
    """Positions the previous text may take (``<|startofprev|>`` included): what the window
    leaves, at most half the decoder's positions, as Whisper caps it."""
    return min(max_positions // 2, max_positions - used)


@dataclass
class _Open:
    """A window being filled."""

    language: str
    timestamps: bool
    pieces: list[Piece] = field(default_factory=list)

    @property
    def end(self) -> int:
        last = self.pieces[-1]
        return last.offset + last.n_samples


def compose_windows(
    items: PackItems,
    cfg: PackConfig,
    *,
    max_samples: int,
    max_positions: int,
    seed: int,
    epoch: int,
    timestamps: bool,
) -> tuple[list[Window], PackStats]:
    """Lay out one epoch's utterances into windows: a pure function of its arguments.

    Utterances are visited in a (seed, epoch) permutation. Each goes, after a gap, into the first
    of its language's open windows it fits (``max_samples``, ``max_positions``), or else starts
    a new window: with probability ``cfg.single_share`` one that holds it alone at offset 0,
    otherwise an open one (closing the oldest when more than ``OPEN_WINDOWS`` are open). So
    about ``cfg.single_share`` of the windows are single utterances.

    Args:
        max_samples: the window's length in samples (16 kHz).
        max_positions: the decoder's positions (``max_target_positions``).
        timestamps: timestamp mode is possible (the tokenizer has timestamp tokens).

    Returns:
        The windows (every utterance in exactly one) and what was made.
    """
    rng = np.random.default_rng([_SALT, seed, epoch])
    lo, hi = (round(s * SAMPLE_RATE) for s in cfg.gap_seconds)
    stats = PackStats(utterances=len(items.languages))
    windows: list[Window] = []
    open_windows: dict[str, list[_Open]] = {}

    def draw_mode() -> bool:
        # Drawn even when timestamps are impossible, so that the layout stays put.
        draw = rng.random()
        return timestamps and draw < cfg.timestamp_share

    def tokens_fit(utts: list[int], stamps: bool) -> bool:
        tokens = [items.n_text_tokens[u] for u in utts]
        return positions(items.prompt_lengths[utts[0]], tokens, stamps) <= max_positions

    def fits(w: _Open, extra: int, offset: int) -> bool:
        utts = [p.utt for p in w.pieces] + [extra]
        return offset + items.n_samples[extra] <= max_samples and tokens_fit(utts, w.timestamps)

    def close(w: _Open) -> None:
        # only a window opened in timestamp mode can be over: what joined it was checked
        if w.timestamps and not tokens_fit([p.utt for p in w.pieces], True):
            w.timestamps = False
            stats.timestamp_fallbacks += 1
        windows.append(Window(tuple(w.pieces), w.timestamps))

    for i in rng.permutation(len(items.languages)).tolist():
        lang, n = items.languages[i], items.n_samples[i]
        gap = int(rng.integers(lo, hi + 1))
        candidates = open_windows.setdefault(lang, [])
        target = next((w for w in candidates if fits(w, i, w.end + gap)), None)
        if target is not None:  # first fit among the language's open windows
            target.pieces.append(Piece(i, target.end + gap, n))
            continue
        if rng.random() < cfg.single_share:  # of the windows opened, this share stays single
            close(_Open(lang, draw_mode(), [Piece(i, 0, n)]))
            continue
        start = gap if gap + n <= max_samples else 0
        candidates.append(_Open(lang, draw_mode(), [Piece(i, start, n)]))
        if len(candidates) > OPEN_WINDOWS:
            close(candidates.pop(0))
    for candidates in open_windows.values():
        for w in candidates:
            close(w)
    windows = _with_previous_text(windows, items, cfg, max_positions, seed, epoch)

    for w in windows:
        stats.windows += 1
        stats.packed += len(w.pieces) > 1
        stats.timestamp_windows += w.timestamps
        stats.prev_windows += bool(w.prev)
        stats.speech_samples += sum(p.n_samples for p in w.pieces)
        stats.window_samples += max_samples
    return windows, stats


def _with_previous_text(
    windows: list[Window],
    items: PackItems,
    cfg: PackConfig,
    max_positions: int,
    seed: int,
    epoch: int,
) -> list[Window]:
    """Give a ``cfg.prev_text_share`` of windows the utterances of the window before them of
    the same language (in composition order) as previous text, where any of it fits."""
    rng = np.random.default_rng([_SALT, seed, epoch, 1])
    last: dict[str, tuple[int, ...]] = {}
    out = []
    for w in windows:
        first = w.pieces[0].utt
        lang = items.languages[first]
        tokens = [items.n_text_tokens[p.utt] for p in w.pieces]
        used = positions(items.prompt_lengths[first], tokens, w.timestamps)
        if (
            rng.random() < cfg.prev_text_share
            and lang in last
            and prev_room(max_positions, used) >= 2
        ):
            w = replace(w, prev=last[lang])
        last[lang] = tuple(p.utt for p in w.pieces)
        out.append(w)
    return out


class PackedWindows(Dataset):
    """One epoch's windows over a ``SpeechDataset``'s utterances, as items of the same form
    (``input_features: (n_mels, n_frames)``, ``decoder_input_ids``, ``labels``, ...).

    A window holding one utterance at offset 0 reads the log-mel cache when there is one (it is
    that utterance's own window); other windows are assembled from audio. A clip that fails to
    decode leaves silence in its place and is reported in ``dropped_parts``; a window none of
    whose clips decodes is ``{"dropped": ...}`` like a failed single clip.
    """

    def __init__(
        self,
        base: SpeechDataset,
        windows: list[Window],
        *,
        no_timestamps: int,
        start_of_prev: int | None,
        timestamps: TimestampTokens | None,
        max_positions: int,
    ):
        self.base = base
        self.windows = windows
        self.no_timestamps = no_timestamps
        self.start_of_prev = start_of_prev
        self.timestamps = timestamps
        self.max_positions = max_positions

    def __len__(self) -> int:
        return len(self.windows)

    def sequences(
        self, w: Window, missing: frozenset[int] = frozenset()
    ) -> tuple[list[int], list[int]]:
        """``(decoder_input_ids, labels)`` of window ``w``; utterances in ``missing`` (failed to
        decode) are left out of the targets."""
        utts = self.base.utts
        prompt = list(utts[w.pieces[0].utt].prompt)
        stamps = self.timestamps if w.timestamps else None
        if stamps is not None:
            prompt = [t for t in prompt if t != self.no_timestamps]
        segments = [
            Segment(
                utts[p.utt].text_ids, p.offset / SAMPLE_RATE, (p.offset + p.n_samples) / SAMPLE_RATE
            )
            for p in w.pieces
            if p.utt not in missing
        ]
        targets = window_targets(segments, stamps)
        prev: list[int] = []
        if w.prev and self.start_of_prev is not None:
            used = len(prompt) + len(targets) + 1
            text = [t for u in w.prev for t in utts[u].text_ids]
            prev = previous_text(self.start_of_prev, text, prev_room(self.max_positions, used))
        return decoder_sequences(prompt, targets, self.base.eot, prev, self.base.language_after)

    def _waveform(self, w: Window) -> tuple[np.ndarray, dict[int, str]]:
        """The window's samples (silence between utterances) and the utterances that failed,
        with the skip report's reason."""
        wave = np.zeros(w.n_samples, dtype=np.float32)
        failed: dict[int, str] = {}
        base, aug = self.base, self.base.augment
        augmenting = aug is not None and aug.changes_audio
        for p in w.pieces:
            u = base.utts[p.utt]
            audio = base.split[u.row]["audio"]
            try:
                # A clip whose header says it is longer than its planned span is never decoded.
                with open_audio(audio.get("bytes") or audio.get("path")) as opened:
                    n = round(opened.seconds * SAMPLE_RATE)
                    n = aug.n_samples(u.uid, base.epoch, n) if augmenting else n
                    clip = None if n > p.n_samples + LENGTH_SLACK else opened.decode()
                if clip is None:
                    failed[p.utt] = LONGER_THAN_DURATION
                    continue
                if not np.isfinite(clip).all():
                    raise ValueError("non-finite samples")
            except Exception:  # noqa: BLE001 - any decoder failure: silence, the rest trains
                failed[p.utt] = "failed to decode"
                continue
            # The augmentation's failure is no clip's, so it stops the run.
            if augmenting:
                clip = aug.wave(clip, u.uid, base.epoch)
            if len(clip) > p.n_samples + LENGTH_SLACK:  # cut, it would keep its whole transcript
                failed[p.utt] = LONGER_THAN_DURATION
                continue
            clip = clip[: p.n_samples]
            wave[p.offset : p.offset + len(clip)] = clip
        return wave, failed

    def _masked_window(self, feats: np.ndarray, w: Window, first_uid: str) -> np.ndarray:
        """SpecAugment of a packed window (its draws keyed by its first utterance)."""
        aug = self.base.augment
        if aug is None:
            return feats
        return aug.features(feats, first_uid, self.base.epoch, w.n_samples / SAMPLE_RATE)

    def __getitem__(self, j: int) -> dict:
        w = self.windows[j]
        utts = self.base.utts
        uids = [utts[p.utt].uid for p in w.pieces]
        failed: dict[int, str] = {}
        cache = self.base.feature_cache
        if w.alone and cache is not None and utts[w.pieces[0].utt].audio_key in cache:
            # the utterance's own window, cached; a cache read error is no decoding failure:
            # it propagates instead of dropping every clip
            feats = self.base.masked(
                cache.features(utts[w.pieces[0].utt].audio_key), w.pieces[0].utt
            )
        else:
            try:
                if w.alone:
                    first = w.pieces[0].utt
                    feats = self.base.masked(self.base.training_features(first), first)
                else:
                    wave, failed = self._waveform(w)
                    if len(failed) == len(w.pieces):
                        raise ValueError("no clip decoded")
                    feats = self._masked_window(self.base.log_mel(wave), w, uids[0])
            except AugmentError:
                # As in SpeechDataset, the augmentation's failure stops the run.
                raise
            except Exception:  # noqa: BLE001 - as SpeechDataset: skip, keep the epoch
                return {"dropped": uids[0], "dropped_parts": uids[1:]}
        dec, labels = self.sequences(w, frozenset(failed))
        kept = [p.utt for p in w.pieces if p.utt not in failed]
        return {
            "input_features": torch.from_numpy(np.asarray(feats, dtype=np.float32)),
            "decoder_input_ids": torch.tensor(dec, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "index": j,
            "uid": "+".join(utts[u].uid for u in kept),
            "language": utts[w.pieces[0].utt].language,
            "text": " ".join(utts[u].text for u in kept),
            "n_utterances": len(kept),
            "replay": any(self.base.is_replay(u) for u in kept),
            "dropped_parts": [utts[u].uid for u in failed],
            "dropped_part_reasons": list(failed.values()),
        }


def _of_utterances(w: Window, drawn: np.ndarray) -> Window:
    """Window ``w`` composed over the places of a draw, with each place's utterance."""
    pieces = tuple(replace(p, utt=int(drawn[p.utt])) for p in w.pieces)
    return replace(w, pieces=pieces, prev=tuple(int(drawn[u]) for u in w.prev))


@dataclass
class Packing:
    """A run's packing: composes each epoch's windows (cached for the current epoch) and wraps
    them as a dataset. See :func:`build_packing`."""

    base: SpeechDataset
    cfg: PackConfig
    seed: int
    max_samples: int
    max_positions: int
    no_timestamps: int
    start_of_prev: int | None
    timestamps: TimestampTokens | None
    sampling: LanguageSampling | None = None
    """``data.sampling``: the epoch's utterances drawn by language are what is packed."""
    _epoch: tuple[int, list[Window], PackStats] | None = None

    def windows(self, epoch: int) -> tuple[list[Window], PackStats]:
        if self._epoch is None or self._epoch[0] != epoch:
            items = PackItems.of(self.base.utts, self.base.augment, epoch)
            drawn = None
            if self.sampling is not None:
                drawn = self.sampling.order(epoch)
                items = items.drawn(drawn)
            windows, stats = compose_windows(
                items,
                self.cfg,
                max_samples=self.max_samples,
                max_positions=self.max_positions,
                seed=self.seed,
                epoch=epoch,
                timestamps=self.timestamps is not None,
            )
            if drawn is not None:  # the windows' places in the draw, back to utterances
                windows = [_of_utterances(w, drawn) for w in windows]
            self._epoch = (epoch, windows, stats)
            log.info("packing, epoch %d: %s", epoch, stats.line())
        return self._epoch[1], self._epoch[2]

    def current_windows(self) -> list[Window]:
        """The windows of the epoch composed last (epoch 0 when none was)."""
        return self.windows(0 if self._epoch is None else self._epoch[0])[0]

    def dataset(self, epoch: int) -> PackedWindows:
        self.base.epoch = epoch  # augmentation draws (the loader of each epoch is new)
        return PackedWindows(
            self.base,
            self.windows(epoch)[0],
            no_timestamps=self.no_timestamps,
            start_of_prev=self.start_of_prev,
            timestamps=self.timestamps,
            max_positions=self.max_positions,
        )


def build_packing(
    cfg: PackConfig,
    base: SpeechDataset,
    *,
    tokenizer,
    no_timestamps: int,
    seed: int,
    window_seconds: float,
    max_positions: int,
) -> Packing:
    """The run's :class:`Packing` for ``data.pack``, its limits checked against the model.

    Args:
        window_seconds: the model's window (``max_source_positions / 50``).

    Raises:
        UserError: ``max_seconds`` exceeds the model's window.
    """
    max_seconds = cfg.max_seconds or window_seconds
    if max_seconds > window_seconds + 1e-9:
        raise UserError(
            f"data.pack.max_seconds: {max_seconds:g} s exceeds the model's {window_seconds:g} s "
            "window (the feature extractor would cut the audio)"
        )
    stamps = TimestampTokens.from_tokenizer(tokenizer, no_timestamps)
    if cfg.timestamp_share > 0 and (stamps is None or stamps.max_seconds + 1e-9 < max_seconds):
        have = "none" if stamps is None else f"only up to <|{stamps.max_seconds:.2f}|>"
        log.warning(
            "data.pack.timestamp_share: the tokenizer has %s of the timestamp tokens a %g s "
            "window needs (<|0.00|> .. after <|notimestamps|>): timestamp mode is off",
            have,
            max_seconds,
        )
        stamps = None
    if stamps is None:
        cfg = cfg.model_copy(update={"timestamp_share": 0.0})
    prev = tokenizer.convert_tokens_to_ids("<|startofprev|>")
    if prev is None or prev == tokenizer.unk_token_id:
        prev = None
        if cfg.prev_text_share > 0:
            log.warning("data.pack.prev_text_share: the tokenizer has no <|startofprev|>: off")
        cfg = cfg.model_copy(update={"prev_text_share": 0.0})
    log.info(
        "packing: windows up to %g s, gaps %g-%g s, %.0f%% of windows single, timestamp mode "
        "%.0f%%, previous text %.0f%%",
        max_seconds,
        *cfg.gap_seconds,
        100 * cfg.single_share,
        100 * cfg.timestamp_share,
        100 * cfg.prev_text_share,
    )
    return Packing(
        base=base,
        cfg=cfg,
        seed=seed,
        max_samples=int(round(max_seconds * SAMPLE_RATE)),
        max_positions=max_positions,
        no_timestamps=no_timestamps,
        start_of_prev=prev,
        timestamps=stamps,
    )
