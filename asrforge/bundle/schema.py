"""The inference bundle's schema: ``InferenceConfig``, derived from ``TrainConfig`` by an allow-list.

Every field of ``TrainConfig`` (recursively, section by section) is listed either in
:data:`TRAINING_ONLY` or in :data:`INFERENCE_FIELDS`, never both. ``InferenceConfig`` is built
from the inference side of that split (the fields keep their types, defaults and docstrings) plus
the bundle's own facts (:class:`BundleFacts`), with ``extra="forbid"`` throughout.
:func:`unclassified_fields` is the contract guard: a field added to the training config without
deciding whether inference needs it makes the test suite fail, naming the field.

``bundle_version`` is semver: a major bump means an older asrforge cannot read the bundle (it is
refused, naming the version needed); a minor bump only adds optional fields (an older asrforge
drops those it does not know, with a warning).
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Mapping
from importlib import metadata
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from asrforge.config import SHAPE_FIELDS, TrainConfig, format_errors
from asrforge.data.audio import SAMPLE_RATE
from asrforge.errors import CheckpointCorruptError, CheckpointNotSupportedError

log = logging.getLogger(__name__)

# Version 1.1 added data.language_tokens, 1.2 the n-gram LM, 1.3 trained_languages and 1.4 the
# ggml format.
BUNDLE_VERSION = "1.4.0"
"""The bundle format this asrforge writes (and the newest it reads)."""
INFERENCE_CONFIG = "inference_config.json"

ALL = "*"
"""A whole field or section: every field under it is on this side of the split."""

Split = Mapping[str, Any]  # field name -> ALL, or a nested Split for a section

TRAINING_ONLY: Split = {
    "output_dir": ALL,
    "seed": ALL,
    "optim": ALL,
    "train": ALL,
    "selection": ALL,
    "checkpoint": ALL,
    "callbacks": ALL,
    "model": {
        # The path is on the training machine, and the bundle holds the weights themselves.
        "pretrained": ALL,
        # The bundle holds the tokenizer files, as it holds the weights.
        "tokenizer": ALL,
        "bpe_vocab_size": ALL,
        "dropout": ALL,
        "gradient_checkpointing": ALL,
        "freeze_encoder": ALL,
        "train_encoder_layers": ALL,
        # The vocabulary size before an extension is history once the bundle has the tokenizer.
        "base_vocab_size": ALL,
        # Export merges the adapters, so the bundle holds plain Whisper weights.
        "lora": ALL,
    },
    "data": {
        "path": ALL,
        # Where the training data came from; the model card names them (bundle/card.py).
        "subset": ALL,
        "revision": ALL,
        "generate": ALL,
        "columns": ALL,
        # The bundle records the languages the training data had, not this setting.
        "language": ALL,
        "audio_dir": ALL,
        "train_split": ALL,
        "eval_split": ALL,
        "eval_carve": ALL,
        # The training filter is dropped, as the bundle records the languages it saw.
        "languages": ALL,
        # What the loss covered; the model decodes the same either way.
        "language_target": ALL,
        "batch_size": ALL,
        "eval_batch_size": ALL,
        "num_workers": ALL,
        "max_eval_samples": ALL,
        "cache_encoder": ALL,
        "cache_features": ALL,
        "cache_dir": ALL,
        "asr_ratio": ALL,
        "text_path": ALL,
        "max_text_lines": ALL,
        # How training windows were composed does not matter to inference, which decodes any audio.
        "pack": ALL,
        # Inference never augments.
        "augment": ALL,
        "stream": ALL,  # how the training split was read
        "replay": ALL,  # rehearsal rows mixed into training
        "sampling": ALL,  # how often each language trained
        "filter_wer": ALL,  # which training rows were left out
    },
    "eval": {
        "eval_steps": ALL,
        "at_start": ALL,
        "at_end": ALL,
        "beam_size": ALL,  # a bundle decodes with the beams its caller asks for
        "compile": ALL,  # captured or not, the hypotheses are the same; the device decides
        # the long-form evaluation's recordings: a bundle's transcribe decodes long audio anyway
        "longform_items": ALL,
        "longform_min_seconds": ALL,
        "longform_max_seconds": ALL,
        "longform_chunking": ALL,
        "longform_vad": ALL,
        "guard": ALL,
        # how the run's evaluations scored; asrforge evaluate takes its own options
        "normalizer": ALL,
    },
}
"""Fields of ``TrainConfig`` an exported model does not need."""

MODEL_SHAPE = (*SHAPE_FIELDS, "vocab_size")
"""The model fields a bundle fills from the exported model (and checks against config.json)."""

INFERENCE_FIELDS: Split = {
    "config_id": ALL,
    "model": {**{name: ALL for name in MODEL_SHAPE}, "attn_implementation": ALL},
    "data": {"task": ALL, "language_tokens": ALL},  # the prompt's language token
    "eval": {"max_new_tokens": ALL},
}
"""Fields of ``TrainConfig`` an exported model keeps (in ``inference_config.json``)."""


MAX_N_FFT = 2048
"""Widest FFT window a bundle's features may ask for, in samples (128 ms at 16 kHz; Whisper's is
400): each window's spectrogram holds ``n_fft / 2 + 1`` bins per frame."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class FeatureConfig(_Strict):
    """The log-mel front end (``WhisperFeatureExtractor`` settings) and optional statistics."""

    feature_size: int = Field(gt=0)
    """Log-mel channels (``num_mel_bins``)."""
    sampling_rate: Literal[SAMPLE_RATE] = SAMPLE_RATE
    """Sample rate the model expects, Hz: asrforge resamples all audio to 16 kHz."""
    hop_length: int = Field(default=160, gt=0)
    """Samples between feature frames (10 ms at 16 kHz)."""
    n_fft: int = Field(default=400, gt=0, le=MAX_N_FFT)
    """Samples of each frame's FFT window (25 ms at 16 kHz)."""
    chunk_length: int = Field(gt=0)
    """The model's window in seconds: ``max_source_positions / 50``."""
    mean: list[float] | None = None
    """Per-channel mean of the log-mels of ``stats_utterances`` training utterances."""
    std: list[float] | None = None
    """Per-channel standard deviation, same utterances."""
    stats_utterances: int = 0
    """How many utterances the statistics come from (0: none computed)."""

    def extractor(self):
        """The ``WhisperFeatureExtractor`` with these settings (what training computed)."""
        from transformers import WhisperFeatureExtractor

        return WhisperFeatureExtractor(
            feature_size=self.feature_size,
            sampling_rate=self.sampling_rate,
            hop_length=self.hop_length,
            chunk_length=self.chunk_length,
            n_fft=self.n_fft,
            padding_value=0.0,
            return_attention_mask=False,
        )

    def problems_with(self, num_mel_bins: int, max_source_positions: int) -> list[str]:
        """What does not fit a Whisper model of ``num_mel_bins`` log-mel channels whose encoder
        takes ``2 * max_source_positions`` frames (``config.json``'s), one line per field.
        Checked before any audio is read, since each window is padded to ``chunk_length``
        seconds before its features are cut to what the encoder takes."""
        problems = []
        if self.feature_size != num_mel_bins:
            problems.append(
                f"features.feature_size: {self.feature_size} log-mel channels, but the model "
                f"takes {num_mel_bins} (config.json num_mel_bins)"
            )
        frames = 2 * max_source_positions
        if self.chunk_length * self.sampling_rate != frames * self.hop_length:
            problems.append(
                f"features.chunk_length: {self.chunk_length} s of {self.hop_length}-sample hops "
                f"at {self.sampling_rate} Hz is not the {frames} frames the model's encoder takes "
                f"(2 x config.json max_source_positions {max_source_positions}): that is "
                f"{frames * self.hop_length / self.sampling_rate:g} s"
            )
        return problems


