"""The streamed training split (``data.stream``): rows read from their files shard by shard, in an
order that is a pure function of (seed, epoch), so a resumed run sees exactly the batches an
uninterrupted one would have (why not ``datasets.IterableDataset``: docs/decisions.md).

Shards: a parquet row group, an arrow/csv/tsv file, or ``data.stream.shard_rows`` lines of a JSONL
file (found by counting newlines once); row counts come from that index and file metadata, so an
epoch's length is known before step 1. Epoch ``e``: the shards permuted by (seed, e) in blocks of
``data.stream.shuffle_shards``, each block's rows permuted by (seed, e, block), cut into batches;
batch ``j`` goes to rank ``j % world`` and that rank's ``i``-th batch to worker ``i % num_workers``
(the DataLoader takes the workers' outputs round-robin, so the order holds to the epoch's end).
Rows are checked as their batch is built (:func:`check_row`: ``prepare_split``'s rules and
reasons); a row ``data.languages`` leaves out is no skip (:meth:`StreamedSplit.left_out`).
``stream_position`` records the shard list's fingerprint: a resume on other shards is refused.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from asrforge.config import DataConfig
from asrforge.data.columns import find_column, language_codes, standardize
from asrforge.data.dataset import Collator, SpeechDataset
from asrforge.data.ids import audio_key, audio_source, named, row_id
from asrforge.data.locate import is_url, locate
from asrforge.data.prepare import Utterance
from asrforge.data.rules import (
    NOT_FOUND,
    UnusableAudio,
    UtteranceRules,
    check_english_only,
    check_language_tokens,
    header_seconds,
    is_english,
    language_filter,
    utterance_problem,
)
from asrforge.data.sources import (
    check_data_path,
    format_of,
    no_rows,
    read_split,
    split_files,
    unreadable,
    utf8_problem,
)
from asrforge.data.workers import ignore_stop_signals
from asrforge.errors import UserError
from asrforge.hub import hub_ref
from asrforge.text.languages import resolve_language

log = logging.getLogger(__name__)

CHUNK = 1 << 24
"""Bytes read at a time while counting a JSONL file's lines."""


@dataclass(frozen=True)
class Shard:
    """A piece of the training split read at once: a file, a parquet row group, or lines
    ``[first_line, first_line + rows)`` of a JSONL file at bytes ``[start, end)``."""

    path: str
    # The sources.FILE_FORMATS name (parquet, arrow, json, csv or tsv).
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
    if fmt in ("json", "csv", "tsv") and not is_url(path) and (problem := no_rows([path])):
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
    import time

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


# -- order -----------------------------------------------------------------------------------


def epoch_blocks(n_shards: int, block: int, seed: int, epoch: int) -> list[list[int]]:
    """The shard indices of each block of ``epoch``, in the order they are read."""
    order = np.random.default_rng([seed, epoch]).permutation(n_shards).tolist()
    return [order[i : i + block] for i in range(0, n_shards, block)]


def block_order(n_rows: int, seed: int, epoch: int, block: int) -> np.ndarray:
    """The order in which a block's rows (numbered across its shards) are read."""
    return np.random.default_rng([seed, epoch, block, 1]).permutation(n_rows)


