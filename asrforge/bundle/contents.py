"""What a bundle holds, read from a training checkpoint (raw, EMA or averaged weights), a
pretrained transformers directory or a bundle written earlier: weights, model and generation
configs, tokenizer and the inference config (:class:`BundleContents`)."""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import GenerationConfig, WhisperConfig

from asrforge.bundle.card import CARD_FILE
from asrforge.bundle.load import (
    ALIGNMENT_HEADS_KEY,
    LM_WEIGHTS_KEY,
    MODEL_FILE,
    check_tensors,
    load_bundle,
    read_bundle_weights,
)
from asrforge.bundle.schema import (
    MODEL_SHAPE,
    FeatureConfig,
    InferenceConfig,
    LMInfo,
    asrforge_version,
    inference_view,
)
from asrforge.checkpoint.average import LORA_REASON, average_top_k, refuse_lora
from asrforge.checkpoint.manifest import (
    read_manifest,
    verify,
)
from asrforge.checkpoint.shards import LazyWeights, has_weights
from asrforge.checkpoint.training import (
    EMA_FILE,
    EMA_STEM,
    MODEL_STEM,
)
from asrforge.config import (
    SHAPE_FIELDS,
    ModelConfig,
    TrainConfig,
    load_config,
)
from asrforge.config.yaml_limits import load_yaml, read_yaml_text
from asrforge.data.audio import SAMPLE_RATE, decode_audio
from asrforge.data.locate import data_ref
from asrforge.data.rules import language_filter
from asrforge.data.sources import load_source
from asrforge.errors import CheckpointError, CheckpointNotSupportedError, UserError
from asrforge.hub import model_dir_if_any
from asrforge.io.small_files import MANIFEST_BYTES, read_json
from asrforge.lm.ngram import read_arpa
from asrforge.model import lora
from asrforge.model.build import build_model, is_multilingual
from asrforge.model.frames import HOP_LENGTH, window_seconds
from asrforge.model.resize import VOCAB_TENSORS
from asrforge.model.tokenizer import SpecialTokens, WhisperTokenizer, load_tokenizer
from asrforge.run_layout import CHECKPOINTS, RunLayout, checkpoint_name
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
    card: str | None = None
    """The bundle's ``README.md``, a model card (``asrforge.bundle.card``)."""
    records: dict[str, Any] = field(default_factory=dict)
    """Manifest entries a bundle written earlier carries into the new one: ``asrforge
    align-heads``' and ``asrforge lm tune``'s records."""


