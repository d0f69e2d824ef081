"""A file asrforge appends to in a run or matrix directory is never written through a symlink
someone left there, nor into a file with another hard link, and no directory on the way of a write
is a link: the link is refused by name (exit code 2) and its target stays as it was."""

from __future__ import annotations

import os
import stat

import pytest

from asrforge.cli import main
from asrforge.io.append import HardLinkRefused, SymlinkRefused, open_append
from asrforge.io.directories import refuse_links_under
from asrforge.io.locks import exclusive
from asrforge.matrix.claims import Claims
from tests.conftest import tiny_config

STAND_IN = "someone else's file\n"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tones_dir):
    """A finished 2-step run and its config, to resume with 2 more steps."""
    tmp = tmp_path_factory.mktemp("symlinked")
    cfg = tiny_config(tmp / "run", tones_dir, train={"max_steps": 2}, eval={"eval_steps": None})
    (tmp / "cfg.yaml").write_text(cfg.to_yaml())
    assert main(["train", str(tmp / "cfg.yaml")]) == 0
    return tmp


@pytest.mark.parametrize("names", [("train.log", "metrics.jsonl"), ("metrics.jsonl",)])
def test_resume_refuses_a_symlinked_log_and_writes_nothing_through_it(
    trained_run, tmp_path, capsys, names
):
    run = trained_run / "run"
    stand_ins = {}
    for name in names:
        stand_ins[name] = tmp_path / f"stand-in-{name}"
        stand_ins[name].write_text(STAND_IN)
        (run / name).rename(tmp_path / f"moved-{name}")
        (run / name).symlink_to(stand_ins[name])
    capsys.readouterr()
    try:
        assert main(["train", str(trained_run / "cfg.yaml"), "--resume", "train.max_steps=4"]) == 2
    finally:
        for name in names:
            (run / name).unlink()
            (tmp_path / f"moved-{name}").rename(run / name)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    first = names[0]
    assert f"{run / first}: a symlink (to {stand_ins[first]})" in err
    for path in stand_ins.values():
        assert path.read_text() == STAND_IN


@pytest.mark.fast
def test_matrix_files_and_locks_are_not_written_through_symlinks(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text(STAND_IN)
    root = tmp_path / "root"
    claims = Claims(root)
    (root / "events.jsonl").symlink_to(target)
    with pytest.raises(SymlinkRefused, match="events.jsonl: a symlink"):
        claims.event("start", "en-a-s0")
    (tmp_path / "job.log").symlink_to(target)
    with pytest.raises(SymlinkRefused, match="job.log: a symlink"):
        open_append(tmp_path / "job.log")
    (tmp_path / "data.lock").symlink_to(target)
    with (
        pytest.raises(SymlinkRefused, match="data.lock: a symlink"),
        exclusive(tmp_path / "data.lock"),
    ):
        pass
    assert target.read_text() == STAND_IN
    # a plain file is appended to as before
    with open_append(tmp_path / "plain.log") as f:
        f.write("one\n")
    with open_append(tmp_path / "plain.log") as f:
        f.write("two\n")
    assert (tmp_path / "plain.log").read_text() == "one\ntwo\n"


@pytest.mark.fast
def test_appended_files_are_created_with_the_umask_applied(tmp_path):
    old = os.umask(0o002)
    try:
        with open_append(tmp_path / "train.log") as f:
            f.write("one\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "train.log").stat().st_mode) == 0o664  # as open() makes it


def tree_snapshot(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("linked", ["eval", "tensorboard", "checkpoints", "eval/deeper"])
def test_resume_refuses_a_linked_directory_anywhere_in_the_run(
    trained_run, tmp_path, capsys, linked
):
    """A directory of the run replaced by a link to one elsewhere (at the top or further down):
    refused by name before anything is written, and the directory elsewhere is untouched."""
    run = trained_run / "run"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "kept.txt").write_text(STAND_IN)
    place = run / linked
    place.parent.mkdir(parents=True, exist_ok=True)
    moved = tmp_path / "moved"
    if place.exists():
        place.rename(moved)
    place.symlink_to(elsewhere, target_is_directory=True)
    log_before = (run / "train.log").read_bytes()
    capsys.readouterr()
    try:
        assert main(["train", str(trained_run / "cfg.yaml"), "--resume", "train.max_steps=4"]) == 2
    finally:
        place.unlink()
        if moved.exists():
            moved.rename(place)
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{place}: a symlink (to {elsewhere})" in err
    assert tree_snapshot(elsewhere) == {"kept.txt": STAND_IN.encode()}
    assert (run / "train.log").read_bytes() == log_before


def test_a_hard_linked_log_is_never_appended_to(trained_run, tmp_path, capsys):
    run = trained_run / "run"
    other = tmp_path / "someone-elses.log"
    other.write_text(STAND_IN)
    (run / "metrics.jsonl").rename(tmp_path / "moved")
    os.link(other, run / "metrics.jsonl")
    capsys.readouterr()
    try:
        assert main(["train", str(trained_run / "cfg.yaml"), "--resume", "train.max_steps=4"]) == 2
    finally:
        (run / "metrics.jsonl").unlink()
        (tmp_path / "moved").rename(run / "metrics.jsonl")
    err = capsys.readouterr().err
    assert "Traceback" not in err and "metrics.jsonl: has 2 hard links" in err
    assert other.read_text() == STAND_IN


def test_matrix_appends_refuse_hard_links(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text(STAND_IN)
    root = tmp_path / "root"
    claims = Claims(root)
    os.link(target, root / "events.jsonl")
    with pytest.raises(HardLinkRefused, match="events.jsonl: has 2 hard links"):
        claims.event("start", "en-a-s0")
    os.link(target, tmp_path / "job.log")
    with pytest.raises(HardLinkRefused, match="job.log: has 3 hard links"):
        open_append(tmp_path / "job.log")
    assert target.read_text() == STAND_IN


@pytest.mark.parametrize("linked", ["runs", "claims", "logs/matrix", "runs/en-a-s0/eval"])
def test_a_matrix_root_with_a_linked_directory_is_refused_before_any_write(tmp_path, linked):
    from asrforge.matrix.run import Launcher

    root = tmp_path / "root"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / linked).parent.mkdir(parents=True)
    (root / linked).symlink_to(elsewhere, target_is_directory=True)
    plan = type("Plan", (), {"root": root, "search": None})()
    with pytest.raises(SymlinkRefused, match=f"{root / linked}: a symlink"):
        Launcher(plan, executor=None)
    assert not any(elsewhere.iterdir()) and not (root / "claims").exists() or linked == "claims"


def test_links_that_name_a_sibling_stay_allowed(tmp_path):
    """The checkpoints' ``latest`` link names its step directory beside it: allowed."""
    root = tmp_path / "run"
    (root / "checkpoints" / "step-000002").mkdir(parents=True)
    (root / "checkpoints" / "latest").symlink_to("step-000002")
    refuse_links_under(root)
    (root / "checkpoints" / "up").symlink_to("../checkpoints")
    with pytest.raises(SymlinkRefused, match="up: a symlink"):
        refuse_links_under(root)


@pytest.mark.fast
def test_a_linked_directory_is_named_as_a_link_inside_the_root_and_what_it_points_to(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "eval").symlink_to(elsewhere)
    with pytest.raises(SymlinkRefused) as refused:
        refuse_links_under(root)
    named = f"{root / 'eval'}: a symlink (to {elsewhere}) inside {root};"
    assert str(refused.value).startswith(named)
