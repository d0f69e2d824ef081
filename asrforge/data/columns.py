"""A read table -> the standard columns: ``audio``, ``text``, ``language``, and ``id`` and
``duration`` when the data has them, found by ``data.columns`` or by their usual names and
checked for their types (:func:`standardize`); and the Arrow column readers that the checks up
front, the carve and the stream read metadata with, no row formatted.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection
from pathlib import Path

import numpy as np

from asrforge.config import DataConfig
from asrforge.data.ids import StandardRows
from asrforge.errors import UserError
from asrforge.text.languages import resolve_language

log = logging.getLogger(__name__)


USUAL_COLUMNS = {
    "audio": ("audio", "audio_filepath", "path"),
    "text": ("text", "sentence", "raw_transcription", "transcription"),
    "language": ("language", "lang", "locale"),
    "id": ("id",),
    "duration": ("duration",),
}
"""Column names looked for, in this order, when ``data.columns`` names none (``audio_filepath``,
``lang``, ``duration``: NeMo; ``sentence``, ``locale``: Common Voice; ``raw_transcription``, the
cased and punctuated text, before ``transcription``: FLEURS)."""


STRING_TYPES = ("string", "large_string", "null")


AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".webm", ".aiff", ".sph")
"""Endings of audio file names: a column named so is a data row read as the header."""


def standardize(
    ds,
    cfg: DataConfig,
    *,
    where: str,
    audio_root: Path,
    language: str | None,
    required: tuple[str, ...] = ("audio", "text"),
    default_language: str | None = None,
    section: str = "data",
):
    """``ds`` with the columns ``audio``, ``text``, ``language``, ``id`` when the data has ids,
    and ``duration`` (seconds) when it has durations; other columns are left out. Its rows read
    as :class:`StandardRows` says: audio undecoded (``{bytes, path}``, a relative path joined to
    ``audio_root``), and an ``id`` (the path as given) when the audio is given as paths.

    Args:
        language: the language of every row (``data.language``), or None: the data's column.
        required: the columns the data must have; without one of ``audio`` and ``text``, data
            with no such column has none here (the forgetting guard's recordings need no
            transcript, a vocabulary no audio).
        default_language: the language of every row when the data has no language column and
            ``language`` is None (the guard's: the run's).
        section: the config section whose fields ``cfg`` holds, as messages name it.

    Raises:
        UserError: a column is missing or holds the wrong type.
    """
    from datasets import Value

    _refuse_headerless(ds, where, section=section)
    kinds = {c: _dtype(ds.features[c]) for c in ds.column_names}
    found: dict[str, str | None] = {}
    for key in ("audio", "text", "language", "id", "duration"):
        # A hint for a missing column never points at one another role holds.
        taken = {getattr(cfg.columns, k) for k in USUAL_COLUMNS if k != key} | set(found.values())
        found[key] = find_column(ds.column_names, key, getattr(cfg.columns, key), where,
                                 required=key in required, section=section, taken=taken,
                                 kinds=kinds)  # fmt: skip
    if language is None and found["language"] is None:
        language = default_language
    if language is not None:
        if cfg.columns.language is not None:
            raise UserError(
                f"{section}.language: set, and {section}.columns.language names column "
                f"{cfg.columns.language!r}: give one of the two"
            )
        if found["language"] is not None:
            log.info(
                "%s.language: every utterance of %s is %s (its column %r is not read)",
                section,
                where,
                language,
                found["language"],
            )
        found["language"] = None
    elif found["language"] is None:
        raise UserError(
            f"{section}.language: {where} has no language column (looked for "
            f"{', '.join(USUAL_COLUMNS['language'])}; columns: {', '.join(ds.column_names)}): set "
            f"{section}.language (e.g. {section}.language=en) or name the column in "
            f"{section}.columns.language"
        )
    _refuse_segments(ds, where, section=section)
    keep = [c for c in found.values() if c is not None]
    ds = ds.select_columns(list(dict.fromkeys(keep)))
    gives_paths = False
    if found["audio"] is not None:
        ds, gives_paths = _audio_column(ds, found["audio"], where=where, section=section)
    for key in ("text", "language"):
        column = found[key]
        if column is not None and _dtype(ds.features[column]) not in STRING_TYPES:
            raise UserError(
                f"{section}.columns.{key}: column {column!r} of {where} holds "
                f"{_dtype(ds.features[column])}, expected strings"
            )
    duration = found["duration"]
    if duration is not None and not _is_number(_dtype(ds.features[duration])):
        raise UserError(
            f"data.columns.duration: column {duration!r} of {where} holds "
            f"{_dtype(ds.features[duration])}, expected seconds (numbers)"
        )
    ds = ds.rename_columns({c: k for k, c in found.items() if c is not None and c != k})
    # The language is added as one Arrow column, not as a list of a million strings.
    if language is not None:
        import pyarrow as pa

        same = pa.repeat(pa.scalar(language, pa.string()), len(ds))
        # named, not hashed: datasets would serialize the column to fingerprint it (24 MB of
        # peak memory at a million rows)
        after = hashlib.sha256(f"{ds._fingerprint}\nlanguage={language}".encode()).hexdigest()
        ds = ds.add_column("language", pa.chunked_array([same]), new_fingerprint=after[:32])
    if "id" in ds.column_names and _dtype(ds.features["id"]) not in STRING_TYPES:
        # Reports name numeric ids as text.
        ds = ds.cast_column("id", Value("string"))
    root = str(Path(audio_root).absolute()).rstrip("/") if gives_paths else None
    ds.set_transform(StandardRows(root, path_ids=gives_paths and "id" not in ds.column_names))
    return ds


def _audio_column(ds, column: str, *, where: str, section: str = "data") -> tuple:
    """``ds`` with ``column`` readable as an undecoded ``Audio`` (``{bytes, path}``), and whether
    it gives the audio as paths. Path strings are kept as the data writes them (a row read joins
    a relative one to the audio root: :class:`StandardRows`); an ``Audio`` feature or its struct,
    or encoded bytes, become an ``Audio`` column.

    Raises:
        UserError: the column holds something else.
    """
    from datasets import Audio

    kind = _dtype(ds.features[column])
    if kind in ("string", "large_string"):
        return ds, True
    if _is_audio_struct(ds.features[column]):
        return ds.cast_column(column, Audio(decode=False)), not _has_bytes(ds, column)
    if kind not in ("binary", "large_binary"):
        raise UserError(
            f"{section}.columns.audio: column {column!r} of {where} holds {kind}; expected audio "
            "(an Audio feature, bytes or a path)"
        )
    return ds.cast_column(column, Audio(decode=False)), False


def find_column(
    columns: list[str],
    key: str,
    named: str | None,
    where: str,
    *,
    required: bool,
    section: str = "data",
    taken: Collection[str | None] = (),
    kinds: dict[str, str] | None = None,
) -> str | None:
    """Which of the data's ``columns`` holds ``key`` (``audio``, ``text``, ...), or None for an
    optional one; ``section.columns.<key>`` names it in messages.

    Args:
        taken: columns other roles hold, never suggested for a missing ``key``.
        kinds: each column's Arrow type name, where known: a missing text or language column
            is suggested among the string columns only.
    """
    if named is not None:
        if named not in columns:
            raise UserError(
                f"{section}.columns.{key}: column {named!r} not in {where} "
                f"(columns: {', '.join(columns)})"
            )
        return named
    column = next((c for c in USUAL_COLUMNS[key] if c in columns), None)
    if column is None and required:
        raise UserError(
            f"{section}.columns.{key}: {where} has no {key} column (looked for "
            f"{', '.join(USUAL_COLUMNS[key])}; columns: {', '.join(columns)}); "
            + _name_it(columns, key, taken, kinds, section)
        )
    return column


LIKELY_NAMES = {
    "audio": ("audio", "path", "file", "wav", "speech", "recording"),
    "text": ("text", "transcri", "sentence", "caption", "utterance", "label", "normalized"),
    "language": ("lang", "locale"),
    "id": ("id",),
    "duration": ("duration", "length", "seconds"),
}
"""Parts of a column name that make it a likely ``key`` column when none has a usual name."""


def _name_it(
    columns: list[str],
    key: str,
    taken: Collection[str | None],
    kinds: dict[str, str] | None,
    section: str,
) -> str:
    """The hint of a missing-column message: a column that is likely ``key``'s, else the columns
    it may be; a file read as one column whose name holds a separator was split at the wrong
    one."""
    if len(columns) == 1 and (sep := next((c for c in ";|\t," if c in columns[0]), None)):
        return (
            f"the file reads as one column named {columns[0]!r}: its columns look separated by "
            f"{sep!r}, and asrforge reads .csv files split at ',' and .tsv files at tabs; save "
            "it with that separator"
        )
    others = {c for k, names in USUAL_COLUMNS.items() if k != key for c in names}
    candidates = [c for c in columns if c not in taken and c not in others]
    if kinds is not None and key in ("text", "language"):
        candidates = [c for c in candidates if kinds.get(c) in STRING_TYPES]
    likely = [c for c in candidates if any(part in c.lower() for part in LIKELY_NAMES[key])]
    if likely:
        return f"name it, e.g. {section}.columns.{key}: {likely[0]}"
    if candidates:
        return f"name it in {section}.columns.{key} (one of: {', '.join(candidates)})"
    return f"name it in {section}.columns.{key}"


def _is_audio_struct(feature) -> bool:
    """An ``Audio`` feature, or the ``{bytes, path}`` struct it is stored as."""
    from datasets import Audio

    return (
        isinstance(feature, Audio)
        or isinstance(feature, dict)
        and {"bytes", "path"} <= set(feature)
    )


def _has_bytes(ds, column: str) -> bool:
    import pyarrow.compute as pc

    encoded = pc.struct_field(ds.data.column(column), "bytes")
    return encoded.null_count < len(encoded)


def _refuse_headerless(ds, where: str, *, section: str = "data") -> None:
    """Refuse a table whose column names hold an audio file's name: a CSV/TSV file without a
    header row, whose first data row was read as the names.

    Raises:
        UserError: naming the file and what its first line holds.
    """
    if any(str(c).lower().endswith(AUDIO_SUFFIXES) for c in ds.column_names):
        raise UserError(
            f"{section}.path: {where}: no header row: the first line must name the columns "
            f"(e.g. audio,text,language); it holds {', '.join(map(str, ds.column_names))}"
        )


def _refuse_segments(ds, where: str, *, section: str = "data") -> None:
    """A NeMo manifest's ``offset``: asrforge reads whole files, and would train the whole file
    on one segment's transcript.

    Raises:
        UserError: some row starts at a nonzero offset.
    """
    import pyarrow.compute as pc

    if "offset" not in ds.column_names:
        return
    offsets = ds.data.column("offset")
    if pc.any(pc.not_equal(pc.fill_null(offsets, 0), 0)).as_py():
        raise UserError(
            f"{section}.path: {where} has segments (a nonzero 'offset'); asrforge reads whole files: "
            "cut each segment into a file of its own"
        )


def _dtype(feature) -> str:
    return getattr(feature, "dtype", type(feature).__name__)


def _is_number(dtype: str) -> bool:
    return dtype == "null" or dtype.startswith(("int", "uint", "float", "double"))


def arrow_columns(split, names: list[str]):
    """``names`` of the ``datasets`` split as one ``pyarrow.Table`` in the split's row order.

    A split selected from another (a carve) maps its rows through an indices table;
    ``with_format("arrow")[:]`` gathers such rows one slice at a time (25 s and 3 GB for a
    million), ``Table.take`` in one vectorized call.
    """
    table = split.data.table.select(names)
    # datasets' row map of a select(), or None where the rows are in place.
    indices = getattr(split, "_indices", None)
    return table if indices is None else table.take(indices.column(0))


def dictionary_encoded(column) -> tuple[list, np.ndarray]:
    """(distinct values, each row's index into them) of an Arrow string column (nulls too)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(pa.chunked_array(column), null_encoding="encode")
    encoded = encoded.combine_chunks() if isinstance(encoded, pa.ChunkedArray) else encoded
    return encoded.dictionary.to_pylist(), encoded.indices.to_numpy(zero_copy_only=False)


def language_codes(column) -> tuple[list[str], np.ndarray]:
    """(distinct language codes, each row's index into them) of an Arrow column of language
    values, each resolved as a cell is (``""`` for none; a value that names no language as it
    is); what a row without one trains as is :func:`~asrforge.data.rules.row_language`'s."""
    values, index = dictionary_encoded(column)
    return [resolve_language(v, strict=False) for v in values], index


def column_seconds(column) -> np.ndarray:
    """A ``duration`` column as float64 seconds, NaN where null.

    Raises:
        UserError: the column holds no numbers.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        numbers = pc.cast(column, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise UserError(
            f"data.columns.duration: the duration column holds {column.type}, expected seconds"
        ) from None
    return pc.fill_null(numbers, float("nan")).to_numpy()
