"""Small files asrforge reads whole from a place it was handed (a bundle, a checkpoint, a data
set directory, a run): manifests, JSON configs and records, YAML configs, ARPA files.

A file is opened non-blocking and checked with ``fstat`` on that descriptor before anything is
read, so a FIFO never waits for a writer and a device (a link to ``/dev/zero``) is never read
without end; a file larger than the limit its caller gives is refused unread. JSON nested deeper
than :data:`MAX_JSON_DEPTH` is refused like any other bad JSON, so it never surfaces as a
``RecursionError`` here or where the value is walked later.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asrforge.errors import UserError

MANIFEST_BYTES = 64 * 2**20
"""Largest ``manifest.json`` read: a few hundred thousand listed files."""
CONFIG_BYTES = 16 * 2**20
"""Largest JSON config or record read (``config.json``, a data set's ``state.json``): these
hold kilobytes."""
TOKENIZER_BYTES = 256 * 2**20
"""Largest ``tokenizer.json`` read: a 250k-token vocabulary with its merges is about 30 MB."""
RECORDS_BYTES = 256 * 2**20
"""Largest JSON-lines record read whole (a run's ``metrics.jsonl``, an evaluation record)."""
MAX_JSON_DEPTH = 100
"""Deepest nesting of objects and arrays a JSON file may have (asrforge's hold under ten)."""

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n} bytes"


def open_regular(path: Path, *, follow: bool = True) -> int:
    """A blocking read-only descriptor of the regular file ``path`` (the caller closes it);
    ``follow=False``: a link at ``path`` itself is not followed.

    Raises:
        FileNotFoundError: ``path`` does not exist (what that means is the caller's to say).
        ValueError: not a regular file (the message says what it is; the caller names it).
        OSError: it cannot be opened (a link, with ``follow=False``).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "a special file")
            raise ValueError(f"{kind}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: Path, limit: int) -> bytes:
    """The contents of the regular file ``path``, at most ``limit`` bytes.

    Raises:
        FileNotFoundError: ``path`` does not exist (what that means is the caller's to say).
        ValueError: not a regular file, or larger than ``limit``; the message says which and the
            caller names the file.
        OSError: it cannot be opened or read.
    """
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ValueError(f"larger than {_size(limit)} ({size} bytes)")
        # A file still growing is cut at the limit rather than read to its end.
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"larger than {_size(limit)}")
    return data


def read_text(path: Path, limit: int) -> str:
    """:func:`read_bytes` decoded as UTF-8.

    Raises:
        ValueError: as :func:`read_bytes`, or not UTF-8 (the first bad byte and its offset).
        OSError: as :func:`read_bytes`.
    """
    data = read_bytes(path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}): save it as UTF-8"
        ) from None


def parse_json(text: str | bytes) -> Any:
    """``text`` as JSON, nested at most :data:`MAX_JSON_DEPTH` levels.

    Raises:
        ValueError: not JSON, or nested deeper (the message says which).
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"not valid JSON (nested deeper than {MAX_JSON_DEPTH} levels)") from None
    except ValueError as e:  # UnicodeDecodeError of bytes included
        raise ValueError(f"not valid JSON ({e})") from None
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"not valid JSON (nested deeper than {MAX_JSON_DEPTH} levels)")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return value


def read_json(
    path: Path, limit: int = CONFIG_BYTES, *, error: Callable[[str], Exception] = UserError
) -> Any:
    """The JSON value of the regular file ``path`` of at most ``limit`` bytes.

    Args:
        error: the exception raised for a file that is there but cannot be used, with the
            message ``"<path>: <what is wrong>"`` (:class:`CheckpointCorruptError` for a file
            inside a bundle or checkpoint).

    Raises:
        FileNotFoundError: ``path`` does not exist (what that means is the caller's to say).
        error: not a regular file, too large, not UTF-8, not JSON or nested too deeply, or an
            OSError reading it.
    """
    try:
        return parse_json(read_text(path, limit))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(f"{path}: cannot be read: {e.strerror or e}") from None
    except ValueError as e:
        raise error(f"{path}: {e}") from None


def read_json_object(
    path: Path, limit: int = CONFIG_BYTES, *, error: Callable[[str], Exception] = UserError
) -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object (a config, a tokenizer).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        error: as :func:`read_json`, or the value is not an object.
    """
    value = read_json(path, limit, error=error)
    if not isinstance(value, dict):
        raise error(f"{path}: not a JSON object")
    return value
