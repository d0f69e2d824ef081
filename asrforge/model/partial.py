"""Partial fine-tuning of the Whisper encoder: a frozen lower part, the top ``top`` layers train.

How it works: docs/training.md, "Partial fine-tuning of the encoder (`model/partial.py`)".
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from asrforge.errors import UserError


def check_top(encoder: nn.Module, top: int) -> None:
    """Raise a UserError unless ``top`` is between 0 and the encoder's layer count."""
    n_layers = len(encoder.layers)
    if not 0 <= top <= n_layers:
        raise UserError(
            f"model.train_encoder_layers: must be between 0 and the model's {n_layers} encoder "
            f"layers, got {top}"
        )


def frozen_modules(encoder: nn.Module, top: int) -> list[nn.Module]:
    """The encoder's submodules below the top ``top`` layers (all of them when ``top`` is 0)."""
    if top == 0:
        return [encoder]
    split = len(encoder.layers) - top
    return [encoder.conv1, encoder.conv2, encoder.embed_positions, *encoder.layers[:split]]


def freeze_encoder_part(encoder: nn.Module, top: int) -> None:
    """``requires_grad=False`` for the frozen part: all but the top ``top`` layers and the final
    norm, or the whole encoder when ``top`` is 0. Raises UserError for a ``top`` out of range."""
    check_top(encoder, top)
    for module in frozen_modules(encoder, top):
        module.requires_grad_(False)


def set_frozen_eval(encoder: nn.Module, top: int) -> None:
    """Put the frozen part in eval mode (no dropout); the trained layers keep their mode."""
    for module in frozen_modules(encoder, top):
        module.eval()


def frozen_part_id(encoder: nn.Module, top: int) -> dict[str, str]:
    """What the frozen part's output depends on: where it ends and the sha256 of its weights
    (names, shapes, dtypes and bytes). Caches of the frozen part are keyed by it."""
    if top == 0:
        split, prefixes = "whole encoder", ("",)
    else:
        n = len(encoder.layers) - top
        split = f"conv+positions+layers[:{n}]"  # the states entering layer n, before its norm
        prefixes = ("conv1.", "conv2.", "embed_positions.", *(f"layers.{i}." for i in range(n)))
    h = hashlib.sha256()
    for name, t in sorted(encoder.state_dict().items()):
        if not name.startswith(prefixes):
            continue
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return {"split": split, "weights_sha256": h.hexdigest()}


@torch.no_grad()
def encode_frozen_part(encoder: nn.Module, features: torch.Tensor, top: int) -> torch.Tensor:
    """The frozen part's output, without an autograd graph (nothing in it trains).

    Args:
        features: log-mels, (batch, n_mels, 2 * max_source_positions).
        top: encoder layers that train above the frozen part.

    Returns:
        (batch, max_source_positions, d_model): the states entering layer ``L - top``, or the
        encoder's output (after ``layer_norm``) when ``top`` is 0.
    """
    split = len(encoder.layers) - top
    training = [m for m in (encoder.conv1, *encoder.layers[:split]) if m.training]
    if training:
        raise RuntimeError("the frozen part of the encoder must be in eval mode (set_frozen_eval)")
    expected = (
        encoder.config.max_source_positions * encoder.conv1.stride[0] * encoder.conv2.stride[0]
    )
    if features.shape[-1] != expected:
        raise ValueError(f"Whisper expects {expected} mel frames, got {features.shape[-1]}")
    hidden = nn.functional.gelu(encoder.conv1(features))
    hidden = nn.functional.gelu(encoder.conv2(hidden)).permute(0, 2, 1)
    positions = torch.arange(encoder.embed_positions.num_embeddings, device=hidden.device)
    # The dropout that follows does nothing in eval mode.
    hidden = hidden + encoder.embed_positions(positions)
    for layer in encoder.layers[:split]:
        hidden = layer(hidden, None)
    return encoder.layer_norm(hidden) if top == 0 else hidden


def encode_trained_part(encoder: nn.Module, hidden: torch.Tensor, top: int) -> torch.Tensor:
    """The top ``top`` layers and the final ``layer_norm`` on the frozen part's output, as
    ``WhisperEncoder.forward`` runs them: LayerDrop (one ``torch.rand`` draw per layer while the
    encoder is in training mode and ``encoder_layerdrop > 0``), no attention mask, each layer's
    dropout by its own mode. ``top == 0`` returns ``hidden`` (the frozen part was all of it).

    Args:
        hidden: (batch, max_source_positions, d_model), see :func:`encode_frozen_part`.

    Returns:
        (batch, max_source_positions, d_model): the encoder's output for the decoder.
    """
    if top == 0:
        return hidden
    for layer in encoder.layers[len(encoder.layers) - top :]:
        if encoder.training and encoder.layerdrop > 0.0 and torch.rand([]) < encoder.layerdrop:
            # LayerDrop skips the layer.
            continue
        hidden = layer(hidden, None)
    return encoder.layer_norm(hidden)
