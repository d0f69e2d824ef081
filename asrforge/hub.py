"""The Hugging Face Hub: a model or data set named by its id (``org/name`` or
``org/name@revision``) resolved to a local directory through ``huggingface_hub``'s cache, with the
commit it resolved to.

An existing local path always wins, and a path written ``./name``, ``../name``, ``/name`` or
``~/name`` is never an id. The cache, offline mode, endpoint and token are ``huggingface_hub``'s
own (``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, ``HF_TOKEN`` or the
user's login), read when an id is resolved; the token is passed on by ``huggingface_hub`` and
never printed or written by asrforge. Only safetensors weights are fetched, and no code from a
repository is ever run. How to use it: docs/data.md, "Data sets and models from the Hub".
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from asrforge.errors import CheckpointCorruptError, CheckpointSaveError, UserError
from asrforge.io.atomic import atomic_directory, describe_os_error, remove_path
from asrforge.io.directories import hidden, real_directory
from asrforge.io.records import TEXT, Kind, optional, record_problems
from asrforge.io.small_files import open_regular, read_bytes

MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.tiktoken", "*.model", "README.md")
"""What a model's snapshot downloads: configs, safetensors weights, tokenizer files, its card."""
CT2_FILES = ("*.json", "*.txt", "model.bin", "README.md")
"""A CTranslate2 model's files (its ``model.bin`` is CTranslate2's own format, not a pickle)."""
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5")
"""Weight files of a repository without safetensors that asrforge refuses to load."""
CONVERT_URL = "https://huggingface.co/spaces/safetensors/convert"

_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[^\s@]+)?$")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REF_BYTES = 256
"""The most a cache's ref file holds: a commit is 40 characters."""
_LISTING_BYTES = 256 * 2**20
"""The most a cache's tree listing of one commit may hold (a file's name, size and id each)."""
_LOCAL_PREFIXES = ("./", "../", "/", "~", ".\\", "..\\")
T = TypeVar("T")


@dataclass(frozen=True)
class HubRef:
    """A repository on the Hub and the revision asked for (None: its default branch)."""

    repo_id: str
    revision: str | None
    repo_type: str = "model"

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"

    @property
    def page(self) -> str:
        """The repository's page, where access to a gated one is requested."""
        kind = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        return f"{endpoint()}/{kind}{self.repo_id}"

    @property
    def download_command(self) -> str:
        kind = "" if self.repo_type == "model" else f" --repo-type {self.repo_type}"
        rev = "" if self.revision is None else f" --revision {self.revision}"
        return f"hf download {self.repo_id}{kind}{rev}"


@dataclass(frozen=True)
class Resolved:
    """Where a model or data set lies on this machine, and the Hub commit it came from (None for a
    local path)."""

    path: Path
    ref: HubRef | None = None
    commit: str | None = None

    def record(self) -> dict:
        """What a run records of it: ``{id, revision, commit}`` (``{path}`` for a local one)."""
        if self.ref is None:
            return {"path": str(self.path)}
        return {"id": self.ref.repo_id, "revision": self.ref.revision, "commit": self.commit}


_RECORD_KINDS = {
    "id": Kind(lambda v: isinstance(v, str) and repo_id_problem(v) is None,
               "a Hub repository id (org/name)"),
    "revision": optional(TEXT),
    "commit": Kind(lambda v: isinstance(v, str) and _COMMIT.fullmatch(v) is not None,
                   "a commit (40 lowercase hex digits)"),
}  # fmt: skip
"""The fields of :meth:`Resolved.record` of a Hub id, as read back."""


def check_records(records: Any, where: str) -> None:
    """Refuse Hub records read back from disk (config field -> :meth:`Resolved.record` of a
    Hub id) unless each names a repository id and a commit: readers pin ids to those commits,
    and ``huggingface_hub`` joins a revision to its cache's paths.

    Args:
        where: the file and the key they were read from, as the error names them.

    Raises:
        CheckpointCorruptError: naming each bad field.
    """
    problems = record_problems(records, {}, where)
    for field, record in () if problems else sorted(records.items()):
        problems += record_problems(record, _RECORD_KINDS, f"{where}.{field}", ("id", "commit"))
    if problems:
        raise CheckpointCorruptError("; ".join(problems))


