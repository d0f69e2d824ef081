"""The ``data:`` section of the run's schema and its parts: where the speech comes from, its
columns, the evaluation carve, streaming, packing, augmentation, sampling and rehearsal."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from asrforge.config.section import PathOrHubId, Section


class PackConfig(Section):
    """Packed training windows (Whisper's own recipe): several utterances of one language in one
    window, separated by short silences, their transcripts joined; a share of windows in
    timestamp mode (``<|t_start|> text <|t_end|>`` per utterance, no ``<|notimestamps|>``) and a
    share conditioned on the previous text (``<|startofprev|>`` + a transcript). Which
    utterances share a window is a pure function of (seed, epoch), so resume stays exact.
    Evaluation is never packed."""

    enabled: bool = False
    """Train on packed windows instead of one utterance per window."""
    max_seconds: float | None = Field(default=None, gt=0)
    """Fill each window up to this many seconds of audio (silences included); default the model's
    window (30 s for Whisper, ``model.max_source_positions / 50`` for a model built here). At most
    the model's window. An utterance longer than this stays alone in its window."""
    gap_seconds: tuple[float, float] = (0.1, 0.6)
    """Range of the silence before each utterance of a packed window, drawn uniformly."""
    single_share: float = Field(default=0.1, ge=0, le=1)
    """Fraction of the windows that hold a single utterance, alone at offset 0 (as in
    short-form use); the rest are packed."""
    timestamp_share: float = Field(default=0.5, ge=0, le=1)
    """Fraction of windows trained in timestamp mode. Needs timestamp tokens (``<|0.00|>`` right
    after ``<|notimestamps|>``, 0.02 s apart, as every Whisper tokenizer has); a tokenizer
    trained here gets them up to the model's window; with other tokenizers that lack them the
    log says so and timestamp mode stays off."""
    prev_text_share: float = Field(default=0.2, ge=0, le=1)
    """Fraction of windows whose prompt starts with ``<|startofprev|>`` and the transcript of the
    window before it of the same language (never a target; at most half the decoder's
    positions, cut from the left), as ``condition_on_previous_text`` decoders feed it."""

    @model_validator(mode="after")
    def _gap_range(self) -> PackConfig:
        lo, hi = self.gap_seconds
        if not 0 <= lo <= hi:
            raise ValueError(
                f"gap_seconds: must be [min, max] with 0 <= min <= max, got [{lo}, {hi}]"
            )
        return self


class SpecAugmentConfig(Section):
    """SpecAugment (Park et al., 2019) on the log-mel features of training windows: bands of mel
    bins and spans of frames set to zero. The defaults are LibriSpeech's LD policy."""

    freq_masks: int = Field(default=2, ge=0)
    """Frequency masks per window."""
    freq_width: int = Field(default=27, ge=0)
    """Widest frequency mask, in mel bins (each mask's width is drawn from 0 to this)."""
    time_masks: int = Field(default=2, ge=0)
    """Time masks per window, placed within its audio (never in the padding)."""
    time_width: int = Field(default=100, ge=0)
    """Widest time mask, in frames (10 ms each)."""
    max_time_share: float = Field(default=0.2, gt=0, le=1)
    """A time mask covers at most this share of the window's audio (a short clip gets short
    masks)."""


class SpeedConfig(Section):
    """Speed perturbation (as Kaldi's): the clip is resampled so it plays faster or slower,
    pitch included. One factor per utterance and epoch, drawn uniformly from ``factors``."""

    factors: list[float] = Field(default_factory=lambda: [0.9, 1.0, 1.1], min_length=1)
    """Speed factors to draw from, each 0.5 to 2 (1.1: 10% faster and shorter), applied in
    steps of 1/160 (the audio is resampled from a multiple of 100 Hz)."""

    @model_validator(mode="after")
    def _factor_range(self) -> SpeedConfig:
        bad = [f for f in self.factors if not 0.5 <= f <= 2.0]
        if bad:
            raise ValueError(f"factors: each must be between 0.5 and 2, got {bad[0]:g}")
        return self


class NoiseConfig(Section):
    """Background noise from your own recordings, mixed into training clips."""

    path: Path
    """A directory of noise recordings (wav, flac, ogg, mp3; searched recursively)."""
    snr_db: tuple[float, float] = (10.0, 30.0)
    """Signal-to-noise ratio range in dB; each noisy clip draws one uniformly."""
    share: float = Field(default=0.5, ge=0, le=1)
    """Fraction of the training clips that get noise."""

    @model_validator(mode="after")
    def _snr_range(self) -> NoiseConfig:
        lo, hi = self.snr_db
        if lo > hi:
            raise ValueError(f"snr_db: must be [min, max] with min <= max, got [{lo}, {hi}]")
        return self


class AugmentConfig(Section):
    """Training-time augmentation, in the DataLoader workers and never in evaluation. Every draw
    is a pure function of (seed, utterance, epoch), so resume stays exact. The audio
    augmentations (speed, noise, transforms) cannot be served from ``data.cache_features`` or
    ``data.cache_encoder``; SpecAugment can use the log-mel cache."""

    spec_augment: SpecAugmentConfig | None = None
    """SpecAugment masks on the log-mel features (``{}`` for the defaults)."""
    speed: SpeedConfig | None = None
    """Speed perturbation (``{}`` for factors 0.9, 1.0, 1.1)."""
    noise: NoiseConfig | None = None
    """Noise mixed in at a drawn SNR."""
    transforms: list[str] = Field(default_factory=list)
    """Your own waveform transforms ``f(wave, rng) -> wave``, applied in order after noise: names
    registered with ``asrforge.data.augment.register_transform``, or ``"module:function"``,
    which imports code and needs ``--allow-external-callbacks``."""


class ColumnsConfig(Section):
    """Which of the data's columns hold what; unset: the usual names are looked for."""

    audio: str | None = None
    """The audio: an ``Audio`` feature, encoded bytes, or a file path (relative paths are read
    from the manifest's directory, or ``data.audio_dir``); default ``audio``, ``audio_filepath``
    (NeMo) or ``path``, the first present."""
    text: str | None = None
    """The transcript (``sentence`` in Common Voice, ``raw_transcription`` in FLEURS); default
    ``text``."""
    language: str | None = None
    """The language: an ISO or Whisper code, an English name (``English``) or a locale (``sv-SE``,
    ``zh-CN``); default ``language`` or ``lang`` (NeMo), or ``data.language`` for all."""
    id: str | None = None
    """An utterance id for reports; default ``id``, else the audio's path as the data gives it, or
    ``<split>-<row>``."""
    duration: str | None = None
    """The audio's duration in seconds (NeMo's ``duration``); default ``duration`` when present.
    With it, start-up reads no audio: a clip out of range (<= 0 s, longer than the model's
    window) is skipped up front, the others are checked when a worker loads them."""


class CarveConfig(Section):
    """An evaluation split held out of the training split: the same rows for a given data set,
    ``size`` and ``seed``, whatever the run's seed (runs of one matrix compare on one split)."""

    size: float = Field(gt=0)
    """Rows to hold out: a count (``200``) or, below 1, a fraction of the training rows (``0.05``)."""
    seed: int = 0
    """Seed of the draw."""

    @field_validator("size")
    @classmethod
    def _count_or_fraction(cls, v: float) -> float:
        if v >= 1 and v != int(v):
            raise ValueError(f"a count (a whole number) or a fraction below 1, got {v:g}")
        return v


class StreamConfig(Section):
    """Stream the training split from its files instead of reading it whole before step 1 (see
    README "Streaming"): for corpora too large to convert or index. Each epoch's row order is a
    pure function of (seed, epoch) and the position is part of the run's state, so a resumed run
    continues with exactly the rows an uninterrupted one would have seen. The evaluation split is
    read as usual (it is small)."""

    enabled: bool = False
    """Stream the training split: a directory of parquet, arrow, jsonl/json, csv or tsv files
    (the ``train*`` ones) or one JSONL/CSV/TSV manifest. Only the shards being read are in
    memory; rows are checked as they stream by and skipped ones are reported as usual."""
    shard_rows: int = Field(default=10_000, gt=0)
    """Lines of a JSONL file read as one shard (a JSONL file is cut at line starts; a parquet
    shard is a row group, an arrow, csv or tsv file is one shard)."""
    shuffle_shards: int = Field(default=4, gt=0)
    """Shards whose rows are shuffled together (the shards' order is shuffled too, every
    epoch): each DataLoader worker holds the rows of about this many shards in memory."""
    eval_path: Path | None = None
    """Where the evaluation split is read from (any form ``data.path`` takes: its
    ``data.eval_split`` split, or one file that is that split); default ``data.path``'s own
    ``data.eval_split`` files."""


class SamplingConfig(Section):
    """Language sampling for multilingual training: each epoch (as long as the training set)
    draws its utterances by language at these shares instead of each utterance once; a small
    language's utterances repeat, a large one's are thinned. Give ``weights`` or
    ``temperature``. Each epoch's draw is a pure function of (seed, epoch), so resume stays
    exact; with ``pack.enabled`` the drawn utterances are what the windows hold. With
    ``stream.enabled`` the languages' sizes come from a read of the language column at start-up
    and each row appears as many times as drawn for it (on average ``share * N / n_l``), so an
    epoch is about as long as the training set; a thinned language's rows are not taken each
    once before any twice (docs/data.md, streaming)."""

    weights: dict[str, float] | None = None
    """Per-language weights, e.g. ``{es: 2, en: 1}``: a language's share is its weight over
    their sum. Every language of the training set needs one (0 leaves it out)."""
    temperature: float | None = Field(default=None, gt=0)
    """Shares by the languages' sizes ``n_l ** (1 / temperature)`` over their sum: 1 keeps the
    data's shares, larger ones move toward equal shares (multilingual pretraining uses 3 to
    5)."""

    @field_validator("weights")
    @classmethod
    def _weights_not_negative(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        bad = {k: w for k, w in (v or {}).items() if not w >= 0 or w == float("inf")}
        if bad:
            raise ValueError(f"must be finite and >= 0, got {bad}")
        return v

    @model_validator(mode="after")
    def _one_way(self) -> SamplingConfig:
        if (self.weights is None) == (self.temperature is None):
            raise ValueError("give one of weights and temperature")
        return self


class ReplayConfig(Section):
    """Rehearsal: rows of another data set (the languages and domain the model already handles)
    mixed into the training utterances under their own language tag, so fine-tuning keeps
    practising what it must not forget. Which replay rows join is a pure function of
    (``seed``, the replay set), fixed for the run, so resume stays exact. With
    ``stream.enabled`` the replay set is read whole before step 1 and its drawn rows join each
    streamed epoch once. See docs/training.md, "Learning without forgetting"."""

    path: PathOrHubId
    """The replay data, in any form ``data.path`` takes. Never the guard's set
    (``eval.guard.path``) or data holding its clips: that is refused, since the guard would
    then measure what the run trained on."""
    share: float = Field(default=0.2, gt=0, lt=1)
    """The share of the training utterances that are replay rows: ``n_train * share / (1 -
    share)`` rows are drawn from the replay set (repeating it when it is smaller)."""
    language: str | None = None
    """The language of every replay row (its tag in the prompt) when the data has no language
    column (a code, an English name or a locale)."""
    split: str = "train"
    """The split of replay data with splits (a single file is read whole)."""
    columns: ColumnsConfig = Field(default_factory=ColumnsConfig)
    """The replay data's column names, as ``data.columns`` gives them."""
    audio_dir: Path | None = None
    """Where the replay data's relative audio paths are read from; default its manifest's
    directory."""


class DataConfig(Section):
    """Where the speech comes from and how it is batched."""

    path: PathOrHubId
    """The data (see README "Your data"): a Hugging Face Hub data set id
    (``mozilla-foundation/common_voice_17_0``, ``google/fleurs``; see ``subset``, ``revision``);
    a ``save_to_disk`` ``DatasetDict`` or ``Dataset``; a directory of parquet, arrow, jsonl/json,
    csv or tsv files whose names start with their split (``train-0000.parquet``,
    ``validation.jsonl``, ``dev.csv`` is ``validation``), or a Hub data set's files with its
    README.md declaring its configurations; an fsspec URL of such a directory (``s3://``,
    ``gs://``, ``hf://``; with ``stream.enabled``); or one such file, the training split: a JSONL
    manifest (NeMo: ``audio_filepath``, ``text``, ``duration``, optional ``lang``) or a CSV/TSV
    with a header row. See ``columns`` for the column names. An existing local path wins over a
    Hub id; ``./name`` is always local."""
    subset: str | None = None
    """The data set's configuration (the Hub's ``name``/subset, e.g. ``sw`` of Common Voice,
    ``es_419`` of FLEURS), as its README.md declares them; needed when it declares several and
    none is the default."""
    revision: str | None = None
    """The Hub revision of ``path`` (a branch, tag or commit); default its main branch. Pinning
    a commit keeps a resumed run on the data it started with."""
    generate: Literal["tones"] | None = None
    """Build this small synthetic data set at ``path`` when it is missing (deterministic)."""
    columns: ColumnsConfig = Field(default_factory=ColumnsConfig)
    """The data's column names, e.g. ``{audio: path, text: sentence, language: locale}``."""
    language: str | None = None
    """The language of every utterance when the data has no language column (a code, an English
    name or a locale)."""
    audio_dir: Path | None = None
    """Where relative audio paths are read from; default the directory of the manifest (of
    ``path`` itself when it is a directory)."""
    train_split: str = "train"
    """The split of ``path`` that trains."""
    eval_split: str = "validation"
    """The evaluation split's name: one of the data's splits, or the split ``eval_carve`` holds
    out of the training split."""
    eval_carve: CarveConfig | None = None
    """Hold the evaluation split out of the training split (for data without one), e.g.
    ``{size: 0.05, seed: 0}``, stratified by language (each language with two rows or more
    gets its share, at least one). The held-out rows are recorded in the run directory
    (``eval_carve.json``, with fingerprints of the data): a resumed run evaluates on the same
    rows and trains on the rest, and refuses data that changed."""
    languages: list[str] | None = None
    """Keep only utterances of these languages; default all. Codes, English names and locales
    are resolved alike here and in the data's ``language`` column (``en``, ``English``,
    ``en-US`` are one language; ``zh-HK`` is Cantonese, ``yue``)."""
    language_tokens: dict[str, str] | None = None
    """Decode a language that has no token of its own under another language's token, e.g.
    ``{lg: sw}`` trains Ganda under ``<|sw|>`` (the run is still selected as Ganda). Without a
    mapping such utterances are skipped ("language 'lg' without a token"), unless the tokenizer
    is a vocabulary extension that added the language's token (``asrforge vocab build``)."""
    language_target: bool = True
    """Train the language token: the position of ``<|startoftranscript|>`` is labelled with the
    row's language token, as in Whisper's own training and transformers' fine-tuning recipe, so
    the model learns to detect the languages it is taught (``transcribe`` detects the language
    unless told). ``false``: the whole prompt is context, never a target. English-only models
    have no language token; nothing changes there."""
    task: Literal["transcribe", "translate"] = "transcribe"
    """Whisper's task token: ``transcribe`` (text in the spoken language) or ``translate``
    (English text)."""
    batch_size: int = Field(default=8, gt=0)
    """Utterances per micro-batch (per process); with ``pack.enabled``, windows (each holds
    several utterances)."""
    eval_batch_size: Annotated[int, Field(gt=0)] | Literal["auto"] | None = None
    """Utterances per evaluation batch; null: ``batch_size``. auto: on a GPU the largest batch
    whose evaluation fits in 80% of its memory (a power of two times ``batch_size``, at most
    512; probed once per model shape and device), since greedy decoding there is bound by
    kernel launches and a larger batch decodes more utterances per second; on the CPU, and in
    a run of several processes, ``batch_size``. Measured on an H100 with the log-mels computed
    by the DataLoader's workers, it was slower per utterance than a batch of 16: the large batch
    waits on its data (bench/README.md)."""
    num_workers: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    """DataLoader worker processes per training process that load audio and compute the log-mel
    features (0: in the main process; a count is capped at the cores the process may use).
    ``auto``: on a GPU, the process's share of the cores less one, at most 4, with pinned memory;
    on a CPU, where the step needs the cores, a worker per four spare cores (0 on 2 or 3 cores)."""

    @field_validator("num_workers", mode="before")
    @classmethod
    def _a_count_or_auto(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        if isinstance(v, str) and v.isdigit():
            return int(v)
        raise ValueError(f"must be a number of workers (0 or more) or auto, got {v!r}")

    max_eval_samples: int | None = Field(default=None, gt=0)
    """Evaluate on the first N utterances of the evaluation split only."""
    cache_encoder: bool = False
    """With ``model.freeze_encoder`` or ``model.train_encoder_layers``: compute the frozen part's
    output (the whole encoder's, or the states entering the first trained layer) once per
    training utterance, keep it on disk (memory-mapped, keyed by the audio's hash and by the
    frozen weights, the split point and the precision) and reuse it every epoch, so training
    costs only the trained part."""
    cache_features: bool = False
    """Compute each utterance's log-mel features once (training and evaluation splits), keep them
    on disk trimmed of the window's padding (read back bit for bit; keyed by the audio's hash and
    the feature extractor's settings) and read them instead of decoding audio every epoch."""
    cache_dir: Path | None = None
    """Where caches live; default ``output_dir/cache``. Share it between runs to reuse them."""
    asr_ratio: float = Field(default=1.0, gt=0, le=1)
    """Fraction of training micro-batches that are speech; the rest are text-only language-model
    batches from ``text_path`` (decoder only, no audio). With 0.5 every other micro-batch is
    text-only; which ones is a pure function of (seed, micro-batch index)."""
    text_path: Path | None = None
    """A UTF-8 text file in the run's language, one sentence per line, for the text-only batches.
    Streamed: only the lines used are ever read."""
    max_text_lines: int | None = Field(default=None, gt=0)
    """Use the first N lines of ``text_path`` (then start over); default all of them."""
    pack: PackConfig = Field(default_factory=PackConfig)
    """Packed training windows with timestamp and previous-text targets (see ``PackConfig``)."""
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    """Training-time augmentation: SpecAugment, speed, noise, your transforms (see
    ``AugmentConfig``); off by default."""
    stream: StreamConfig = Field(default_factory=StreamConfig)
    """Stream the training split from its files (see ``StreamConfig``); off by default."""
    sampling: SamplingConfig | None = None
    """Language sampling for multilingual mixes: ``{weights: {es: 2, en: 1}}`` or
    ``{temperature: 3}`` (see ``SamplingConfig``); off by default (each utterance once an
    epoch)."""
    filter_wer: float | None = Field(default=None, gt=0)
    """Drop training rows whose transcript the starting model (``model.pretrained``) disagrees
    with by more than this WER (its greedy transcript against the row's, normalized as
    evaluation normalizes them; 0.5 drops rows it gets more than half wrong): each row is
    scored once, cached by fingerprint under ``cache_dir``, and the dropped rows are listed in
    ``skipped-<split>.json``. Costs one decoding pass over the training split before step 1,
    the first time. Not with ``stream.enabled``."""
    replay: ReplayConfig | None = None
    """Rehearsal: mix a share of another data set into the training utterances, e.g. ``{path:
    data/en, share: 0.2, language: en}`` (see ``ReplayConfig``); off by default."""

    @model_validator(mode="after")
    def _text_only_needs_text(self) -> DataConfig:
        if self.asr_ratio < 1.0 and self.text_path is None:
            raise ValueError(
                f"text_path: needed for text-only batches (asr_ratio is {self.asr_ratio:g} < 1)"
            )
        return self

    @model_validator(mode="after")
    def _streaming_reads_rows_once_in_order(self) -> DataConfig:
        if not self.stream.enabled:
            return self
        # each needs every training row before step 1, which is what streaming avoids
        why = {
            "pack.enabled": "packed windows are composed from every utterance's duration",
            "cache_features": "the log-mel cache is built from every utterance first",
            "cache_encoder": "the encoder cache is built from every utterance first",
            "eval_carve": "a carve holds rows out of the whole training split: give the "
            "evaluation split its own file (stream.eval_path)",
            "filter_wer": "every training row is scored before step 1",
        }
        on = {
            "pack.enabled": self.pack.enabled,
            "cache_features": self.cache_features,
            "cache_encoder": self.cache_encoder,
            "eval_carve": self.eval_carve is not None,
            "filter_wer": self.filter_wer is not None,
        }
        problems = [f"{name}: not available with stream.enabled ({why[name]})"
                    for name, value in on.items() if value]  # fmt: skip
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _caches_serve_unaugmented_inputs(self) -> DataConfig:
        aug = self.augment
        audio = [n for n in ("speed", "noise") if getattr(aug, n) is not None]
        audio += ["transforms"] if aug.transforms else []
        if self.cache_features and audio:
            raise ValueError(
                f"cache_features: the log-mel cache holds un-augmented features, so it cannot serve "
                f"augment.{audio[0]} (which changes the audio); turn one of them off"
            )
        if self.cache_encoder and (audio or aug.spec_augment is not None):
            what = audio[0] if audio else "spec_augment"
            raise ValueError(
                f"cache_encoder: cached encoder states are computed from un-augmented inputs, so "
                f"they cannot serve augment.{what}; turn one of them off"
            )
        return self
