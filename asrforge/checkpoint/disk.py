"""Disk use of a run's checkpoints: what a directory holds, and what a save will add.

Sizes are apparent bytes (``st_size``), each inode counted once: ``best/`` and the top-k
directories are hard links of a step directory's files and cost nothing of their own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the matrix reads sizes with this module alone, without torch
    from asrforge.checkpoint.training import CheckpointContents

GB = 10**9
RESUME_ONLY_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng.pt")
"""What only a resume reads; ``checkpoint.after_run: best`` deletes them when a run ends."""
# Headers, pickle framing, JSON and the tokenizer add a small, bounded amount per file.
_FILE_OVERHEAD = 64 << 10


def _files(root: Path):
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:  # deleted while we walk (a rotation)
                continue
            yield Path(dirpath, name), st


def tree_bytes(root: Path) -> int:
    """Bytes of the files under ``root``, each inode once (hard links are free)."""
    seen: dict[tuple[int, int], int] = {}
    for _path, st in _files(Path(root)):
        seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def exclusive_bytes(root: Path) -> dict[str, int]:
    """``{entry name: bytes}`` for each directory directly under ``root``: what deleting that
    directory alone would free (inodes also linked from another entry are not counted)."""
    root = Path(root)
    owners: dict[tuple[int, int], tuple[int, set[str]]] = {}
    for path, st in _files(root):
        top = path.relative_to(root).parts[0]
        size, names = owners.setdefault((st.st_dev, st.st_ino), (st.st_size, set()))
        names.add(top)
    out: dict[str, int] = {}
    for size, names in owners.values():
        if len(names) == 1:
            (name,) = names
            out[name] = out.get(name, 0) + size
    return out


def tensor_bytes(obj: Any, seen: set | None = None) -> int:
    """Bytes of every distinct tensor in a nest of dicts, lists and tuples (views of one tensor
    counted once, as :func:`asrforge.checkpoint.training.save_weights` writes them once)."""
    import torch

    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if obj.numel() == 0:
            return 0
        key = (
            str(obj.device),
            obj.untyped_storage().data_ptr(),
            obj.storage_offset(),
            tuple(obj.shape),
        )
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def estimate_save_bytes(contents: CheckpointContents) -> int:
    """What :func:`asrforge.checkpoint.training.save_training_checkpoint` will write for these
    contents: the tensor bytes of each file, plus a bound on headers and small files."""
    total = 0
    for key in ("model", "ema", "optimizer", "scheduler", "scaler", "rng"):
        if getattr(contents, key) is not None:
            total += tensor_bytes(getattr(contents, key)) + _FILE_OVERHEAD
    total += len(str(contents.config_yaml or "").encode()) + 4 * _FILE_OVERHEAD
    return total


def format_gb(n: int | float) -> str:
    """A size for people: ``2.35 GB``, ``14.2 MB``, ``310.0 kB``, ``900 B`` (powers of 10)."""
    for unit, scale in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{int(n)} B"