def hub_ref(value: str | os.PathLike | None, repo_type: str = "model",
            revision: str | None = None, *, section: str | None = None) -> HubRef | None:  # fmt: skip
    """The Hub repository ``value`` names, or None when it is a local path (one that exists, one
    written as a path, or anything that is not ``org/name[@revision]``).

    Args:
        revision: a revision given apart (``data.revision``); ``@revision`` in ``value`` too is
            refused unless the two agree.
        section: the config section whose ``path`` and ``revision`` these are (``data``), as
            that refusal names them.

    Raises:
        UserError: two revisions that disagree, or one with a ``..`` part or a leading ``/``.
    """
    if value is None:
        return None
    text = os.fspath(value)
    if text.startswith(_LOCAL_PREFIXES) or Path(text).exists() or not _ID.match(text):
        return None
    repo_id, _, at = text.partition("@")
    path, apart = (f"{section}.path", f"{section}.revision") if section else ("", "revision")
    if at and revision is not None and at != revision:
        raise UserError(
            f"{path + ': ' if path else ''}{text} names revision {at!r}, and {apart} "
            f"is {revision!r}: give the revision in one place"
        )
    named = at or revision
    # huggingface_hub joins a revision to its cache's paths: a '..' part would lead out of it
    if named is not None and (named.startswith("/") or ".." in named.split("/")):
        raise UserError(
            f"{path + ': ' if path else ''}{text}: revision {named!r} is not a "
            "branch, tag or commit (a '..' part or a leading '/')"
        )
    return HubRef(repo_id, named, repo_type)


def repo_id_problem(text: str) -> str | None:
    """Why ``text`` is not a Hub repository id to upload to (``org/name``, no revision), or
    None when it is one."""
    if _ID.match(text) and "@" not in text:
        return None
    return f"{text!r}: not a Hub repository id (org/name)"


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now, not when ``huggingface_hub``
    was imported."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def hf_home() -> Path:
    """``HF_HOME`` as the environment names it now (default ``~/.cache/huggingface``)."""
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "huggingface"
    )
    return Path(home).expanduser()


