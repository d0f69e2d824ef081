"""``ModelConfig`` -> tokenizer, ``WhisperForConditionalGeneration`` and feature extractor."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    BitsAndBytesConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)
from transformers import logging as hf_logging

from asrforge.config import SHAPE_FIELDS, ModelConfig
from asrforge.data.audio import SAMPLE_RATE
from asrforge.errors import UserError
from asrforge.hub import model_dir_problem, resolve_model
from asrforge.io.small_files import read_json_object
from asrforge.model.embeddings import extend_pretrained
from asrforge.model.frames import HOP_LENGTH, window_seconds
from asrforge.model.lowbit import stored_numel
from asrforge.model.partial import freeze_encoder_part
from asrforge.model.tokenizer import (
    SpecialTokens,
    WhisperTokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)
from asrforge.model.vocab import VocabExtension, load_extended_tokenizer

log = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    """A model built for training or evaluation, with what the loop needs beside it: its
    tokenizer, special tokens and feature extractor. (The inference side is
    :class:`asrforge.bundle.Bundle`.)"""

    model: WhisperForConditionalGeneration
    tokenizer: WhisperTokenizer
    specials: SpecialTokens
    features: WhisperFeatureExtractor


def build_tokenizer(
    cfg: ModelConfig,
    train_texts: Iterable[str] | None = None,
    *,
    timestamps: bool = False,
    languages: Iterable[str] = (),
) -> WhisperTokenizer:
    """The tokenizer the config asks for: ``cfg.tokenizer``, the pretrained model's, or a BPE
    trained on ``train_texts`` for a from-scratch model (with timestamp tokens over the model's
    window when ``timestamps``, and a token for each of the data's ``languages`` Whisper has
    none for; given tokenizers are taken as they are)."""
    if cfg.tokenizer is not None:
        if VocabExtension.read(cfg.tokenizer) is not None:
            return load_extended_tokenizer(cfg.tokenizer)
        return load_tokenizer(cfg.tokenizer)
    if cfg.pretrained is not None:
        return load_tokenizer(pretrained_dir(cfg))
    if train_texts is None:
        raise UserError("model.tokenizer is not set and there are no training texts to build one")
    return train_bpe_tokenizer(
        train_texts, cfg.bpe_vocab_size, cfg.chunk_seconds if timestamps else None, languages
    )


def is_multilingual(cfg: ModelConfig) -> bool:
    """English-only Whisper models (``*.en``) have no language or task token in their prompt."""
    if cfg.pretrained is None:
        return True
    return has_language_slot(pretrained_dir(cfg))


def pretrained_dir(cfg: ModelConfig) -> Path:
    """``cfg.pretrained`` on this machine: the directory itself, or the snapshot of the Hub id
    it names (:func:`asrforge.hub.resolve_model`).

    Raises:
        UserError: it is missing, a file, or a directory without ``config.json``.
    """
    path = resolve_model(cfg.pretrained).path
    if problem := model_dir_problem(cfg.pretrained, path):
        raise UserError(f"model.pretrained: {problem}")
    return path


def has_language_slot(directory: Path, vocab_size: int | None = None) -> bool:
    """Whether the Whisper model at ``directory`` prompts with a language token (multilingual),
    read from its files alone, no weights: the generation config's ``is_multilingual``, else
    the size of the vocabulary (``config.json``'s, else ``vocab_size``: its tokenizer's).

    A directory that says neither (no such files) counts as multilingual: the model's load
    reports what is missing.
    """
    gen = directory / "generation_config.json"
    if gen.is_file():
        flag = read_json_object(gen).get("is_multilingual")
        if flag is not None:
            return bool(flag)
    config = directory / "config.json"
    if config.is_file():
        vocab_size = read_json_object(config).get("vocab_size", vocab_size)
    # transformers' own rule for Whisper checkpoints: English-only ones have 51864 tokens
    return vocab_size is None or vocab_size >= 51865


def build_model(
    cfg: ModelConfig,
    tokenizer: WhisperTokenizer,
    seed: int,
    *,
    language_tokens: Mapping[str, str] | None = None,
    quantization: BitsAndBytesConfig | None = None,
    device: torch.device | str | None = None,
) -> BuiltModel:
    """Build (from scratch) or load (from ``cfg.pretrained``) the model.

    Weights of a from-scratch model are drawn under ``torch.manual_seed(seed)``. When
    ``cfg.tokenizer`` is an extension of the pretrained model's tokenizer (``asrforge vocab
    build``), the model's vocabulary is extended to it (new rows drawn under ``seed``).
    ``cfg.vocab_size`` and ``cfg.base_vocab_size`` are checked when set, then filled in.
    ``cfg.freeze_encoder`` / ``cfg.train_encoder_layers`` freeze the encoder or its lower part
    (``asrforge.model.partial``; a UserError when the model has fewer encoder layers).
    ``language_tokens`` (``data.language_tokens``) decodes languages without a token of their
    own under another's (see :class:`SpecialTokens`). ``quantization`` loads the pretrained
    model's linear layers quantized (``asrforge.model.lowbit``) onto ``device``.
    """
    specials = SpecialTokens.from_tokenizer(tokenizer, is_multilingual(cfg), language_tokens)
    if cfg.pretrained is not None:
        model = _load_pretrained(cfg, quantization, device)
        base_vocab_size = model.config.vocab_size
        if quantization is not None and base_vocab_size != len(tokenizer):
            raise UserError(
                f"model.lora.quantize_base: the pretrained model {cfg.pretrained} has "
                f"{base_vocab_size} tokens, model.tokenizer {len(tokenizer)}; a quantized base "
                "keeps its own vocabulary (with LoRA the embeddings do not train)"
            )
        if base_vocab_size != len(tokenizer) and (
            cfg.tokenizer is None
            or extend_pretrained(model, tokenizer, cfg.tokenizer, pretrained_dir(cfg), seed) is None
        ):
            raise UserError(
                f"model.tokenizer has {len(tokenizer)} tokens but the pretrained model "
                f"{cfg.pretrained} has {model.config.vocab_size}: extend the vocabulary with "
                "`asrforge vocab build` instead of pointing at another tokenizer"
            )
        n_mels, chunk = model.config.num_mel_bins, window_seconds(model.config)
    else:
        wcfg = scratch_config(cfg, len(tokenizer), specials)
        wcfg._attn_implementation = cfg.attn_implementation  # noqa: SLF001
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = WhisperForConditionalGeneration(wcfg)
        n_mels, chunk = cfg.num_mel_bins, cfg.chunk_seconds
        base_vocab_size = len(tokenizer)
    if cfg.pretrained is not None:
        _record_shape(cfg, model.config)
    _record_vocab_sizes(cfg, model.config.vocab_size, base_vocab_size)
    _set_generation_defaults(model, specials)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    top = cfg.trained_top_encoder_layers
    if top is not None:  # freeze_encoder (top 0) or train_encoder_layers (top N)
        freeze_encoder_part(model.model.encoder, top)
        if top:
            log.info(
                "encoder: the top %d of %d layers and the final layer norm train; the "
                "convolutions, positions and lower layers are frozen",
                top,
                model.config.encoder_layers,
            )
    features = feature_extractor(n_mels, chunk)
    return BuiltModel(model=model, tokenizer=tokenizer, specials=specials, features=features)


def scratch_config(
    cfg: ModelConfig, vocab_size: int, specials: SpecialTokens | None = None
) -> WhisperConfig:
    """The ``WhisperConfig`` of a model built from scratch in ``cfg``'s shape, with
    ``specials``' start and end tokens (None: transformers' defaults, for a skeleton whose
    token ids nothing reads)."""
    tokens = {} if specials is None else {
        "decoder_start_token_id": specials.sot, "eos_token_id": specials.eot,
        "pad_token_id": specials.eot, "bos_token_id": specials.eot,
    }  # fmt: skip
    return WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=cfg.num_mel_bins,
        d_model=cfg.d_model,
        encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.encoder_attention_heads,
        decoder_attention_heads=cfg.decoder_attention_heads,
        encoder_ffn_dim=cfg.encoder_ffn_dim,
        decoder_ffn_dim=cfg.decoder_ffn_dim,
        max_source_positions=cfg.max_source_positions,
        max_target_positions=cfg.max_target_positions,
        dropout=cfg.dropout,
        begin_suppress_tokens=None,
        suppress_tokens=None,
        **tokens,
    )


def feature_extractor(n_mels: int, window_seconds: float) -> WhisperFeatureExtractor:
    """Whisper's log-mel front end: ``n_mels`` channels, 25 ms frames every 10 ms of 16 kHz
    audio, padded or cut to the encoder's window (whole seconds)."""
    return WhisperFeatureExtractor(
        feature_size=n_mels,
        sampling_rate=SAMPLE_RATE,
        hop_length=HOP_LENGTH,
        chunk_length=int(window_seconds),
        n_fft=400,
    )


