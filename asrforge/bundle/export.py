"""Export: a training checkpoint, a run, or a pretrained transformers directory -> inference bundle.

How it works: docs/bundle.md, "How an export is written (`bundle/export.py`)".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import yaml
from safetensors.torch import load_file
from transformers import GenerationConfig, WhisperConfig

from asrforge.bundle.load import (
    MODEL_FILE,
    SEAL_KEY,
    Bundle,
    check_tensors,
    manifest_digest,
    verify_bundle,
)
from asrforge.bundle.schema import (
    BUNDLE_VERSION,
    INFERENCE_CONFIG,
    MODEL_SHAPE,
    FeatureConfig,
    InferenceConfig,
    LMInfo,
    asrforge_version,
    inference_view,
)
from asrforge.checkpoint.average import CHECKPOINTS_DIR, average_top_k
from asrforge.checkpoint.manager import UNGUARDED_DIR
from asrforge.checkpoint.manifest import (
    MANIFEST_NAME,
    manifest_seal,
    read_manifest,
    verify,
    write_manifest,
)
from asrforge.checkpoint.manifest import SEAL_KEY as FILES_SEAL
from asrforge.checkpoint.shards import LazyWeights, has_weights
from asrforge.checkpoint.training import (
    EMA_FILE,
    EMA_STEM,
    MODEL_STEM,
    save_weights_sharded,
)
from asrforge.config import (
    SHAPE_FIELDS,
    ConfigError,
    ModelConfig,
    TrainConfig,
    load_config,
    parse_size,
)
from asrforge.data.audio import decode_audio
from asrforge.data.rules import language_filter
from asrforge.data.sources import load_source
from asrforge.errors import CheckpointError, UserError
from asrforge.io.atomic import atomic_directory, atomic_write_text
from asrforge.lm.ngram import read_arpa
from asrforge.model import lora
from asrforge.model.build import build_model, is_multilingual
from asrforge.model.frames import HOP_LENGTH, SAMPLE_RATE, window_seconds
from asrforge.model.tokenizer import SpecialTokens, WhisperTokenizer, load_tokenizer
from asrforge.model.vocab import ids_read_as_timestamps
from asrforge.text.languages import resolve_language

log = logging.getLogger(__name__)

Weights = Literal["ema", "raw", "average"]


@dataclass
class BundleContents:
    """Everything a bundle holds, in memory."""

    state: Mapping[str, torch.Tensor]
    """Weights in transformers names; tied names share one tensor. A checkpoint's are
    :class:`~asrforge.checkpoint.shards.LazyWeights`, read from disk a tensor at a time."""
    config: WhisperConfig
    generation: GenerationConfig
    tokenizer: WhisperTokenizer
    inference: Any
    """The ``InferenceConfig``."""
    note: str = ""
    """What was exported, for the user (``checkpoints/best (step 200), EMA weights``)."""
    lm: Path | None = None
    """An ARPA file to carry (its facts are in ``inference.lm``)."""


# ---------------------------------------------------------------------------------------------
# Public entry points


def export_bundle(
    source: str | Path,
    out: str | Path,
    weights: Weights | None = None,
    fmt: Literal["hf", "ct2"] = "hf",
    *,
    average_k: int = 5,
    average_metric: str = "wer",
    stats_utterances: int = 16,
    ct2_quantization: str | None = None,
    lm: str | Path | None = None,
    max_shard_size: int | str | None = "5GB",
) -> Path:
    """Write an inference bundle.

    Args:
        source: a training checkpoint directory (``manifest.json`` + ``model.safetensors``), a run
            directory (its ``checkpoints/best``, else ``checkpoints/latest``), or a pretrained
            transformers Whisper directory (safetensors weights).
        out: the bundle directory to write (an existing bundle there is replaced).
        weights: ``ema`` (default when the checkpoint has EMA weights), ``raw``, or ``average``
            (mean of the run's ``average_k`` best checkpoints by ``average_metric``, as in
            ``asrforge average``: their EMA weights when they have them, else the raw ones).
        fmt: ``hf`` (transformers safetensors, loadable by ``load_bundle``) or ``ct2``.
        stats_utterances: training utterances whose log-mel statistics are recorded (0: none).
        ct2_quantization: CTranslate2 weight type for ``fmt="ct2"`` (e.g. ``int8``); default as is.
        lm: an ARPA file from ``asrforge lm build`` to carry for beam search (``lm.arpa``).
        max_shard_size: weights larger than this are written as transformers' shards and index
            (bytes, or ``"5GB"``, ``"500MB"``, ...); None: one file.

    Returns:
        ``out``.

    Raises:
        UserError: a bad source, out, or option; CheckpointCorruptError: the source does not
            verify; CheckpointNotSupportedError: weights that do not fit the model config.
    """
    source, out = Path(source), Path(out)
    if fmt not in ("hf", "ct2"):
        raise UserError(f"format: must be hf or ct2, got {fmt!r}")
    try:
        shard_bytes = None if max_shard_size is None else parse_size(max_shard_size)
    except ValueError as e:
        raise UserError(f"max_shard_size: {e}") from None
    _check_out(out, source)
    converter = ct2_converter() if fmt == "ct2" else None
    kind, path = resolve_source(source)
    if kind == "pretrained":
        if weights not in (None, "raw"):
            raise UserError(
                f"{source}: a pretrained directory has one set of weights, not {weights}"
            )
        contents = pretrained_contents(path)
    else:
        contents = checkpoint_contents(
            path,
            weights,
            average_k=average_k,
            average_metric=average_metric,
            stats_utterances=stats_utterances,
        )
    if lm is not None:
        contents = with_lm(contents, Path(lm))
    return _export_contents(contents, out, converter, ct2_quantization, shard_bytes)


def _export_contents(
    contents: BundleContents,
    out: Path,
    converter: type | None,
    ct2_quantization: str | None,
    shard_bytes: int | None,
) -> Path:
    """Write ``contents`` at ``out``: with CTranslate2's ``converter`` a ct2 bundle, else hf."""
    log.info("exporting %s", contents.note)
    _check_timestamp_reading(contents.tokenizer, "ct2" if converter is not None else "hf")
    if converter is not None:
        return write_ct2(contents, out, converter, ct2_quantization, shard_bytes)
    return write_bundle(contents, out, max_shard_bytes=shard_bytes)


