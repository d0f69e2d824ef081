"""The run's data, built for ``prepare_run``: its splits (read, carved, or streamed), the
training and evaluation sets, the log-mel and encoder caches, packing, and the text-only batches."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from asrforge.checkpoint import (
    TrainingCheckpoint,
)
from asrforge.checkpoint.resume import check_resume_data
from asrforge.config import DataConfig, TrainConfig
from asrforge.data.augment import build_augmenter
from asrforge.data.cache.encoder import EncoderCache
from asrforge.data.cache.features import FeatureCache
from asrforge.data.carve import training_splits
from asrforge.data.dataset import SpeechDataset, language_counts, language_label_after
from asrforge.data.packing import Packing, build_packing
from asrforge.data.prepare import (
    fingerprint_compares,
    language_value_counts,
    prepare_split,
    split_languages,
)
from asrforge.data.replay import (
    JoinedRows,
    ReplayUtterances,
    check_apart_from_guard,
    check_same_replay,
    read_replay,
    replay_count,
    replay_picks,
)
from asrforge.data.rules import (
    CHECKED_AS_READ,
    SkipReport,
    kept_rows,
    language_filter,
    left_out_counts,
    trained_languages,
)
from asrforge.data.stream import StreamedSplit, stream_eval_split
from asrforge.data.synth import make_tones_dataset
from asrforge.data.text_only import TextBatches
from asrforge.errors import UserError
from asrforge.evaluation.batch_size import eval_batch_size
from asrforge.evaluation.guard_items import guard_clip_files
from asrforge.model.build import (
    BuiltModel,
)
from asrforge.model.frames import window_seconds
from asrforge.model.partial import encode_frozen_part, frozen_part_id
from asrforge.train.ranks import main_process_first
from asrforge.train.transcript_filter import filter_transcripts

log = logging.getLogger("asrforge.train")


def setup_splits(
    cfg: TrainConfig, out: Path, acc, resume_from: TrainingCheckpoint | None
) -> tuple[Any, Any, SplitTexts]:
    """The training split (with ``data.stream.enabled`` its :class:`StreamedSplit`, no pass
    over it here), the evaluation split, and the training split's texts."""
    if cfg.data.stream.enabled:
        stream, eval_split = open_stream(cfg, resume_from)
        return stream, eval_split, SplitTexts(cfg.data, eval_split=eval_split, stream=stream)
    train_split, eval_split = load_splits(cfg, acc, out, resuming=resume_from is not None)
    return train_split, eval_split, SplitTexts(cfg.data, train_split, eval_split)


def setup_data(
    cfg: TrainConfig,
    out: Path,
    acc,
    bundle: BuiltModel,
    train_source,
    eval_split,
    precision: str,
    resume_from: TrainingCheckpoint | None = None,
) -> tuple[SpeechDataset | StreamedSplit, SpeechDataset, SkipReport, Packing | None]:
    """The training and evaluation data sets with their caches, the training split's skip
    report, and with ``data.pack.enabled`` the packed windows."""
    model = bundle.model
    if isinstance(train_source, StreamedSplit):
        train_set, eval_set, train_skipped = build_stream_datasets(
            cfg, out, acc, bundle, train_source, eval_split, resuming=resume_from is not None
        )
    else:
        train_set, eval_set, train_skipped = build_datasets(
            cfg, out, acc, bundle, train_source, eval_split, resume_from=resume_from
        )
    if cfg.data.cache_features:
        attach_feature_cache(cfg, out, acc, bundle, train_set, eval_set)
    if cfg.data.cache_encoder and getattr(model.config, "apply_spec_augment", False):
        log.warning(
            "data.cache_encoder: the model's config has apply_spec_augment on, but cached encoder "
            "states are computed once from unmasked features: SpecAugment is not applied"
        )
    packing = build_run_packing(cfg, bundle, train_set) if cfg.data.pack.enabled else None
    if cfg.data.cache_encoder and packing is not None:
        log.warning(
            "data.cache_encoder: off for training with data.pack.enabled: packed windows "
            "change every epoch and the encoder sees the whole window at once, so their "
            "encoder states cannot be cached; the frozen part runs every step"
        )
    elif cfg.data.cache_encoder:
        attach_encoder_cache(cfg, out, acc, model, train_set, precision)
    return train_set, eval_set, train_skipped, packing