def _record_shape(cfg: ModelConfig, config: WhisperConfig) -> None:
    """Check the shape fields set in ``cfg`` against the pretrained model's; fill in all of them
    (so the run's config.yaml and checkpoints record the whole shape, heads included, and an
    export needs no pretrained directory to rebuild the model)."""
    built = {name: getattr(config, name) for name in SHAPE_FIELDS}
    wrong = [
        f"model.{name}: set to {getattr(cfg, name)}, but model.pretrained {cfg.pretrained} has "
        f"{built[name]}"
        for name in SHAPE_FIELDS
        if name in cfg.model_fields_set and getattr(cfg, name) != built[name]
    ]
    if wrong:
        raise UserError("; ".join(wrong))
    for name, value in built.items():
        setattr(cfg, name, value)


def _record_vocab_sizes(cfg: ModelConfig, vocab_size: int, base_vocab_size: int) -> None:
    """Check ``model.vocab_size``/``model.base_vocab_size`` when set; fill them in (so the run's
    config.yaml records them)."""
    for name, built in (("vocab_size", vocab_size), ("base_vocab_size", base_vocab_size)):
        want = getattr(cfg, name)
        if want is not None and want != built:
            raise UserError(
                f"model.{name}: set to {want}, but the model built from model.tokenizer and "
                f"model.pretrained has {built}"
            )
    cfg.vocab_size, cfg.base_vocab_size = vocab_size, base_vocab_size