def local_batches(total_rows: int, batch_size: int, rank: int, world: int) -> int:
    """Batches of an epoch of ``total_rows`` rows that rank ``rank`` of ``world`` takes."""
    return len(range(rank, -(-total_rows // batch_size), world))


# -- checks ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowRules:
    """What :func:`check_row` needs: the rules ``prepare_split`` applies (one set: its limits
    and reason strings), and what only a stream checks row by row: the split's name (its
    messages) and the language filter."""

    utterance: UtteranceRules
    split: str
    # data.languages' codes, or None for all.
    keep: set[str] | None


def check_row(row: dict, uid: str, rules: RowRules) -> Utterance | str | None:
    """The utterance of one standardized row (``audio``, ``text``, ``language``), why it is
    skipped (the ``SkipReport`` reason ``prepare_split`` gives: :func:`utterance_problem` and
    the audio header's), or None when ``data.languages`` leaves its language out (on purpose,
    not a skip: counted up front, :meth:`StreamedSplit.left_out`). ``Utterance.row`` is 0.

    Raises:
        UserError: its language has no token (every utterance of it would be dropped), or is
            not English under an English-only model.
    """
    value = row.get("language")
    lang = resolve_language(value, strict=False)
    if rules.keep is not None and lang not in rules.keep:
        return None
    utterance, specials = rules.utterance, rules.utterance.specials
    if specials.multilingual and specials.token_language(lang) is None:
        check_language_tokens(Counter([value]), rules.split, specials, rules.keep, [uid])
    if not specials.multilingual and not is_english(value):
        check_english_only(Counter([value]), rules.split, False, rules.keep)
    text = row.get("text")
    prompt = utterance.prompt(lang)
    text_ids = utterance.text_ids(text) if text and text.strip() else []
    duration = row.get("duration")
    # what the text and the data's duration tell (as prepare_split), then the audio's header
    problem = utterance_problem(
        utterance,
        text=text,
        n_prompt=len(prompt),
        n_text=len(text_ids),
        seconds=math.nan if duration is None else float(duration),
    )
    if problem is not None:
        return problem
    audio = row.get("audio") or {}
    try:
        seconds = header_seconds(audio)
    except UnusableAudio as e:
        return e.reason
    problem = utterance.seconds_problem(seconds)
    if problem is not None:
        return problem
    return Utterance(0, uid, lang, text.strip(), prompt, text_ids, audio_key(audio), seconds)


def _count_languages(counts: Counter, column) -> None:
    """Add the rows per language code of a pyarrow ``column`` of language values to ``counts``."""
    codes, index = language_codes(column)
    for code, n in zip(codes, np.bincount(index, minlength=len(codes)), strict=True):
        counts[code] += int(n)


# -- the stream ------------------------------------------------------------------------------


class StreamedSplit:
    """The training split as a stream of shards (see the module docstring).

    Args:
        cfg: the data section (``path``, ``columns``, ``language``, ``audio_dir``, ``stream``,
            ``batch_size``, ``num_workers``, ``train_split``).
        seed: the run's seed: the order of every epoch.

    Raises:
        UserError: the files cannot be read, or the first shard lacks a column.
    """

    def __init__(self, cfg: DataConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self.split = cfg.train_split
        self.shards, self.audio_root = find_shards(cfg)
        self.language = (
            resolve_language(cfg.language, "data.language") if cfg.language is not None else None
        )
        self.fingerprint = shard_list_fingerprint(self.shards)
        self.first_rows = np.cumsum([0] + [s.rows for s in self.shards])  # global row numbers
        self.rules: RowRules | None = None  # set by prepare()
        self.features = None
        self.eot = 0
        # An Augmenter, set from data.augment.
        self.augment = None
        self.epoch = 0
        self.languages: Counter = Counter()
        """The languages of the first shard (the run's language when none is configured)."""
        # With data.language set every row has it; otherwise the shards are counted when asked.
        self._language_counts = (
            Counter({self.language: len(self)}) if self.language is not None else None
        )
        first = self.read_shard(0)  # a missing column or a bad type fails now, not mid-epoch
        self.languages.update(resolve_language(x, strict=False) for x in first["language"])

    def __len__(self) -> int:
        return int(self.first_rows[-1])

    def read_shard(self, index: int):
        """Shard ``index`` with the standard columns (a ``datasets.Dataset`` in memory)."""
        import datasets
        from datasets.table import InMemoryTable

        shard = self.shards[index]
        where = (
            shard.path
            if shard.fmt != "json"
            else f"{shard.path} (lines from {shard.first_line + 1})"
        )
        table = read_table(shard)
        if table.num_rows != shard.rows:
            raise UserError(f"data.path: {where} changed while training ({table.num_rows} rows, "
                            f"{shard.rows} when the run started)")  # fmt: skip
        ds = datasets.Dataset(InMemoryTable(table))
        columns_log = logging.getLogger("asrforge.data.columns")  # standardize's
        level = columns_log.level
        # What standardize says of one shard it says of all, so it is said once.
        if index or self.languages:
            columns_log.setLevel(max(level, logging.WARNING))
        try:
            return standardize(
                ds, self.cfg, where=where, audio_root=self.audio_root, language=self.language
            )
        finally:
            columns_log.setLevel(level)

    def read_columns(self, shard: Shard, keys: list[str]) -> list:
        """The pyarrow columns of ``shard`` holding ``keys`` (``text``, ``language``), in that
        order, not standardized; a parquet file reads these alone."""
        found: dict[str, str] = {}

        def keep(names: list[str]) -> list[str]:
            for key in keys:
                named = getattr(self.cfg.columns, key)
                found[key] = find_column(names, key, named, shard.path, required=True)
            return list(dict.fromkeys(found.values()))

        table = read_table(shard, keep)
        return [table.column(found[key]) for key in keys]

    def texts(self) -> Iterator[str | None]:
        """Every transcript, shard by shard in file order (a tokenizer trained here reads them);
        a pass to the end counts the rows per language too, which :meth:`language_counts` then
        gives without reading the shards again."""
        counting = self._language_counts is None
        counts: Counter = Counter()
        for shard in self.shards:
            columns = self.read_columns(shard, ["text", "language"] if counting else ["text"])
            if counting:
                _count_languages(counts, columns[1])
            yield from columns[0].to_pylist()
        if counting:
            self._language_counts = counts

    def prepare(self, *, tokenizer, specials, features, eot: int, max_target_positions: int,
                max_seconds: float) -> None:  # fmt: skip
        """Give the stream what its rows are checked and featurized with; the first shard's
        languages are checked for a token now.

        Raises:
            UserError: a language of the first shard has no token.
        """
        keep = language_filter(self.cfg.languages)
        rules = UtteranceRules(
            tokenizer, specials, self.cfg.task, max_target_positions, max_seconds
        )
        self.rules = RowRules(rules, self.split, keep)
        self.features, self.eot = features, eot
        if specials.multilingual:
            check_language_tokens(self.languages, self.split, specials, keep)
        check_english_only(self.languages, self.split, specials.multilingual, keep)

    def left_out(self) -> dict[str, int]:
        """Rows per language code that ``data.languages`` leaves out, over every shard (their
        language column alone is read: a pass over the metadata, made only with the filter)."""
        keep = language_filter(self.cfg.languages)
        if keep is None:
            return {}
        counts = self.language_counts()
        return {lang: n for lang, n in counts.items() if n and lang not in keep}

    def language_counts(self) -> Counter:
        """Rows per language code over every shard (their language column alone is read, once
        a run)."""
        if self._language_counts is None:
            counts: Counter = Counter()
            for shard in self.shards:
                _count_languages(counts, self.read_columns(shard, ["language"])[0])
            self._language_counts = counts
        return Counter(self._language_counts)

    def batches_per_epoch(self, rank: int, world: int) -> int:
        return local_batches(len(self), self.cfg.batch_size, rank, world)

    def loader(
        self,
        epoch: int,
        start_batch: int,
        *,
        rank: int,
        world: int,
        workers: int = 0,
        pin_memory: bool = False,
    ) -> Iterator[dict]:
        """The batches of ``epoch`` on this rank from its ``start_batch``-th on; a batch's
        skipped rows are in its ``dropped``/``dropped_reasons``, as a map-style split's.

        Raises:
            UserError: (while iterated) a row's language has no token, or a shard cannot be read.
        """
        batches = _EpochBatches(self, epoch, start_batch, rank, world)
        loader = DataLoader(
            batches,
            batch_size=None,  # each item is a collated batch
            num_workers=workers,
            persistent_workers=False,
            prefetch_factor=4 if workers else None,
            pin_memory=pin_memory,
            # a private generator: starting the loader must not draw from the global RNG
            # (dropout's), or a resumed run would see other dropout masks
            generator=torch.Generator().manual_seed(self.seed * 7919 + epoch),
            worker_init_fn=ignore_stop_signals,  # a SIGTERM is the training process's to handle
        )
        return _stopping(loader)

    # -- what a worker does ---------------------------------------------------------------------
    def batch(self, rows: list[tuple[dict, str]], epoch: int, position: dict) -> dict:
        """One collated batch of standardized rows ``(row, uid)``: checked, decoded, featurized
        (as ``SpeechDataset`` does, augmentation included); skipped rows are dropped with their
        reasons."""
        utts, items = [], []
        for row, uid in rows:
            checked = check_row(row, uid, self.rules)
            if checked is None:  # left out by data.languages
                continue
            if isinstance(checked, str):
                if checked == NOT_FOUND:  # the id may not say which file (as prepare_split)
                    uid = named(uid, audio_source(row.get("audio")))
                items.append({"dropped": uid, "reason": checked})
                continue
            checked.row = len(utts)
            utts.append((checked, row))
        ds = SpeechDataset([r for _, r in utts], [u for u, _ in utts], self.features, self.eot)
        ds.augment, ds.epoch = self.augment, epoch
        items += [ds[i] for i in range(len(utts))]
        batch = Collator(pad_id=self.eot)(items)
        batch["stream_position"] = position
        return batch


class _EpochBatches(IterableDataset):
    """One rank's batches of one epoch, from ``start`` on; worker ``w`` of ``W`` yields the
    rank's batches ``start + w``, ``start + w + W``, ..."""

    def __init__(self, stream: StreamedSplit, epoch: int, start: int, rank: int, world: int):
        self.stream, self.epoch, self.start, self.rank, self.world = (
            stream,
            epoch,
            start,
            rank,
            world,
        )

    def __iter__(self) -> Iterator[dict]:
        s = self.stream
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        size, total = s.cfg.batch_size, len(s)
        blocks = epoch_blocks(len(s.shards), s.cfg.stream.shuffle_shards, s.seed, self.epoch)
        block_rows = [sum(s.shards[i].rows for i in b) for b in blocks]
        block_first = np.cumsum([0, *block_rows])  # the epoch's row position each block starts at
        cache: dict[int, tuple] = {}  # block -> (its rows in read order, their tables)
        n_local = local_batches(total, size, self.rank, self.world)
        try:
            for i in range(self.start + worker, n_local, n_workers):
                j = i * self.world + self.rank  # the batch's number in the epoch
                lo, hi = j * size, min((j + 1) * size, total)
                rows = []
                for pos in range(lo, hi):
                    b = int(np.searchsorted(block_first, pos, side="right")) - 1
                    if b not in cache:
                        for old in [k for k in cache if k < b]:  # blocks are read in order
                            del cache[old]
                        cache[b] = self._load_block(blocks[b], b)
                    rows.append(self._row(cache[b], pos - int(block_first[b])))
                position = {"fingerprint": s.fingerprint, "epoch": self.epoch, "batch": j,
                            "rows_before": hi}  # fmt: skip
                yield s.batch(rows, self.epoch, position)
        except UserError as e:
            # A language without a token or a file gone bad stops the run.
            yield {"stop": str(e), "size": 0, "dropped": [], "dropped_reasons": []}

    def _load_block(self, shard_ids: list[int], b: int) -> tuple:
        s = self.stream
        tables = [s.read_shard(i) for i in shard_ids]
        index = [(k, r) for k, t in enumerate(tables) for r in range(len(t))]
        order = block_order(len(index), s.seed, self.epoch, b)
        return [index[o] for o in order], tables, shard_ids

    def _row(self, block: tuple, k: int) -> tuple[dict, str]:
        """Row ``k`` (in read order) of a loaded block and its id."""
        rows, tables, shard_ids = block
        t, r = rows[k]
        row = tables[t][r]
        first = int(self.stream.first_rows[shard_ids[t]])  # the shard's first row in the split
        return row, row_id(row.get("id"), self.stream.split, first + r)


def _stopping(batches) -> Iterator[dict]:
    """``batches``, raising in the training process the error a worker met (a language without
    a token, a file gone bad), which it passes on as a ``stop`` batch."""
    for batch in batches:
        if "stop" in batch:
            raise UserError(batch["stop"])
        yield batch


def stream_eval_split(cfg: DataConfig):
    """The evaluation split of a streamed run: ``data.stream.eval_path``'s, else ``data.path``'s
    ``data.eval_split`` files (read as :func:`~asrforge.data.sources.load_source` reads them;
    the training files are not read).

    Raises:
        UserError: there is none.
    """
    path = cfg.stream.eval_path or cfg.path
    elsewhere = is_url(path) or hub_ref(path, "dataset") is not None
    if cfg.stream.eval_path is None and not elsewhere and not Path(path).is_dir():
        raise UserError(
            f"data.stream.eval_path: data.path {path} is one file, the training split; name the "
            f"evaluation split's data (data.stream.eval_path)"
        )
    # one file (or one saved Dataset) is the evaluation split; a directory's named split is read
    # alone, so the training files are never converted
    update = {"path": path}
    if cfg.stream.eval_path is not None and Path(path).is_file():
        update["subset"] = None  # one file is the split, whatever configuration data.path has
    return read_split(cfg.model_copy(update=update), cfg.eval_split, option="data.eval_split")
