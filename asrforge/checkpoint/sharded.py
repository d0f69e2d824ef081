"""Optimizer state sharded across processes (``train.distributed: fsdp``), written and read
with ``torch.distributed.checkpoint`` (DCP).

Every process writes its own shard file (``__<rank>_0.distcp``) into one staging directory
beside the checkpoint; rank zero adds ``.metadata``. The staging directory then becomes the
checkpoint's ``optimizer/`` folder (:class:`~asrforge.checkpoint.training.CheckpointContents`
``optimizer_dir``), so the manifest lists and hashes every shard and the checkpoint appears
whole or not at all, like any other.

DCP unpickles ``.metadata`` and ``torch.load``\\s its non-tensor values without
``weights_only``; reading goes through :class:`SafeReader` and :class:`SafeLoadPlanner`, which
accept only DCP's own metadata classes and ``weights_only`` values.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from asrforge.errors import CheckpointError

SHARDED_OPTIMIZER_DIR = "optimizer"
"""The folder of a checkpoint that holds the sharded optimizer state."""
METADATA_FILE = ".metadata"

# The globals DCP's metadata pickle may name: its own dataclasses and the torch types they hold.
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("torch", "Size"),
    ("torch", "float32"),
    ("torch", "float64"),
    ("torch", "float16"),
    ("torch", "bfloat16"),
    ("torch", "int64"),
    ("torch", "int32"),
    ("torch", "bool"),
    ("torch", "strided"),
    ("torch", "contiguous_format"),
    ("torch", "preserve_format"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader, its ``.metadata`` unpickled with DCP's own classes only."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / METADATA_FILE
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError) as e:
            raise CheckpointError(f"{path}: cannot be loaded safely: {e}") from None
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor values (learning rates, step counts) with
    ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def save_sharded(state: dict[str, Any], directory: Path) -> None:
    """Write ``state`` (DTensors: each process's own shard) into ``directory``; every process
    calls it with the same directory, which rank zero created empty."""
    dcp_save(state, storage_writer=FileSystemWriter(directory, single_file_per_rank=True))


def load_sharded(state: dict[str, Any], directory: Path) -> None:
    """Fill ``state`` (shaped as the state to restore, e.g. from
    ``get_optimizer_state_dict``) in place from ``directory``; every process calls it."""
    dcp_load(state, storage_reader=SafeReader(directory), planner=SafeLoadPlanner())
