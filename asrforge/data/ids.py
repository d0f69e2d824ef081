"""What names a row and its audio: a row's id, a row's key for the evaluation carve and the
resume's check of the training data (id or file name, and text; and their digest), an audio
path as a row reads it, and the caches' key of a clip's audio.

A standardized split's rows read through :class:`StandardRows` (the split's ``datasets``
transform): a relative audio path is joined to the audio root there, and rows without an ``id``
column are named by their audio's path as the data gives it. Code reading Arrow columns directly
gets the same ids from :func:`given_ids`, and each row's full name (``<split>-<row>`` where the
data gives none) from :func:`row_uids`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StandardRows:
    """How a row of a standardized split reads (the split's ``datasets`` transform): audio as an
    undecoded ``Audio`` value ``{"bytes", "path"}``, a relative path joined to the audio root
    (the manifest's directory or ``data.audio_dir``), and, when the audio is given as paths and
    the data has no ids, an ``id``: the path as the data gives it.

    The split's Arrow columns stay as the data wrote them, memory-mapped: nothing per row is
    built before a row is read (a million absolute paths and a copy of them as ids would be
    ~150 MB of anonymous memory at start-up). Code reading Arrow columns directly gets ids
    from :func:`given_ids`.
    """

    audio_root: str | None
    """Absolute, without a trailing ``/``; None: the audio is not given as paths (bytes)."""
    path_ids: bool
    """Rows without an ``id`` column are named by their audio's path as the data gives it."""

    def __call__(self, batch: dict) -> dict:
        if "audio" in batch:
            given = [_path_of(a) for a in batch["audio"]]
            if self.path_ids:
                batch["id"] = given
            batch["audio"] = [self.audio(a, p) for a, p in zip(batch["audio"], given, strict=True)]
        return batch

    def audio(self, value, path: str | None) -> dict:
        """The ``{"bytes", "path"}`` of one row's audio (a path string, or such a dict)."""
        data = value.get("bytes") if isinstance(value, dict) else None
        if self.audio_root is not None and path is not None and not path.startswith("/"):
            # The path is joined as it was written before, since the caches' keys hash it.
            path = f"{self.audio_root}/{path}"
        return {"bytes": data, "path": path}


def _path_of(audio) -> str | None:
    return audio.get("path") if isinstance(audio, dict) else audio


def standard_rows(split) -> StandardRows | None:
    """The row view :func:`standardize` gave ``split`` (None: not a standardized split)."""
    transform = split.format.get("format_kwargs", {}).get("transform")
    return transform if isinstance(transform, StandardRows) else None


def given_ids(split, rows) -> list[str | None] | None:
    """The ids of ``rows`` (positions in ``split``) of a standardized split, reading those rows
    only: its ``id`` column, else (audio given as paths) the paths as the data gives them. None:
    the split has no ids (its rows are named by number); an empty cell's id is None."""
    view = standard_rows(split)
    if "id" in split.column_names:
        column = "id"
    elif view is not None and view.path_ids:
        column = "audio"
    else:
        return None
    values = split.data.table.column(column).take(table_positions(split, rows))
    given = (given_paths(values) if column == "audio" else values).to_pylist()
    return [None if x is None else str(x) for x in given]


def table_positions(split, rows):
    """``rows`` (positions in ``split``) as positions in its Arrow table, through the row map a
    ``select()`` (a carve) leaves, as an Arrow array for ``take``."""
    # The command line imports ids through data.sources, so pyarrow loads when a split is read.
    import pyarrow as pa

    positions = pa.array(np.asarray(rows, dtype=np.int64))
    indices = getattr(split, "_indices", None)
    return positions if indices is None else indices.column(0).take(positions)


def given_paths(audio):
    """The paths, as the data gives them, of an Arrow column of audio (path strings, or the
    ``{bytes, path}`` structs of an ``Audio`` column)."""
    # The command line imports ids through data.sources, so pyarrow loads when a split is read.
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.struct_field(audio, "path") if pa.types.is_struct(audio.type) else audio


def row_keys(split) -> list[str]:
    """What names each row of a standardized split: its ``id``, else its audio's path and its
    text (tab-separated)."""
    ids = given_ids(split, np.arange(len(split)))
    if ids is not None:
        # An empty cell becomes "None", as carves recorded it.
        return [str(x) for x in ids]
    # Paths are read from Arrow so that the audio's bytes, if any, are not copied out.
    paths = []
    for batch in split.select_columns(["audio"]).with_format("arrow").iter(batch_size=4096):
        paths += given_paths(batch.column("audio")).to_pylist()
    texts = split["text"] if "text" in split.column_names else [None] * len(split)
    return [f"{p or ''}\t{t or ''}" for p, t in zip(paths, texts, strict=True)]


def relocatable_keys(split, rows, *, with_text: bool = True) -> list[str]:
    """What names each of ``rows`` (positions in a standardized split) wherever the data lies:
    the ``id`` column's value, else the audio file's name, and the text (tab-separated), since
    data staged to another directory is the same data while its absolute paths are not, and a
    transcript edited under its id is not. ``with_text=False``: the id alone where there is one,
    as resume checks before the text was part of the key made it. Read as Arrow columns, with
    no pass through the split's transform."""
    positions = table_positions(split, rows)
    table = split.data.table
    texts = (
        table.column("text").take(positions).to_pylist()
        if "text" in split.column_names
        else [None] * len(positions)
    )
    if "id" in split.column_names:
        ids = [str(x) for x in table.column("id").take(positions).to_pylist()]
        if not with_text:
            return ids
        return [f"{i}\t{t or ''}" for i, t in zip(ids, texts, strict=True)]
    # the paths are taken out of the audio column first, so embedded audio bytes are not copied
    paths = given_paths(table.column("audio")).take(positions).to_pylist()
    return [f"{os.path.basename(p or '')}\t{t or ''}" for p, t in zip(paths, texts, strict=True)]


def copy_keys(split) -> list[str | None]:
    """Per row of a standardized split, what two copies of one row share: its id, its audio
    file's path as the data gives it and its text (None for a row whose audio is not a file:
    embedded bytes are not compared). Read as Arrow columns."""
    if "audio" not in split.column_names:
        return [None] * len(split)
    positions = table_positions(split, np.arange(len(split)))
    table = split.data.table
    paths = given_paths(table.column("audio")).take(positions).to_pylist()
    ids = (
        table.column("id").take(positions).to_pylist()
        if "id" in split.column_names
        else [None] * len(paths)
    )
    texts = (
        table.column("text").take(positions).to_pylist() if "text" in split.column_names else ids
    )
    return [
        None if not path else f"{i}\t{path}\t{t}"
        for i, path, t in zip(ids, paths, texts, strict=True)
    ]


def keys_digest(keys) -> str:
    """sha256 of row keys (:func:`row_keys`) in order: what a run records to know its data again
    (the carve's rows, the training split's usable utterances)."""
    h = hashlib.sha256()
    for key in keys:
        h.update(key.encode())
        h.update(b"\n")
    return h.hexdigest()


def audio_source(audio) -> bytes | str | None:
    """The encoded bytes of an undecoded ``Audio`` value, else its path (None: neither)."""
    if not isinstance(audio, dict):
        return None
    return audio.get("bytes") or audio.get("path") or None


def audio_key(audio) -> str:
    """The feature and encoder caches' key: sha256 of the audio's bytes, or of its path with the
    file's size and modification time (a file rewritten in place is other audio: the caches,
    which may outlive a run in ``data.cache_dir``, must not serve its old log-mels)."""
    src = audio_source(audio)
    if isinstance(src, bytes):
        return hashlib.sha256(src).hexdigest()
    name = str(src)
    try:
        stat = os.stat(name)
        name = f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}"
    except (OSError, ValueError):
        # A missing file (or a path with a NUL byte) is reported when the audio is read.
        pass
    return hashlib.sha256(name.encode()).hexdigest()


def named(uid: str, source) -> str:
    """How the skip report names a clip whose file is missing: its id, and the path when the id
    does not say it."""
    return uid if not isinstance(source, str) or source.endswith(uid) else f"{uid} ({source})"


def row_id(given: str | None, split: str, row: int) -> str:
    """The id of row ``row`` of split ``split``: the id the data gives (its ``id`` cell, else, for
    audio given as paths, the path as the data writes it), or ``<split>-<row>`` where it gives
    none or the cell is empty. Training, evaluation, the stream and the skip report all name a
    row by it."""
    return f"{split}-{row}" if given is None else str(given)


def row_uids(split, name: str, rows: np.ndarray) -> list[str]:
    """The ids (:func:`row_id`) of ``rows`` of the standardized split ``split`` named ``name``,
    reading those rows' id cells only."""
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) == 0:
        return []
    given = given_ids(split, rows) or [None] * len(rows)
    return [row_id(x, name, r) for x, r in zip(given, rows.tolist(), strict=True)]
