"""LoRA adapters (peft) on a Whisper model: add them in place, save and load only them, merge.

The adapters are injected into the model itself (peft's ``LoraModel`` tuner, no ``PeftModel``
wrapper), so the model stays a ``WhisperForConditionalGeneration``: the loop, evaluation and
the frozen-encoder code see the attributes they always see, and the optimizer, built after
this, finds only the adapters trainable.

A checkpoint holds the adapters alone. The base weights are rebuilt on resume and export the
way training built them (the pretrained directory, or a from-scratch model drawn under the
run's seed) and must hash to the sha256 the checkpoint records (:func:`base_fingerprint`), so a
changed pretrained directory is refused instead of silently pairing adapters with other
weights.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from asrforge.config import LoraConfig, ModelConfig
from asrforge.errors import CheckpointNotSupportedError, UserError
from asrforge.hub import cached_model_dir
from asrforge.model.build import build_model, scratch_config
from asrforge.model.lowbit import import_quietly

# peft's name for a model's only adapter, which is part of the tensor names.
ADAPTER_NAME = "default"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the names PeftModel.from_pretrained reads
ADAPTER_CONFIG = "adapter_config.json"
BASE_KEY = "lora_base_sha256"  # the checkpoint manifest's record of the base weights


def _peft():
    # peft imports bitsandbytes when installed; imported here first, its warnings stay quiet.
    import_quietly()
    try:
        import peft
    except ImportError:
        raise UserError(
            "model.lora: needs the peft package (pip install 'asrforge[lora]')"
        ) from None
    return peft


def peft_config(cfg: LoraConfig):
    """The ``peft.LoraConfig`` of ``cfg`` (no bias training, no extra modules)."""
    return _peft().LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
    )


def add_adapters(model: torch.nn.Module, cfg: LoraConfig) -> Any:
    """Inject LoRA adapters into ``model`` in place and freeze everything else.

    Returns:
        peft's ``LoraModel`` tuner (its ``.model`` is ``model``), for :func:`merge_adapters`.

    Raises:
        UserError: peft is missing, or a name of ``target_modules`` selects no layer of the
            model LoRA adapts (:func:`target_problems`' rule).
    """
    peft = _peft()
    # peft refuses only a list of which no name matches; a typo beside a right name trains less
    kinds = {name: _kind(module) for name, module in model.named_modules() if name}
    if problems := _unselected(cfg.target_modules, kinds):
        raise UserError("; ".join(problems))
    try:
        tuner = peft.LoraModel(model, peft_config(cfg), ADAPTER_NAME)
    except ValueError as e:
        # peft says "Target modules {...} not found in the base model" and the like.
        raise UserError(f"model.lora.target_modules {list(cfg.target_modules)}: {e}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(_is_adapter(name))
        # peft makes an adapter in its layer's dtype (bf16 over a 4-bit base in a bf16 run),
        # where small updates vanish, so adapters train in fp32 as PeftModel keeps them.
        if _is_adapter(name) and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()
    return tuner


def target_problems(cfg: ModelConfig) -> list[str]:
    """``cfg.lora.target_modules`` checked against the module names of the model ``cfg``
    builds, with no weights read (its skeleton on the meta device: for ``cfg.pretrained``, from
    its ``config.json``, a Hub id's only when the cache holds it); one line per name that
    selects no layer LoRA adapts (:func:`_unselected`). Empty without LoRA, or when the
    model's config cannot be read without the network (the run's start checks it then)."""
    if cfg.lora is None:
        return []
    if cfg.pretrained is None:
        # the vocabulary's size changes no module's name: any size above the default token ids
        config = scratch_config(cfg, vocab_size=51865)
    else:
        directory = cached_model_dir(cfg.pretrained)
        if directory is None or not (directory / "config.json").is_file():
            return []
        try:
            config = WhisperConfig.from_json_file(directory / "config.json")
        except (OSError, ValueError):
            return []  # the run's load names what is wrong with it
    return _unselected(cfg.lora.target_modules, _skeleton_kinds(config.to_json_string()))


def _unselected(targets: Sequence[str], kinds: Mapping[str, str | None]) -> list[str]:
    """One ``model.lora.target_modules.N: ...`` line per name of ``targets`` that selects no
    module of ``kinds``, or a module LoRA cannot adapt. A name selects a module whose name it
    is or ends with after a dot (peft's rule for a list: ``q_proj``, ``decoder.layers.3.fc1``).

    Args:
        kinds: the model's module names (``model.encoder.layers.0.fc1``), each to None when
            peft adapts it (linear, embedding, convolution), else its class name.
    """
    problems = []
    for i, target in enumerate(targets):
        where = f"model.lora.target_modules.{i}: {target!r}"
        matched = [name for name in kinds if name == target or name.endswith(f".{target}")]
        if not matched:
            layers = sorted({name.rsplit(".", 1)[-1] for name, kind in kinds.items()
                             if kind is None})  # fmt: skip
            last = target.rsplit(".", 1)[-1]
            close = difflib.get_close_matches(last, layers, n=1)
            if last in layers:  # a path to a layer the model has fewer of (decoder.layers.9.fc1)
                named = [name for name in kinds if name.endswith(f".{last}")]
                hint = f"no module's name ends with it (its {last}: {named[0]} ... {named[-1]})"
            else:
                hint = f"did you mean {close[0]}?" if close else f"its layers: {', '.join(layers)}"
            problems.append(f"{where} names no layer of the model — {hint}")
        elif other := [name for name in matched if kinds[name] is not None]:
            problems.append(
                f"{where} selects {other[0]} ({kinds[other[0]]}), which LoRA cannot adapt: name "
                "linear layers (q_proj, k_proj, v_proj, out_proj, fc1, fc2)"
            )
    return problems


@functools.lru_cache(maxsize=32)
def _skeleton_kinds(config_json: str) -> dict[str, str | None]:
    """:func:`_kind` of every module of the Whisper model ``config_json`` describes, built on
    the meta device (no memory, no weights; cached: a matrix checks many jobs of one model)."""
    config = WhisperConfig.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    return {name: _kind(module) for name, module in model.named_modules() if name}


def _kind(module: torch.nn.Module) -> str | None:
    """None when peft's LoRA adapts ``module`` (its layer types), else its class name."""
    from transformers.pytorch_utils import Conv1D

    adapted = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d,
               torch.nn.Conv3d, torch.nn.MultiheadAttention, Conv1D)  # fmt: skip
    return None if isinstance(module, adapted) else type(module).__name__


def has_adapters(model: torch.nn.Module) -> bool:
    return any(_is_adapter(name) for name, _ in model.named_parameters())


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under the model's own parameter names (what a checkpoint holds)."""
    return {n: p.detach() for n, p in model.named_parameters() if _is_adapter(n)}


def checkpoint_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a training checkpoint saves of ``model``: the adapters when it has any, else the
    whole state dict."""
    return adapter_state(model) if has_adapters(model) else model.state_dict()


def load_model_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load :func:`checkpoint_weights` back: every tensor, strictly.

    Raises:
        CheckpointNotSupportedError: a model with adapters given other tensors than exactly its
            adapters (a full-model checkpoint, or another rank or target set).
    """
    if not has_adapters(model):
        model.load_state_dict(state, strict=True)
        return
    want = adapter_state(model)
    missing, unknown = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    misshapen = sorted(n for n in set(want) & set(state) if want[n].shape != state[n].shape)
    problems = [
        f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
        for what, names in (
            ("missing", missing),
            ("not adapters of this model", unknown),
            ("of another shape", misshapen),
        )
        if names
    ]
    if problems:
        raise CheckpointNotSupportedError(
            f"the checkpoint's weights are not this model's LoRA adapters ({'; '.join(problems)})"
        )
    model.load_state_dict(state, strict=False)


def base_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the weights the adapters sit on (names, dtypes, shapes, bytes; call it before
    :func:`add_adapters`)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def check_base(recorded: str | None, actual: str, where: Path | str) -> None:
    """Refuse adapters whose recorded base is not the one rebuilt now.

    Raises:
        UserError: the checkpoint records no base (not a LoRA checkpoint) or another one.
    """
    if recorded is None:
        raise UserError(f"{where}: not a LoRA checkpoint (its manifest records no {BASE_KEY})")
    if not isinstance(recorded, str):
        raise UserError(f"{where}: its manifest's {BASE_KEY} is {recorded!r}, not a sha256")
    if recorded != actual:
        raise UserError(
            f"{where}: its LoRA adapters were trained on other base weights (sha256 "
            f"{recorded[:12]}..., rebuilt now: {actual[:12]}...); was model.pretrained changed?"
        )


def merge_adapters(tuner: Any) -> torch.nn.Module:
    """Fold each adapter into its layer (``W + (alpha/r) B A``) and remove the LoRA layers:
    a plain Whisper model with the usual tensor names."""
    return tuner.merge_and_unload()


def write_adapter(
    directory: Path, adapters: Mapping[str, torch.Tensor], cfg: LoraConfig, base: str | None
) -> None:
    """Write ``adapters`` as peft writes a ``PeftModel`` (``adapter_model.safetensors`` +
    ``adapter_config.json``), so ``PeftModel.from_pretrained(whisper, directory)`` loads them.

    Args:
        directory: an existing (temporary) directory.
        adapters: :func:`adapter_state` names.
        base: the base model's path or hub name for ``base_model_name_or_path``, if known.
    """
    from safetensors.torch import save_file

    tag = f".{ADAPTER_NAME}."
    tensors = {
        "base_model.model." + name.replace(tag, "."): t.contiguous() for name, t in adapters.items()
    }
    save_file(tensors, str(Path(directory) / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_config(cfg)
    config.base_model_name_or_path = base
    config.save_pretrained(str(directory))  # adapter_config.json


def _is_adapter(name: str) -> bool:
    return ".lora_" in name


def merged_state(
    cfg: Any,
    tokenizer: Any,
    adapters: Mapping[str, torch.Tensor],
    recorded: str | None,
    where: Path,
) -> dict[str, torch.Tensor]:
    """Plain Whisper weights: the run's base rebuilt as training built it, with ``adapters``
    merged in.

    Args:
        cfg: the run's ``TrainConfig`` (the checkpoint's config.yaml).
        tokenizer: the checkpoint's tokenizer.
        adapters: :func:`adapter_state` names, as a checkpoint holds them.
        recorded: the checkpoint's :data:`BASE_KEY`.
        where: the checkpoint, for messages.

    Raises:
        UserError: the rebuilt base is not the one the adapters were trained on.
        CheckpointNotSupportedError: the tensors are not this configuration's adapters.
    """

    if cfg.model.lora is None:
        raise UserError(f"{where}: records LoRA base weights but its config has no model.lora")
    try:
        model = build_model(
            cfg.model, tokenizer, cfg.seed, language_tokens=cfg.data.language_tokens
        ).model
    except UserError as e:
        # the base is read again here, where the user may not expect it: say why
        raise UserError(
            f"{where}: a model.lora run's adapters are merged into their base model, which "
            f"could not be loaded: {e}"
        ) from None
    check_base(recorded, base_fingerprint(model), where)
    tuner = add_adapters(model, cfg.model.lora)
    load_model_state(model, adapters)
    return merge_adapters(tuner).state_dict()
