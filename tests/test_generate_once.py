"""Runs started together that each find the tones data set missing build it once: the others
wait for the builder's lock and read what it wrote, which is never deleted under them."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from asrforge.data.sources import load_arrow
from asrforge.data.synth import make_tones_dataset, tone_splits
from asrforge.io.locks import exclusive

SIZES = {"train": 6, "validation": 3}


def test_a_run_waits_for_the_builder_and_reuses_its_data_set(tmp_path):
    path = tmp_path / "generated" / "tones"
    path.parent.mkdir()
    built = threading.Event()
    second = threading.Thread(
        target=lambda: (make_tones_dataset(path, sizes=SIZES), built.set()), daemon=True
    )
    with exclusive(path.with_name("tones.lock")):  # another run is building it
        second.start()
        assert not built.wait(2.0), "generation did not wait for the run building the data set"
        tone_splits(seed=7, sizes=SIZES).save_to_disk(str(path))
        first_ids = load_arrow(path)["train"]["text"]
        marker = path / "being-read"
        marker.write_text("a reader's file")
    second.join(30)
    assert built.is_set()
    # the second run read the first one's data set: neither replaced nor removed
    assert marker.read_text() == "a reader's file"
    assert load_arrow(path)["train"]["text"] == first_ids
    assert sorted(p.name for p in path.parent.iterdir()) == ["tones", "tones.lock"]


def _build(path):
    make_tones_dataset(path, sizes=SIZES)


@pytest.mark.fast
def test_two_processes_generating_at_once_both_succeed_with_one_data_set(tmp_path):
    path = tmp_path / "generated" / "tones"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_build, args=(path,)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(load_arrow(path)["train"]) == SIZES["train"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["tones", "tones.lock"]


@pytest.mark.fast
def test_a_killed_builders_temporary_is_removed_and_the_new_data_set_is_made_durable(
    tmp_path, monkeypatch
):
    path = tmp_path / "generated" / "tones"
    path.parent.mkdir()
    dead = path.parent / ".tmp-tones-4242-0123abcd"  # a builder killed mid-write left it
    dead.mkdir()
    (dead / "half.arrow").write_bytes(b"half")
    other = path.parent / ".tmp-tonesx-4242-0123abcd"  # another directory's: not ours to remove
    other.mkdir()
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    make_tones_dataset(path, sizes=SIZES)
    assert sorted(p.name for p in path.parent.iterdir()) == [other.name, "tones", "tones.lock"]
    assert len(load_arrow(path)["train"]) == SIZES["train"]
    assert synced  # its files and directories are flushed before it is renamed into place
