"""Data sources: whatever ``data.path`` holds -> splits with the columns ``audio``, ``text``,
``language`` (and ``id`` when there is one) that :func:`asrforge.data.prepare.prepare_split` reads.

How it works: docs/data.md, "Reading a data source (`data/sources.py`)".
"""

from __future__ import annotations

import csv
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from asrforge.config import DataConfig, apply_override, format_errors
from asrforge.data.columns import standardize
from asrforge.data.locate import FILE_FORMATS, is_url, locate, split_of
from asrforge.errors import UserError
from asrforge.hub import Resolved
from asrforge.io.small_files import CONFIG_BYTES, read_json
from asrforge.text.languages import resolve_language

log = logging.getLogger(__name__)



@dataclass
class Source:
    """The splits of ``data.path``, each with the standard columns."""

    splits: dict  # split name -> datasets.Dataset
    where: Path | str
    """``data.path``, for messages (a Hub id with its subset)."""
    names: list[str] = field(default_factory=list)
    """Every split's name, also those not read (``load_source(split=...)``)."""
    resolved: Resolved | None = None
    """The Hub commit ``data.path`` resolved to, for the run's record."""


def load_source(
    cfg: DataConfig,
    *,
    split: str | None = None,
    section: str = "data",
    required: tuple[str, ...] = ("audio", "text"),
    default_language: str | None = None,
) -> Source:
    """Read ``cfg.path`` and give every split the standard columns.

    Args:
        cfg: the data section (``path``, ``columns``, ``language``, ``audio_dir``; ``cache_dir``
            for the Arrow copy ``datasets`` makes of parquet/json/csv files, default its own
            cache).
        split: read only this split (another split's files are not converted to Arrow); a
            single file or saved ``Dataset`` is ``cfg.train_split``.
        section: the config section whose fields ``cfg`` holds, as messages name it
            (``eval.guard`` for the forgetting guard's data).
        required, default_language: see :func:`standardize`.

    Raises:
        UserError: the path is missing or holds nothing readable, or a column is missing or of
            the wrong type (named by its ``data.columns`` path, the file and the columns there).
    """
    import datasets

    datasets.disable_progress_bars()
    located = locate(cfg, section=section, only=split)
    path = Path(located.root) if not is_url(located.root) else located.root
    cache_dir = Path(cfg.cache_dir) / "datasets" if cfg.cache_dir is not None else None
    if located.splits is not None:
        raw, root = _load_grouped(located.splits, cache_dir, only=split, section=section), path
    elif is_url(path):
        fmt = format_of(Path(path), section=section)
        raw, root = _load_files(fmt, [path], cache_dir, section=section), path.rsplit("/", 1)[0]
    elif path.is_dir() and (
        (path / "dataset_dict.json").exists() or (path / "state.json").exists()
    ):
        raw, root = _load_saved(path), path
    elif path.is_dir():
        check_data_path(path, section=section)
        grouped = split_files(path, section=section)
        raw, root = _load_grouped(grouped, cache_dir, only=split, section=section), path
    else:
        check_data_path(path, section=section)
        fmt = format_of(path, section=section)
        raw, root = _load_files(fmt, [path], cache_dir, section=section), path.parent
    # One file or one saved Dataset is the split training reads.
    if not isinstance(raw, dict):
        raw = {cfg.train_split: raw}
    names = sorted(raw)
    raw = {name: ds for name, ds in raw.items() if split in (None, name)}
    root = Path(cfg.audio_dir) if cfg.audio_dir is not None else root
    where_all = located.where if located.resolved.ref is not None else path
    language = None
    if cfg.language is not None:
        language = resolve_language(cfg.language, f"{section}.language")
    splits = {}
    for name, ds in raw.items():
        one = len(names) == 1 or (not is_url(path) and not path.is_dir())
        where = where_all if one else f"{where_all} (split {name!r})"
        splits[name] = standardize(
            ds,
            cfg,
            where=str(where),
            audio_root=root,
            language=language,
            required=required,
            default_language=default_language,
            section=section,
        )
    return Source(splits, where_all, names, located.resolved)


def check_data_path(path: Path, *, section: str = "data") -> None:
    """Refuse a data path that is missing, or neither a directory nor a regular file (a FIFO or
    a device would block its reader forever).

    Raises:
        UserError: naming ``section.path`` and what is wrong.
    """
    if not path.exists():
        raise UserError(missing_data_path(path, section))
    if not path.is_dir() and not path.is_file():
        raise UserError(
            f"{section}.path: {path} is not a regular file or a directory (a pipe or a device "
            "is never read as data)"
        )


