"""The decoder's projections as decoding runs them: the output projection
(:func:`vocab_logits`) and, on the CPU, the layers' linear projections of several rows
(:func:`packed_linears`), each frozen weight laid out once for the CPU's matrix kernels."""

from __future__ import annotations

import contextlib
import functools
import logging
import platform
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

log = logging.getLogger(__name__)


def vocab_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The output projection of decoder states ``hidden`` (..., d_model) -> (..., vocab), as
    ``model.proj_out`` computes it.

    On the CPU, outside autograd, a plain bias-free projection without hooks whose weight is
    not trained (a bundle's, or a LoRA run's frozen one) multiplies by a copy of that weight
    laid out for the kernel that reads it fastest, made at its first use and kept until the
    weight changes (:func:`_kept`): for one row the weight transposed into (d_model, vocab)
    (``proj_out`` took twice as long for one row of tiny.en or base), for several float32 rows
    outside autocast the weight packed by oneDNN (MKL's product of four rows took 2-2.5x as
    long on the AMD EPYC; bench/README.md, "Packed projections and windows encoded one at a
    time"). Each copy is one more of the vocabulary's matrix. A trained weight can be
    rewritten without a trace a copy could see (a sharded model gathers it afresh for every
    evaluation), so it is never copied."""
    proj = model.proj_out
    if proj.bias is not None or not _frozen_on_cpu(proj):
        # a copy made before the weight moved or became trainable is of no more use
        _LAYOUTS.pop(proj, None)
        return proj(hidden)
    weight = proj.weight
    rows = hidden.numel() // hidden.shape[-1]
    if rows > 1 and _packs(weight, hidden):
        return _packed_product(proj, hidden)
    return hidden @ _kept(proj, "transposed", lambda w: w.t().contiguous())


@contextlib.contextmanager
def packed_linears(module: torch.nn.Module, rows: int) -> Iterator[None]:
    """Within, ``module``'s frozen float32 ``nn.Linear`` layers on an x86-64 CPU multiply
    ``rows`` > 1 rows through copies of their weights packed by oneDNN (:func:`vocab_logits`'
    rule and copies), put in their places and back after. MKL's products of four rows took
    1.3-2x as long for Whisper's layer shapes (bench/README.md, "Packed projections and
    windows encoded one at a time").

    Nothing changes for one row, autograd or autocast, a module with hooks anywhere (a
    sharded model's gathers), or layers whose copies would pass
    :data:`PACKED_LAYERS_MAX_BYTES`. The model is shared: another thread's pass through a
    swapped layer with autograd, autocast or one row runs as the layer itself would
    (:class:`_PackedLinear`).
    """
    swapped = []
    if (
        rows > 1
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and _onednn_on_x86()
        and not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
    ):
        layers, others = [], []
        for parent in module.modules():
            for name, child in parent._modules.items():
                if not isinstance(child, torch.nn.Linear):
                    continue
                packable = _frozen_on_cpu(child) and child.weight.dtype == torch.float32
                (layers if packable else others).append((parent, name, child))
        for _, _, child in others:
            _LAYOUTS.pop(child, None)  # a copy of a weight since moved, cast or trained
        size = sum(child.weight.nbytes for _, _, child in layers)
        for parent, name, child in layers if size <= PACKED_LAYERS_MAX_BYTES else ():
            parent._modules[name] = _PackedLinear(child)
            swapped.append((parent, name, child))
    try:
        yield
    finally:
        for parent, name, child in swapped:
            parent._modules[name] = child


PACKED_LAYERS_MAX_BYTES = 1 << 30
"""The most memory :func:`packed_linears`' copies of one decoder's layers take: Whisper tiny
to small (38-453 MB in float32) are packed; medium and large (1.6-3.4 GB, half again the
model) keep MKL's products."""


class _PackedLinear(torch.nn.Module):
    """``linear`` multiplying several float32 rows by its weight's oneDNN-packed copy (kept as
    :func:`vocab_logits` keeps its own), and anything else as ``linear`` would. It holds the
    layer's own weight and bias, so the module's parameters and their names stay as they
    were."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        object.__setattr__(self, "linear", linear)
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        if x.numel() == x.shape[-1] or not _frozen_on_cpu(linear) or not _packs(linear.weight, x):
            return linear(x)
        return _packed_product(linear, x)


def _packed_product(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` through oneDNN with the layer's packed copy of its weight (:func:`_kept`)."""
    packed = _kept(layer, "packed", _pack)
    flat = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, x.shape[-1]), packed, layer.bias, "none", [], ""
    )
    return flat.view(*x.shape[:-1], layer.out_features)


def _frozen_on_cpu(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is a plain ``nn.Linear`` without hooks whose CPU weight and bias are
    not trained, used outside autograd: what a kept copy may stand in for."""
    if type(layer) is not torch.nn.Linear or layer._forward_hooks or layer._forward_pre_hooks:
        return False
    weight, bias = layer.weight, layer.bias
    return (
        weight.device.type == "cpu"
        and not weight.requires_grad
        and not weight.is_inference()
        and (bias is None or not bias.requires_grad)
        and not torch.is_grad_enabled()
    )


class _Copy(NamedTuple):
    """A weight's copy in one layout, and what identified the weight when it was made."""

    storage: StorageWeakRef
    """The weight's storage, held weakly: a weight replaced or cast is not kept alive by its
    copy, and while the storage lives no other weight can take its address."""
    data_ptr: int
    dtype: torch.dtype
    shape: torch.Size
    strides: tuple[int, ...]
    version: int
    tensor: torch.Tensor


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each layer's kept copies of its weight by layout name (``{layout: _Copy}``). Beside the
module rather than in its attributes, since a packed copy is an opaque tensor that neither
``copy.deepcopy`` nor ``torch.save`` can take."""


def _kept(
    layer: torch.nn.Linear, layout: str, make: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``make(layer.weight)``, kept until the weight is written in place (its version moves),
    replaced or cast (its storage freed, or another one)."""
    weight = layer.weight
    layouts = _LAYOUTS.setdefault(layer, {})
    kept = layouts.get(layout)
    if (
        kept is None
        or kept.storage.expired()
        or kept.data_ptr != weight.data_ptr()
        or kept.dtype != weight.dtype
        or kept.shape != weight.shape
        or kept.strides != weight.stride()
        or kept.version != weight._version
    ):
        layouts.pop(layout, None)  # the old copy goes before the new one is made
        kept = _Copy(
            StorageWeakRef(weight.untyped_storage()),
            weight.data_ptr(),
            weight.dtype,
            weight.shape,
            weight.stride(),
            weight._version,
            make(weight.detach()),
        )
        layouts[layout] = kept
    return kept.tensor


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered for oneDNN's product with a few rows (the size it is tuned for:
    16, an evaluation's batch; four rows ran as fast with it as with a pack for four)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 16)


def _packs(weight: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``rows`` are multiplied by a oneDNN-packed copy of ``weight``: both float32,
    outside autocast (oneDNN's op has no autocast rule), on an x86-64 CPU whose torch has
    oneDNN (measured there only)."""
    return (
        weight.dtype == rows.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and _onednn_on_x86()
    )


@functools.cache
def _onednn_on_x86() -> bool:
    """Whether this torch has oneDNN's packed linear and runs on an x86-64 CPU."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ones(4, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, 16)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as e:
        log.debug("oneDNN's packed linear is not usable here (%s); MKL projects", e)
        return False
    return bool(torch.equal(out, torch.full((2, 4), 8.0)))
