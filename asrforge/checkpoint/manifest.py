"""``manifest.json``: the list of a checkpoint directory's files with their sha256 and size.

How it works: docs/training.md, "The manifest (`checkpoint/manifest.py`)".
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from asrforge.errors import CheckpointCorruptError
from asrforge.hub import check_records
from asrforge.io.atomic import atomic_write_text, describe_os_error
from asrforge.io.small_files import MANIFEST_BYTES, read_json

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SEAL_KEY = "seal"
BUNDLE_SEAL_KEY = "bundle_seal"
"""The seal bundles carry (``asrforge.bundle``); a manifest with it alone is a bundle's."""
_RESERVED = ("format_version", "files")
_SEALS = (SEAL_KEY, BUNDLE_SEAL_KEY)
_CHUNK = 4 << 20
_PARALLEL_BYTES = 64 << 20  # below this, threads cost more than they save


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def sha256_files(paths: list[Path]) -> list[str]:
    """:func:`sha256_file` of each path, several files at once (hashlib releases the GIL)."""
    sizes = [p.stat().st_size for p in paths]
    workers = min(len(paths), os.cpu_count() or 1, 4)
    if workers <= 1 or sum(sizes) < _PARALLEL_BYTES:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        # Largest first, so one big file does not start last.
        order = sorted(range(len(paths)), key=lambda i: -sizes[i])
        digests = dict(zip(order, pool.map(sha256_file, [paths[i] for i in order]), strict=True))
    return [digests[i] for i in range(len(paths))]


def manifest_seal(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON, its seals left out."""
    body = {k: v for k, v in manifest.items() if k not in _SEALS}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def check_seal(manifest: dict[str, Any], path: Path) -> None:
    """Raise unless the manifest matches its seal.

    A bundle written before checkpoints were sealed has only ``bundle_seal`` (the digest of
    everything but itself); it is checked the same way.

    Raises:
        CheckpointCorruptError: no seal, or one the manifest does not match.
    """
    altered = (
        f"{path}: does not match its own seal (the manifest was edited or damaged: its step, "
        "metrics or file list cannot be trusted)"
    )
    if SEAL_KEY in manifest:
        if manifest[SEAL_KEY] != manifest_seal(manifest):
            raise CheckpointCorruptError(altered)
    elif BUNDLE_SEAL_KEY in manifest:
        body = {k: v for k, v in manifest.items() if k != BUNDLE_SEAL_KEY}
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        if manifest[BUNDLE_SEAL_KEY] != digest:
            raise CheckpointCorruptError(altered)
    else:
        raise CheckpointCorruptError(
            f"{path}: the manifest is not sealed (written by an asrforge before checkpoint "
            "manifests were sealed, or edited)"
        )


def list_files(directory: Path) -> list[str]:
    """Every regular file under ``directory`` as a sorted POSIX relative path, the manifest
    excluded."""
    directory = Path(directory)
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        for name in filenames:
            rel = Path(dirpath, name).relative_to(directory).as_posix()
            if rel != MANIFEST_NAME:
                out.append(rel)
    return sorted(out)


def write_manifest(
    directory: Path, meta: dict[str, Any], known: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Hash every file of ``directory`` and write ``manifest.json`` (atomically); call it last.

    Args:
        directory: the (usually still temporary) checkpoint directory.
        meta: JSON-able facts stored at the top level of the manifest (``step``, ``metrics``,
            ``config_id``, ``seed``, ...). ``format_version`` and ``files`` are reserved; the
            seals of a manifest it was copied from are dropped (the new one is sealed afresh).
        known: ``{relative path: digest}`` (objects with ``sha256`` and ``size``) of files
            hashed while they were written; those are not read again (a size that differs
            from the file's is re-hashed).

    Returns:
        The manifest as written.
    """
    directory = Path(directory)
    clash = [k for k in _RESERVED if k in meta]
    if clash:
        raise ValueError(f"manifest meta may not set the reserved keys {clash}")
    known = known or {}
    rels = list_files(directory)
    sizes = {rel: (directory / rel).stat().st_size for rel in rels}
    fresh = [rel for rel in rels if rel not in known or known[rel].size != sizes[rel]]
    hashed = dict(zip(fresh, sha256_files([directory / rel for rel in fresh]), strict=True))
    files = {
        rel: {"sha256": hashed[rel] if rel in hashed else known[rel].sha256, "size": sizes[rel]}
        for rel in rels
    }
    meta = {k: v for k, v in meta.items() if k not in _SEALS}
    manifest = {"format_version": FORMAT_VERSION, **meta, "files": files}
    manifest[SEAL_KEY] = manifest_seal(manifest)
    atomic_write_text(directory / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
    return manifest


PRUNED_KEY = "pruned_after_run"
"""Manifest key listing the files ``checkpoint.after_run: best`` deleted from a checkpoint."""


def write_pruned_manifest(directory: Path, manifest: dict[str, Any], removed: list[str]) -> None:
    """Write ``manifest`` without the ``removed`` files into ``directory``, listing them under
    :data:`PRUNED_KEY` and sealed afresh; the kept files' hashes are carried over (they are the
    same inodes, not re-read)."""
    out = {k: v for k, v in manifest.items() if k not in _SEALS}
    out["files"] = {rel: e for rel, e in manifest["files"].items() if rel not in removed}
    out[PRUNED_KEY] = sorted({*out.get(PRUNED_KEY, []), *removed})
    out[SEAL_KEY] = manifest_seal(out)
    atomic_write_text(Path(directory) / MANIFEST_NAME, json.dumps(out, indent=2) + "\n")


def read_manifest(directory: Path) -> dict[str, Any]:
    """Parse ``manifest.json`` and check its seal, without checking the files.

    Raises:
        CheckpointCorruptError: the manifest is missing, not a regular file, too large,
            unparseable, from a newer format, lists a bad entry, does not match its seal, or
            records Hub commits that are none (:func:`asrforge.hub.check_records`).
    """
    path = Path(directory) / MANIFEST_NAME
    try:
        manifest = read_json(path, MANIFEST_BYTES, error=CheckpointCorruptError)
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{directory}: {MANIFEST_NAME} is missing (an incomplete or foreign directory)"
        ) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointCorruptError(f"{path}: not a manifest (no 'files' mapping)")
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise CheckpointCorruptError(f"{path}: format_version missing or not an integer")
    if version > FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{path}: format_version {version} is newer than this asrforge supports "
            f"({FORMAT_VERSION}); upgrade asrforge to read it"
        )
    for rel, entry in manifest["files"].items():
        if problem := entry_problem(rel):
            raise CheckpointCorruptError(
                f"{path}: lists {rel!r}, {problem}; a manifest names files inside its own "
                "directory only"
            )
        if not isinstance(entry, dict):
            raise CheckpointCorruptError(
                f"{path}: the entry of {rel!r} is {type(entry).__name__} {entry!r:.40}, not an "
                "object with its sha256 and size"
            )
    check_seal(manifest, path)
    if "hub_commits" in manifest:
        check_records(manifest["hub_commits"], f"{path}: hub_commits")
    return manifest


