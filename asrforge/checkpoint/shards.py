"""Sharded safetensors weights, laid out as transformers writes and ``from_pretrained`` reads.

How it works: docs/training.md, "Sharded weights (`checkpoint/shards.py`)".
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from asrforge.checkpoint.manifest import sha256_file
from asrforge.checkpoint.streaming import FileDigest, can_stream, write_safetensors, write_text
from asrforge.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotSupportedError,
    CheckpointSaveError,
)
from asrforge.io.atomic import fsync_file
from asrforge.io.small_files import MANIFEST_BYTES, parse_json, read_json

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "C64": torch.complex64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype codes -> torch dtypes (what the readers here understand)."""


def single_name(stem: str) -> str:
    """``model.safetensors``: the unsharded file."""
    return f"{stem}.safetensors"


def index_name(stem: str) -> str:
    """``model.safetensors.index.json``: the index of a sharded state dict."""
    return f"{stem}.safetensors.index.json"


def shard_name(stem: str, number: int, total: int) -> str:
    """``model-00002-of-00003.safetensors`` (``number`` from 1), transformers' naming."""
    return f"{stem}-{number:05d}-of-{total:05d}.safetensors"


def is_weights_file(rel: str, stem: str) -> bool:
    """True for the single file, the index or a shard of ``stem``'s weights."""
    return rel in (single_name(stem), index_name(stem)) or bool(
        re.fullmatch(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.safetensors", rel)
    )


def has_weights(files: Any, stem: str) -> bool:
    """Whether ``files`` (a manifest's file names, or a directory) holds ``stem``'s weights."""
    if isinstance(files, Path):
        return (files / single_name(stem)).is_file() or (files / index_name(stem)).is_file()
    return single_name(stem) in files or index_name(stem) in files


def plan_shards(sizes: Mapping[str, int], max_bytes: int | None) -> list[list[str]]:
    """Split tensor names, in order, into shards of at most ``max_bytes`` of tensor data, as
    transformers does (a tensor larger than the limit alone); None: one shard."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if max_bytes is not None and shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_shards(
    directory: Path,
    stem: str,
    plan: list[list[str]],
    get_tensor: Callable[[str], torch.Tensor],
    metadata: Mapping[str, str],
) -> dict[str, FileDigest]:
    """Write the weights ``plan`` groups, one shard's tensors in memory at a time.

    Args:
        directory: where the files go (existing; atomicity is the caller's).
        stem: ``model`` or ``ema``.
        plan: tensor names per shard (:func:`plan_shards`); one group: the single file.
        get_tensor: the tensor of a name (distinct and contiguous), called while its shard is
            written.
        metadata: the header metadata of every file.

    Returns:
        ``{file name: digest}`` of every file written, the index included.
    """
    directory = Path(directory)
    if len(plan) == 1:
        tensors = {name: get_tensor(name) for name in plan[0]}
        return {single_name(stem): _write(directory / single_name(stem), tensors, metadata)}
    digests: dict[str, FileDigest] = {}
    weight_map: dict[str, str] = {}
    total = 0
    for number, names in enumerate(plan, start=1):
        fname = shard_name(stem, number, len(plan))
        tensors = {name: get_tensor(name) for name in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        digests[fname] = _write(directory / fname, tensors, metadata)
        del tensors  # before the next shard's are read
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    text = json.dumps(index, indent=2) + "\n"
    digests[index_name(stem)] = write_text(directory / index_name(stem), text)
    return digests


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: Mapping[str, str]) -> FileDigest:
    """One file, hashed while written; a dtype the streaming writer does not name goes through
    the library (then hashed, and fsynced, after)."""
    if can_stream(tensors):
        return write_safetensors(path, tensors, metadata)
    try:
        save_file(tensors, str(path), metadata=dict(metadata))
    except SafetensorError as e:
        raise CheckpointSaveError(f"{path}: safetensors could not write it: {e}") from e
    fsync_file(path)
    return FileDigest(sha256_file(path), path.stat().st_size)


def weight_map(directory: Path, stem: str) -> dict[str, str]:
    """``{tensor name: file name}`` of ``stem``'s weights in ``directory``, from the index when
    sharded, else from the single file's header (aliases not included).

    Raises:
        CheckpointCorruptError: neither file is there, or the index is damaged.
    """
    directory = Path(directory)
    index = directory / index_name(stem)
    if (directory / single_name(stem)).is_file():
        return dict.fromkeys(read_header(directory / single_name(stem)), single_name(stem))
    if not index.is_file():
        raise CheckpointCorruptError(
            f"{directory}: has neither {single_name(stem)} nor {index_name(stem)}"
        )
    try:
        data = read_json(index, MANIFEST_BYTES, error=ValueError)
        mapping = data["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = str(e).removeprefix(f"{index}: ")  # the reader names the file too
        raise CheckpointCorruptError(f"{index}: not a safetensors index ({why})") from None
    if not isinstance(mapping, dict) or not all(
        isinstance(f, str) and is_weights_file(f, stem) and f != single_name(stem)
        for f in mapping.values()
    ):
        raise CheckpointCorruptError(f"{index}: its weight_map names files that are not shards")
    return mapping


def weight_files(directory: Path, stem: str) -> list[str]:
    """The safetensors files of ``stem``'s weights, in order (shards or the single file)."""
    return sorted(set(weight_map(directory, stem).values()))


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """``{name: {"dtype", "shape", "data_offsets"}}`` of a safetensors file, validated by the
    library first (a file that is not safetensors is named)."""
    try:
        with safe_open(str(path), framework="pt"):
            pass
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{path}: not a readable safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return header


def read_metadata(path: Path) -> dict[str, str]:
    """The header metadata of a safetensors file (empty when none)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
        raise CheckpointCorruptError(f"{path}: not a readable safetensors file: {e}") from None


class TensorReader:
    """Reads tensors, or blocks of their rows, from one safetensors file with ``pread``.

    Only locates bytes: open files whose header the library validated (:func:`read_header`).
    Safetensors data is little-endian, like every host torch ships for.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        n = int.from_bytes(os.pread(self.fd, 8, 0), "little")
        self.header = json.loads(os.pread(self.fd, n, 8))
        self.header.pop("__metadata__", None)
        self.base = 8 + n

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def shape(self, name: str) -> list[int]:
        return self.header[name]["shape"]

    def dtype(self, name: str) -> torch.dtype:
        code = self.header[name]["dtype"]
        if code not in DTYPES:
            raise CheckpointNotSupportedError(f"{self.path}: {name!r} has dtype {code}, not read")
        return DTYPES[code]

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, in a fresh buffer."""
        shape = self.shape(name)
        return self.rows(name, 0, shape[0] if shape else 1).reshape(shape)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[start:stop]`` (the whole tensor, as one row, for a 0-d one)."""
        info = self.header[name]
        dtype, shape = self.dtype(name), info["shape"]
        begin, end = info["data_offsets"]
        if not shape:
            start, stop, shape = 0, 1, [1]
        row = (end - begin) // shape[0] if shape[0] else 0
        buf = torch.empty((stop - start) * row, dtype=torch.uint8)
        view, offset = memoryview(buf.numpy()), self.base + begin + start * row
        while view:
            got = os.preadv(self.fd, [view], offset)
            if got <= 0:
                raise CheckpointError(f"{self.path}: ends inside tensor {name!r}")
            view, offset = view[got:], offset + got
        return buf.view(dtype).reshape(stop - start, *shape[1:])


class LazyWeights(Mapping[str, torch.Tensor]):
    """A state dict on disk (one file or shards): names and shapes from the headers, each tensor
    read when it is asked for. Tied aliases are keys too (read as their kept tensor);
    :meth:`materialize` gives the dict :func:`load_weights` would, ties as one object.

    Args:
        sources: ``{name: (file, name in that file, dtype to cast to or None)}``.
        aliases: ``{alias: kept name}``.
        keepalive: held for as long as the mapping lives (a temporary directory the files are in).
    """

    def __init__(
        self,
        sources: dict[str, tuple[Path, str, torch.dtype | None]],
        aliases: Mapping[str, str],
        keepalive: Any = None,
    ):
        self.sources = sources
        self.aliases = dict(aliases)
        self.keepalive = keepalive
        self._headers: dict[Path, dict[str, Any]] = {}
        for path, _name, _cast in sources.values():
            if path not in self._headers:
                self._headers[path] = read_header(path)

    @classmethod
    def open(cls, directory: Path, stem: str, keepalive: Any = None) -> LazyWeights:
        """``stem``'s weights in ``directory`` (the single file or the shards).

        Raises:
            CheckpointCorruptError: no weights there, a damaged index or file, or an alias record
                naming no tensor.
        """
        directory = Path(directory)
        mapping = weight_map(directory, stem)
        sources = {name: (directory / f, name, None) for name, f in mapping.items()}
        first = directory / next(iter(mapping.values()), single_name(stem))
        aliases = read_aliases(first) if mapping else {}
        check_aliases(aliases, sources, first)
        return cls(sources, aliases, keepalive)

    def overlaid(self, other: LazyWeights) -> LazyWeights:
        """These weights with ``other``'s tensors in place of the same names, cast to this
        mapping's dtypes (EMA over the raw weights)."""
        targets = {name: self.aliases.get(name, name) for name in other.sources}
        unknown = sorted(n for n, target in targets.items() if target not in self.sources)
        if unknown:
            raise CheckpointError(f"tensors the model lacks: {unknown[:3]}")
        sources = dict(self.sources)
        for name, (path, inner, _cast) in other.sources.items():
            sources[targets[name]] = (path, inner, self.dtype(targets[name]))
        return LazyWeights(sources, self.aliases, (self.keepalive, other.keepalive))

    def stored(self) -> list[str]:
        """The names stored in the files (aliases left out), in order."""
        return list(self.sources)

    def _info(self, name: str) -> dict[str, Any]:
        path, inner, _cast = self.sources[self.aliases.get(name, name)]
        return self._headers[path][inner]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        _path, _inner, cast = self.sources[self.aliases.get(name, name)]
        return cast or DTYPES[self._info(name)["dtype"]]

    def nbytes(self, name: str) -> int:
        numel = 1
        for n in self.shape(name):
            numel *= n
        return numel * torch.empty(0, dtype=self.dtype(name)).element_size()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.shape(name) for name in self}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.sources and name not in self.aliases:
            raise KeyError(name)
        path, inner, cast = self.sources[self.aliases.get(name, name)]
        with TensorReader(path) as reader:
            t = reader.tensor(inner)
        return t.to(cast) if cast is not None and cast != t.dtype else t

    def __iter__(self) -> Iterator[str]:
        yield from self.sources
        yield from (a for a in self.aliases if a not in self.sources)

    def __len__(self) -> int:
        return len(set(self.sources) | set(self.aliases))

    def materialize(self) -> dict[str, torch.Tensor]:
        """Every tensor in memory; an alias is the same object as its kept tensor."""
        state = {name: self[name] for name in self.sources}
        for alias, kept in self.aliases.items():
            state[alias] = state[kept]
        return state


ALIASES_KEY = "asrforge_aliases"
"""The safetensors header key of a weights file's ``{alias: kept name}`` record: tied tensors
are stored once."""


def aliases_in(metadata: dict[str, str], path: Path) -> dict[str, str]:
    """The ``{alias: kept name}`` record of a safetensors header's ``metadata`` (empty when
    none).

    Raises:
        CheckpointCorruptError: the record is damaged (not JSON, nested too deeply, or not an
            object of names), naming ``path``.
    """
    try:
        aliases = parse_json(metadata.get(ALIASES_KEY, "{}"))
    except ValueError as e:
        raise CheckpointCorruptError(f"{path}: damaged {ALIASES_KEY} metadata: {e}") from None
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise CheckpointCorruptError(
            f"{path}: damaged {ALIASES_KEY} metadata: not an object of tensor names"
        )
    return aliases


def check_aliases(aliases: Mapping[str, str], stored: Collection[str], where: Path) -> None:
    """Refuse an alias record that names a tensor the files do not store, or that gives a stored
    tensor's name to another one (it would replace that tensor when loaded).

    Raises:
        CheckpointCorruptError: naming ``where`` (the file or directory of the weights).
    """
    for alias, kept in aliases.items():
        if kept not in stored:
            raise CheckpointCorruptError(
                f"{where}: alias {alias!r:.100} names no tensor {kept!r:.100}"
            )
        if alias in stored:
            raise CheckpointCorruptError(
                f"{where}: alias {alias!r:.100} (of {kept!r:.100}) is the name of a stored tensor"
            )


def read_aliases(path: Path) -> dict[str, str]:
    """The ``{alias: kept name}`` record of a safetensors file's header (empty when none).

    Raises:
        CheckpointCorruptError: the file is not safetensors, or the record is damaged.
    """
    return aliases_in(read_metadata(path), path)
