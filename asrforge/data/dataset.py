"""ASR datasets: an Arrow split -> filtered utterances -> (log-mel, prompt, labels) batches.

Filtering happens once, up front, in the main process: empty text, labels longer than the
decoder allows, missing audio files, unreadable, empty or over-long audio are skipped with their
ids and counted, so an epoch never crashes halfway. A language the tokenizer has no token for
stops the run (:func:`check_language_tokens`) instead of dropping all of its utterances.
Log-mels are computed in DataLoader workers; a clip whose samples turn out NaN/inf (or that
fails to decode there) is dropped from its batch with its id and reason (``Collator``), and
reported by the loop and by evaluation.

The ``language`` column and ``data.languages`` are resolved alike (:func:`data_language`): codes,
English names and locales (``en``, ``English``, ``en-US``) are one language.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from asrforge.config import DataConfig
from asrforge.data.audio import SAMPLE_RATE, audio_info, audio_problem, decode_audio
from asrforge.data.augment import AugmentError
from asrforge.errors import UserError
from asrforge.text.languages import find_language_code

log = logging.getLogger(__name__)

IGNORE = -100  # label id the loss skips
TEXT_COLUMNS = ("text", "language")
"""Columns that must hold strings (or nulls, which are skipped as empty)."""


def load_arrow(path: Path):
    """``datasets.load_from_disk`` with audio left undecoded (we decode with soundfile)."""
    import datasets
    from datasets import Audio

    datasets.disable_progress_bars()
    path = Path(path)
    if not path.exists():
        raise UserError(f"data.path: {path} does not exist (set data.generate: tones to make a small one)")
    dd = load_saved(path)
    if isinstance(dd, datasets.Dataset):
        raise UserError(f"data.path: {path} holds one split; save a DatasetDict with named splits")
    for name, split in dd.items():
        missing = {"audio", "text", "language"} - set(split.column_names)
        if missing:
            raise UserError(f"data.path: split {name!r} lacks columns {sorted(missing)}")
        for column in TEXT_COLUMNS:
            dtype = getattr(split.features[column], "dtype", type(split.features[column]).__name__)
            if dtype not in ("string", "large_string", "null"):
                raise UserError(
                    f"data.path: {path} split {name!r}: column {column!r} holds {dtype}, "
                    "expected strings"
                )
        if isinstance(split.features["audio"], Audio):
            dd[name] = split.cast_column("audio", Audio(decode=False))
    return dd


def load_saved(path: Path):
    """``datasets.load_from_disk(path)``: a ``DatasetDict`` or one ``Dataset``.

    Raises:
        UserError: a split saved without rows, or not a ``save_to_disk`` directory.
    """
    import datasets

    empty = _empty_splits(path)
    if empty:  # datasets' load_from_disk fails on them with an IndexError
        raise UserError(
            f"data.path: {path}: split(s) {', '.join(map(repr, empty))} have no rows; "
            "add rows or leave the split out of the saved DatasetDict"
        )
    try:
        return datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"data.path: {path} is not a dataset saved with save_to_disk: {e}") from None


def _empty_splits(path: Path) -> list[str]:
    """Splits of the ``save_to_disk`` directory ``path`` that were saved without rows (no data
    files), read from its JSON files; [] when they cannot be read (load_from_disk reports it)."""
    try:
        names = json.loads((path / "dataset_dict.json").read_text())["splits"]
        states = {n: json.loads((path / n / "state.json").read_text()) for n in names}
        return [n for n, state in states.items() if not state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


@lru_cache(maxsize=1024)
def data_language(value: str | None) -> str:
    """The language code of a ``language`` value (``"English"``, ``"en-US"`` -> ``"en"``;
    ``"zh-HK"`` -> ``"yue"``), or the value itself when it names no known language."""
    text = "" if value is None else str(value)
    return find_language_code(text) or text


def language_filter(languages: list[str] | None, where: str = "data.languages") -> set[str] | None:
    """The codes of ``languages`` (codes, names or locales), or None for "all".

    Raises:
        UserError: an entry names no known language (by its path, e.g. ``data.languages.1``).
    """
    if not languages:
        return None
    unknown = [f"{where}.{i}: unknown language {x!r}" for i, x in enumerate(languages)
               if find_language_code(x) is None]  # fmt: skip
    if unknown:
        raise UserError("; ".join(unknown) + " (give an ISO or Whisper code or an English name)")
    return {find_language_code(x) for x in languages}


@dataclass
class Utterance:
    row: int  # row in the Arrow split
    uid: str
    language: str
    text: str
    prompt: list[int]
    text_ids: list[int]
    audio_key: str = ""  # sha256 of the audio bytes (or of the path): the encoder cache's key
    seconds: float = 0.0  # the audio's duration (from its header): packing lays windows out by it


@dataclass
class SkipReport:
    """What filtering dropped, by reason."""

    split: str
    total: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, uid: str) -> None:
        self.skipped.setdefault(reason, []).append(uid)

    @property
    def n_skipped(self) -> int:
        return sum(len(v) for v in self.skipped.values())

    def log(self, out_dir: Path | None) -> None:
        if not self.n_skipped:
            log.info("split %s: %d utterances, none skipped", self.split, self.total)
            return
        counts = ", ".join(f"{len(v)} {k}" for k, v in self.skipped.items())
        ids = [u for v in self.skipped.values() for u in v]
        shown = ", ".join(ids[:20]) + (f" ... (+{len(ids) - 20})" if len(ids) > 20 else "")
        where = ""
        if out_dir is not None:
            target = Path(out_dir) / f"skipped-{self.split}.json"
            target.write_text(json.dumps(self.skipped, indent=1))
            where = f"; all ids in {target}"
        log.warning(
            "split %s: skipped %d of %d utterances (%s): %s%s",
            self.split, self.n_skipped, self.total, counts, shown, where,
        )


def prepare_split(
    split,
    name: str,
    *,
    cfg: DataConfig,
    tokenizer,
    specials,
    max_target_positions: int,
    max_seconds: float,
) -> tuple[list[Utterance], SkipReport]:
    """Tokenize and check every utterance of ``split``; return the usable ones and a report."""
    report = SkipReport(split=name, total=len(split))
    keep_langs = language_filter(cfg.languages)
    ids = split["id"] if "id" in split.column_names else [f"{name}-{i}" for i in range(len(split))]
    texts, langs = split["text"], split["language"]
    if specials.multilingual:
        check_language_tokens(langs, name, specials, keep_langs, ids)
    check_english_only(langs, name, specials, keep_langs)
    out: list[Utterance] = []
    row = 0
    for batch in split.select_columns(["audio"]).iter(batch_size=256):
        for audio in batch["audio"]:
            uid, text, lang = str(ids[row]), texts[row], data_language(langs[row])
            r, row = row, row + 1
            if keep_langs is not None and lang not in keep_langs:
                continue
            if text is None or not text.strip():
                report.add("empty text", uid)
                continue
            blob = audio.get("bytes") if isinstance(audio, dict) else None
            src = blob if blob else (audio.get("path") if isinstance(audio, dict) else None)
            try:
                if not src:
                    raise ValueError("no audio")
                _, seconds = audio_info(src)
            except Exception:  # noqa: BLE001 - any decoder failure means the same: unreadable
                if isinstance(src, str) and not Path(src).exists():  # named: the id may not say
                    named = uid if src.endswith(uid) else f"{uid} ({src})"
                    report.add("audio file not found", named)
                else:
                    report.add("unreadable audio", uid)
                continue
            if seconds <= 0:
                report.add("empty audio (0 samples)", uid)
                continue
            if seconds > max_seconds:
                report.add(f"audio longer than {max_seconds:g} s", uid)
                continue
            text_ids = tokenizer.encode(" " + text.strip(), add_special_tokens=False)
            prompt = specials.prompt(lang, cfg.task)
            if len(prompt) + len(text_ids) + 1 > max_target_positions:
                report.add(f"labels longer than {max_target_positions} tokens", uid)
                continue
            key = hashlib.sha256(blob if blob else str(src).encode()).hexdigest()
            out.append(Utterance(r, uid, lang, text.strip(), prompt, text_ids, key, seconds))
    _log_language_tokens(name, out, specials, report)
    return out, report


def check_language_tokens(
    values: list, split: str, specials, keep: set[str] | None, ids: list | None = None
) -> None:
    """Refuse a language (a value of the ``language`` column) the tokenizer has no token for:
    training would otherwise drop every one of its utterances.

    Args:
        ids: the rows' ids (as ``values``), to name the rows that give no language.

    Raises:
        UserError: naming each such value, its utterance count and the ways to fix it; rows
            without a language by their ids.
    """
    counts = Counter(values)
    tokenless: dict[str | None, int] = {}
    for value, n in counts.items():
        code = data_language(value)
        if (keep is None or code in keep) and specials.token_language(code) is None:
            tokenless[value] = n
    if not tokenless:
        return
    problems = []
    unnamed = sum(n for v, n in tokenless.items() if not v)
    if unnamed:
        problems.append(_no_language(values, unnamed, ids))
    found = ", ".join(_language_value(v, n) for v, n in tokenless.items() if v)
    if found:
        problems.append(
            f"language {found} has no token in this tokenizer. Map it to an existing token "
            "(data.language_tokens, e.g. {lg: sw}), add its token with `asrforge vocab build`, "
            "or leave it out (data.languages); a value that names no language: give ISO codes, "
            "English names or locales (data.columns.language names the column)"
        )
    raise UserError(f"data: split {split!r}: " + "; and ".join(problems))


def _no_language(values: list, n: int, ids: list | None) -> str:
    """What to say of the ``n`` rows whose ``language`` cell is empty."""
    which = ""
    if ids is not None:
        named = [str(ids[i]) for i, v in enumerate(values) if not v]
        which = f" (ids {', '.join(named[:10])}{f' ... (+{n - 10})' if n > 10 else ''})"
    return (
        f"{n} utterance(s) give no language{which}. Fill in their language cells, set "
        "data.language (e.g. data.language=sw) when all of the data is one language, or name "
        "the column that holds it with data.columns.language"
    )


def check_english_only(values: list, split: str, specials, keep: set[str] | None) -> None:
    """Under an English-only model (``*.en``: its prompt carries no language token), refuse a
    language other than English (a value of the ``language`` column): its utterances would
    train under the English prompt, and the bundle would then refuse to transcribe it. A row
    without a language is English's. Nothing to check for a multilingual model.

    Raises:
        UserError: naming each such value, its utterance count and the ways to fix it.
    """
    if specials.multilingual:
        return
    counts = Counter(values)
    other = {value: n for value, n in counts.items()
             if value and not is_english(value) and (keep is None or data_language(value) in keep)}  # fmt: skip
    if not other:
        return
    found = ", ".join(_language_value(v, n) for v, n in other.items())
    raise UserError(
        f"data: split {split!r}: the model is English-only (its tokenizer has no language "
        f"tokens), but the data has language {found}: they would train under the English "
        "prompt. Leave them out (data.languages: [en]) or fine-tune a multilingual model "
        "(model.pretrained)"
    )


def is_english(value: str | None) -> bool:
    """Whether a ``language`` value is English (or empty: an English-only model's every row)."""
    return not value or data_language(value) == "en"


def _language_value(value: str, n: int) -> str:
    code = data_language(value)
    return f"{value!r} ({n} utterances{'' if code == value else f', code {code!r}'})"


def _log_language_tokens(name: str, utts: list[Utterance], specials, report: SkipReport) -> None:
    """Say which languages decode under another's token."""
    if not specials.multilingual:
        return
    for lang in sorted({u.language for u in utts} & set(specials.token_of)):
        log.info(
            "split %s: language %s is decoded with <|%s|> (the tokenizer has no <|%s|>); "
            "checkpoint selection still goes by %s",
            name, lang, specials.token_of[lang], lang, lang,
        )


class UnusableAudio(UserError):
    """Audio that decodes but cannot be trained or evaluated on (see ``audio_problem``)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class SpeechDataset(Dataset):
    """Utterances -> dicts with ``input_features: (n_mels, n_frames)`` float32, ``decoder_input_ids``
    and ``labels`` (same length; the prompt's positions are ``IGNORE`` in labels).

    A clip that fails to decode in a worker, or whose samples are NaN/inf, yields
    ``{"dropped": uid, "reason": ...}`` (the collator drops it and records both), never an
    exception that would end the epoch.
    """

    def __init__(self, split, utterances: list[Utterance], feature_extractor, eot: int):
        self.split = split
        self.utts = utterances
        self.fe = feature_extractor
        self.eot = eot
        self.encoder_cache = None  # an EncoderCache: yield encoder states instead of log-mels
        self.feature_cache = None  # a FeatureCache: read log-mels instead of computing them
        self.augment = None  # an Augmenter (training set only): data.augment
        self.epoch = 0  # the epoch being loaded: augmentation draws depend on it

    def __len__(self) -> int:
        return len(self.utts)

    def features_of(self, i: int) -> np.ndarray:
        """Log-mel features of utterance ``i``: (n_mels, n_frames) float32.

        Raises:
            UnusableAudio: the audio has no samples or NaN/inf ones.
            UserError: the audio cannot be decoded.
        """
        cache = self.feature_cache
        if cache is not None and self.utts[i].audio_key in cache:
            return cache.features(self.utts[i].audio_key)
        return self.log_mel(self.wave_of(i))

    def wave_of(self, i: int) -> np.ndarray:
        """Utterance ``i``'s audio, 16 kHz mono float32.

        Raises:
            UnusableAudio: the audio has no samples or NaN/inf ones.
            UserError: the audio cannot be decoded.
        """
        audio = self.split[self.utts[i].row]["audio"]
        wave = decode_audio(audio.get("bytes") or audio.get("path"))
        problem = audio_problem(wave)
        if problem is not None:
            raise UnusableAudio(problem)
        return wave

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
        aug, u = self.augment, self.utts[i]
        if aug is None:
            return feats
        seconds = aug.n_samples(u.uid, self.epoch, round(u.seconds * SAMPLE_RATE)) / SAMPLE_RATE
        return aug.features(feats, u.uid, self.epoch, seconds)

    def __getitem__(self, i: int) -> dict | None:
        u = self.utts[i]
        cache, features = self.encoder_cache, self.feature_cache
        if cache is not None and u.audio_key in cache:
            inputs = {"encoder_hidden_states": torch.from_numpy(cache.row(u.audio_key))}
        elif features is not None and u.audio_key in features:  # a cache read error is no
            # decoding failure: it propagates instead of dropping every clip
            feats = self.masked(features.features(u.audio_key), i)
            inputs = {"input_features": torch.from_numpy(feats)}
        else:
            try:
                inputs = {"input_features": torch.from_numpy(self.masked(self.training_features(i), i))}
            except UnusableAudio as e:
                return {"dropped": u.uid, "reason": e.reason}
            except AugmentError:  # the augmentation's own failure, not the clip's: it stops
                raise
            except Exception:  # noqa: BLE001 - any decoder failure: skip the clip, keep the epoch
                return {"dropped": u.uid, "reason": "failed to decode"}
        dec = u.prompt + u.text_ids
        labels = [IGNORE] * (len(u.prompt) - 1) + u.text_ids + [self.eot]
        return {
            **inputs,
            "decoder_input_ids": torch.tensor(dec, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "index": i,
            "uid": u.uid,
            "language": u.language,
            "text": u.text,
        }


@dataclass
class Collator:
    """Pads a list of items into a batch; ``pad_id`` pads decoder inputs, ``IGNORE`` pads labels."""

    pad_id: int

    def __call__(self, items: list[dict]) -> dict:
        dropped = [it["dropped"] for it in items if "dropped" in it]
        reasons = [it.get("reason", "failed to decode") for it in items if "dropped" in it]
        # a packed window's clips that failed to decode (the rest of the window trains)
        parts = [uid for it in items for uid in it.get("dropped_parts", ())]
        dropped += parts
        reasons += ["failed to decode"] * len(parts)
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
            "size": len(items),
            "dropped": dropped,
            "dropped_reasons": reasons,
        }


def dropped_by_reason(batch: dict) -> dict[str, list[str]]:
    """The ids a collated batch dropped, by reason (as :class:`SkipReport` groups them)."""
    out: dict[str, list[str]] = {}
    reasons = batch.get("dropped_reasons") or ["failed to decode"] * len(batch.get("dropped", []))
    for uid, reason in zip(batch.get("dropped", []), reasons, strict=True):
        out.setdefault(reason, []).append(uid)
    return out


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int, rank: int = 0, world: int = 1) -> list[list[int]]:
    """The shuffled batches of one epoch, a pure function of (seed, epoch): resuming at batch k
    of an epoch replays exactly the batches an uninterrupted run would have seen."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    batches = [perm[i : i + batch_size] for i in range(0, n, batch_size)]
    return batches[rank::world]


def eval_batches(utts: list[Utterance], batch_size: int) -> list[list[int]]:
    """Evaluation batches ordered by label length (longest first) so a batch decodes about as
    many steps as its members need."""
    order = sorted(range(len(utts)), key=lambda i: -len(utts[i].text_ids))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def language_counts(utts: list[Utterance]) -> Counter:
    return Counter(u.language for u in utts)
