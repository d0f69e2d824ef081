"""ASR datasets: usable utterances (``data/prepare.py``) -> (log-mel, prompt, labels) batches, and
the order they are read in.

Log-mels are computed in DataLoader workers; a clip that turns out unusable there (NaN/inf
samples, a failed decode, or the checks a lazily prepared split leaves to the workers) is
dropped from its batch with its id and the skip report's reason (``Collator``), and reported by
the loop (``skipped-<split>.json``) and by evaluation.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset

from asrforge.data.audio import SAMPLE_RATE
from asrforge.data.augment import AugmentError
from asrforge.data.ids import named
from asrforge.data.prepare import UtteranceTable
from asrforge.data.rules import (
    NOT_FOUND,
    UnusableAudio,
    header_seconds,
    no_usable_clips,
    read_audio,
)

log = logging.getLogger(__name__)

IGNORE = -100  # label id the loss skips


def prompt_labels(forced: Sequence[int], language_after: int | None) -> list[int]:
    """Labels of a forced prompt's positions but its last (which predicts the first target):
    ``IGNORE``, except that with ``language_after`` (the ``<|startoftranscript|>`` id) that
    token's position is labelled with the language token after it, so the model learns to
    detect the language it is taught, as Whisper's own training does."""
    labels = [IGNORE] * (len(forced) - 1)
    if language_after is not None:
        # the last one: any previous text (<|startofprev|> ...) comes before it
        at = len(forced) - 1 - list(reversed(forced)).index(language_after)
        if at < len(labels):
            labels[at] = forced[at + 1]
    return labels


def language_label_after(specials, language_target: bool) -> int | None:
    """A training set's :attr:`SpeechDataset.language_after`: ``<|startoftranscript|>``'s id
    when ``data.language_target`` is on and prompts carry a language token (a multilingual
    model), else None."""
    return specials.sot if language_target and specials.multilingual else None