def export_interpolated(
    contents: BundleContents,
    state: Mapping[str, torch.Tensor],
    facts: dict[str, Any],
    out: str | Path,
    fmt: Literal["hf", "ct2"] = "hf",
    *,
    ct2_quantization: str | None = None,
    max_shard_size: int | str | None = "5GB",
) -> Path:
    """Write a bundle of ``contents`` with the weights ``state`` in place of its own (the
    fine-tuned weights interpolated with the starting ones), ``facts`` (the share chosen, the
    guard's figures) recorded in ``inference_config.json`` as ``source.within_guard``."""
    out = Path(out)
    try:
        shard_bytes = None if max_shard_size is None else parse_size(max_shard_size)
    except ValueError as e:
        raise UserError(f"max_shard_size: {e}") from None
    converter = ct2_converter() if fmt == "ct2" else None
    source = {**contents.inference.source, "within_guard": facts}
    contents = dataclasses.replace(
        contents,
        state=state,
        inference=contents.inference.model_copy(update={"source": source}),
        note=f"{contents.note}, {facts['share']:g} of it over the starting model's",
    )
    return _export_contents(contents, out, converter, ct2_quantization, shard_bytes)


def finetuned_checkpoint(source: Path) -> Path:
    """The checkpoint an export within the guard interpolates: a run's
    ``checkpoints/best-unguarded`` when it has one, else what :func:`resolve_source` takes.

    Raises:
        UserError: ``source`` is no checkpoint or run (a pretrained model has no start).
    """
    unguarded = source / CHECKPOINTS_DIR / UNGUARDED_DIR
    if (unguarded / MANIFEST_NAME).is_file():
        log.info("%s: using checkpoints/%s", source, UNGUARDED_DIR)
        return unguarded
    kind, path = resolve_source(source)
    if kind != "checkpoint":
        raise UserError(f"--within-guard: {source} is not a training run or checkpoint")
    return path


def read_run_config(ckpt: Path) -> TrainConfig:
    """The config ``ckpt`` was trained with (its ``config.yaml``)."""
    return read_train_config(ckpt / "config.yaml")


def check_same_start(
    finetuned: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor], start_from: str
) -> dict[str, torch.Tensor]:
    """The fine-tuned weights as a dict of tensors of their own (ties kept as one object),
    once every one of them is in ``start`` with the same shape.

    Raises:
        UserError: a tensor the start lacks or has in another shape (``start_from`` named).
    """
    copies: dict[int, torch.Tensor] = {}
    own = {}
    for name, tensor in in_memory(finetuned).items():
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.clone()
        own[name] = copies[id(tensor)]
    lacking = [n for n in own if n not in start and not n.startswith("proj_out.")]
    differ = [
        f"{n} {list(own[n].shape)} fine-tuned, {list(start[n].shape)} there"
        for n in own
        if n in start and tuple(start[n].shape) != tuple(own[n].shape)
    ]
    if lacking or differ:
        what = f"it lacks {lacking[0]}" if lacking else differ[0]
        raise UserError(
            f"--within-guard: the starting weights {start_from} are not the fine-tuned model's "
            f"start ({what}); a run with a resized vocabulary needs its step-0 checkpoint "
            "(eval.at_start saves it)"
        )
    return own