def read_run_config(ckpt: Path) -> TrainConfig:
    """The config ``ckpt`` was trained with (its ``config.yaml``)."""
    return read_train_config(ckpt / "config.yaml")


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
    if contents.records.pop(LM_WEIGHTS_KEY, None) is not None:
        log.warning("--lm %s: the bundle's lm tune weights were tuned for its own LM and are "
                    "dropped; tune them again (asrforge lm tune)", path)  # fmt: skip
    contents.lm = path
    contents.note += f", {lm.order}-gram LM {path.name}"
    return contents


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
    cfg = pinned_to_recorded_commits(read_train_config(ckpt / "config.yaml"), manifest)
    tokenizer = load_tokenizer(ckpt / "tokenizer")
    multilingual = _multilingual(cfg.model, len(tokenizer), manifest.get("multilingual"))
    specials = SpecialTokens.from_tokenizer(tokenizer, multilingual, cfg.data.language_tokens)

    has_ema = has_weights(files, EMA_STEM)
    chosen = weights or ("ema" if has_ema else "raw")
    step = manifest.get("step")
    source: dict[str, Any] = {"checkpoint": checkpoint_name(ckpt), "step": step}
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
        refuse_lora(manifest, ckpt, "; use --weights raw or ema")
        state, averaged = _average(ckpt, average_k, average_metric)
        # the checkpoint's step and figures are not the mean's: only the averaged steps are named
        source = {"checkpoint": source["checkpoint"], **averaged}
    else:
        raise UserError(f"weights: must be ema, raw or average, got {chosen!r}")
    # A LoRA checkpoint's adapters are merged into the rebuilt base weights.
    if lora.BASE_KEY in manifest:
        state = lora.merged_state(cfg, tokenizer, in_memory(state), manifest[lora.BASE_KEY], ckpt)
    elif cfg.model.lora is not None:
        raise CheckpointNotSupportedError(
            f"{ckpt}: a model.lora run's checkpoint whose manifest records no {lora.BASE_KEY}: "
            "its weights are adapters without the base they were trained on (an average of "
            f"the run's checkpoints? {LORA_REASON}); export one of its step checkpoints instead"
        )

    config, base_gen = _whisper_config(cfg, tokenizer, state, ckpt)
    trained, stats = None, None
    if scan_data:
        trained, stats = _data_facts(cfg, specials, config, stats_utterances)
    trained = trained or _languages_fallback(cfg, ckpt, specials)
    languages = bundle_languages(cfg.model, base_gen, specials, trained)
    view = inference_view(cfg)
    view["model"].update({name: getattr(config, name) for name in MODEL_SHAPE})
    icfg = InferenceConfig.model_validate(
        {
            **view,
            "asrforge_version": asrforge_version(),
            "weights": chosen,
            "multilingual": multilingual,
            "languages": languages,
            "trained_languages": trained,
            "features": feature_config(config, stats).model_dump(),
            "source": source,
        }
    )
    generation = generation_config(base_gen, config, specials, icfg)
    where = f"{ckpt.parent.name}/{ckpt.name}" if ckpt.parent.name == CHECKPOINTS else str(ckpt)
    if chosen == "average":
        steps = ", ".join(map(str, source["averaged_steps"]))
        note = f"the mean of steps {steps} of {ckpt.parent.parent}, {averaged['averaged_weights']}"
    else:
        note = f"{where} (step {step}), {chosen} weights"
    return BundleContents(state, config, generation, tokenizer, icfg, note)


def pinned_to_recorded_commits(cfg: TrainConfig, manifest: dict) -> TrainConfig:
    """``cfg`` with a Hub ``model.pretrained`` and ``data.path`` pinned to the commits the
    checkpoint records (``hub_commits``), so an export rebuilds the weights it was trained from
    even after the branch moved, and reads the cache without asking the Hub which commit a
    branch is at."""
    commits = manifest.get("hub_commits") or {}
    record = commits.get("model.pretrained") or {}
    if record.get("commit") and record.get("revision") is None:
        pinned = f"{record['id']}@{record['commit']}"
        model = cfg.model.model_copy(update={"pretrained": pinned})
        cfg = cfg.model_copy(update={"model": model})
    data = commits.get("data.path") or {}
    if data.get("commit") and data_ref(cfg.data) is not None:
        pinned_data = cfg.data.model_copy(update={"path": data["id"], "revision": data["commit"]})
        cfg = cfg.model_copy(update={"data": pinned_data})
    return cfg


def read_train_config(path: Path) -> TrainConfig:
    """The training config saved at ``path``; a UserError naming it when it is unreadable."""
    try:
        data = load_yaml(read_yaml_text(path))
        return load_config(data=data)
    except (ValueError, AttributeError, OSError) as e:
        raise UserError(f"{path}: not a readable training config: {e}") from None


def pretrained_contents(
    hf_dir: Path, name: str | None = None, hub: dict | None = None
) -> BundleContents:
    """A pretrained transformers Whisper directory (safetensors weights) as bundle contents;
    ``name``: its ``config_id`` (default the directory's name, which a Hub snapshot's is not:
    a commit); ``hub``: what it was resolved from on the Hub (``Resolved.record()``: id,
    revision, commit), recorded as ``source``; else ``source.pretrained`` is the directory's
    name."""
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
    languages = bundle_languages(ModelConfig(pretrained=hf_dir), base_gen, specials, ["en"])
    icfg = InferenceConfig.model_validate(
        {
            "config_id": name or hf_dir.name,
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
            "source": (
                {"pretrained": hub["id"], "revision": hub["revision"], "commit": hub["commit"]}
                if hub is not None
                else {"pretrained": hf_dir.name}
            ),
        }
    )
    generation = generation_config(base_gen, config, specials, icfg)
    return BundleContents(state, config, generation, tokenizer, icfg, f"pretrained model {hf_dir}")