class SpeechDataset(Dataset):
    """Utterances -> dicts with ``input_features: (n_mels, n_frames)`` float32, ``decoder_input_ids``
    and ``labels`` (same length; the prompt's positions are ``IGNORE`` in labels, but the
    language token's with :attr:`language_after`).

    A clip that cannot be used yields ``{"dropped": uid, "reason": ...}`` (the collator drops it
    and records both), never an exception that would end the epoch: audio that fails to decode
    or has NaN/inf samples, and for a lazily prepared table (``UtteranceTable.lazy``) what
    ``prepare_split`` would have skipped up front (labels too long, a missing, unreadable,
    empty or over-long audio file), with the skip report's reason.

    Args:
        utterances: an :class:`UtteranceTable` (or a list of :class:`Utterance`).
    """

    def __init__(self, split, utterances, feature_extractor, eot: int):
        self.split = split
        self.utts = utterances
        self.fe = feature_extractor
        self.eot = eot
        # An EncoderCache, to yield encoder states instead of log-mels.
        self.encoder_cache = None
        # A FeatureCache, to read log-mels instead of computing them.
        self.feature_cache = None
        # An Augmenter (data.augment), for the training set only.
        self.augment = None
        # The epoch being loaded, on which augmentation draws depend.
        self.epoch = 0
        # The first replay utterance (data.replay; data/replay.py), None without replay.
        self.replay_from: int | None = None
        # The training utterances (before replay) as UtteranceTable.fingerprint gives them, for
        # a resume to know them again; None for an evaluation set.
        self.fingerprint: dict[str, int | str] | None = None
        # <|startoftranscript|>'s id when the language token after it is a target
        # (data.language_target; training sets only), None when no prompt position is.
        self.language_after: int | None = None

    def is_replay(self, i: int) -> bool:
        """Whether utterance ``i`` is a replay row (``data.replay``)."""
        return self.replay_from is not None and i >= self.replay_from

    def __len__(self) -> int:
        return len(self.utts)

    def features_of(self, i: int) -> np.ndarray:
        """Log-mel features of utterance ``i``: (n_mels, n_frames) float32.

        Raises:
            UnusableAudio: the audio is missing, unreadable, has no samples or NaN/inf ones.
        """
        cache = self.feature_cache
        if cache is not None and self.utts[i].audio_key in cache:
            return cache.features(self.utts[i].audio_key)
        return self.log_mel(self.wave_of(i))

    def wave_of(self, i: int) -> np.ndarray:
        """Utterance ``i``'s audio, 16 kHz mono float32.

        Raises:
            UnusableAudio: the audio is missing, unreadable, has no samples or NaN/inf ones, or
                is longer than the window (its duration not known before, or the data's
                ``duration`` said less than it holds).
        """
        audio = self.split[self._row(i)]["audio"]
        return read_audio(audio, self._window_seconds())

    def _row(self, i: int) -> int:
        utts = self.utts
        return int(utts.rows[i]) if isinstance(utts, UtteranceTable) else utts[i].row

    def _window_seconds(self) -> float | None:
        """The window the decoded audio must fit (None: checked from its header already). A
        duration known up front may be the data's own ``duration``, not the file's: the
        decoded length is checked too, since the feature extractor would cut the audio and
        leave its whole transcript."""
        utts = self.utts
        return utts.rules.max_seconds if isinstance(utts, UtteranceTable) else None

    def log_mel(self, wave: np.ndarray) -> np.ndarray:
        """(n_mels, n_frames) float32 log-mel features of one window's audio."""
        feats = self.fe(wave, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
        return np.asarray(feats, dtype=np.float32)

    def training_features(self, i: int) -> np.ndarray:
        """Utterance ``i``'s log-mels as training sees them this epoch: its augmented audio
        (``data.augment``), else what :meth:`features_of` gives."""
        aug = self.augment
        if aug is None or not aug.changes_audio:
            return self.features_of(i)
        return self.log_mel(aug.wave(self.wave_of(i), self.utts[i].uid, self.epoch))

    def masked(self, feats: np.ndarray, i: int) -> np.ndarray:
        """SpecAugment of utterance ``i``'s window this epoch (unchanged without it)."""
        aug = self.augment
        if aug is None:
            return feats
        u = self.utts[i]
        seconds = u.seconds
        # A lazily prepared row whose data gives no duration takes it from the audio's header.
        if np.isnan(seconds):
            seconds = header_seconds(self.split[u.row]["audio"])
        seconds = aug.n_samples(u.uid, self.epoch, round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        return aug.features(feats, u.uid, self.epoch, seconds)

    def __getitem__(self, i: int) -> dict | None:
        u = self.utts[i]
        if isinstance(self.utts, UtteranceTable) and self.utts.lazy:
            problem = self.utts.problem(u)
            if problem is not None:
                return {"dropped": u.uid, "reason": problem}
        cache, features = self.encoder_cache, self.feature_cache
        if cache is not None and u.audio_key in cache:
            inputs = {"encoder_hidden_states": torch.from_numpy(cache.row(u.audio_key))}
        elif features is not None and u.audio_key in features:  # a cache read error is no
            # decoding failure: it propagates instead of dropping every clip
            feats = self.masked(features.features(u.audio_key), i)
            inputs = {"input_features": torch.from_numpy(feats)}
        else:
            try:
                inputs = {
                    "input_features": torch.from_numpy(self.masked(self.training_features(i), i))
                }
            except UnusableAudio as e:
                uid = named(u.uid, e.source) if e.reason == NOT_FOUND else u.uid
                return {"dropped": uid, "reason": e.reason}
            except AugmentError:
                # The augmentation's own failure is not the clip's, so it stops the run.
                raise
            except Exception:  # noqa: BLE001 - any decoder failure: skip the clip, keep the epoch
                return {"dropped": u.uid, "reason": "failed to decode"}
        dec = u.prompt + u.text_ids
        labels = prompt_labels(u.prompt, self.language_after) + u.text_ids + [self.eot]
        return {
            **inputs,
            "decoder_input_ids": torch.tensor(dec, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "index": i,
            "uid": u.uid,
            "language": u.language,
            "text": u.text,
            "replay": self.is_replay(i),
        }


@dataclass
class Collator:
    """Pads a list of items into a batch; ``pad_id`` pads decoder inputs, ``IGNORE`` pads labels."""

    pad_id: int

    def __call__(self, items: list[dict]) -> dict:
        dropped = [it["dropped"] for it in items if "dropped" in it]
        reasons = [it.get("reason", "failed to decode") for it in items if "dropped" in it]
        # a packed window's clips that failed (the rest of the window trains)
        for it in items:
            parts = it.get("dropped_parts", ())
            dropped += parts
            reasons += it.get("dropped_part_reasons") or ["failed to decode"] * len(parts)
        items = [it for it in items if "dropped" not in it]
        if not items:
            return {"size": 0, "dropped": dropped, "dropped_reasons": reasons}
        t = max(len(it["labels"]) for it in items)
        dec = torch.full((len(items), t), self.pad_id, dtype=torch.long)
        lab = torch.full((len(items), t), IGNORE, dtype=torch.long)
        for r, it in enumerate(items):
            n = len(it["labels"])
            dec[r, :n] = it["decoder_input_ids"]
            lab[r, :n] = it["labels"]
        key = "encoder_hidden_states" if "encoder_hidden_states" in items[0] else "input_features"
        return {
            key: torch.stack([it[key] for it in items]),
            "decoder_input_ids": dec,
            "labels": lab,
            "index": [it["index"] for it in items],
            "uid": [it["uid"] for it in items],
            "language": [it["language"] for it in items],
            "text": [it["text"] for it in items],
            "replay": torch.tensor([bool(it.get("replay")) for it in items]),
            "size": len(items),
            "dropped": dropped,
            "dropped_reasons": reasons,
        }

    def join(self, pieces: Sequence[dict]) -> dict:
        """One batch of collated ``pieces`` in order, as this collator would have made of all
        their items at once (labels and decoder inputs padded to the longest)."""
        if len(pieces) == 1:
            return pieces[0]
        kept = [p for p in pieces if p["size"]]
        dropped = [uid for p in pieces for uid in p["dropped"]]
        reasons = [r for p in pieces for r in p["dropped_reasons"]]
        if not kept:
            return {"size": 0, "dropped": dropped, "dropped_reasons": reasons}
        t = max(p["labels"].shape[1] for p in kept)

        def padded(key: str, value: int) -> torch.Tensor:
            return torch.cat([
                torch.nn.functional.pad(p[key], (0, t - p[key].shape[1]), value=value)
                for p in kept
            ])  # fmt: skip

        key = "encoder_hidden_states" if "encoder_hidden_states" in kept[0] else "input_features"
        return {
            key: torch.cat([p[key] for p in kept]),
            "decoder_input_ids": padded("decoder_input_ids", self.pad_id),
            "labels": padded("labels", IGNORE),
            **{k: [x for p in kept for x in p[k]] for k in ("index", "uid", "language", "text")},
            "replay": torch.cat([p["replay"] for p in kept]),
            "size": sum(p["size"] for p in kept),
            "dropped": dropped,
            "dropped_reasons": reasons,
        }


def worker_pieces(batches: Sequence[list[int]], workers: int) -> tuple[list[list[int]], list[int]]:
    """Each batch cut into up to ``workers`` contiguous pieces, and how many each became: a
    DataLoader gives a whole batch to one worker, so a large evaluation batch would be read and
    featurized by one of them while the others wait (:class:`JoinedBatches` joins them again)."""
    pieces, counts = [], []
    for batch in batches:
        k = max(1, min(workers, len(batch)))
        cuts = np.array_split(np.asarray(batch, dtype=np.int64), k)
        pieces += [c.tolist() for c in cuts]
        counts.append(k)
    return pieces, counts


class JoinedBatches:
    """The batches of ``loader``, which loads each as ``counts[k]`` pieces
    (:func:`worker_pieces`), joined again by ``collator``; pinned here when ``pin``, not by
    ``loader`` (a joined batch is a new tensor, and a GPU copies pinned memory without
    waiting)."""

    def __init__(self, loader, counts: Sequence[int], collator: Collator, pin: bool = False):
        self.loader, self.counts, self.collator, self.pin = loader, list(counts), collator, pin

    def __len__(self) -> int:
        return len(self.counts)

    def __iter__(self):
        pieces = iter(self.loader)
        for k in self.counts:
            batch = self.collator.join([next(pieces) for _ in range(k)])
            if self.pin:
                batch = {
                    key: v.pin_memory() if isinstance(v, torch.Tensor) else v
                    for key, v in batch.items()
                }
            yield batch


def dropped_by_reason(batch: dict) -> dict[str, list[str]]:
    """The ids a collated batch dropped, by reason (as :class:`SkipReport` groups them)."""
    out: dict[str, list[str]] = {}
    reasons = batch.get("dropped_reasons") or ["failed to decode"] * len(batch.get("dropped", []))
    for uid, reason in zip(batch.get("dropped", []), reasons, strict=True):
        out.setdefault(reason, []).append(uid)
    return out


@dataclass
class UsableClipWatch:
    """Stops training on a split none of whose clips can be read: a lazily prepared or streamed
    split's clips are checked only as the workers load them, so one whose every clip is
    dropped would otherwise take steps on no audio.

    It gives up once a clip trains, and stops the run once an epoch's worth of clips (each
    occurrence counted: rows that name the same file are several clips) was dropped and none
    trained. One process sees a share of each epoch, so with several it takes as many epochs.
    """

    split: str
    where: str
    """What holds the split, for the error (``data.path``)."""
    clips_per_epoch: int
    kept: bool = False
    """A clip trained (a resumed run's before it too): the split is usable."""
    n_dropped: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)

    def see(self, batch: dict) -> None:
        """Count a collated training micro-batch (text-only ones are not the split's).

        Raises:
            UserError: no clip has trained and an epoch's worth were dropped.
        """
        if self.kept or batch.get("task", "asr") != "asr":
            return
        if batch["size"]:
            self.kept = True
            return
        for reason, uids in dropped_by_reason(batch).items():
            self.counts[reason] += len(uids)
            shown = self.examples.setdefault(reason, [])
            shown += uids[: 3 - len(shown)]
        self.n_dropped += len(batch.get("dropped", []))
        if self.n_dropped >= max(self.clips_per_epoch, 1):
            how = "dropped when read, and none trained"
            raise no_usable_clips(self.split, self.where, self.examples, self.counts, how)


class Batches(Sequence):
    """Batches of indices cut from one permutation, without a Python list per batch until one
    is read: ``batches[k]`` is a list of ints; slicing gives Batches again (a resume's
    ``[start:]``, a rank's ``[rank::world]``)."""

    def __init__(self, order: np.ndarray, batch_size: int, which: range | None = None):
        self.order, self.batch_size = order, batch_size
        self.which = which if which is not None else range(-(-len(order) // batch_size))

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return Batches(self.order, self.batch_size, self.which[k])
        start = self.which[k] * self.batch_size
        return self.order[start : start + self.batch_size].tolist()

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


def epoch_batches(
    n: int, batch_size: int, seed: int, epoch: int, rank: int = 0, world: int = 1
) -> Batches:
    """The shuffled batches of one epoch, a pure function of (seed, epoch): resuming at batch k
    of an epoch replays exactly the batches an uninterrupted run would have seen."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).numpy()
    return Batches(perm, batch_size)[rank::world]


def eval_batches(utts, batch_size: int) -> list[list[int]]:
    """Evaluation batches ordered by label length (longest first) so a batch decodes about as
    many steps as its members need. A lazily prepared table's texts are tokenized here (an
    evaluation split is small)."""
    if isinstance(utts, UtteranceTable) and utts.n_tokens is not None:
        order = np.argsort(-utts.n_tokens, kind="stable").tolist()
    else:
        order = sorted(range(len(utts)), key=lambda i: -len(utts[i].text_ids))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def language_counts(utts) -> Counter:
    """Utterances per language."""
    if isinstance(utts, UtteranceTable):
        return utts.language_counts()
    return Counter(u.language for u in utts)