def start_weights(ckpt: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The weights ``ckpt``'s run started from, and where they were read: its step-0
    checkpoint (``step-000000/``, or ``best/`` while it holds step 0), else the run's
    ``model.pretrained``.

    Raises:
        UserError: neither is there, named.
    """
    root = ckpt.parent
    for candidate in (root / "step-000000", root / "best"):
        if (candidate / MANIFEST_NAME).is_file() and read_manifest(candidate).get("step") == 0:
            contents = checkpoint_contents(candidate, "raw", stats_utterances=0, scan_data=False)
            return in_memory(contents.state), str(candidate)
    cfg = read_train_config(ckpt / "config.yaml")
    pretrained = cfg.model.pretrained
    if pretrained is not None and (Path(pretrained) / "config.json").is_file():
        return read_pretrained_weights(Path(pretrained)), str(pretrained)
    gone = (
        f"and model.pretrained {pretrained} is not there"
        if pretrained is not None
        else "and the run was trained from scratch (no model.pretrained)"
    )
    raise UserError(
        f"--within-guard: the starting weights of {ckpt} are missing: no step-0 checkpoint "
        f"({root / 'step-000000'}, or {root / 'best'} at step 0; eval.at_start saves it) {gone}"
    )


def with_lm(contents: BundleContents, path: Path) -> BundleContents:
    """``contents`` carrying the LM at ``path``, its facts read from the file.

    Raises:
        UserError: not a readable ARPA file, or an LM of none of the bundle's languages.
    """

    if not path.is_file():
        raise UserError(f"--lm {path}: no such file")
    try:
        lm = read_arpa(path)
    except CheckpointError as e:
        raise UserError(f"--lm {e}") from None
    languages = lm.meta.get("languages")
    normalizer = lm.meta.get("normalizer")
    if not languages or not normalizer:
        raise UserError(
            f"--lm {path}: records no languages or normalizer (not built by `asrforge lm build`): "
            "the words it expects are unknown"
        )
    if not set(languages) & set(contents.inference.languages):
        raise UserError(
            f"--lm {path}: an LM of {', '.join(languages)}; the bundle transcribes "
            f"{', '.join(contents.inference.languages)}"
        )
    info = LMInfo(
        order=lm.order, vocab_size=lm.vocab_size, normalizer=normalizer, languages=languages
    )
    contents.inference = contents.inference.model_copy(update={"lm": info})
    contents.lm = path
    contents.note += f", {lm.order}-gram LM {path.name}"
    return contents


def export_adapter(source: str | Path, out: str | Path, weights: Weights | None = None) -> Path:
    """Write a LoRA checkpoint's adapters alone, as peft writes them (``adapter_model.safetensors``
    + ``adapter_config.json``, with a sha256 manifest), for ``PeftModel.from_pretrained`` on the
    base model it was trained on.

    Args:
        source: a training checkpoint or run directory of a run with ``model.lora``.
        weights: ``ema`` (default when the checkpoint has EMA weights) or ``raw``.

    Raises:
        UserError: the source is not a LoRA checkpoint, or ``weights`` is ``average``.
    """
    source, out = Path(source), Path(out)
    _check_out(out, source)
    kind, ckpt = resolve_source(source)
    manifest = verify(ckpt) if kind == "checkpoint" else {}
    if lora.BASE_KEY not in manifest:
        raise UserError(f"{source}: --adapter-only needs a checkpoint of a run with model.lora")
    has_ema = has_weights(manifest["files"], EMA_STEM)
    chosen = weights or ("ema" if has_ema else "raw")
    if chosen not in ("ema", "raw"):
        raise UserError(f"--adapter-only: --weights must be ema or raw, got {chosen!r}")
    if chosen == "ema" and not has_ema:
        raise UserError(f"{ckpt}: has no EMA weights (train.ema_decay was off); use --weights raw")
    cfg = read_train_config(ckpt / "config.yaml")
    adapters = (
        ema_weights(ckpt) if chosen == "ema" else LazyWeights.open(ckpt, MODEL_STEM)
    ).materialize()
    base = str(cfg.model.pretrained) if cfg.model.pretrained is not None else None
    with atomic_directory(out) as tmp:
        lora.write_adapter(tmp, adapters, cfg.model.lora, base)
        write_bundle_manifest(
            tmp,
            {
                "kind": "lora_adapter",
                "weights": chosen,
                "step": manifest.get("step"),
                "checkpoint": str(ckpt),
                lora.BASE_KEY: manifest[lora.BASE_KEY],
            },
        )
    log.info("wrote the LoRA adapters of %s (%s weights) to %s", ckpt, chosen, out)
    return out


def bundle_from_pretrained(hf_dir: str | Path, out: str | Path) -> Path:
    """Export a pretrained transformers Whisper directory (e.g. from ``asrforge import-ct2``)."""
    return export_bundle(hf_dir, out)


def bundle_from_checkpoint(
    path: str | Path, weights: Weights | None = None, *, device: str = "cpu"
) -> Bundle:
    """A :class:`Bundle` straight from a training checkpoint, in memory (what ``asrforge
    evaluate`` uses): the same weights and settings an export of it would hold."""
    kind, ckpt = resolve_source(Path(path))
    if kind == "pretrained":
        contents = pretrained_contents(ckpt)
    else:
        contents = checkpoint_contents(ckpt, weights, stats_utterances=0, scan_data=False)
    log.info("loaded %s", contents.note)
    return contents_to_bundle(contents, device=device)


def contents_to_bundle(contents: BundleContents, *, device: str = "cpu") -> Bundle:
    model = check_tensors(tensor_shapes(contents.state), contents.config, "weights")
    model.load_state_dict(in_memory(contents.state), strict=False, assign=True)
    model.tie_weights()
    model.generation_config = contents.generation
    return Bundle(model, contents.tokenizer, contents.inference, device=device)


def write_bundle_manifest(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Write ``manifest.json`` (sha256 of every file) and seal it with its own digest."""
    manifest = write_manifest(directory, meta)
    manifest[SEAL_KEY] = manifest_digest(manifest)
    atomic_write_text(Path(directory) / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
    return manifest


# ---------------------------------------------------------------------------------------------
# Sources


def resolve_source(source: Path) -> tuple[str, Path]:
    """``("checkpoint" | "pretrained", directory)`` for what the user named; a run directory
    resolves to ``checkpoints/best``, else ``checkpoints/latest`` (logged)."""
    if not source.is_dir():
        raise UserError(f"{source}: no such directory")
    if (source / INFERENCE_CONFIG).is_file():
        raise UserError(f"{source}: already an inference bundle")
    if (source / MANIFEST_NAME).is_file() and has_weights(source, MODEL_STEM):
        return "checkpoint", source
    root = source / "checkpoints"
    if root.is_dir():
        candidates = [("best", root / "best")]
        if (root / "latest").is_symlink():
            candidates.append(("latest", root / os.readlink(root / "latest")))
        elif (root / "latest.txt").is_file():
            candidates.append(("latest", root / (root / "latest.txt").read_text().strip()))
        for name, path in candidates:
            if (path / MANIFEST_NAME).is_file():
                step = read_manifest(path).get("step")
                log.info("%s: using checkpoints/%s (step %s)", source, name, step)
                return "checkpoint", path
        raise UserError(f"{source}: has no checkpoints/best or checkpoints/latest to export")
    if (source / "config.json").is_file():
        return "pretrained", source
    raise UserError(
        f"{source}: not a checkpoint (no {MANIFEST_NAME} + {MODEL_FILE}), a run directory "
        "(no checkpoints/) or a transformers model directory (no config.json)"
    )


def _check_out(out: Path, source: Path) -> None:
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise UserError(f"--out {out}: must not be inside the source {source}")
    if out.exists() and (
        not out.is_dir() or (any(out.iterdir()) and not (out / INFERENCE_CONFIG).is_file())
    ):
        raise UserError(f"--out {out}: exists and is not a bundle; choose another directory")


def checkpoint_contents(
    ckpt: Path,
    weights: Weights | None = None,
    *,
    average_k: int = 5,
    average_metric: str = "wer",
    stats_utterances: int = 16,
    scan_data: bool = True,
) -> BundleContents:
    """Read a training checkpoint (verified first) into bundle contents."""
    manifest = verify(ckpt)
    files = manifest["files"]
    if "config.yaml" not in files or not any(f.startswith("tokenizer/") for f in files):
        raise CheckpointError(f"{ckpt}: not a training checkpoint (no config.yaml or tokenizer/)")
    cfg = read_train_config(ckpt / "config.yaml")
    tokenizer = load_tokenizer(ckpt / "tokenizer")
    multilingual = _multilingual(cfg.model, len(tokenizer), manifest.get("multilingual"))
    specials = SpecialTokens.from_tokenizer(tokenizer, multilingual, cfg.data.language_tokens)

    has_ema = has_weights(files, EMA_STEM)
    chosen = weights or ("ema" if has_ema else "raw")
    source: dict[str, Any] = {"checkpoint": str(ckpt), "step": manifest.get("step")}
    source["metrics"] = manifest.get("metrics") or {}
    if chosen == "ema":
        if not has_ema:
            raise UserError(
                f"{ckpt}: has no EMA weights (train.ema_decay was off); use --weights raw"
            )
        state = ema_weights(ckpt)
    elif chosen == "raw":
        state = LazyWeights.open(ckpt, MODEL_STEM)
    elif chosen == "average":
        state, averaged = _average(ckpt, average_k, average_metric)
        source.update(averaged)
    else:
        raise UserError(f"weights: must be ema, raw or average, got {chosen!r}")
    # A LoRA checkpoint's adapters are merged into the rebuilt base weights.
    if lora.BASE_KEY in manifest:
        if chosen == "average":
            raise UserError(
                f"{ckpt}: holds LoRA adapters; averaging their factors is not averaging the "
                "updates: use --weights raw or ema"
            )
        state = lora.merged_state(cfg, tokenizer, in_memory(state), manifest[lora.BASE_KEY], ckpt)

    config, base_gen = _whisper_config(cfg, tokenizer, state, ckpt)
    languages, stats = None, None
    if scan_data:
        languages, stats = _data_facts(cfg, specials, config, stats_utterances)
    languages = languages or _languages_fallback(cfg, ckpt, specials)
    view = inference_view(cfg)
    view["model"].update({name: getattr(config, name) for name in MODEL_SHAPE})
    icfg = InferenceConfig.model_validate(
        {
            **view,
            "asrforge_version": asrforge_version(),
            "weights": chosen,
            "multilingual": multilingual,
            "languages": languages,
            "features": feature_config(config, stats).model_dump(),
            "source": source,
        }
    )
    generation = generation_config(base_gen, config, specials, icfg)
    step = manifest.get("step")
    where = f"{ckpt.parent.name}/{ckpt.name}" if ckpt.parent.name == "checkpoints" else str(ckpt)
    note = f"{where} (step {step}), {chosen} weights"
    return BundleContents(state, config, generation, tokenizer, icfg, note)


def read_train_config(path: Path) -> TrainConfig:
    """The training config saved at ``path``; a UserError naming it when it is unreadable."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        return load_config(data=data)
    except (yaml.YAMLError, AttributeError, ConfigError) as e:
        raise UserError(f"{path}: not a readable training config: {e}") from None


def pretrained_contents(hf_dir: Path) -> BundleContents:
    """A pretrained transformers Whisper directory (safetensors weights) as bundle contents."""
    config = WhisperConfig.from_pretrained(str(hf_dir), local_files_only=True)
    if config.model_type != "whisper":
        raise UserError(f"{hf_dir}: a {config.model_type!r} model, not Whisper")
    state = read_pretrained_weights(hf_dir)
    tokenizer = load_tokenizer(hf_dir)
    multilingual = is_multilingual(ModelConfig(pretrained=hf_dir))
    specials = SpecialTokens.from_tokenizer(tokenizer, multilingual)
    base_gen = None
    if (hf_dir / "generation_config.json").is_file():
        base_gen = GenerationConfig.from_pretrained(str(hf_dir), local_files_only=True)
    if not multilingual:
        languages = ["en"]
    elif base_gen is not None and getattr(base_gen, "lang_to_id", None):
        languages = [t.strip("<|>") for t in base_gen.lang_to_id]
    else:
        languages = list(specials.languages)
    icfg = InferenceConfig.model_validate(
        {
            "config_id": hf_dir.name,
            "model": {
                **{name: getattr(config, name) for name in MODEL_SHAPE},
                "attn_implementation": "sdpa",
            },
            "data": {"task": "transcribe"},
            "eval": {"max_new_tokens": max(1, config.max_target_positions - 4)},
            "asrforge_version": asrforge_version(),
            "weights": "pretrained",
            "multilingual": multilingual,
            "languages": languages,
            "features": feature_config(config).model_dump(),
            "source": {"pretrained": str(hf_dir)},
        }
    )
    generation = generation_config(base_gen, config, specials, icfg)
    return BundleContents(state, config, generation, tokenizer, icfg, f"pretrained model {hf_dir}")


def read_pretrained_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a transformers directory: one safetensors file or its shards."""
    index = hf_dir / "model.safetensors.index.json"
    if (hf_dir / MODEL_FILE).is_file():
        shards = [hf_dir / MODEL_FILE]
    elif index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        shards = [hf_dir / n for n in names]
    else:
        raise UserError(
            f"{hf_dir}: no {MODEL_FILE} (only safetensors weights are read; pickled "
            "pytorch_model.bin files are never loaded)"
        )
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    return state


def _multilingual(cfg: ModelConfig, vocab_size: int, recorded: bool | None = None) -> bool:
    """Whether the model's prompt has language and task tokens: as training recorded it in the
    checkpoint's manifest, else as the pretrained directory says."""
    if isinstance(recorded, bool):
        return recorded
    if cfg.pretrained is None:
        return True
    if (Path(cfg.pretrained) / "config.json").is_file():
        return is_multilingual(cfg)
    return vocab_size >= 51865  # transformers' rule, for checkpoints that did not record it


def ema_weights(ckpt: Path) -> LazyWeights:
    """Raw weights with the EMA tensors put over them, cast to the raw dtypes (EMA keeps
    trainable parameters only: frozen ones and buffers come from the raw weights); tied aliases
    are the raw weights' (an EMA alias of a kept name reads the kept name's EMA tensor)."""
    raw, ema = LazyWeights.open(ckpt, MODEL_STEM), LazyWeights.open(ckpt, EMA_STEM)
    try:
        return raw.overlaid(ema)
    except CheckpointError as e:
        raise CheckpointError(f"{ckpt / EMA_FILE}: {e}") from None


def in_memory(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as a dict of tensors (a lazy one read whole; ties kept as one object)."""
    return state.materialize() if isinstance(state, LazyWeights) else dict(state)


def tensor_shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Name -> shape, without reading a lazy state's tensors."""
    if isinstance(state, LazyWeights):
        return state.shapes()
    return {k: tuple(v.shape) for k, v in state.items()}


def _average(ckpt: Path, k: int, metric: str) -> tuple[LazyWeights, dict[str, Any]]:

    root = ckpt.parent
    # Read lazily: the directory lives as long as the weights do (removed when they are freed)
    tmp = tempfile.TemporaryDirectory(prefix=".asrforge-average-")
    out = average_top_k(root, metric, k, Path(tmp.name) / "avg")
    manifest = read_manifest(out)
    state = LazyWeights.open(out, MODEL_STEM, keepalive=tmp)
    facts = {
        "averaged_steps": manifest.get("steps"),
        "average_metric": metric,
        "averaged_weights": manifest.get("weights"),
        "k": manifest.get("k"),
    }
    log.info(
        "averaged the %s weights of %s checkpoints by %s: steps %s",
        manifest.get("weights"),
        manifest.get("k"),
        metric,
        manifest.get("steps"),
    )
    return state, facts


def _whisper_config(
    cfg: TrainConfig, tokenizer: WhisperTokenizer, state: dict[str, torch.Tensor], ckpt: Path
) -> tuple[WhisperConfig, GenerationConfig | None]:
    """The transformers config of the trained model and the base generation config, if any.

    From the shape the checkpoint's config.yaml records (every run records the whole shape,
    heads included, pretrained runs too), with the pretrained directory's config.json for the
    rest when it is still there. Never guessed: a pretrained run whose directory is gone and
    whose config.yaml records no shape (an older asrforge) is refused.

    Raises:
        UserError: no recorded shape and no pretrained directory, or a pretrained directory
            whose shape is no longer the one trained.
        CheckpointNotSupportedError: the recorded shape does not fit the weights.
    """
    pretrained = Path(cfg.model.pretrained) if cfg.model.pretrained is not None else None
    recorded = pretrained is None or set(SHAPE_FIELDS) <= cfg.model.model_fields_set
    base_gen = None
    if pretrained is None:
        with torch.device("meta"):  # exactly the config training built, at no cost
            config = build_model(cfg.model, tokenizer, cfg.seed).model.config
    elif (pretrained / "config.json").is_file():
        config = WhisperConfig.from_pretrained(str(pretrained), local_files_only=True)
        changed = [
            f"{name} {getattr(cfg.model, name)} when trained, {getattr(config, name)} now"
            for name in SHAPE_FIELDS
            if recorded and getattr(cfg.model, name) != getattr(config, name)
        ]
        if changed:
            raise UserError(
                f"{ckpt}: model.pretrained {pretrained} is no longer the model it was trained "
                f"from ({'; '.join(changed)})"
            )
        if (pretrained / "generation_config.json").is_file():
            base_gen = GenerationConfig.from_pretrained(str(pretrained), local_files_only=True)
    elif recorded:
        config = _config_from_record(cfg.model, tokenizer)
        log.info(
            "model.pretrained %s is gone: the model config is rebuilt from the shape %s records",
            pretrained,
            ckpt / "config.yaml",
        )
    else:
        raise UserError(
            f"{ckpt}: model.pretrained {pretrained} is gone and the checkpoint's config.yaml does "
            "not record the model's shape (written by an older asrforge): the attention heads "
            "cannot be read from the weights. Restore that directory to export this checkpoint"
        )
    shapes = tensor_shapes(state)
    config.vocab_size = int(shapes["model.decoder.embed_tokens.weight"][0])
    config.use_cache = True
    config.architectures = ["WhisperForConditionalGeneration"]
    if pretrained is not None and not (pretrained / "config.json").is_file():
        check_tensors(shapes, config, str(ckpt))
    return config, base_gen


def _config_from_record(cfg: ModelConfig, tokenizer: WhisperTokenizer) -> WhisperConfig:
    """A Whisper config of the shape ``cfg`` records, token ids from the tokenizer."""
    eot = tokenizer.eos_token_id
    return WhisperConfig(
        **{name: getattr(cfg, name) for name in SHAPE_FIELDS},
        vocab_size=len(tokenizer),
        decoder_start_token_id=tokenizer.convert_tokens_to_ids("<|startoftranscript|>"),
        eos_token_id=eot,
        pad_token_id=eot,
        bos_token_id=eot,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )


def generation_config(
    base: GenerationConfig | None, config: WhisperConfig, specials: SpecialTokens, icfg: Any
) -> GenerationConfig:
    """What transformers' ``generate`` and ASR pipeline need to decode as ``Bundle`` does: the
    prompt tokens, the bundle's languages (detection picks among them) and the task."""
    fields: dict[str, Any] = {}
    if base is not None:
        # `_from_model_config` would make save_pretrained write a config derived from the model
        # config instead of this one, losing the prompt tokens set below
        skip = ("transformers_version", "_from_model_config")
        fields = {k: v for k, v in base.to_diff_dict().items() if k not in skip}
        # `task` and `language` replace the deprecated `forced_decoder_ids`.
        fields.pop("forced_decoder_ids", None)
    for key in ("lang_to_id", "task_to_id", "task", "language"):  # the bundle's, not the base's
        fields.pop(key, None)
    fields.update(
        specials.generation_fields(icfg.languages),
        bos_token_id=specials.eot,
        max_length=config.max_target_positions,
        return_timestamps=False,
    )
    fields.setdefault("suppress_tokens", [])
    fields.setdefault("begin_suppress_tokens", [])
    if specials.multilingual:
        fields["task"] = icfg.data.task
        if len(icfg.languages) == 1:
            fields["language"] = icfg.languages[0]
    return GenerationConfig(**fields)


def feature_config(config: WhisperConfig, stats: tuple | None = None) -> FeatureConfig:
    """The bundle's feature settings for ``config``'s window, with the data's log-mel ``stats``
    (mean, std, count) when the run normalized by them."""
    mean, std, n = stats if stats else (None, None, 0)
    chunk = int(window_seconds(config))
    return FeatureConfig(feature_size=config.num_mel_bins, chunk_length=chunk, mean=mean, std=std,
                         stats_utterances=n)  # fmt: skip


def _data_facts(
    cfg: TrainConfig, specials: SpecialTokens, config: WhisperConfig, n_stats: int
) -> tuple[list[str] | None, tuple | None]:
    """Languages of the training split and log-mel statistics of its first ``n_stats``
    utterances, when the training data is still where the config says (else ``None``s)."""

    try:
        split = load_source(cfg.data).splits[cfg.data.train_split]
    except (UserError, KeyError, OSError) as e:
        log.info("training data not readable (%s): languages from the config or eval records", e)
        return None, None
    langs = (
        sorted({resolve_language(x, strict=False) for x in split["language"]}) if specials.multilingual else ["en"]
    )
    keep = language_filter(cfg.data.languages)
    if keep is not None:
        langs = [c for c in langs if c in keep]
    if specials.multilingual:
        langs = [c for c in langs if c in specials.languages]
    stats = None
    if n_stats > 0 and len(split):
        fe, frames = feature_config(config).extractor(), []
        for row in split.select_columns(["audio"]):
            audio = row["audio"]
            try:
                wave = decode_audio(audio.get("bytes") or audio.get("path"))
            except UserError:
                # Training skipped a missing or unreadable clip too.
                continue
            mel = fe(wave, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
            frames.append(mel[:, : max(1, wave.shape[0] // HOP_LENGTH)])  # the padding left out
            if len(frames) == n_stats:
                break
        if frames:
            mels = np.concatenate(frames, axis=1).astype(np.float64)  # (n_mels, frames)
            stats = (mels.mean(1).round(5).tolist(), mels.std(1).round(5).tolist(), len(frames))
    return langs, stats


def _languages_fallback(cfg: TrainConfig, ckpt: Path, specials: SpecialTokens) -> list[str]:
    if not specials.multilingual:
        return ["en"]
    if cfg.data.languages:
        codes = [resolve_language(c, strict=False) for c in cfg.data.languages]
        return [c for c in codes if c in specials.languages]
    seen: set[str] = set()
    for records in sorted((ckpt.parent.parent / "eval").glob("step-*.jsonl")):
        for line in records.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            if "language" in rec:
                seen.add(rec["language"])
    langs = sorted(c for c in seen if c in specials.languages)
    if not langs:
        log.warning("no record of the training languages: the bundle accepts every language token")
        langs = list(specials.languages)
    return langs


def _check_timestamp_reading(tokenizer, fmt: str) -> None:
    """An extended vocabulary's new tokens follow the timestamps, and Whisper code outside
    asrforge reads them as timestamps: faster-whisper's text drops every id past
    ``<|endoftext|>`` (so a ct2 export would lose each new token, silently: refused), and
    transformers' ASR pipeline drops them too (the hf bundle is fine for asrforge and for
    ``generate`` + ``decode``: warned)."""
    misread = ids_read_as_timestamps(tokenizer)
    if not misread:
        return
    what = (
        f"the vocabulary has {len(misread)} token(s) after its timestamp tokens (ids "
        f"{misread.start}..{misread.stop - 1}, an extended vocabulary)"
    )
    if fmt == "ct2":
        raise UserError(
            f"--format ct2: {what}; faster-whisper reads every id past <|notimestamps|> as a "
            "timestamp and leaves those tokens out of its text. Export --format hf and "
            "transcribe with asrforge"
        )
    log.warning(
        "%s: transformers' ASR pipeline and its timestamp decoding (output_offsets, "
        "return_timestamps) read them as timestamps and drop them from the text; transcribe "
        "with asrforge, or model.generate() + tokenizer.decode() (README, Vocabulary)",
        what,
    )


# ---------------------------------------------------------------------------------------------
# Writing


def _write_hf_files(
    contents: BundleContents, directory: Path, max_shard_bytes: int | None = None
) -> None:
    save_weights_sharded(directory, MODEL_STEM, contents.state, max_shard_bytes=max_shard_bytes)
    contents.config.save_pretrained(str(directory))
    contents.generation.save_pretrained(str(directory))
    # transformers ignores this cleanup for BPE tokenizers and warns on every decode when set
    contents.tokenizer.clean_up_tokenization_spaces = False
    contents.tokenizer.save_pretrained(str(directory))
    contents.inference.features.extractor().save_pretrained(str(directory))


def _write_inference_config(contents: BundleContents, directory: Path, fmt: str) -> None:
    icfg = contents.inference.model_copy(update={"format": fmt})
    text = json.dumps(icfg.model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n"
    (directory / INFERENCE_CONFIG).write_text(text, encoding="utf-8")


def _copy_lm(contents: BundleContents, directory: Path) -> None:
    if contents.lm is not None:
        shutil.copyfile(contents.lm, directory / contents.inference.lm.file)


def update_bundle_manifest(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Add ``meta`` to a bundle's manifest (the files unchanged) and seal it afresh, in one
    atomic rename: the bundle is verified first and is never left half-updated."""

    manifest = verify_bundle(directory)
    body = {k: v for k, v in manifest.items() if k not in (FILES_SEAL, SEAL_KEY)}
    body.update(meta)
    body[FILES_SEAL] = manifest_seal(body)
    body[SEAL_KEY] = manifest_digest(body)
    atomic_write_text(Path(directory) / MANIFEST_NAME, json.dumps(body, indent=2) + "\n")
    return body


def write_bundle(
    contents: BundleContents, out: Path, *, max_shard_bytes: int | None = 5 * 10**9
) -> Path:
    """Write ``contents`` as a transformers-format bundle at ``out``, atomically; weights past
    ``max_shard_bytes`` sharded."""
    with atomic_directory(out) as tmp:
        _write_hf_files(contents, tmp, max_shard_bytes)
        _write_inference_config(contents, tmp, "hf")
        _copy_lm(contents, tmp)
        for p in tmp.iterdir():
            p.chmod(0o644)  # safetensors writes 0o600
        write_bundle_manifest(tmp, {"kind": "bundle", "bundle_version": BUNDLE_VERSION})
    log.info("wrote the bundle %s (%s)", out, contents.note)
    return out


def ct2_converter() -> type:
    """CTranslate2's own converter class (an optional dependency)."""
    try:
        from ctranslate2.converters import TransformersConverter
    except ImportError:
        raise UserError(
            "--format ct2 needs the optional dependency ctranslate2 (pip install ctranslate2)"
        ) from None
    return TransformersConverter


def write_ct2(
    contents: BundleContents,
    out: Path,
    converter: type,
    quantization: str | None,
    max_shard_bytes: int | None = None,
) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".asrforge-hf-", dir=out.parent) as hf_dir:
        _write_hf_files(contents, Path(hf_dir), max_shard_bytes)
        with atomic_directory(out) as tmp:
            copy = [
                f
                for f in ("tokenizer.json", "preprocessor_config.json")
                if (Path(hf_dir) / f).is_file()
            ]
            converter(hf_dir, copy_files=copy, load_as_float16=False).convert(
                str(tmp), quantization=quantization, force=True
            )
            _write_inference_config(contents, tmp, "ct2")
            _copy_lm(contents, tmp)
            write_bundle_manifest(
                tmp, {"kind": "bundle", "bundle_version": BUNDLE_VERSION, "format": "ct2"}
            )
    log.info("wrote the CTranslate2 bundle %s (%s)", out, contents.note)
    return out