def cache_dir() -> Path:
    """``huggingface_hub``'s cache as the environment names it now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return hf_home() / "hub"


class _Pins:
    """What :func:`pinned` keeps: each resolution made, by its request, and the commit each
    repository resolved to first."""

    def __init__(self) -> None:
        self.resolutions: dict[tuple, Resolved] = {}
        self.commits: dict[tuple, str] = {}


_pins: ContextVar[_Pins | None] = ContextVar("asrforge_hub_pins", default=None)


@contextmanager
def pinned() -> Iterator[None]:
    """Within it (in this thread or task), a Hub repository resolves to the commit it first
    resolved to, whatever files are asked for, and a resolution already made is not asked of the
    Hub again: a command, or a run's start-up, reads one commit of each repository (a branch
    that moves meanwhile moves none of its files) and asks the Hub once for each. Outside,
    every call resolves afresh (:func:`_snapshot`)."""
    token = _pins.set(_pins.get() or _Pins())
    try:
        yield
    finally:
        _pins.reset(token)


def resolve(
    value: str | os.PathLike,
    *,
    field: str,
    repo_type: str = "model",
    revision: str | None = None,
    patterns: tuple[str, ...] | None = MODEL_FILES,
) -> Resolved:
    """``value`` as a local directory: itself when it is a local path, else the snapshot of the
    Hub repository it names (downloaded into the cache unless offline), only the files
    ``patterns`` match.

    Args:
        field: the config field or option that names ``value``, as messages name it.
        revision: see :func:`hub_ref`.

    Raises:
        UserError: the id is not in the cache while offline (naming the ``hf download`` command),
            the repository is gated or private and no token is set (naming ``HF_TOKEN`` and its
            page), it or the revision does not exist.
    """
    ref = hub_ref(value, repo_type, revision)
    if ref is None:
        return Resolved(Path(value))
    where = (offline(), cache_dir(), endpoint())
    request = (ref, None if patterns is None else tuple(patterns), *where)
    pins = _pins.get()
    if pins is not None and request in pins.resolutions:
        return pins.resolutions[request]
    commit = None if pins is None else pins.commits.get((ref, *where))
    path = _snapshot(ref, field, patterns, *where, commit=commit)
    resolved = Resolved(path, ref, path.name)
    if pins is not None:
        pins.resolutions[request] = resolved
        pins.commits.setdefault((ref, *where), path.name)
    return resolved


def _repo_folder(ref: HubRef) -> str:
    """The repository's folder name, as ``huggingface_hub``'s cache names it."""
    return f"{ref.repo_type}s--{ref.repo_id.replace('/', '--')}"


def _snapshot(ref: HubRef, field: str, patterns, is_offline: bool, cache: Path, url: str, *,
              commit: str | None = None) -> Path:  # fmt: skip
    """The snapshot ``snapshot_download`` gives, resolved afresh on every call (offline a read of
    the ref; online one request when the files are cached), so a process never holds on to a
    commit a branch has left; at ``commit`` when given (:func:`pinned`)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    revision = ref.revision if commit is None else commit
    _check_cached_ref(ref, field, cache / _repo_folder(ref), revision)
    try:
        return Path(
            snapshot_download(
                ref.repo_id,
                repo_type=ref.repo_type,
                revision=revision,
                cache_dir=cache,
                local_files_only=is_offline,
                allow_patterns=list(patterns) if patterns is not None else None,
                endpoint=url,
            )
        )
    except RevisionNotFoundError:
        raise UserError(
            f"{field}: {ref}: revision {ref.revision!r} does not exist in {ref.page}"
        ) from None
    except GatedRepoError:
        raise UserError(
            f"{field}: {ref} is gated: accept its terms at {ref.page} and set HF_TOKEN "
            "(or run `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"{field}: {ref}: no such local path (from {Path.cwd()}), nor a repository at "
            f"{ref.page} (or it is "
            "private: if it is yours, set HF_TOKEN or run `hf auth login`)"
        ) from None
    except IncompleteSnapshotError:
        raise UserError(
            f"{field}: {ref}: its snapshot in the Hugging Face cache {cache} is incomplete (a "
            f"download was interrupted): download it again with `{ref.download_command}`"
        ) from None
    except (LocalEntryNotFoundError, FileNotFoundError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = (
            "HF_HUB_OFFLINE is set" if is_offline else f"the Hub could not be reached ({reason})"
        )
        what = "revision" if ref.revision else "snapshot"
        raise UserError(
            f"{field}: {ref}: no such local path (from {Path.cwd()}), and no {what} of it in the "
            "Hugging Face cache "
            f"{cache}, and {where}: download it first with `{ref.download_command}`"
        ) from None
    except HfHubHTTPError as e:
        raise UserError(f"{field}: {ref}: the Hub answered {e}".splitlines()[0]) from None


def _check_cached_ref(ref: HubRef, field: str, repo: Path, revision: str | None) -> None:
    """Refuse what ``huggingface_hub`` reads of the cache folder ``repo`` to find a snapshot,
    before it reads it whole and unchecked: the ref file of a branch or tag, a regular file
    holding a commit, and that commit's tree listing, a regular file of a bounded size (a FIFO
    would hang the read, a device or a sparse file exhaust memory).

    Raises:
        UserError: naming the file and what is wrong with it.
    """
    from huggingface_hub.constants import DEFAULT_REVISION

    commit = revision or DEFAULT_REVISION
    if not _COMMIT.fullmatch(commit):
        path = repo / "refs" / commit
        text = _small_cache_file(ref, field, path, _REF_BYTES)
        if text is None:
            return  # not cached: huggingface_hub says so
        commit = text.decode("utf-8", "replace")
        if not _COMMIT.fullmatch(commit):
            raise UserError(
                f"{field}: {ref}: {path} in the Hugging Face cache holds {commit[:60]!r}, not a "
                f"commit (40 hex digits): download it again with `{ref.download_command}`"
            )
    _small_cache_file(ref, field, repo / "trees" / f"{commit}.json", _LISTING_BYTES, read=False)


def _small_cache_file(ref: HubRef, field: str, path: Path, limit: int, *,
                      read: bool = True) -> bytes | None:  # fmt: skip
    """The bytes of the cache file ``path`` (b"" unless ``read``), None when there is none.

    Raises:
        UserError: it is no regular file of at most ``limit`` bytes, or cannot be read.
    """
    try:
        if read:
            return read_bytes(path, limit)
        fd = open_regular(path)
        size = os.fstat(fd).st_size
        os.close(fd)
        if size > limit:
            raise ValueError(f"larger than {limit} bytes ({size} bytes)")
        return b""
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise UserError(
            f"{field}: {ref}: {path} in the Hugging Face cache is {e}: download it again with "
            f"`{ref.download_command}`"
        ) from None
    except OSError as e:
        raise UserError(
            f"{field}: {ref}: {path} in the Hugging Face cache cannot be read "
            f"({describe_os_error(e)})"
        ) from None


def resolve_model(value: str | os.PathLike, *, field: str = "model.pretrained") -> Resolved:
    """A transformers Whisper model by local path or Hub id (:func:`resolve`); a Hub snapshot
    must hold safetensors weights.

    Raises:
        UserError: as :func:`resolve`, or the repository has only pickle weights (naming the
            safetensors conversion).
    """
    resolved = resolve(value, field=field)
    if resolved.ref is not None:
        check_safetensors(resolved, field)
    return resolved


def model_dir_problem(value: str | os.PathLike, path: Path) -> str | None:
    """Why ``path``, where ``value`` resolved, is not a transformers model directory (``value``
    as given, then what is wrong), or None when it is one."""
    if not path.exists():
        return f"{os.fspath(value)}: no such model directory"
    if not path.is_dir():
        return f"{os.fspath(value)}: is a file, not a model directory"
    if not (path / "config.json").is_file():
        return f"{os.fspath(value)}: has no config.json (not a transformers model directory)"
    return None


def check_safetensors(resolved: Resolved, field: str) -> None:
    """Refuse a Hub snapshot with no safetensors weights (its pickle weights are never read)."""
    if any(resolved.path.glob("*.safetensors")):
        return
    pickles = [name for name in PICKLE_WEIGHTS if (resolved.path / name).exists()]
    if not pickles:
        raise UserError(
            f"{field}: {resolved.ref} (commit {resolved.commit}) has no weights (no "
            "*.safetensors file): name a revision that has them (org/name@revision)"
        )
    raise UserError(
        f"{field}: {resolved.ref} (commit {resolved.commit}) has only {', '.join(pickles)}, no "
        f"*.safetensors weights; asrforge never loads pickle weights: convert them with "
        f"{CONVERT_URL} and name the revision it opens (org/name@refs/pr/N)"
    )


Listing = Callable[[Path], Mapping[str, int]]
"""The size in bytes of each file a snapshot may hold, by its path inside the snapshot, as the
snapshot's own listing says (a bundle's manifest, the manifest itself included); read from the
snapshot before anything is copied, so what it raises (a bundle of a format that is not loaded)
refuses the snapshot with nothing copied."""


def verified_copy(
    resolved: Resolved, listed: Listing, verify: Callable[[Path], T]
) -> tuple[Path, T]:
    """:func:`materialize` of ``resolved`` and what ``verify`` returns for the copy. A copy that
    ``verify`` refuses is deleted, so nothing refused stays on disk; one made before this call
    is made again once from the cache, which may have been repaired (downloaded again) since, or
    the copy itself damaged; a copy made in this call is not, since copying the same snapshot
    again gives the same files.

    Raises:
        CheckpointCorruptError: :func:`materialize` or ``verify`` refused a fresh copy: the
            message names the snapshot's files rather than the copy's, and how to download the
            commit again should the cache be what is damaged.
    """
    if resolved.ref is None:
        return resolved.path, verify(resolved.path)
    made_before = _copy_folder(resolved).is_dir()
    try:
        return _verified(resolved, listed, verify)
    except CheckpointCorruptError:
        if not made_before:
            raise
    return _verified(resolved, listed, verify)


def _verified(resolved: Resolved, listed: Listing, verify: Callable[[Path], T]) -> tuple[Path, T]:
    """:func:`materialize` and ``verify`` once; a copy ``verify`` refuses is deleted.

    Raises:
        CheckpointCorruptError: naming the snapshot's files (:func:`_named_in_snapshot`).
        UserError: what else ``verify`` raises.
    """
    try:
        path = materialize(resolved, listed)
    except CheckpointCorruptError as e:
        raise _named_in_snapshot(e, _copy_folder(resolved), resolved) from None
    try:
        return path, verify(path)
    except UserError as e:
        # nothing refused stays on disk, so a later run copies the snapshot again: what can be
        # refused from the listing alone (a bundle's format) is refused by it, before any copy
        remove_path(path)
        if isinstance(e, CheckpointCorruptError):
            raise _named_in_snapshot(e, path, resolved) from None
        raise


def _named_in_snapshot(
    error: CheckpointCorruptError, copy: Path, resolved: Resolved
) -> CheckpointCorruptError:
    """``error`` about the copy ``copy`` said of the cache's snapshot it was made from."""
    said = str(error).replace(str(copy), str(resolved.path))
    pinned_ref = HubRef(resolved.ref.repo_id, resolved.commit, resolved.ref.repo_type)
    return CheckpointCorruptError(
        f"{said} (in the Hugging Face cache's snapshot of {resolved.ref}; if the cache rather "
        f"than the repository is damaged: {pinned_ref.download_command} --force-download)"
    )


def _copy_folder(resolved: Resolved) -> Path:
    """Where :func:`materialize` copies a Hub snapshot: ``HF_HOME/asrforge/<repo>/<commit>``."""
    return hf_home() / "asrforge" / _repo_folder(resolved.ref) / str(resolved.commit)


def materialize(resolved: Resolved, listed: Listing) -> Path:
    """A Hub snapshot's files copied as regular files into
    ``HF_HOME/asrforge/<repo>/<commit>`` (once; the cache keeps them as symlinks into its blobs,
    and a bundle's manifest names regular files only; hidden files, such as the Hub's
    ``.gitattributes``, are left out, :func:`~asrforge.io.directories.hidden`). Every entry is
    checked against ``listed`` before any byte is copied, and no more bytes are copied than it
    lists, so a snapshot cannot fill the disk beyond what its listing declares. A local path is
    returned as it is.

    Raises:
        SymlinkRefused: a directory on the way to the copy (``asrforge/``, the repository's or
            the commit's) is a link.
        CheckpointCorruptError: a snapshot entry is no regular file of the repository's own
            cache folder (:func:`_open_cached`), is not listed, or differs in size from its
            listed size; nothing is copied, and no copy is left.
        CheckpointSaveError: the listed files do not fit in the free space of ``HF_HOME``.
    """
    if resolved.ref is None:
        return resolved.path
    home = hf_home()
    target = _copy_folder(resolved)
    try:
        # HF_HOME is the person's choice and may be a link; what asrforge makes in it may not
        home.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(target):
            return real_directory(target, under=home)
        real_directory(target.parent, under=home)
    except OSError as e:
        raise CheckpointSaveError(f"could not write {target}: {describe_os_error(e)}") from e
    repo = resolved.path.parents[1]  # <cache>/<repo>/snapshots/<commit>
    for folder in (repo, repo / "snapshots", resolved.path):
        if folder.is_symlink():
            raise CheckpointCorruptError(
                f"{folder}: a symlink (to {os.readlink(folder)}) in the Hugging Face cache, "
                "which huggingface_hub never makes: download the repository again"
            )
    inside = (Path(os.path.realpath(repo)) / "blobs", Path(os.path.realpath(resolved.path)))
    folders, files = _snapshot_entries(resolved.path, inside)
    sizes = listed(resolved.path)
    for rel, src in files.items():
        _check_listed(src, rel, sizes, inside)
    needed = sum(sizes[rel] for rel in files)
    free = shutil.disk_usage(target.parent).free
    if needed > free:
        raise CheckpointSaveError(
            f"could not write {target}: the snapshot's files need {needed} bytes, "
            f"{target.parent} has {free} free"
        )
    with atomic_directory(target) as partial:
        for rel in folders:
            (partial / rel).mkdir(parents=True, exist_ok=True)
        for rel, src in files.items():
            _copy_exactly(_open_cached(src, inside), partial / rel, sizes[rel], src)
    return target


def _snapshot_entries(
    snapshot: Path, inside: tuple[Path, ...]
) -> tuple[list[str], dict[str, Path]]:
    """The snapshot's real subdirectories and its other entries (path inside it -> entry), hidden
    ones left out, each entry checked to lie in ``inside`` (nothing is opened yet).

    Raises:
        CheckpointCorruptError: an entry resolves outside ``inside``.
    """
    folders, files = [], {}
    for src in sorted(snapshot.rglob("*")):
        rel = src.relative_to(snapshot)
        if hidden(rel):
            continue
        if src.is_dir() and not src.is_symlink():
            folders.append(rel.as_posix())
            continue
        _cached_path(src, inside)
        files[rel.as_posix()] = src
    return folders, files


def _check_listed(src: Path, rel: str, sizes: Mapping[str, int], inside: tuple[Path, ...]) -> None:
    """Refuse the snapshot entry ``src`` (``rel`` inside it) unless the listing names it and the
    regular file it resolves to has the listed size.

    Raises:
        CheckpointCorruptError: naming ``src`` and what is wrong.
    """
    if rel not in sizes:
        raise CheckpointCorruptError(
            f"{src}: not listed in the snapshot's manifest (a file was added to the "
            "repository); asrforge copies only the files it lists"
        )
    fd = _open_cached(src, inside)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    _check_size(src, size, sizes[rel])


def _check_size(src: Path, size: int, listed: int) -> None:
    if size != listed:
        raise CheckpointCorruptError(
            f"{src}: size differs: expected {listed} bytes, found {size} (listed in the "
            "snapshot's manifest)"
        )


def _copy_exactly(fd: int, dest: Path, size: int, src: Path) -> None:
    """Copy the ``size`` bytes the open regular file ``fd`` (of the snapshot entry ``src``)
    holds into the new file ``dest``, closing ``fd``.

    Raises:
        CheckpointCorruptError: the file holds more or fewer bytes (it changed since it was
            checked).
    """
    with os.fdopen(fd, "rb") as f, open(dest, "xb") as out:
        _check_size(src, os.fstat(f.fileno()).st_size, size)
        left = size
        while left and (chunk := f.read(min(left, 16 * 2**20))):
            out.write(chunk)
            left -= len(chunk)
        if left or f.read(1):
            raise CheckpointCorruptError(
                f"{src}: changed while it was copied (expected {size} bytes)"
            )


def _cached_path(src: Path, inside: tuple[Path, ...]) -> Path:
    """The real path of the snapshot entry ``src``, which must lie in one of ``inside``.

    Raises:
        CheckpointCorruptError: ``src`` resolves elsewhere, naming it and what it points at.
    """
    real = Path(os.path.realpath(src))
    if not any(real.is_relative_to(folder) for folder in inside):
        raise CheckpointCorruptError(
            f"{_what(src, real)} outside the Hugging Face cache's folder of its repository; "
            "asrforge copies only the cache's own files"
        )
    return real


def _what(src: Path, real: Path) -> str:
    return f"{src}: points to {real}, which is" if src.is_symlink() else f"{src}: is"


def _open_cached(src: Path, inside: tuple[Path, ...]) -> int:
    """A read descriptor of the regular file the snapshot entry ``src`` resolves to, which must
    lie in one of ``inside`` (the repository's ``blobs/`` and the snapshot itself).

    Raises:
        CheckpointCorruptError: ``src`` resolves elsewhere or to no regular file (a device, a
            FIFO, a directory), or cannot be opened; naming it and what it points at.
    """
    real = _cached_path(src, inside)
    try:
        # follow=False: a link put at the resolved path since is not followed out of the cache
        return open_regular(real, follow=False)
    except ValueError as e:
        raise CheckpointCorruptError(
            f"{_what(src, real)} {e}; asrforge copies only the cache's own files"
        ) from None
    except OSError as e:
        raise CheckpointCorruptError(
            f"{src}: {real} in the Hugging Face cache cannot be read ({describe_os_error(e)})"
        ) from None


def model_dir_if_any(value: str | os.PathLike | None) -> Path | None:
    """``value``'s model directory (:func:`resolve_model`), or None when there is none to read:
    no model named, or one that cannot be resolved (readers that can do without it, such as
    export rebuilding the shape a checkpoint records, say so themselves)."""
    if value is None:
        return None
    try:
        return resolve_model(value).path
    except UserError:
        return None


def cached_model_dir(
    value: str | os.PathLike, patterns: tuple[str, ...] = ("config.json",)
) -> Path | None:
    """``value``'s model directory when it can be read without the network: a local path as it
    is, a Hub id's snapshot only when the cache holds it (the files ``patterns`` match, as far
    as ``huggingface_hub`` can tell); None when the cache does not. Readers that can do without
    the model (the LoRA targets a plan checks, the license a card copies) skip rather than
    download."""
    ref = hub_ref(value)
    if ref is None:
        return Path(value)
    try:
        return _snapshot(ref, "model.pretrained", patterns, True, cache_dir(), endpoint())
    except UserError:
        return None