def bundle_contents(source: str | Path) -> BundleContents:
    """A transformers-format bundle (a directory, or a Hub id of a pushed one), verified as
    :func:`~asrforge.bundle.load.load_bundle` verifies it, as contents to write in another
    format: its weights as stored, its configs, tokenizer, LM, card, and the records of
    ``align-heads`` and ``lm tune``. Heads ``align-heads`` found go into the generation
    config's ``alignment_heads``, where CTranslate2's converter reads them."""
    bundle = load_bundle(source)
    path = bundle.path
    manifest = read_manifest(path)
    generation = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    if ALIGNMENT_HEADS_KEY in manifest:
        if bundle.alignment_heads:
            generation.alignment_heads = [list(pair) for pair in bundle.alignment_heads]
        elif hasattr(generation, "alignment_heads"):
            del generation.alignment_heads  # align-heads found none that qualifies
    icfg = bundle.config
    config = WhisperConfig.from_pretrained(str(path), local_files_only=True)
    del bundle  # its float32 model; the weights are read again as stored
    return BundleContents(
        read_bundle_weights(path),
        config,
        generation,
        load_tokenizer(path),
        icfg,
        f"the bundle {source}",
        lm=None if icfg.lm is None else path / icfg.lm.file,
        card=(path / CARD_FILE).read_text(encoding="utf-8")
        if (path / CARD_FILE).is_file()
        else None,
        records={k: manifest[k] for k in (ALIGNMENT_HEADS_KEY, LM_WEIGHTS_KEY) if k in manifest},
    )


def read_pretrained_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a transformers directory: one safetensors file or its shards."""
    index = hf_dir / "model.safetensors.index.json"
    if (hf_dir / MODEL_FILE).is_file():
        shards = [hf_dir / MODEL_FILE]
    elif index.is_file():
        names = sorted(set(read_json(index, MANIFEST_BYTES)["weight_map"].values()))
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
    if (pretrained := model_dir_if_any(cfg.pretrained)) and (pretrained / "config.json").is_file():
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
        "averaged_values": manifest.get("values"),
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
    pretrained = model_dir_if_any(cfg.model.pretrained)
    if pretrained is None and cfg.model.pretrained is not None:
        pretrained = Path(cfg.model.pretrained)  # gone: the recorded shape stands in for it
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
    embed = VOCAB_TENSORS[0]
    if embed not in shapes:
        raise CheckpointNotSupportedError(
            f"{ckpt}: its weights have no {embed}: not a whole Whisper model's weights"
        )
    config.vocab_size = int(shapes[embed][0])
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
        sorted({resolve_language(x, strict=False) for x in split["language"]})
        if specials.multilingual
        else ["en"]
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


def bundle_languages(
    model: ModelConfig,
    base_gen: GenerationConfig | None,
    specials: SpecialTokens,
    trained: list[str],
) -> list[str]:
    """The languages a bundle transcribes and detects among: a multilingual pretrained base's
    own (its ``lang_to_id``, else every language its tokenizer has a token of its own for), then
    the trained ones it lacked; a model trained from scratch knows the trained ones only, an
    English-only one English."""
    if not specials.multilingual:
        return ["en"]
    if model.pretrained is None:
        return list(trained)
    if base_gen is not None and getattr(base_gen, "lang_to_id", None):
        base = [t.strip("<|>") for t in base_gen.lang_to_id]
    else:
        # no generation config (the pretrained directory is gone): the tokenizer's own tokens
        base = [c for c in specials.languages if c not in specials.token_of]
    return [*base, *(c for c in trained if c not in base)]


def _languages_fallback(cfg: TrainConfig, ckpt: Path, specials: SpecialTokens) -> list[str]:
    if not specials.multilingual:
        return ["en"]
    if cfg.data.languages:
        codes = [resolve_language(c, strict=False) for c in cfg.data.languages]
        return [c for c in codes if c in specials.languages]
    seen: set[str] = set()
    for records in RunLayout(ckpt.parent.parent).eval_records():
        for line in records.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            if "language" in rec:
                seen.add(rec["language"])
    langs = sorted(c for c in seen if c in specials.languages)
    if not langs:
        log.warning("no record of the training languages: the bundle accepts every language token")
        langs = list(specials.languages)
    return langs