def _load_saved(path: Path):
    """A ``save_to_disk`` directory: its splits, or its one ``Dataset``."""
    import datasets

    loaded = load_saved(path)
    return loaded if isinstance(loaded, datasets.Dataset) else dict(loaded)


def _load_grouped(
    by_split: dict, cache_dir: Path | None, only: str | None = None, *, section: str = "data"
) -> dict:
    """Each split from its data files (:func:`split_files`, or the files a data set's
    configuration names: :func:`asrforge.data.locate.locate`). With ``only``, the other splits
    are named but not read (None); ``section`` names the path in messages (see
    :func:`load_source`)."""
    splits = {}
    for name, group in by_split.items():
        if only not in (None, name):
            splits[name] = None
            continue
        formats = {format_of(Path(f), section=section) for f in group}
        if not formats:
            raise UserError(f"{section}.path: split {name!r}: no file matches its configuration")
        if len(formats) > 1:
            raise UserError(
                f"{section}.path: split {name!r} mixes formats "
                f"({', '.join(Path(f).name for f in group)}); convert them to one"
            )
        splits[name] = _load_files(formats.pop(), group, cache_dir, section=section)
    return splits


def split_files(path: Path, *, section: str = "data") -> dict[str, list[Path]]:
    """The data files of the directory ``path`` by split: grouped by the word each file name, or
    else its folder's name, starts with. The files are the directory's own, or when none of
    those names a split, its subdirectories' (a Hub snapshot keeps them in ``data/``); no deeper,
    so a folder of a million clips beside a manifest is not walked. ``section`` names ``path``
    in messages.

    Raises:
        UserError: no file names a split.
    """
    by_split: dict[str | None, list[Path]] = {}
    for pattern in ("*", "*/*"):
        for f in sorted(path.glob(pattern)):
            if f.suffix.lower() not in FILE_FORMATS or not f.exists() or f.is_dir():
                continue
            check_data_path(f, section=section)  # a pipe named as data is refused, not passed over
            by_split.setdefault(split_of(f.name) or split_of(f.parent.name), []).append(f)
        if set(by_split) - {None}:
            break
    unsplit = by_split.pop(None, [])
    if not by_split:
        raise UserError(
            f"{section}.path: {path} holds no data files named by their split (train*, validation*, "
            f"dev*, test*; formats {', '.join(sorted(FILE_FORMATS))}) and is not a dataset "
            "saved with save_to_disk"
        )
    if unsplit:
        log.warning(
            "%s.path: %s: not read, their names say no split: %s",
            section,
            path,
            ", ".join(str(f.relative_to(path)) for f in unsplit),
        )
    for name, files in by_split.items():
        if len(files) > 1:  # a stray train_backup.jsonl beside train.jsonl joins the split
            log.info("%s.path: split %r is read from %d files: %s", section, name, len(files),
                     ", ".join(str(f.relative_to(path)) for f in files))  # fmt: skip
    return by_split


def format_of(path: Path, *, section: str = "data") -> str:
    """The ``datasets`` loader of the file ``path`` (``section.path`` in messages)."""
    fmt = FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UserError(
            f"{section}.path: {path}: not a format asrforge reads (a save_to_disk directory, "
            f"or {', '.join(sorted(FILE_FORMATS))} files)"
        )
    return fmt


JSON_LOADER_LOG = "datasets.packaged_modules.json.json"
"""The logger of ``datasets``' JSON loader."""
CSV_LOADER_LOG = "datasets.packaged_modules.csv.csv"
"""The logger of ``datasets``' CSV loader (TSV's too)."""