def _load_pretrained(
    cfg: ModelConfig,
    quantization: BitsAndBytesConfig | None = None,
    device: torch.device | str | None = None,
) -> WhisperForConditionalGeneration:
    """Load ``cfg.pretrained``; every tensor of the model must come from its weights. With
    ``quantization``, its linear layers are quantized as they load onto ``device``.

    transformers re-initializes a tensor the weights file lacks and drops one the model has no
    place for, reporting both only through its logger. Both are checked here instead: a missing
    or wrongly shaped tensor is a UserError naming it, an unexpected one a warning naming it.
    (The one deliberate change of the loaded weights, the vocabulary extension to an extended
    tokenizer, happens after loading and reports itself: ``asrforge.model.embeddings``.)
    """
    path = pretrained_dir(cfg)
    quantized = {}
    if quantization is not None:
        # bitsandbytes quantizes a weight when it is placed on its device
        quantized = {"quantization_config": quantization, "device_map": {"": device or "cpu"}}
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report is replaced by the checks below
    # local files only: its bar of tensors loaded would only fill logs and reports
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model, info = WhisperForConditionalGeneration.from_pretrained(
            str(path),
            local_files_only=True,
            use_safetensors=True,  # never unpickle a weights file
            attn_implementation=cfg.attn_implementation,
            dropout=cfg.dropout,
            output_loading_info=True,
            **quantized,
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise UserError(f"model.pretrained: cannot load {path}: {e}") from None
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()
    check_loading_info(path, info)
    return model


def check_loading_info(path: Path, info: dict) -> None:
    """Refuse missing or mismatched tensors of a pretrained load; warn about unexpected ones.

    Args:
        path: the pretrained directory (named in the messages).
        info: ``from_pretrained(..., output_loading_info=True)``'s report.

    Raises:
        UserError: naming every tensor the weights lack or hold in another shape.
    """
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(
        str(k if isinstance(k, str) else k[0]) for k in info.get("mismatched_keys") or ()
    )
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        log.warning(
            "model.pretrained %s: %d tensor(s) the model has no place for, ignored: %s",
            path,
            len(unexpected),
            ", ".join(unexpected),
        )
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from its weights: {', '.join(missing)}")
    if mismatched:
        problems.append(f"{len(mismatched)} tensor(s) of the wrong shape: {', '.join(mismatched)}")
    if problems:
        raise UserError(
            f"model.pretrained {path}: {'; '.join(problems)} (they would be initialized at "
            "random; restore the weights file)"
        )


def _set_generation_defaults(
    model: WhisperForConditionalGeneration, specials: SpecialTokens
) -> None:
    """Generation settings so that transformers' ``generate`` and pipeline agree with ours."""
    for name, value in specials.generation_fields().items():
        setattr(model.generation_config, name, value)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts; tied weights counted once."""
    seen, total, trainable = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = stored_numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable
