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

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from asrforge.config import LoraConfig
from asrforge.errors import CheckpointNotSupportedError, UserError
from asrforge.model.build import build_model

# peft's name for a model's only adapter, which is part of the tensor names.
ADAPTER_NAME = "default"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the names PeftModel.from_pretrained reads
ADAPTER_CONFIG = "adapter_config.json"
BASE_KEY = "lora_base_sha256"  # the checkpoint manifest's record of the base weights


def _peft():
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
        UserError: peft is missing, or ``target_modules`` names no linear layer of the model.
    """
    peft = _peft()
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
    model = build_model(
        cfg.model, tokenizer, cfg.seed, language_tokens=cfg.data.language_tokens
    ).model
    check_base(recorded, base_fingerprint(model), where)
    tuner = add_adapters(model, cfg.model.lora)
    load_model_state(model, adapters)
    return merge_adapters(tuner).state_dict()
