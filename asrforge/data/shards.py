"""The streamed training split's shards: where they are (:func:`find_shards`: a local path, a Hub
data set, an fsspec URL), what one holds (a parquet row group, an arrow/csv/tsv file, or
``data.stream.shard_rows`` lines of a JSONL file, found by counting newlines once; row counts from
that index and file metadata, so an epoch's length is known before step 1), reading one
(:func:`read_table`, a remote file through fsspec with retries), and the shard list's
fingerprint (:func:`shard_list_fingerprint`).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asrforge.config import DataConfig
from asrforge.data.locate import is_url, locate
from asrforge.data.sources import (
    check_data_path,
    format_of,
    no_rows,
    split_files,
    unreadable,
    utf8_problem,
)
from asrforge.errors import UserError

log = logging.getLogger(__name__)

CHUNK = 1 << 24
"""Bytes read at a time while counting a JSONL file's lines."""


@dataclass(frozen=True)
class Shard:
    """A piece of the training split read at once: a file, a parquet row group, or lines
    ``[first_line, first_line + rows)`` of a JSONL file at bytes ``[start, end)``."""

    path: str
    # The locate.FILE_FORMATS name (parquet, arrow, json, csv or tsv).
    fmt: str
    rows: int
    group: int = 0  # parquet row group
    start: int = 0
    end: int = 0
    first_line: int = 0


# -- shards ----------------------------------------------------------------------------------


def find_shards(cfg: DataConfig) -> tuple[list[Shard], Path | str]:
    """The shards of the training split of ``cfg.path`` (a local path, a Hub id, an fsspec URL:
    :func:`~asrforge.data.locate.locate`) in file order, and the directory relative audio paths
    are read from.

    Raises:
        UserError: the path is missing, a ``save_to_disk`` directory, or has no training files.
    """
    located = locate(cfg, stream=True)
    if located.splits is not None or is_url(located.root):
        if located.splits is None:  # one file at a URL: the training split
            files, root = [str(located.root)], str(located.root).rsplit("/", 1)[0]
        else:
            files, root = located.splits.get(cfg.train_split), located.root
        if not files:
            has = ", ".join(located.splits or {}) or "none"
            raise UserError(
                f"data.train_split {cfg.train_split!r}: no such split in {located.where} to "
                f"stream (it has {has})"
            )
        shards = [s for f in files for s in _file_shards(f, cfg.stream.shard_rows)]
        if not sum(s.rows for s in shards):
            raise UserError(f"data: split {cfg.train_split!r} of {located.where} has no rows")
        return shards, Path(cfg.audio_dir) if cfg.audio_dir is not None else root
    path = Path(located.root)
    check_data_path(path)
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        raise UserError(
            f"data.stream.enabled: {path} is a save_to_disk directory, which is memory-mapped "
            "where it lies already; stream a directory of parquet/arrow/jsonl/csv files or a "
            "JSONL/CSV manifest, or turn data.stream.enabled off"
        )
    if path.is_dir():
        files = split_files(path).get(cfg.train_split)
        if not files:
            raise UserError(f"data: no {cfg.train_split!r} files in {path} to stream")
        root = path
    else:
        files, root = [path], path.parent
    shards = [s for f in files for s in _file_shards(f, cfg.stream.shard_rows)]
    if not sum(s.rows for s in shards):
        raise UserError(f"data: split {cfg.train_split!r} of {path} has no rows")
    return shards, Path(cfg.audio_dir) if cfg.audio_dir is not None else root


def _file_shards(path: Path | str, shard_rows: int) -> list[Shard]:
    fmt = format_of(Path(path))
    if fmt in ("json", "csv", "tsv") and not is_url(path) and (
        problem := no_rows([path], header=fmt != "json")
    ):
        raise UserError(f"data.path: {problem}")
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            def row_groups():
                with open_shard_file(path) as f:
                    return pq.ParquetFile(f).metadata

            meta = with_retries(row_groups, path)
            return [Shard(str(path), fmt, meta.row_group(g).num_rows, group=g)
                    for g in range(meta.num_row_groups)]  # fmt: skip
        if fmt == "json":
            return with_retries(lambda: _jsonl_shards(path, shard_rows), path)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow's errors have no common type
        raise unreadable(str(path), fmt, e) from None
    return [Shard(str(path), fmt, read_table(Shard(str(path), fmt, 0)).num_rows)]


RETRY_SECONDS = (1.0, 4.0, 16.0)
"""Waits before each new try of a remote shard whose read failed (a dropped connection, a
timeout): a corpus streamed for days meets them."""


def open_shard_file(path: Path | str):
    """A data file opened for reading bytes: a local path as it is, an fsspec URL through its
    file system (``s3://``, ``gs://``, ``hf://``, ``https://``, ``memory://``, ``file://``)."""
    if not is_url(path):
        return open(path, "rb")
    import fsspec

    return fsspec.open(str(path), "rb").open()


def with_retries(read: Callable, path: Path | str):
    """``read()``; for a remote file tried again after each of :data:`RETRY_SECONDS` when it
    fails with an I/O error other than a missing file or a refusal (which no retry mends)."""
    waits = list(RETRY_SECONDS) if is_url(path) else []
    while True:
        try:
            return read()
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            raise
        except (OSError, TimeoutError) as e:
            if not waits:
                raise
            wait = waits.pop(0)
            log.warning("data.path: reading %s failed (%s); trying again in %.0f s", path, e, wait)
            time.sleep(wait)