def entry_problem(rel: str) -> str | None:
    """Why ``rel`` cannot name a file of a manifest's directory, or None when it can."""
    if rel.startswith("/"):
        return "an absolute path"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "not a plain relative path (an empty, '.' or '..' part)"
    if "\0" in rel:
        return "a name with a NUL character"
    return None


def _listed_size(directory: Path, rel: str) -> int:
    """The size of the manifest entry ``rel``, a regular file under ``directory`` reached
    through real directories only.

    Raises:
        CheckpointCorruptError: the file is missing, cannot be looked at (permissions), is not
            a regular file, or a symlink is on the way to it.
    """
    p = directory
    for part in rel.split("/"):
        p = p / part
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointCorruptError(f"{p}: missing (listed in {MANIFEST_NAME})") from None
        except OSError as e:
            raise CheckpointCorruptError(
                f"{p}: cannot be looked at: {describe_os_error(e)} (listed in {MANIFEST_NAME})"
            ) from None
        if stat.S_ISLNK(st.st_mode):
            raise CheckpointCorruptError(
                f"{p}: a symlink (to {os.readlink(p)}), on the way to {rel!r} listed in "
                f"{MANIFEST_NAME}; a manifest names regular files inside its own directory only"
            )
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorruptError(f"{p}: not a regular file (listed in {MANIFEST_NAME})")
    return st.st_size


def verify(directory: Path, *, check_hashes: bool = True) -> dict[str, Any]:
    """Check that every file the manifest lists is present with its size and sha256.

    Args:
        directory: a checkpoint directory.
        check_hashes: also hash each file (reads everything); False checks sizes only.

    Returns:
        The manifest.

    Raises:
        CheckpointCorruptError: naming the first bad file and what is wrong with it.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    entries = sorted(manifest["files"].items())
    for rel, entry in entries:
        p = directory / rel
        size = _listed_size(directory, rel)
        if size != entry.get("size"):
            raise CheckpointCorruptError(
                f"{p}: size differs: expected {entry.get('size')} bytes, found {size} "
                f"(listed in {MANIFEST_NAME})"
            )
    if check_hashes:
        try:
            digests = sha256_files([directory / rel for rel, _ in entries])
        except OSError as e:
            raise CheckpointCorruptError(f"{directory}: a file cannot be read: {e}") from None
        for (rel, entry), digest in zip(entries, digests, strict=True):
            if digest != entry.get("sha256"):
                raise CheckpointCorruptError(
                    f"{directory / rel}: sha256 {digest[:12]}… does not match the manifest's "
                    f"{str(entry.get('sha256'))[:12]}… (the file was altered or damaged)"
                )
    return manifest