def _load_files(fmt: str, files: list[Path], cache_dir: Path | None, *, section: str = "data"):
    """One split from files of one format, by ``datasets``' loader for it (``section.path`` in
    messages)."""
    import datasets

    if fmt == "arrow":  # memory-mapped where it lies, no copy
        try:
            parts = [datasets.Dataset.from_file(str(f)) for f in files]
        except Exception as e:  # noqa: BLE001 - pyarrow's errors have no common type
            raise UserError(
                f"{section}.path: cannot read {files[0]} as an Arrow file: {e}"
            ) from None
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    options: dict = {}
    if fmt in ("csv", "tsv"):  # a transcript "NA" or "null" is text, not a missing value
        options["keep_default_na"] = False
    # Unquoted, as Common Voice writes it, so a " is text.
    if fmt == "tsv":
        options.update(sep="\t", quoting=csv.QUOTE_NONE)
    local = not any(is_url(f) for f in files)
    # The JSON and CSV loaders log a file they fail on, counting rows from 0, and the error
    # raised below names that failure by the line an editor shows; this load alone is kept from
    # logging it.
    loader_log = logging.getLogger(JSON_LOADER_LOG if fmt == "json" else CSV_LOADER_LOG)
    level = loader_log.level
    if fmt in ("json", "csv", "tsv"):
        loader_log.setLevel(logging.CRITICAL)
    try:
        ds = datasets.load_dataset(
            "csv" if fmt == "tsv" else fmt,
            data_files=[str(f) for f in files],
            split="train",
            cache_dir=str(cache_dir) if cache_dir is not None else None,
            **options,
        )
    except Exception as e:  # noqa: BLE001 - the loaders raise many types for a malformed file
        text_table = fmt in ("csv", "tsv")
        bad = local and (
            no_rows(files, header=text_table)
            or (_bad_json_line(files) if fmt == "json" else None)
            or (_bad_utf8_line(files) if text_table else None)
        )
        # The line is named here because pyarrow counts rows of a block from 0 ("row 1" of another
        # line).
        if bad:
            raise UserError(f"{section}.path: {bad}") from None
        raise unreadable(", ".join(map(str, files)), fmt, e, section=section) from None
    finally:
        loader_log.setLevel(level)
    if fmt == "json":
        find_line = (lambda: _bad_utf8_line(files)) if local else (lambda: None)
        check_utf8(ds.data.table, find_line, section=section)
    return ds


def unreadable(where: str, fmt: str, error: BaseException, *, section: str = "data") -> UserError:
    """The error of data ``where`` (files, a row group) that its ``fmt`` reader failed on, in the
    same words whether the split is read whole or streamed."""
    cause = error.__cause__ or error
    return UserError(f"{section}.path: cannot read {where} as {fmt}: {type(cause).__name__}: {cause}")


def no_rows(files: list[Path], *, header: bool = False) -> str | None:
    """``FILE: empty file``, ``FILE: only blank lines, no rows`` or (``header``: a CSV/TSV's
    first line names its columns) ``FILE: a header line and no rows`` for the first of
    ``files`` (text files) that holds no row at all, or None; each is read up to its first
    row. The loaders' own words for these are ``StopIteration`` and ``Instruction "train"
    corresponds to no data``."""
    for file in files:
        if Path(file).stat().st_size == 0:
            return f"{file}: empty file"
        with open(file, "rb") as f:
            lines = (line for line in f if line.strip())
            if next(lines, None) is None:
                return f"{file}: only blank lines, no rows"
            if header and next(lines, None) is None:
                return f"{file}: a header line and no rows"
    return None


def check_utf8(table, find_line, *, section: str = "data") -> None:
    """Refuse a table whose text is not UTF-8 (pyarrow's JSON reader keeps such bytes in a string
    column, and decoding them later fails deep inside ``datasets``).

    Args:
        find_line: gives ``FILE line N: ...`` for the first line that is not UTF-8, or None;
            called only when the table fails the check.

    Raises:
        UserError: naming the file and line.
    """
    import pyarrow as pa

    try:
        # Only the text columns are checked, since audio bytes need no pass.
        for column in table.columns:
            if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                column.validate(full=True)
    except pa.ArrowInvalid as e:
        raise UserError(f"{section}.path: {find_line() or f'not UTF-8 text ({e})'}") from None