def data_phase(cfg: TrainConfig, packing: Packing | None) -> str:
    """The start-up phase's name: the splits and the caches built with them."""
    caches = [
        n
        for n, on in (
            ("features", cfg.data.cache_features),
            ("encoder", cfg.data.cache_encoder and packing is None),
        )
        if on
    ]
    return " + ".join(["splits", *(f"{n} cache" for n in caches)])


def load_splits(cfg: TrainConfig, acc, out: Path, *, resuming: bool) -> tuple[Any, Any]:
    """The training and evaluation splits of ``data.path`` in any of its formats
    (:mod:`asrforge.data.sources`; the tones data set generated first when asked for and
    missing); a carved evaluation split is recorded in ``out`` and read back on a resume."""
    data_path = Path(cfg.data.path)
    if not data_path.exists() and cfg.data.generate == "tones":
        if acc.is_main_process:
            make_tones_dataset(data_path)
        acc.wait_for_everyone()
    return training_splits(cfg.data, run_dir=out, resuming=resuming, is_main=acc.is_main_process)


def open_stream(
    cfg: TrainConfig, resume_from: TrainingCheckpoint | None
) -> tuple[StreamedSplit, Any]:
    """``data.stream``: the training split's stream (its shards counted, the first one read) and
    the evaluation split, read whole.

    Raises:
        UserError: the data cannot be read, or a resume would continue on other shards.
    """
    stream = StreamedSplit(cfg.data, cfg.seed)
    log.info(
        "data.stream: split %s streams from %d shard(s), %d rows (fingerprint %s)",
        cfg.data.train_split,
        len(stream.shards),
        len(stream),
        stream.fingerprint,
    )
    saved = (resume_from.train_state.get("stream_position") or {}) if resume_from else {}
    if saved and saved.get("fingerprint") != stream.fingerprint:
        raise UserError(
            f"data.stream: the checkpoint {resume_from.path} was trained on other shards "
            f"(fingerprint {saved.get('fingerprint')}, now {stream.fingerprint}: files, row counts "
            "or data.stream.shard_rows changed); resume on the data the run started with"
        )
    if resume_from is not None and not saved and resume_from.train_state.get("step"):
        log.warning(
            "data.stream: the checkpoint %s was not trained on a stream: its epoch %d goes on "
            "in the stream's order, not the one it started in",
            resume_from.path,
            resume_from.train_state.get("epoch", 0),
        )
    return stream, stream_eval_split(cfg.data)


class SplitTexts:
    """The transcripts of the training split's rows that ``data.languages`` keeps (an Arrow
    split's or a stream's), read only when iterated (a BPE trained from scratch): a given or
    pretrained tokenizer never reads them, so start-up holds no list of every text.
    :meth:`languages` are the codes that BPE gets tokens for.

    The BPE is a from-scratch model's, so rows are keyed as a multilingual model trains them
    (:func:`~asrforge.data.rules.row_language`): one with no language is kept only without a
    filter.
    """

    def __init__(
        self, cfg: DataConfig, split=None, eval_split=None, *, stream: StreamedSplit | None = None
    ):
        self.cfg, self.split, self.eval_split, self.stream = cfg, split, eval_split, stream
        self.keep = language_filter(cfg.languages)

    def __iter__(self):
        if self.stream is not None:
            # the stream leaves out the same rows, on the pass that counts its languages
            yield from self.stream.texts()
            return
        rows = self.split.select_columns(["text", "language"]).with_format("arrow")
        for batch in rows.iter(batch_size=4096):
            kept = kept_rows(batch.column("language"), self.keep, multilingual=True)
            yield from batch.column("text").filter(kept).to_pylist()

    def languages(self) -> set[str]:
        """The language codes of the training and evaluation splits (their language columns; a
        stream's were counted by a pass over its texts, when one was made) that ``data.languages``
        keeps: the evaluation split's rows are left out by the same filter."""
        found = set(self.stream.language_counts()) if self.stream else split_languages(self.split)
        if self.eval_split is not None:
            found |= split_languages(self.eval_split)
        return found if self.keep is None else found & self.keep

    def nothing_kept(self) -> UserError | None:
        """The error :func:`build_datasets` would give a training split whose every row
        ``data.languages`` leaves out (the BPE has nothing to learn from, and comes first), or
        None."""
        if self.keep is None:
            return None
        if self.stream is not None:
            left_out, total = self.stream.left_out(), len(self.stream)
        else:
            counts = trained_languages(language_value_counts(self.split), multilingual=True)
            left_out = left_out_counts(counts, self.keep)
            total = len(self.split)
        if not total or sum(left_out.values()) < total:
            return None
        report = SkipReport(self.cfg.train_split, total, left_out=left_out)
        return report.nothing_usable(self.cfg.path, self.cfg.languages)