class LMInfo(_Strict):
    """A word n-gram LM the bundle carries for beam search (``asrforge export --lm``)."""

    file: str = "lm.arpa"
    """The ARPA file in the bundle (listed in the manifest with its sha256, like the weights)."""
    order: int = Field(ge=1)
    """The n of its n-grams."""
    vocab_size: int = Field(ge=1)
    """Its unigrams: the words, ``<s>``, ``</s>`` and ``<unk>``."""
    normalizer: str
    """How its text was normalized, and hypotheses must be before it scores them:
    :func:`asrforge.text.normalize`'s ``english`` (Whisper's English normalizer), ``basic``, or
    ``by-language`` (each language's own)."""
    languages: list[str]
    """The languages of its text; utterances in others are decoded without it."""
    alpha: float = 0.5
    """LM weight when ``asrforge lm tune`` has recorded none (in the manifest's ``lm_weights``)."""
    beta: float = 1.0
    """Word bonus when none is tuned."""


class BundleFacts(_Strict):
    """What a bundle records besides the inference fields of the training config."""

    bundle_version: str = BUNDLE_VERSION
    """Semver of the bundle format (see the module doc)."""
    asrforge_version: str
    """The asrforge that wrote the bundle."""
    format: Literal["hf", "ct2", "ggml"] = "hf"
    """``hf``: transformers safetensors (loadable by ``load_bundle``); ``ct2``: CTranslate2;
    ``ggml``: whisper.cpp's model file (``ggml-model.bin``)."""
    weights: Literal["ema", "raw", "average", "pretrained"]
    """Which weights were exported."""
    multilingual: bool
    """Whether the decoder prompt carries a language and a task token."""
    languages: list[str]
    """Languages the bundle transcribes (ISO codes): a multilingual pretrained base's own and
    those it was trained on; ``transcribe`` accepts these and detects among them."""
    trained_languages: list[str] | None = None
    """The languages of its training data (None: a pretrained model exported as it is)."""
    features: FeatureConfig
    source: dict[str, Any] = Field(default_factory=dict)
    """Where the weights came from: checkpoint path, step, metrics, averaged steps."""
    lm: LMInfo | None = None
    """The word n-gram LM beam search fuses (None: the bundle has none)."""


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model class inside an annotation (``X``, ``X | None``, ``list[X]``, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, UnionType, list, dict, tuple):
        for arg in get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def unclassified_fields(
    root: type[BaseModel] = TrainConfig,
    training_only: Split = TRAINING_ONLY,
    inference: Split = INFERENCE_FIELDS,
    prefix: str = "",
) -> list[str]:
    """The contract guard: every field of ``root`` must be on exactly one side of the split.

    Walks ``root``'s fields recursively (into sections listed field by field).

    Returns:
        One line per problem, by dotted path: a field in neither set, in both, listed field by
        field although it is a value, or a listed name ``root`` does not have. Empty when sound.
    """
    problems = []
    fields = root.model_fields
    for name, field in fields.items():
        path = prefix + name
        t, i = training_only.get(name), inference.get(name)
        if t is None and i is None:
            problems.append(
                f"{path}: in neither TRAINING_ONLY nor INFERENCE_FIELDS (asrforge/bundle/schema.py)"
                " — decide whether an exported model needs it"
            )
        elif t is not None and i is not None and (t == ALL or i == ALL):
            problems.append(f"{path}: in both TRAINING_ONLY and INFERENCE_FIELDS")
        elif t == ALL or i == ALL:
            continue
        else:
            section = _model_in(field.annotation)
            if section is None:
                problems.append(f"{path}: a value, but listed field by field")
                continue
            problems += unclassified_fields(section, t or {}, i or {}, prefix=path + ".")
    for side, split in (("TRAINING_ONLY", training_only), ("INFERENCE_FIELDS", inference)):
        for name in split:
            if name not in fields:
                problems.append(
                    f"{prefix}{name}: listed in {side} but {root.__name__} has no such field"
                )
    return problems


