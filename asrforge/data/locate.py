"""Where the files of ``data.path`` are: a local path, a Hugging Face Hub data set id
(``org/name``, with ``data.subset`` and ``data.revision``), or an fsspec URL of a directory
(``s3://``, ``gs://``, ``hf://``, ``memory://``, ``file://``); and which files hold each split of
a data set repository's configuration, as its README.md declares them (YAML ``configs:``, the way
Hub data sets do) or, without that, as its folders do (``<subset>/<split>/*.parquet``, the Hub's
parquet conversion).

A Hub id read whole is downloaded into the Hugging Face cache (only the configuration's files);
streamed online it is listed and read shard by shard through ``hf://`` (nothing downloaded
whole); offline both read the cache. A directory downloaded with ``hf download --repo-type
dataset`` reads the same as its id. A loading script is never run.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from asrforge.config import DataConfig
from asrforge.config.yaml_limits import MAX_BYTES, load_front_matter, read_yaml_text
from asrforge.errors import UserError
from asrforge.hub import HubRef, Resolved, hub_ref, offline, resolve

log = logging.getLogger(__name__)

FILE_FORMATS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "tsv",
}
"""File extension -> the ``datasets`` loader that reads it (tsv: ``csv`` with tabs)."""
SPLIT_WORDS = {
    "train": "train",
    "validation": "validation",
    "dev": "validation",
    "valid": "validation",
    "val": "validation",
    "test": "test",
}
"""The word a data file's name starts with -> its split."""
DATA_SUFFIXES = tuple(FILE_FORMATS)
"""The file endings of data files."""
PARQUET_REVISION = "refs/convert/parquet"
"""The Hub's own parquet conversion of a data set, where one with a loading script has its rows."""


class Configs(dict):
    """configuration name -> split -> file patterns; ``default``: the default configuration's
    name (then first), or None."""

    default: str | None = None


@dataclass
class DataFiles:
    """``data.path`` located.

    ``root``: the local directory or file (or the URL) relative audio paths are read from;
    ``splits``: each split's files (local paths or URLs) when a configuration or a listing names
    them, else None (:func:`asrforge.data.sources.split_files` groups the directory's files);
    ``resolved``: the Hub commit, for the run's record; ``where``: what messages call it."""

    root: Path | str
    splits: dict[str, list[str]] | None
    resolved: Resolved
    where: str


def split_of(name: str) -> str | None:
    """The split a file or folder name starts with (``dev_clean.jsonl`` -> ``validation``)."""
    word = re.match(r"[a-z]*", name.lower()).group()
    return SPLIT_WORDS.get(word)


def is_url(path: str | Path) -> bool:
    """Whether ``path`` is an fsspec URL (``protocol://...``) rather than a local path."""
    return re.match(r"^[a-z][a-z0-9+.-]*://", str(path)) is not None


def data_ref(cfg: DataConfig, section: str = "data") -> HubRef | None:
    """The Hub data set ``cfg.path`` names, or None: a local path (also one ``data.generate``
    builds, whatever it looks like) or a URL. ``section``: where ``cfg`` is in the config."""
    if cfg.generate is not None:
        return None
    return hub_ref(cfg.path, "dataset", cfg.revision, section=section)


def locate(
    cfg: DataConfig,
    *,
    section: str = "data",
    stream: bool = False,
    only: str | None = None,
) -> DataFiles:
    """Where ``cfg.path``'s files are (see the module docstring).

    Args:
        stream: the files are read shard by shard: an online Hub id is listed through
            ``hf://``, not downloaded.
        only: the one split that will be read: a Hub id downloads only its files.

    Raises:
        UserError: an id that cannot be resolved (:func:`asrforge.hub.resolve`), a subset or
            split the data set lacks (listing those it has), or a data set with a loading script
            only.
    """
    text = str(cfg.path)
    ref = data_ref(cfg, section)
    if ref is None and not is_url(text):
        return _local(Path(text), cfg.subset, Resolved(Path(text)), text, section)
    if ref is None:
        return _remote(text, cfg.subset, Resolved(Path(text)), text, section)
    card = _card(ref, section)
    where = f"{card.ref}" + (f" (subset {cfg.subset})" if cfg.subset else "")
    if stream and not offline():
        # Listed and read shard by shard at the commit the card resolved to, never downloaded.
        url = f"hf://datasets/{ref.repo_id}@{card.commit}"
        return _remote(url, cfg.subset, card, where, section)
    configs = declared_configs(card.path / "README.md")
    if configs:
        name = choose_config(configs, cfg.subset, where, section)
        wanted = {k: v for k, v in configs[name].items() if only in (None, k)}
        patterns = tuple(p for globs in (wanted or configs[name]).values() for p in globs)
    else:
        patterns = _layout_patterns(cfg.subset, only)
    resolved = resolve(ref.repo_id, field=f"{section}.path", repo_type="dataset",
                       revision=card.ref.revision, patterns=("README.md", "*.py", *patterns))  # fmt: skip
    return _local(resolved.path, cfg.subset, resolved, where, section)