def build_datasets(
    cfg: TrainConfig,
    out: Path,
    acc,
    bundle: BuiltModel,
    train_split,
    eval_split,
    *,
    resume_from: TrainingCheckpoint | None = None,
) -> tuple[SpeechDataset, SpeechDataset, SkipReport]:
    """The training and evaluation data sets: each split's usable utterances (the skipped ones
    reported in the log and ``skipped-<split>.json``), and the training split's report; no
    usable training utterance is a UserError, and neither is, resuming, usable training
    utterances other than the checkpoint's (:func:`check_resume_data`).

    The training split is prepared lazily (:func:`prepare_split`: metadata up front, audio and
    labels checked in the workers) unless packing or a cache needs every clip's duration,
    tokens or audio key first; the evaluation split (small) is checked in full.
    """
    config = bundle.model.config
    kw = dict(
        cfg=cfg.data,
        tokenizer=bundle.tokenizer,
        specials=bundle.specials,
        max_target_positions=config.max_target_positions,
        max_seconds=window_seconds(config),
    )
    data = cfg.data
    # replay joins utterances checked in full (a lazy table's checks are its own rows')
    lazy = not (
        data.pack.enabled or data.cache_features or data.cache_encoder or data.replay
        or data.filter_wer is not None
    )  # fmt: skip
    # a split checked in full is cached: rank zero checks it, the others (and a resume) read it
    kw["cache"] = Path(data.cache_dir or out / "cache") / "prepared"
    (train_utts, train_report), (eval_utts, eval_report) = main_process_first(
        acc,
        lambda: (
            prepare_split(train_split, data.train_split, lazy=lazy, **kw),
            prepare_split(eval_split, data.eval_split, **kw),
        ),
    )
    if cfg.data.max_eval_samples:
        eval_utts = eval_utts[: cfg.data.max_eval_samples]
    eot = bundle.specials.eot
    if data.filter_wer is not None and train_utts:
        scored = SpeechDataset(train_split, train_utts, bundle.features, eot)
        train_utts = main_process_first(
            acc,
            lambda: filter_transcripts(
                cfg, kw["cache"].parent, scored, train_report, model=bundle.model,
                tokenizer=bundle.tokenizer, eot=eot, device=acc.device,
            ),
        )  # fmt: skip
    fingerprint = train_utts.fingerprint()
    if resume_from is not None and train_utts:
        recorded = resume_from.train_state.get("train_data")
        # an older checkpoint's fingerprint is compared with one made its way
        now = train_utts.fingerprint_as(recorded, resume_from.path) if recorded else fingerprint
        check_resume_data(recorded, now, resume_from.path,
                          f"data.path {data.path} (split {data.train_split})", log,
                          compared=fingerprint_compares(now))  # fmt: skip
    for r in (train_report, eval_report):
        r.log(out if acc.is_main_process else None)
    if not train_utts:
        raise train_report.nothing_usable(cfg.data.path, cfg.data.languages)
    if not eval_utts:
        raise eval_report.nothing_usable(cfg.data.path, cfg.data.languages)
    if data.replay is not None:
        # the replay rows are checked against the run's replay.json, not the fingerprint
        train_split, train_utts = join_replay(
            cfg, out, acc, kw, train_split, train_utts, resuming=resume_from is not None
        )
    train_set = SpeechDataset(train_split, train_utts, bundle.features, eot)
    train_set.fingerprint = fingerprint
    if isinstance(train_utts, ReplayUtterances):
        train_set.replay_from = train_utts.first_replay
    train_set.language_after = language_label_after(bundle.specials, cfg.data.language_target)
    # training only: the evaluation set never augments
    train_set.augment = build_augmenter(
        cfg.data.augment, seed=cfg.seed, window_seconds=window_seconds(config)
    )
    return train_set, SpeechDataset(eval_split, eval_utts, bundle.features, eot), train_report


