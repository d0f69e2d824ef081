"""The optimizer state sharded by DCP is read only from the files of its own folder that the
checkpoint's manifest lists: a ``.metadata`` altered (and the manifest resealed, as anyone can)
to name a file elsewhere, an unlisted file, a FIFO or a link, or bytes past a shard's end, is
refused by name in one line; DCP's own refusals (a ``BaseException``) arrive as a
:class:`CheckpointError` too. One process, no torchrun: DCP reads the same files either way."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
from pathlib import Path

import pytest
import torch

from asrforge.checkpoint.manifest import write_manifest
from asrforge.checkpoint.sharded import METADATA_FILE, SafeReader, load_sharded, save_sharded
from asrforge.errors import CheckpointError

pytestmark = [pytest.mark.fast, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def optimizer_state(fill: float = 0.0) -> dict:
    return {
        "state": {"w": torch.full((64,), fill), "v": torch.full((3, 5), fill)},
        "param_groups": [{"lr": fill, "betas": (fill, fill)}],
    }


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A checkpoint whose ``optimizer/`` holds one process's DCP shards, sealed."""
    ckpt = tmp_path / "step-000001"
    (ckpt / "optimizer").mkdir(parents=True)
    saved = optimizer_state()
    saved["state"]["w"] = torch.arange(64.0)
    saved["param_groups"][0]["lr"] = 0.5
    save_sharded(saved, ckpt / "optimizer")
    write_manifest(ckpt, {"step": 1})
    return ckpt


def retarget(ckpt: Path, name_for, *, reseal: bool = True) -> None:
    """Rewrite ``.metadata`` with each value's file name passed through ``name_for``, then
    reseal the manifest (its seal is a sha256 anyone can recompute)."""
    directory = ckpt / "optimizer"
    metadata = SafeReader(directory).read_metadata()
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=name_for(info.relative_path))
        for index, info in metadata.storage_data.items()
    }
    (directory / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    if reseal:
        write_manifest(ckpt, {"step": 1})


def load(ckpt: Path) -> dict:
    state = optimizer_state()
    load_sharded(state, ckpt / "optimizer")
    return state


def test_an_untouched_checkpoint_loads(checkpoint):
    state = load(checkpoint)
    assert torch.equal(state["state"]["w"], torch.arange(64.0))
    assert state["param_groups"][0]["lr"] == 0.5


@pytest.mark.parametrize("where", ["absolute", "dotdot", "subfolder"])
def test_a_shard_named_outside_the_folder_is_refused_unread(checkpoint, tmp_path, where):
    outside = tmp_path / "outside"
    outside.mkdir()
    (checkpoint / "optimizer" / "deeper").mkdir()
    for name in os.listdir(checkpoint / "optimizer"):
        if name.endswith(".distcp"):
            (outside / name).write_bytes((checkpoint / "optimizer" / name).read_bytes())
            (checkpoint / "optimizer" / "deeper" / name).write_bytes(b"")
    names = {
        "absolute": lambda n: str(outside / n),
        "dotdot": lambda n: f"../../outside/{n}",
        "subfolder": lambda n: f"deeper/{n}",
    }
    retarget(checkpoint, names[where])
    before = {p: p.stat().st_atime_ns for p in outside.iterdir()}
    with pytest.raises(CheckpointError, match="not a plain name of a file in its own folder") as e:
        load(checkpoint)
    assert "\n" not in str(e.value) and str(checkpoint / "optimizer") in str(e.value)
    assert {p: p.stat().st_atime_ns for p in outside.iterdir()} == before


def test_a_file_of_the_folder_the_manifest_does_not_list_is_refused(checkpoint):
    directory = checkpoint / "optimizer"
    (shard,) = [n for n in os.listdir(directory) if n.endswith(".distcp")]
    (directory / "__7_0.distcp").write_bytes((directory / shard).read_bytes())
    # only .metadata changes after the seal: the manifest still lists the old shard alone
    retarget(checkpoint, lambda n: "__7_0.distcp", reseal=False)
    write_manifest_without(checkpoint, "optimizer/__7_0.distcp")
    with pytest.raises(CheckpointError, match="__7_0.distcp: not listed in the checkpoint's"):
        load(checkpoint)


def write_manifest_without(ckpt: Path, rel: str) -> None:
    aside = ckpt.parent / "aside"
    (ckpt / rel).rename(aside)
    write_manifest(ckpt, {"step": 1})
    aside.rename(ckpt / rel)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_listed_shard_that_is_not_a_regular_file_is_refused_without_hanging(
    checkpoint, tmp_path, kind
):
    directory = checkpoint / "optimizer"
    (shard,) = [n for n in os.listdir(directory) if n.endswith(".distcp")]
    (directory / shard).rename(tmp_path / shard)
    if kind == "fifo":
        os.mkfifo(directory / shard)
    elif kind == "symlink":
        (directory / shard).symlink_to(tmp_path / shard)
    else:
        (directory / shard).mkdir()
    old = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading the shard hung"))
    signal.alarm(30)
    try:
        with pytest.raises(CheckpointError, match=f"{shard}: not a regular file"):
            load(checkpoint)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_truncated_shard_is_one_line_naming_it(checkpoint):
    directory = checkpoint / "optimizer"
    (shard,) = [n for n in os.listdir(directory) if n.endswith(".distcp")]
    data = (directory / shard).read_bytes()
    (directory / shard).write_bytes(data[: len(data) // 2])
    write_manifest(checkpoint, {"step": 1})  # resealed over the cut file
    with pytest.raises(CheckpointError, match=rf"are not inside {shard} \(\d+ bytes\)") as e:
        load(checkpoint)
    assert "\n" not in str(e.value)


def test_a_shard_whose_bytes_are_not_a_tensor_is_a_checkpoint_error_not_a_base_exception(
    checkpoint,
):
    """DCP raises CheckpointException (a BaseException the CLI's ``except`` never saw): it
    arrives as one CheckpointError line naming the folder and the first process's error."""
    directory = checkpoint / "optimizer"
    (shard,) = [n for n in os.listdir(directory) if n.endswith(".distcp")]
    size = (directory / shard).stat().st_size
    (directory / shard).write_bytes(b"\x80" * size)  # the same length, nothing DCP can read
    write_manifest(checkpoint, {"step": 1})
    with pytest.raises(CheckpointError) as e:
        load(checkpoint)
    message = str(e.value)
    assert message.startswith(f"{directory}: the sharded optimizer state cannot be loaded: ")
    assert "\n" not in message and "CheckpointException" not in message


class _Marker:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_refused_class_in_metadata_is_one_line_through_load(checkpoint, tmp_path):
    marker = tmp_path / "ran"
    (checkpoint / "optimizer" / METADATA_FILE).write_bytes(pickle.dumps(_Marker(str(marker))))
    write_manifest(checkpoint, {"step": 1})
    with pytest.raises(CheckpointError, match="is not part of a DCP checkpoint") as e:
        load(checkpoint)
    assert "\n" not in str(e.value) and not marker.exists()
