"""The decoder's output projection as decoding runs it (:func:`vocab_logits`), with the frozen
weight laid out once for the CPU's matrix kernels."""

from __future__ import annotations

import torch


def vocab_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The output projection of decoder states ``hidden`` (..., d_model) -> (..., vocab), as
    ``model.proj_out`` computes it. On the CPU, without autograd, a plain bias-free projection
    without hooks whose weight is not trained (a bundle's, or a LoRA run's frozen one)
    multiplies by that weight transposed once into (d_model, vocab), kept beside the module
    (one more copy of the vocabulary's matrix): ``proj_out`` took twice as long for one row of
    tiny.en or base (bench/README.md, "The output projection on the CPU"). A trained weight
    can be rewritten without a trace the copy could see (a sharded model gathers it afresh for
    every evaluation), so it is never copied."""
    proj = model.proj_out
    weight = proj.weight
    if (
        type(proj) is not torch.nn.Linear
        or proj.bias is not None
        or proj._forward_hooks
        or proj._forward_pre_hooks
        or weight.device.type != "cpu"
        or weight.requires_grad
        or weight.is_inference()
        or torch.is_grad_enabled()
    ):
        # a copy made before the weight moved or became trainable is of no more use
        proj.__dict__.pop(_TRANSPOSED, None)
        return proj(hidden)
    return hidden @ _transposed(proj)


_TRANSPOSED = "_asrforge_transposed"
"""Where :func:`vocab_logits` keeps a projection's transposed weight: in the module's own
attributes, so it goes with the model."""


def _transposed(proj: torch.nn.Linear) -> torch.Tensor:
    """``proj``'s weight as a contiguous (in, out) tensor, kept on the module until the weight
    is written in place (its version moves) or replaced (another storage: the one copied is
    held, so no new weight can take its address)."""
    weight = proj.weight
    kept = proj.__dict__.get(_TRANSPOSED)
    if (
        kept is None
        or kept[0].data_ptr() != weight.data_ptr()
        or kept[0].dtype != weight.dtype
        or kept[0].shape != weight.shape
        or kept[1] != weight._version
    ):
        kept = (weight.detach(), weight._version, weight.detach().t().contiguous())
        proj.__dict__[_TRANSPOSED] = kept
    return kept[2]