def utf8_problem(lines, file, first_line: int = 0) -> str | None:
    """``FILE line N: not UTF-8 text (...)`` for the first of ``lines`` (bytes, numbered from
    ``first_line + 1``) that is not UTF-8, or None."""
    for n, line in enumerate(lines, start=first_line + 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            return (
                f"{file} line {n}: not UTF-8 text (bytes {line[e.start : e.end + 3]!r} at "
                f"column {e.start + 1}); save the file as UTF-8"
            )
    return None


def _bad_utf8_line(files: list[Path]) -> str | None:
    for file in files:
        with open(file, "rb") as f:
            if (bad := utf8_problem(f, file)) is not None:
                return bad
    return None


def _bad_json_line(files: list[Path]) -> str | None:
    """``FILE line N: not JSON (why)`` for the first line of JSON-lines ``files`` that is not a
    JSON object, or None (none, or a file that is one JSON document rather than JSON lines).
    Read only after the loader failed, to name the line as an editor numbers it."""
    for file in files:
        # A .json file may be one document rather than lines, and the two are not told apart.
        whole = Path(file).suffix != ".jsonl"
        with open(file, "rb") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    return None if n == 1 and whole else f"{file} line {n}: not JSON ({e})"
                if not isinstance(row, dict):
                    return None if n == 1 and whole else f"{file} line {n}: not a JSON object"
    return None


SOURCE_OPTIONS = ("columns", "language", "audio_dir", "cache_dir", "subset", "revision")
"""The ``data`` fields that say how to read a source: the ``data.*`` options of the commands that
read data outside a run (``evaluate``, ``lm build``, ``lm tune``)."""


def source_config(path: Path | str, options: list[str]) -> DataConfig:
    """The data section of a command that reads ``path`` outside a run, from its ``data.*``
    options written as a run's config overrides (``data.columns.text=sentence``,
    ``data.language=en``, ``data.audio_dir=/corpus``): the same names, values and checks.

    Raises:
        UserError: an option outside :data:`SOURCE_OPTIONS` or a bad value, each named.
    """
    from pydantic import ValidationError

    section: dict = {}
    problems = []
    for item in options:
        key = item.partition("=")[0]
        field = key.split(".")[1] if key.count(".") else ""
        if not key.startswith("data.") or field not in SOURCE_OPTIONS:
            problems.append(
                f"{key}: not an option here (it takes data.columns.audio/text/language/id, "
                "data.language, data.audio_dir, data.cache_dir, data.subset, data.revision)"
            )
            continue
        try:
            apply_override(section, item)
        except ValueError as e:
            problems.append(str(e))
    if not problems:
        try:
            return DataConfig.model_validate({**section.get("data", {}), "path": str(path)})
        except ValidationError as e:
            problems = format_errors(e, DataConfig, prefix="data")
    raise UserError("; ".join(problems))


def read_split(
    data: Path | DataConfig,
    split: str,
    *,
    option: str = "--split",
    section: str = "data",
    required: tuple[str, ...] = ("audio", "text"),
    default_language: str | None = None,
):
    """One split of ``data`` with the standard columns (:func:`load_source`). Data of one split
    (a manifest, a CSV/TSV, a saved ``Dataset``) is that split, whatever ``split`` names.

    Args:
        data: a path (the usual column names), or a data section naming the columns etc.
        option: what names ``split`` in messages.
        section, required, default_language: see :func:`load_source`.

    Raises:
        UserError: the split is missing (the message lists the splits there are) or has no rows,
            or :func:`load_source` refuses the data.
    """
    cfg = data_config(data).model_copy(update={"train_split": split})
    source = load_source(
        cfg, split=split, section=section, required=required, default_language=default_language
    )
    if split not in source.splits:
        raise UserError(
            f"{option} {split!r}: not in {source.where} (it has {', '.join(source.names)})"
        )
    if len(source.splits[split]) == 0:
        raise UserError(f"{option} {split!r}: {source.where} has no rows in it")
    return source.splits[split]


def reads_whole(path: Path) -> bool:
    """Whether ``path`` holds one split only (a file, or one saved ``Dataset``), which
    :func:`read_split` reads whole whatever split is asked for."""
    path = Path(path)
    return path.is_file() or (path / "state.json").is_file()


def data_config(data: Path | DataConfig) -> DataConfig:
    """``data`` as a data section: a path alone is read with the usual column names."""
    return data if isinstance(data, DataConfig) else DataConfig(path=data)


def missing_data_path(path: Path, section: str = "data") -> str:
    """What to say of a data path that does not exist: the tones ``data.generate`` builds are
    offered only for ``data.path`` written as a folder, since a path with a file's suffix is a
    manifest mistyped, not a data set to make."""
    hint = "; data.generate: tones makes a small one"
    offer = section == "data" and not Path(path).suffix
    # a config's relative paths are read from where the command runs, not from the config's
    where = "" if Path(path).is_absolute() else f" (read from {Path.cwd()})"
    return f"{section}.path: {path}{where} does not exist{hint if offer else ''}"


TEXT_COLUMNS = ("text", "language")
"""Columns that must hold strings (or nulls, which are skipped as empty)."""


def load_arrow(path: Path):
    """``datasets.load_from_disk`` with audio left undecoded (we decode with soundfile)."""
    import datasets
    from datasets import Audio

    datasets.disable_progress_bars()
    path = Path(path)
    if not path.exists():
        raise UserError(missing_data_path(path, "data"))
    dd = load_saved(path)
    if isinstance(dd, datasets.Dataset):
        raise UserError(f"data.path: {path} holds one split; save a DatasetDict with named splits")
    for name, split in dd.items():
        missing = {"audio", "text", "language"} - set(split.column_names)
        if missing:
            raise UserError(f"data.path: split {name!r} lacks columns {sorted(missing)}")
        for column in TEXT_COLUMNS:
            dtype = getattr(split.features[column], "dtype", type(split.features[column]).__name__)
            if dtype not in ("string", "large_string", "null"):
                raise UserError(
                    f"data.path: {path} split {name!r}: column {column!r} holds {dtype}, "
                    "expected strings"
                )
        if isinstance(split.features["audio"], Audio):
            dd[name] = split.cast_column("audio", Audio(decode=False))
    return dd


def load_saved(path: Path):
    """``datasets.load_from_disk(path)``: a ``DatasetDict`` or one ``Dataset``.

    Raises:
        UserError: a split saved without rows, not a ``save_to_disk`` directory, or one whose
            JSON files or data files cannot be read safely (:func:`_saved_splits`).
    """
    import datasets

    splits = _saved_splits(path)
    empty = [name for name, files in splits.items() if not files and name is not None]
    if empty:  # datasets' load_from_disk fails on them with an IndexError
        raise UserError(
            f"data.path: {path}: split(s) {', '.join(map(repr, empty))} have no rows; "
            "add rows or leave the split out of the saved DatasetDict"
        )
    try:
        return datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"data.path: {path} is not a dataset saved with save_to_disk: {e}") from None