def join_replay(
    cfg: TrainConfig, out: Path, acc, kw: dict, train_split, train_utts, *, resuming: bool
) -> tuple[JoinedRows, ReplayUtterances]:
    """``data.replay``: the training rows and utterances with the replay set's drawn ones after
    them (:func:`draw_replay`)."""
    replay_split, utts, picks = draw_replay(cfg, out, acc, kw, len(train_utts), resuming=resuming)
    joined = JoinedRows(train_split, replay_split)
    return joined, ReplayUtterances(train_utts, utts, picks, row_offset=joined.offset)


def draw_replay(
    cfg: TrainConfig, out: Path, acc, kw: dict, n_train: int, *, resuming: bool
) -> tuple[Any, Sequence, np.ndarray]:
    """``data.replay``: the replay split, its usable utterances (checked in full, the skipped
    ones reported as ``skipped-replay.json``) and the picks that join ``n_train`` training
    utterances.

    Raises:
        UserError: the replay data is the guard's or holds its clips, cannot be read, has no
            usable utterance, or (resuming) is not the data the run started with.
    """
    data = cfg.data
    replay = data.replay
    replay_split = read_replay(replay, data.cache_dir)
    if cfg.eval.guard is not None:
        guard_files = guard_clip_files(cfg.eval.guard, data.cache_dir)
        check_apart_from_guard(replay_split, replay, cfg.eval.guard.path, guard_files)
    check_same_replay(replay_split, replay, out, resuming=resuming, is_main=acc.is_main_process)
    # the replay set keeps its own languages: data.languages picks the training rows
    kw = {**kw, "cfg": data.model_copy(update={"languages": None})}
    utts, report = main_process_first(acc, lambda: prepare_split(replay_split, "replay", **kw))
    report.log(out if acc.is_main_process else None)
    if not utts:
        raise UserError(f"data.replay: no usable utterances in {replay.path} ({report.total} rows)")
    picks = replay_picks(len(utts), replay_count(n_train, replay.share), cfg.seed)
    log.info(
        "data.replay: %d utterances drawn from %d usable ones of %s (languages %s) join the %d "
        "training utterances (%.0f%% replay)",
        len(picks),
        len(utts),
        replay.path,
        ", ".join(sorted(language_counts(utts))),
        n_train,
        100 * len(picks) / (len(picks) + n_train),
    )
    return replay_split, utts, picks


def build_stream_datasets(
    cfg: TrainConfig,
    out: Path,
    acc,
    bundle: BuiltModel,
    stream: StreamedSplit,
    eval_split,
    *,
    resuming: bool = False,
) -> tuple[StreamedSplit, SpeechDataset, SkipReport]:
    """``data.stream``: the stream, given what its rows are checked and featurized with (they
    are checked as they stream by), the evaluation data set as :func:`build_datasets` makes it,
    and the training split's report: nothing skipped yet (its rows' drops come in during
    training, as a lazily prepared split's), the rows ``data.languages`` leaves out counted; a
    filter that leaves nothing is a UserError, as for a map-style split."""
    config = bundle.model.config
    limits = dict(
        max_target_positions=config.max_target_positions, max_seconds=window_seconds(config)
    )
    stream.prepare(
        tokenizer=bundle.tokenizer,
        specials=bundle.specials,
        features=bundle.features,
        eot=bundle.specials.eot,
        **limits,
    )
    stream.augment = build_augmenter(
        cfg.data.augment, seed=cfg.seed, window_seconds=window_seconds(config)
    )
    train_report = SkipReport(cfg.data.train_split, total=len(stream), left_out=stream.left_out(),
                              read_checks=CHECKED_AS_READ)  # fmt: skip
    kw = dict(cfg=cfg.data, tokenizer=bundle.tokenizer, specials=bundle.specials, **limits)
    eval_utts, eval_report = prepare_split(eval_split, cfg.data.eval_split, **kw)
    if cfg.data.max_eval_samples:
        eval_utts = eval_utts[: cfg.data.max_eval_samples]
    for r in (train_report, eval_report):
        r.log(out if acc.is_main_process else None)
    if train_report.n_left_out == train_report.total:
        raise train_report.nothing_usable(cfg.data.path, cfg.data.languages)
    if not eval_utts:
        eval_path = cfg.data.stream.eval_path or cfg.data.path
        raise eval_report.nothing_usable(eval_path, cfg.data.languages)
    if cfg.data.replay is not None:  # checked in full now; the training rows as they stream
        kw["cache"] = Path(cfg.data.cache_dir or out / "cache") / "prepared"
        n_train = train_report.total - train_report.n_left_out
        replay_split, utts, picks = draw_replay(cfg, out, acc, kw, n_train, resuming=resuming)
        stream.join_replay(replay_split, utts, picks)
    eval_set = SpeechDataset(eval_split, eval_utts, bundle.features, bundle.specials.eot)
    return stream, eval_set, train_report