def _jsonl_shards(path: Path, shard_rows: int) -> list[Shard]:
    """Shards of ``shard_rows`` lines: one pass over the bytes counting newlines, keeping only
    the offsets where a shard starts (memory grows with the shards, not the lines), and checking
    they are UTF-8 text, which pyarrow's JSON reader would keep in its string columns.

    Raises:
        UserError: a line is not UTF-8, naming it.
    """
    starts, lines, offset = [0], 0, 0
    last = b"\n"
    utf8 = codecs.getincrementaldecoder("utf-8")()
    with open_shard_file(path) as f:
        while chunk := f.read(CHUNK):
            _check_utf8(utf8, chunk, path)
            newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            # line number (1-based, counted from the file's start) each newline ends
            ends = lines + 1 + np.arange(len(newlines))
            cuts = newlines[ends % shard_rows == 0]
            starts += (offset + cuts + 1).tolist()
            lines += len(newlines)
            offset += len(chunk)
            last = chunk[-1:]
    _check_utf8(utf8, b"", path, final=True)
    if last != b"\n":  # a last line without a newline
        lines += 1
    # A file that ends at a shard's start has no shard there.
    if starts[-1] >= offset:
        starts.pop()
    shards = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else offset
        rows = min(shard_rows, lines - i * shard_rows)
        shards.append(
            Shard(str(path), "json", rows, start=start, end=end, first_line=i * shard_rows)
        )
    return shards


def _check_utf8(decoder, chunk: bytes, path: Path, *, final: bool = False) -> None:
    try:
        decoder.decode(chunk, final)
    except UnicodeDecodeError as e:
        with open_shard_file(path) as f:
            line = utf8_problem(f, path)
        raise UserError(f"data.path: {line or f'{path}: not UTF-8 text ({e})'}") from None


def read_table(shard: Shard, keep: Callable[[list[str]], list[str]] | None = None):
    """The rows of ``shard`` as a pyarrow table: every column as the file has them, or those
    ``keep`` picks from the file's column names (a parquet row group then reads them alone,
    leaving its audio bytes on disk).

    Raises:
        UserError: the file cannot be read (in the words ``sources`` uses for a split read
            whole), or a JSONL line is no JSON object.
    """
    try:
        return with_retries(lambda: _read(shard, keep), shard.path)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow's errors have no common type
        raise unreadable(shard.path, shard.fmt, e) from None


def _read(shard: Shard, keep):
    if shard.fmt == "parquet":
        import pyarrow.parquet as pq

        with open_shard_file(shard.path) as f:
            file = pq.ParquetFile(f)
            columns = None if keep is None else keep(file.schema_arrow.names)
            return file.read_row_group(shard.group, columns=columns)
    table = _read_table(shard)
    return table if keep is None else table.select(keep(table.column_names))


def _read_table(shard: Shard):
    import pyarrow as pa

    if is_url(shard.path):  # read once into memory: a remote file cannot be memory-mapped
        with open_shard_file(shard.path) as f:
            data = f.read()
        return _table_from(shard, pa.BufferReader(data))
    return _table_from(shard, shard.path)


def _table_from(shard: Shard, source):
    """The table of a whole arrow/csv/tsv file or a JSONL shard from ``source`` (a local path,
    or a buffer of a remote file's bytes)."""
    import pyarrow as pa

    # datasets writes the Arrow IPC stream format, other writers the file format.
    if shard.fmt == "arrow":
        opened = pa.memory_map(source) if isinstance(source, str) else source
        with opened:
            try:
                return pa.ipc.open_stream(opened).read_all()
            except pa.ArrowInvalid:
                opened.seek(0)
                return pa.ipc.open_file(opened).read_all()
    if shard.fmt in ("csv", "tsv"):
        import pyarrow.csv as pcsv

        tabs = shard.fmt == "tsv"
        return pcsv.read_csv(
            source,
            parse_options=pcsv.ParseOptions(
                delimiter="\t" if tabs else ",", quote_char=not tabs and '"'
            ),
            # a transcript "NA" or "null" is text, not a missing value (as sources reads them)
            convert_options=pcsv.ConvertOptions(
                strings_can_be_null=False, quoted_strings_can_be_null=False
            ),
        )
    return _json_table(shard)


def _json_table(shard: Shard):
    """A JSONL shard's lines, by pyarrow's JSON reader (about 10x faster than ``json.loads`` per
    line); when it gives another row count (it skips blank lines) or fails, line by line, so
    every line is a row, as the shard index counted them, and a bad line is named."""
    import pyarrow as pa
    import pyarrow.json as pj

    with open_shard_file(shard.path) as f:
        f.seek(shard.start)
        data = f.read(shard.end - shard.start)
    try:
        table = pj.read_json(pa.BufferReader(data))
    except pa.ArrowInvalid:
        table = None
    if table is None or table.num_rows != shard.rows:
        table = pa.Table.from_pylist(_json_rows(shard, data))
    return table


def _json_rows(shard: Shard, data: bytes) -> list[dict]:
    """The objects of a JSONL shard's lines (a blank line is a row with no fields)."""
    rows = []
    for n, line in enumerate(data.split(b"\n")[: shard.rows]):
        try:
            row = json.loads(line) if line.strip() else {}
        except ValueError as e:
            raise UserError(
                f"data.path: {shard.path} line {shard.first_line + n + 1}: not JSON ({e})"
            ) from None
        if not isinstance(row, dict):
            raise UserError(
                f"data.path: {shard.path} line {shard.first_line + n + 1}: not a JSON object"
            )
        rows.append(row)
    return rows


def shard_list_fingerprint(shards: list[Shard]) -> str:
    """Names the stream: the shard list (paths, sizes in rows and bytes)."""
    text = json.dumps([[s.path, s.fmt, s.rows, s.group, s.start, s.end] for s in shards])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
