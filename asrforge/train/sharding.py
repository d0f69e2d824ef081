"""Sharded data parallelism (``train.distributed: fsdp``) on PyTorch FSDP2 (``fully_shard``).

Each encoder and decoder layer is one unit of sharding, the rest of the model (embeddings,
convolutions, final norms) the root's: between uses each process holds 1/N of every
parameter, gradient and optimizer state, and a unit's whole weights exist only while it runs.

asrforge calls ``fully_shard`` itself under accelerate's processes (accelerate still starts
the process group, places the data and autocasts): accelerate 1.15 makes FSDP a GPU-only
distributed type and, on a CPU, silently runs DDP instead, so its own FSDP path could not be
tested without GPUs while this one is the same on CPUs (gloo) and GPUs (NCCL).

Evaluation, the guard and long-form decoding call the Whisper model directly, each process a
different number of times: :func:`whole_weights` gathers every unit for their duration, so
they need no collective. A checkpoint holds the whole weights (:func:`full_weights`, on rank
zero, the usual safetensors files) and the optimizer state sharded
(:func:`save_optimizer_shards`, :mod:`asrforge.checkpoint.sharded`).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers.models.whisper.modeling_whisper import WhisperDecoderLayer, WhisperEncoderLayer

from asrforge.checkpoint.sharded import load_sharded, save_sharded
from asrforge.errors import UserError
from asrforge.model.dtypes import precision_dtype

WRAPPED_LAYERS = (WhisperEncoderLayer, WhisperDecoderLayer)
"""The units of sharding: one all-gather before each layer runs, one reduce-scatter after its
backward."""
_LOW_PARAM_PRECISIONS = frozenset({"bf16"})
"""Precisions whose weights are gathered and used in their low dtype (sharded fp32 master
weights, gradients reduced in fp32); other runs gather fp32."""


def check_processes(num_processes: int, precision: str, launched_as: str) -> None:
    """Refuse what sharding cannot run: one process (nothing to shard across), fp16 (``auto``
    can pick it on GPUs without bf16; the loss scaler's overflow check is per shard), and
    accelerate's own FSDP or DeepSpeed (``launched_as``: its ``distributed_type``), which would
    wrap the model a second time."""
    if launched_as in ("FSDP", "DEEPSPEED"):
        raise UserError(
            f"train.distributed: fsdp shards the model itself, and accelerate was launched with "
            f"its own {launched_as}: launch with torchrun or accelerate launch --multi_gpu"
        )
    if num_processes < 2:
        raise UserError(
            "train.distributed: fsdp shards across processes and this run has one; launch it "
            "with torchrun --nproc_per_node N (N >= 2) or set train.distributed: ddp"
        )
    if precision == "fp16":
        raise UserError(
            "train.distributed: fsdp cannot train in fp16 (train.precision: auto picked it on "
            "GPUs without bf16): set train.precision: fp32, or ddp"
        )


def shard_model(model: nn.Module, precision: str, device: torch.device) -> nn.Module:
    """Shard ``model`` in place across the process group: each of its Whisper encoder and
    decoder layers a unit, the rest the root's. Build the optimizer after this: the parameters
    become DTensors.

    Args:
        model: the module the training step calls (its forward runs the root's gathers).
        precision: the run's resolved precision (``bf16``, ``fp32``, ``no``).
        device: the process's device (``train.device: cpu`` on a GPU machine shards on CPUs).
    """
    dtype = precision_dtype(precision) if precision in _LOW_PARAM_PRECISIONS else None
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    # One dimension over every process; the default would take the GPU even for CPU runs.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, WRAPPED_LAYERS):
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextmanager
def whole_weights(model: nn.Module) -> Iterator[None]:
    """Every unit's whole weights on every process for the body (one all-gather each), so
    forward passes run in any number and order without collectives; sharded again after.
    Nothing for an unsharded ``model``. Every process enters it at the same point."""
    if not is_sharded(model):
        yield
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            if unit is not model:
                unit.set_reshard_after_forward(True, recurse=False)


def full_weights(model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The whole weights on the CPU of rank zero (empty on the others), names without
    ``prefix``; every process calls it (it gathers)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if not state:
        return {}
    # Gathered one by one, tied weights (the output projection is the token embedding) come
    # back as copies: one tensor under each name again, so the checkpoint stores it once.
    first_name: dict[int, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        first = first_name.setdefault(id(value), name)
        if first != name and first in state and name in state:
            state[name] = state[first]
    return {k.removeprefix(prefix): v for k, v in state.items()}


def load_full_weights(model: nn.Module, weights: Mapping[str, torch.Tensor], prefix: str) -> None:
    """Load whole ``weights`` (names without ``prefix``, read by every process) into the
    sharded ``model``: each process keeps its own shard."""
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, {prefix + k: v for k, v in weights.items()}, options=options)


def save_optimizer_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, staging: Path, is_main: bool, barrier
) -> None:
    """Write the optimizer's state, each process its own shard, into ``staging`` (a fresh
    directory rank zero makes; ``barrier()`` waits for every process)."""
    if is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    save_sharded(get_optimizer_state_dict(model, optimizer), staging)


def load_optimizer_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path
) -> None:
    """Restore the optimizer's state from the shards in ``directory`` (any number of processes
    wrote them: DCP reshards)."""
    state = get_optimizer_state_dict(model, optimizer)
    load_sharded(state, directory)
    set_optimizer_state_dict(model, optimizer, state)