def attach_feature_cache(
    cfg: TrainConfig,
    out: Path,
    acc,
    bundle: BuiltModel,
    train_set: SpeechDataset,
    eval_set: SpeechDataset,
) -> None:
    """``data.cache_features``: log-mels once, for both splits; the other ranks open the result."""
    feature_root = Path(cfg.data.cache_dir or out / "cache") / "features"
    features = (
        FeatureCache.build(feature_root, train_set, eval_set) if acc.is_main_process else None
    )
    acc.wait_for_everyone()
    if features is None:
        features = FeatureCache.open(feature_root, bundle.features)
    train_set.feature_cache = eval_set.feature_cache = features


def build_run_packing(cfg: TrainConfig, bundle: BuiltModel, train_set: SpeechDataset) -> Packing:
    """``data.pack``: the packed training windows of each epoch."""
    config = bundle.model.config
    packing = build_packing(
        cfg.data.pack,
        train_set,
        tokenizer=bundle.tokenizer,
        no_timestamps=bundle.specials.no_timestamps,
        seed=cfg.seed,
        window_seconds=window_seconds(config),
        max_positions=config.max_target_positions,
    )
    if cfg.data.cache_features:
        log.info(
            "data.cache_features with packing: the cache serves evaluation and the "
            "windows holding one utterance at offset 0; packed windows are computed "
            "from audio (a window's log-mels are not its clips' log-mels side by side)"
        )
    return packing


def attach_encoder_cache(
    cfg: TrainConfig, out: Path, acc, model, train_set: SpeechDataset, precision: str
) -> None:
    """``data.cache_encoder``: the frozen part's output (the whole encoder's or the lower
    layers'), computed once per training utterance by rank zero; the other ranks open it."""
    cache_root = Path(cfg.data.cache_dir or out / "cache") / "encoder"
    encoder, top = model.model.encoder, cfg.model.trained_top_encoder_layers
    producer = {
        **frozen_part_id(encoder, top),
        "precision": precision,
        "attn_implementation": str(model.config._attn_implementation),  # noqa: SLF001
    }
    build = functools.partial(
        EncoderCache.build,
        cache_root,
        encoder,
        train_set,
        producer=producer,
        forward=functools.partial(encode_frozen_part, encoder, top=top),
    )
    if acc.is_main_process:
        train_set.encoder_cache = build(
            batch_size=eval_batch_size(cfg.data.eval_batch_size, cfg.data.batch_size),
            autocast=acc.autocast,
        )
    acc.wait_for_everyone()
    if not acc.is_main_process:
        train_set.encoder_cache = build(batch_size=1, autocast=acc.autocast)


def build_text_batches(cfg: TrainConfig, bundle: BuiltModel, langs: Counter) -> TextBatches:
    """``data.asr_ratio < 1``: text-only batches in the run's language, the file checked now."""
    text_language = (cfg.data.languages or [None])[0] or langs.most_common(1)[0][0]
    text = TextBatches(
        cfg.data.text_path,
        tokenizer=bundle.tokenizer,
        prompt=bundle.specials.prompt(text_language),
        eot=bundle.specials.eot,
        batch_size=cfg.data.batch_size,
        max_len=bundle.model.config.max_target_positions,
        max_lines=cfg.data.max_text_lines,
        seed=cfg.seed,
    )
    text.check()
    log.info(
        "text-only batches: %.0f%% of micro-batches, %s lines of %s (language %s)",
        100 * (1 - cfg.data.asr_ratio),
        cfg.data.max_text_lines or "all",
        cfg.data.text_path,
        text_language,
    )
    return text