def _derive(
    source: type[BaseModel], keep: Split, name: str, base: type[BaseModel]
) -> type[BaseModel]:
    """A strict model with the ``keep`` fields of ``source`` (types, defaults, docstrings kept)."""
    fields: dict[str, Any] = {}
    for field_name, sub in keep.items():
        info = copy.copy(source.model_fields[field_name])
        if sub == ALL:
            fields[field_name] = (info.annotation, info)
            continue
        section = _model_in(info.annotation)
        derived = _derive(section, sub, f"Inference{section.__name__}", _Strict)
        derived.__doc__ = f"{section.__doc__}\n\n(Inference fields only.)"
        fields[field_name] = (derived, Field(description=info.description))  # required
    return create_model(name, __base__=base, **fields)


InferenceConfig = _derive(TrainConfig, INFERENCE_FIELDS, "InferenceConfig", BundleFacts)
InferenceConfig.__doc__ = (
    "``inference_config.json``: the inference fields of the training config (``model``: shape "
    "and attention; ``data.task``; ``eval.max_new_tokens``; ``config_id``) plus the bundle's "
    "own facts (version, weights, languages, feature front end, source)."
)


def inference_view(cfg: TrainConfig) -> dict[str, Any]:
    """The inference fields of a training config (:data:`INFERENCE_FIELDS`), as plain data."""

    def keep(plain: dict[str, Any], split: Split) -> dict[str, Any]:
        return {k: plain[k] if sub == ALL else keep(plain[k], sub) for k, sub in split.items()}

    return keep(cfg.model_dump(mode="json", by_alias=True), INFERENCE_FIELDS)