def _card(ref: HubRef, section: str) -> Resolved:
    """The data set's README.md (and loading script, if any) at ``ref``'s revision; for a data
    set with a loading script and no declared configurations, at the Hub's parquet conversion of
    it instead, since the script is never run (the ``datasets`` library reads it there too)."""
    files = ("README.md", "*.py")
    card = resolve(str(ref), field=f"{section}.path", repo_type="dataset", patterns=files)
    scripted = any(card.path.glob("*.py")) and not declared_configs(card.path / "README.md")
    if not scripted or ref.revision is not None:
        return card
    log.info("%s.path: %s has a loading script: reading its parquet conversion (%s)",
             section, ref.repo_id, PARQUET_REVISION)  # fmt: skip
    return resolve(ref.repo_id, field=f"{section}.path", repo_type="dataset",
                   revision=PARQUET_REVISION, patterns=files)  # fmt: skip


def _layout_patterns(subset: str | None, only: str | None) -> tuple[str, ...]:
    """The files of a data set without declared configurations to download: its data files,
    under ``subset/`` (``<subset>/<split>/*.parquet``, the Hub's parquet conversion), and with
    ``only`` those whose name or folder starts with a word of that split."""
    prefix = f"{subset}/" if subset is not None else ""
    if only is None:
        return tuple(f"{prefix}*{suffix}" for suffix in DATA_SUFFIXES)
    words = [w for w, split in SPLIT_WORDS.items() if split == only] or [only]
    return tuple(f"{prefix}{w}*" for w in words) + tuple(f"{prefix}*/{w}*" for w in words)


def _local(path: Path, subset: str | None, resolved: Resolved, where: str, section: str):
    configs = declared_configs(path / "README.md") if path.is_dir() else {}
    if configs:
        name = choose_config(configs, subset, where, section)
        splits = {
            split: sorted(str(f) for p in globs for f in path.glob(p) if _is_data(f.name))
            for split, globs in configs[name].items()
        }
        return DataFiles(path, splits, resolved, where)
    if subset is not None:
        folders = sorted(f.name for f in path.iterdir() if f.is_dir()) if path.is_dir() else []
        if subset not in folders:
            raise UserError(
                f"{section}.subset {subset!r}: not in {where} (it has "
                f"{', '.join(folders) or 'no subsets: leave data.subset out'})"
            )
        path = path / subset
    elif path.is_dir() and any(path.glob("*.py")) and not _has_data_files(path):
        raise UserError(
            f"{section}.path: {where} holds a loading script and no data files; asrforge never "
            f"runs a data set's code: read the Hub's parquet conversion of it "
            f"({section}.revision: {PARQUET_REVISION}, with {section}.subset)"
        )
    return DataFiles(path, None, resolved, where)


