"""One-pass checkpoint writes: each file's sha256 is computed from the bytes as they are written,
so the manifest needs no second read of the checkpoint.

:func:`write_safetensors` writes the safetensors format itself (an 8-byte little-endian header
length, the JSON header padded with spaces to 8 bytes, then each tensor's bytes in header order),
streaming each tensor's memory to the file without the whole-file buffer ``safetensors.torch``
builds; ``safetensors.load_file`` and transformers read it like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# os.write writes at most about 2 GiB per call, so each call stays well under that.
_MAX_WRITE = 1 << 30


@dataclass(frozen=True)
class FileDigest:
    """A written file's sha256 (hex) and size in bytes, as the manifest lists them."""

    sha256: str
    size: int


class HashingWriter:
    """A new file (it must not exist) written through, hashed on the way; fsynced on close.

    Usable as the file object of ``torch.save``. A failed write raises an OSError naming the
    file, kept in :attr:`error` for a caller whose library raises its own error over it.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self.hash = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)  # releases the GIL for large buffers, like os.write
        n = len(view)
        try:
            while view:
                view = view[os.write(self.fd, view[:_MAX_WRITE]) :]
        except OSError as e:
            e.filename = e.filename or str(self.path)
            self.error = e
            raise
        self.size += n
        return n

    def flush(self) -> None:
        pass

    def close(self) -> FileDigest:
        """fsync and close; the file's digest."""
        if self.fd >= 0:
            try:
                os.fsync(self.fd)
            finally:
                os.close(self.fd)
                self.fd = -1
        return FileDigest(self.hash.hexdigest(), self.size)

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def can_stream(tensors: Mapping[str, torch.Tensor]) -> bool:
    """True when every tensor's dtype has a safetensors name here (else use ``save_file``)."""
    return all(t.dtype in _DTYPES for t in tensors.values())


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> FileDigest:
    """Write ``tensors`` (distinct, contiguous; see ``training.save_weights``) as safetensors.

    Raises:
        OSError: the write failed (the caller's atomic directory removes the file).
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with HashingWriter(path) as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors.values():
            f.write(_raw_bytes(t))
        return f.close()


def torch_save(obj: Any, path: Path) -> FileDigest:
    """``torch.save(obj)`` into a new file, hashed while written.

    Raises:
        OSError: a write failed (a full disk), naming the file.
    """
    with HashingWriter(path) as f:
        try:
            torch.save(obj, f)
        except RuntimeError:
            # torch's zip writer, closed after our failed write, raises "unexpected pos" over it
            if f.error is not None:
                raise f.error from None
            raise
        return f.close()


def write_text(path: Path, text: str) -> FileDigest:
    """UTF-8 ``text`` into a new file, hashed while written."""
    with HashingWriter(path) as f:
        f.write(text.encode("utf-8"))
        return f.close()