def asrforge_version() -> str:
    try:
        return metadata.version("asrforge")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def parse_version(text: Any, where: str) -> tuple[int, int, int]:
    """``"1.2.3"`` -> ``(1, 2, 3)``.

    Raises:
        CheckpointNotSupportedError: not a ``MAJOR.MINOR.PATCH`` string.
    """
    parts = str(text).split(".") if isinstance(text, str) else []
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise CheckpointNotSupportedError(
            f"{where}: bundle_version must be a MAJOR.MINOR.PATCH string, got {text!r}"
        )
    major, minor, patch = (int(p) for p in parts)
    return major, minor, patch


def check_version(raw: Mapping[str, Any], where: str) -> tuple[int, int, int]:
    """Refuse a bundle of another major version, naming the version needed.

    Raises:
        CheckpointNotSupportedError: the bundle's major version is newer or older than ours.
    """
    got = parse_version(raw.get("bundle_version"), where)
    ours = parse_version(BUNDLE_VERSION, "asrforge")
    writer = raw.get("asrforge_version", "an unknown asrforge")
    if got[0] > ours[0]:
        if _is_newer(writer, asrforge_version()):
            need = (
                f"it was written by asrforge {writer}, which reads bundle format {got[0]}.x: "
                f"upgrade to asrforge >= {writer}"
            )
        else:  # a writer no newer than us cannot tell which asrforge reads it
            need = (
                f"upgrade asrforge to one that reads bundle format {got[0]}.x (the bundle says "
                f"it was written by asrforge {writer})"
            )
        raise CheckpointNotSupportedError(
            f"{where}: bundle_version {raw['bundle_version']} is newer than this asrforge "
            f"supports: asrforge {asrforge_version()} reads bundle format {ours[0]}.x (up to "
            f"{BUNDLE_VERSION}); {need}"
        )
    if got[0] < ours[0]:
        raise CheckpointNotSupportedError(
            f"{where}: bundle_version {raw['bundle_version']} is an older format than this asrforge "
            f"reads ({ours[0]}.x); re-export it with `asrforge export`, or read it with "
            f"asrforge {writer}"
        )
    return got


def _is_newer(version: Any, than: str) -> bool:
    """Whether the asrforge ``version`` is a release after ``than``, by their leading numbers
    (``0.2.0.dev1`` > ``0.1.0``; False when ``version`` has none)."""

    def numbers(text: Any) -> tuple[int, ...] | None:
        found = re.match(r"\d+(\.\d+)*", str(text))
        return tuple(int(n) for n in found.group().split(".")) if found else None

    mine, theirs = numbers(than), numbers(version)
    return theirs is not None and (mine is None or theirs > mine)


def parse_inference_config(raw: Mapping[str, Any], where: str) -> BaseModel:
    """Validate ``inference_config.json`` (after :func:`check_version`).

    A bundle of a newer minor version may carry optional fields this asrforge does not know:
    those are dropped with a warning. Anything else that does not fit is an error.

    Raises:
        CheckpointNotSupportedError: a newer major version, or fields that do not validate.
    """
    got = check_version(raw, where)
    newer_minor = got[:2] > parse_version(BUNDLE_VERSION, "asrforge")[:2]
    data = copy.deepcopy(dict(raw))
    for _ in range(2):
        try:
            return InferenceConfig.model_validate(data)
        except ValidationError as e:
            extras = [err["loc"] for err in e.errors() if err["type"] == "extra_forbidden"]
            if newer_minor and extras and len(extras) == len(e.errors()):
                for loc in extras:
                    node = data
                    for key in loc[:-1]:
                        node = node[key]
                    node.pop(loc[-1], None)
                log.warning(
                    "%s: bundle_version %s is newer than %s; ignoring fields %s",
                    where,
                    raw["bundle_version"],
                    BUNDLE_VERSION,
                    ", ".join(".".join(map(str, loc)) for loc in extras),
                )
                continue
            raise CheckpointNotSupportedError(
                f"{where}: {INFERENCE_CONFIG} does not fit the schema: "
                + "; ".join(format_errors(e, InferenceConfig))
            ) from None
    raise CheckpointCorruptError(f"{where}: {INFERENCE_CONFIG} could not be validated")