def _remote(url: str, subset: str | None, resolved: Resolved, where: str, section: str):
    """A directory (or one file) at an fsspec URL: its README.md's configurations, else its data
    files grouped by split, as a local directory's are."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # the protocol's package is missing, or no protocol
        raise UserError(f"{section}.path: {url}: {e}") from None
    root = root.rstrip("/")
    if fs.isfile(root):
        return DataFiles(url, None, resolved, where)
    configs = Configs()
    if fs.isfile(f"{root}/README.md"):
        readme = fs.unstrip_protocol(f"{root}/README.md")
        with fs.open(f"{root}/README.md", "rb") as f:
            text = f.read(MAX_BYTES + 1)
        if len(text) > MAX_BYTES:
            raise UserError(f"{readme}: larger than {MAX_BYTES // 2**20} MiB")
        configs = parse_configs(text.decode("utf-8", "replace"), readme)
    if configs:
        name = choose_config(configs, subset, where, section)
        splits = {
            split: sorted(
                fs.unstrip_protocol(f) for p in globs for f in fs.glob(f"{root}/{p}") if _is_data(f)
            )  # fmt: skip
            for split, globs in configs[name].items()
        }
        return DataFiles(url, splits, resolved, where)
    if subset is not None:
        root = f"{root}/{subset}"
        if not fs.isdir(root):
            raise UserError(f"{section}.subset {subset!r}: no such folder in {where}")
    splits: dict[str, list[str]] = {}
    for pattern in ("*", "*/*"):
        for f in sorted(fs.glob(f"{root}/{pattern}")):
            name, parent = f.rsplit("/", 1)[-1], f.rsplit("/", 2)[-2]
            split = split_of(name) or split_of(parent)
            if _is_data(name) and split is not None:
                splits.setdefault(split, []).append(fs.unstrip_protocol(f))
        if splits:
            break
    if not splits:
        raise UserError(
            f"{section}.path: {where} holds no data files named by their split (train*, "
            f"validation*, dev*, test*; formats {', '.join(DATA_SUFFIXES)})"
        )
    return DataFiles(fs.unstrip_protocol(root), splits, resolved, where)


def declared_configs(readme: Path) -> Configs:
    """The configurations a data set's README.md declares (see :func:`parse_configs`); {} when
    there is no README.md or it declares none.

    Raises:
        UserError: the README.md is no regular file, larger than a YAML file may be, not UTF-8,
            or its YAML header is beyond asrforge's bounds (:func:`parse_configs`); naming it.
    """
    if not readme.is_file():
        return Configs()
    try:
        text = read_yaml_text(readme)
    except (OSError, ValueError) as e:
        raise UserError(f"{readme}: {e}") from None
    return parse_configs(text, str(readme))


def parse_configs(text: str, where: str) -> Configs:
    """configuration name -> split -> file patterns, from a README's YAML header ``configs:``
    (``data_files`` as a pattern, a list of them, a list of ``{split, path}`` or a mapping of
    split to patterns; a pattern with no split is ``train``, as ``datasets`` reads it). The
    default configuration (``default: true``, else the one named ``default``) comes first.

    Args:
        where: the README's path or URL, as errors name it.

    Raises:
        UserError: the header is not YAML (``datasets`` refuses such a card too), or nested or
            (its aliases expanded) large beyond :mod:`asrforge.config.yaml_limits`' bounds; a
            key given twice is not refused (the later wins, as ``datasets`` reads it).
    """
    try:
        header = load_front_matter(text) or {}
    except ValueError as e:
        raise UserError(f"{where}: YAML header: {e}") from None
    configs = header.get("configs") if isinstance(header, dict) else None
    if not isinstance(configs, list):
        return Configs()
    out: dict[str, dict[str, list[str]]] = {}
    default = None
    for entry in configs:
        if not isinstance(entry, dict) or "config_name" not in entry:
            continue
        name = str(entry["config_name"])
        out[name] = _split_patterns(entry.get("data_files"))
        if entry.get("default") is True or (default is None and name == "default"):
            default = name
    if default is None:
        return Configs(out)
    ordered = Configs({default: out.pop(default), **out})
    ordered.default = default
    return ordered


def _split_patterns(files) -> dict[str, list[str]]:
    as_list = lambda v: [str(x) for x in (v if isinstance(v, list) else [v])]  # noqa: E731
    if isinstance(files, dict):
        return {str(split): as_list(p) for split, p in files.items()}
    if isinstance(files, list) and all(isinstance(x, dict) for x in files):
        out: dict[str, list[str]] = {}
        for x in files:
            out.setdefault(str(x.get("split", "train")), []).extend(as_list(x.get("path", [])))
        return out
    return {"train": as_list(files)} if files else {}


def choose_config(configs: Configs, subset: str | None, where: str, section: str) -> str:
    """The configuration ``subset`` names, or the data set's default one.

    Raises:
        UserError: ``subset`` is not one of them, or none is given and there are several with
            no default; listing them.
    """
    names = list(configs)
    if subset is not None:
        if subset not in configs:
            raise UserError(
                f"{section}.subset {subset!r}: {where.split(' (')[0]} has no such configuration "
                f"(it has {_listing(names)})"
            )
        return subset
    if len(names) == 1 or getattr(configs, "default", None) is not None:
        return names[0]
    # commands that take --data name the subset with --subset, a config with data.subset
    flag = ", or --subset with --data" if section == "data" else ""
    raise UserError(
        f"{section}.subset: {where} has {len(names)} configurations and no default: name one "
        f"({_listing(names)}) with {section}.subset{flag}"
    )


def _listing(names: list[str], most: int = 30) -> str:
    more = f", ... ({len(names) - most} more)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _is_data(name: str) -> bool:
    return name.lower().endswith(DATA_SUFFIXES)


def _has_data_files(path: Path) -> bool:
    return any(_is_data(f.name) for pattern in ("*", "*/*") for f in path.glob(pattern))
