"""A manifest vouches only for its own directory's files: an entry is a plain relative path to
a regular file inside it. ``..``, an absolute path or a symlink on the way is refused by name,
in a checkpoint and in a bundle, even when the manifest's hashes and seal were redone to match."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from asrforge.bundle.export import export_bundle
from asrforge.bundle.load import load_bundle, verify_bundle
from asrforge.checkpoint.manifest import (
    BUNDLE_SEAL_KEY,
    MANIFEST_NAME,
    SEAL_KEY,
    manifest_seal,
    verify,
    write_manifest,
)
from asrforge.errors import CheckpointCorruptError
from tests.test_bundle import train_tiny_run


def _list_and_reseal(directory: Path, rel: str, target: Path) -> None:
    """What someone handing over the directory would do: list ``rel`` with the sha256 and size
    of ``target`` (the file it reaches) and seal the manifest again."""
    path = directory / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    data = target.read_bytes()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    bundle = BUNDLE_SEAL_KEY in manifest
    manifest = {k: v for k, v in manifest.items() if k not in (SEAL_KEY, BUNDLE_SEAL_KEY)}
    manifest[SEAL_KEY] = manifest_seal(manifest)
    if bundle:
        manifest[BUNDLE_SEAL_KEY] = hashlib.sha256(
            json.dumps(manifest, sort_keys=True).encode()
        ).hexdigest()
    path.write_text(json.dumps(manifest, indent=2))


@pytest.fixture
def outside(tmp_path) -> Path:
    path = tmp_path / "outside.txt"
    path.write_text("not the checkpoint's\n")
    return path


def _checkpoint(tmp_path) -> Path:
    ckpt = tmp_path / "run" / "checkpoints" / "step-000001"
    (ckpt / "tokenizer").mkdir(parents=True)
    (ckpt / "train_state.json").write_text("{}")
    (ckpt / "tokenizer" / "vocab.json").write_text("{}")
    write_manifest(ckpt, {"step": 1})
    return ckpt


@pytest.mark.fast
@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("../../../outside.txt", "not a plain relative path"),
        ("tokenizer/../../../../outside.txt", "not a plain relative path"),
        ("ABSOLUTE", "an absolute path"),
        ("tokenizer/vocab\0.json", "a name with a NUL character"),
    ],
)
def test_a_checkpoint_manifest_entry_outside_its_directory_is_refused(
    tmp_path, outside, entry, why
):
    ckpt = _checkpoint(tmp_path)
    entry = str(outside) if entry == "ABSOLUTE" else entry
    _list_and_reseal(ckpt, entry, outside)
    with pytest.raises(CheckpointCorruptError, match=f"lists {re.escape(repr(entry))}, {why}"):
        verify(ckpt)


@pytest.mark.fast
@pytest.mark.parametrize("link", ["evil.txt", "tokenizer"])
def test_a_listed_symlink_is_refused_even_to_a_file_inside(tmp_path, outside, link):
    ckpt = _checkpoint(tmp_path)
    if link == "tokenizer":  # a symlinked directory on the way to a listed file
        elsewhere = tmp_path / "elsewhere"
        shutil.move(ckpt / "tokenizer", elsewhere)
        (ckpt / "tokenizer").symlink_to(elsewhere)
        with pytest.raises(CheckpointCorruptError, match="tokenizer: a symlink .* on the way"):
            verify(ckpt)
    else:
        (ckpt / link).symlink_to(outside)
        _list_and_reseal(ckpt, link, outside)
        with pytest.raises(CheckpointCorruptError, match="evil.txt: a symlink"):
            verify(ckpt)


@pytest.mark.fast
def test_a_listed_file_that_cannot_be_looked_at_is_a_corrupt_checkpoint(tmp_path, monkeypatch):
    ckpt = _checkpoint(tmp_path)
    real = os.lstat

    def lstat(path, *a, **k):
        if Path(path).name == "tokenizer":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "lstat", lstat)
    with pytest.raises(CheckpointCorruptError, match="tokenizer: cannot be looked at: Permission"):
        verify(ckpt)


@pytest.mark.fast
@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("fifo", "a FIFO, not a regular file"),
        ("zero", "a character device, not a regular file"),
        ("deep", "nested deeper than"),
    ],
)
def test_a_manifest_that_is_no_small_json_file_is_refused_unread(tmp_path, how, why):
    ckpt = _checkpoint(tmp_path)
    path = ckpt / MANIFEST_NAME
    path.unlink()
    if how == "fifo":  # would wait for a writer forever
        os.mkfifo(path)
    elif how == "zero":  # would be read until memory runs out
        path.symlink_to("/dev/zero")
    else:
        path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointCorruptError, match=f"{re.escape(str(path))}: .*{why}"):
        verify(ckpt)


@pytest.mark.fast
def test_a_manifest_entry_that_is_not_an_object_is_refused(tmp_path):
    ckpt = _checkpoint(tmp_path)
    path = ckpt / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["files"]["train_state.json"] = 5
    manifest[SEAL_KEY] = manifest_seal(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match="'train_state.json' is int 5, not an object"):
        verify(ckpt)


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory, tones_dir) -> Path:
    run = train_tiny_run(tmp_path_factory.mktemp("bundle-run"), tones_dir)
    return export_bundle(run, tmp_path_factory.mktemp("bundles") / "tiny")


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_a_bundle_manifest_that_points_outside_is_refused(bundle_dir, tmp_path, outside, how):
    bundle = tmp_path / "copy"
    shutil.copytree(bundle_dir, bundle)
    verify_bundle(bundle)  # the copy is sound before it is tampered with
    if how == "symlink":
        entry = "notes.txt"
        (bundle / entry).symlink_to(outside)
    else:
        entry = "../outside.txt" if how == "dotdot" else str(outside)
    _list_and_reseal(bundle, entry, outside)
    with pytest.raises(
        CheckpointCorruptError,
        match="notes.txt: a symlink" if how == "symlink" else f"lists '{entry}'",
    ):
        load_bundle(bundle)


@pytest.fixture(scope="module")
def random_bundle(tmp_path_factory) -> Path:
    """A random 1-layer bundle, exported in a moment."""
    from tests.test_data_hardening import save_random_whisper

    root = tmp_path_factory.mktemp("random")
    save_random_whisper(root / "hf")
    return export_bundle(root / "hf", root / "bundle")


@pytest.mark.fast
def test_hidden_files_that_tools_leave_in_a_bundle_are_no_part_of_it(random_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(random_bundle, bundle)
    (bundle / ".DS_Store").write_bytes(b"\0Bud1")  # Finder
    (bundle / "._model.safetensors").write_bytes(b"\0\5\26\7")  # AppleDouble, on a FAT stick
    (bundle / ".git" / "objects").mkdir(parents=True)
    (bundle / ".git" / "objects" / "x.pkl").write_bytes(b"\x80\x04")  # never read
    assert load_bundle(bundle).path == bundle
    # a file that is not hidden is still one nobody vouched for
    (bundle / "notes.txt").write_text("added")
    unlisted = re.escape(f"{bundle / 'notes.txt'}: not list")
    with pytest.raises(CheckpointCorruptError, match=unlisted):
        verify_bundle(bundle)
