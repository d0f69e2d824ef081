"""Optimizer state sharded across processes (``train.distributed: fsdp``), written and read
with ``torch.distributed.checkpoint`` (DCP).

Every process writes its own shard file (``__<rank>_0.distcp``) into one staging directory
beside the checkpoint; rank zero adds ``.metadata``. The staging directory then becomes the
checkpoint's ``optimizer/`` folder (:class:`~asrforge.checkpoint.training.CheckpointContents`
``optimizer_dir``), so the manifest lists and hashes every shard and the checkpoint appears
whole or not at all, like any other.

DCP unpickles ``.metadata`` and ``torch.load``\\s its non-tensor values without
``weights_only``; reading goes through :class:`SafeReader` and :class:`SafeLoadPlanner`, which
accept only DCP's own metadata classes and ``weights_only`` values. ``.metadata`` also names the
file of each value, and anyone can reseal a manifest: every file it names must be a regular file
of the folder itself that the checkpoint's manifest lists (and so hashed), each value's bytes
inside it. DCP's own refusals (a ``CheckpointException``, a ``BaseException``) reach the user as
one :class:`~asrforge.errors.CheckpointError`.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from asrforge.checkpoint.manifest import MANIFEST_NAME, read_manifest
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
    """DCP's file reader, its ``.metadata`` unpickled with DCP's own classes only, and every
    file it names checked against ``listed``.

    Args:
        path: the folder of the shards.
        listed: the names of the folder's files its checkpoint's manifest lists; None checks
            only that each named file is a regular file directly in the folder.
    """

    def __init__(self, path: str | os.PathLike, listed: Collection[str] | None = None):
        super().__init__(path)
        self.listed = None if listed is None else frozenset(listed)

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / METADATA_FILE
        self._regular_file(METADATA_FILE)
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot be loaded safely: {e}") from None
        self._check_storage(metadata, path)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def _regular_file(self, name: str) -> int:
        """The size of ``name``, a regular file directly in the folder (and listed)."""
        if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or (
                "\0" in name):
            raise CheckpointError(f"{Path(self.path) / METADATA_FILE}: names the file {name!r}, "
                                  "not a plain name of a file in its own folder")
        where = Path(self.path) / name
        if self.listed is not None and name not in self.listed:
            raise CheckpointError(f"{where}: not listed in the checkpoint's {MANIFEST_NAME}")
        try:
            info = os.lstat(where)
        except OSError as e:
            raise CheckpointError(f"{where}: cannot be read ({e.strerror})") from None
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{where}: not a regular file")
        return info.st_size

    def _check_storage(self, metadata: Any, path: Path) -> None:
        storage = getattr(metadata, "storage_data", None)
        if not isinstance(storage, dict):
            raise CheckpointError(f"{path}: no map of values to files (storage_data)")
        sizes: dict[str, int] = {}
        for index, info in storage.items():
            name = getattr(info, "relative_path", None)
            if name not in sizes:
                sizes[name] = self._regular_file(name)
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                       for x in (offset, length)) or offset + length > sizes[name]:
                raise CheckpointError(
                    f"{path}: {getattr(index, 'fqn', index)}: bytes {offset!r}+{length!r} are not "
                    f"inside {name} ({sizes[name]} bytes)")
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{path}: {getattr(index, 'fqn', index)}: stored with "
                                      f"transforms {info.transform_descriptors!r}, which asrforge "
                                      "does not write")


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
    ``get_optimizer_state_dict``) in place from ``directory``, a checkpoint's folder whose
    files its manifest lists; every process calls it.

    Raises:
        CheckpointError: a file named outside the folder or the manifest, a class DCP does not
            write, a truncated shard: any refusal of DCP's, in one line.
    """
    directory = Path(directory)
    prefix = f"{directory.name}/"
    listed = [rel[len(prefix):] for rel in read_manifest(directory.parent)["files"]
              if rel.startswith(prefix)]
    try:
        dcp_load(state, storage_reader=SafeReader(directory, listed), planner=SafeLoadPlanner())
    except CheckpointException as e:
        raise CheckpointError(f"{directory}: the sharded optimizer state cannot be loaded: "
                              f"{_first_failure(e)}") from None


def _first_failure(e: CheckpointException) -> str:
    """The first process's error of a DCP refusal as one line (ours as it was raised)."""
    for failure in e.failures.values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, CheckpointError):
            return str(error)
        text = str(error).strip().splitlines()
        return f"{type(error).__name__}: {text[0] if text else ''}"
    return str(e).strip().splitlines()[0]