def _saved_splits(path: Path) -> dict[str | None, list[Path]]:
    """The data files of each split of the ``save_to_disk`` directory ``path`` (the key None for
    one saved ``Dataset``), read from its JSON files before ``load_from_disk`` reads them.

    datasets reads these JSON files whole and opens each data file ``state.json`` names, so a
    FIFO among them would wait for a writer forever and a link to a device would be read
    without end: each JSON file goes through the bounded reader, each data file must be a
    regular file in its split's directory.

    Raises:
        UserError: a JSON file that is no regular file, too large or not the JSON datasets
            writes, or a data file that is missing, outside its directory or no regular file.
    """

    def bad(what: str) -> UserError:
        return UserError(f"data.path: {what}")

    def read(file: Path, optional: bool = False):
        try:
            return read_json(file, CONFIG_BYTES, error=bad)
        except FileNotFoundError:
            if optional:
                return None
            raise bad(f"{file}: missing; {path} is not a dataset saved with save_to_disk") from None

    def plain(name: object) -> bool:
        return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name

    if os.path.lexists(path / "dataset_dict.json"):
        found = read(path / "dataset_dict.json")
        names = found.get("splits") if isinstance(found, dict) else None
        if not (isinstance(names, list) and all(plain(n) for n in names)):
            raise bad(
                f"{path / 'dataset_dict.json'}: 'splits' must be a list of the names of its "
                f"split directories, got {names!r:.60}"
            )
        directories = {n: path / n for n in names}
    else:
        directories = {None: path}
    out: dict[str | None, list[Path]] = {}
    for name, directory in directories.items():
        state_file = directory / "state.json"
        state = read(state_file)
        read(directory / "dataset_info.json", optional=True)
        listed = state.get("_data_files") if isinstance(state, dict) else None
        if not (
            isinstance(listed, list)
            and all(isinstance(f, dict) and plain(f.get("filename")) for f in listed)
        ):
            raise bad(
                f"{state_file}: '_data_files' must be a list of {{\"filename\": ...}} records "
                "naming files of its own directory"
            )
        out[name] = [directory / f["filename"] for f in listed]
        for file in out[name]:
            try:
                mode = os.stat(file).st_mode
            except OSError as e:
                raise bad(f"{file}: {e.strerror} (listed in {state_file})") from None
            if not stat.S_ISREG(mode):
                raise bad(
                    f"{file}: not a regular file (listed in {state_file}); a FIFO or a device is "
                    "never read as data"
                )
    return out
