"""A file asrforge appends to in a run or matrix directory is never written through a symlink
someone left there: the link is refused by name (exit code 2) and its target stays as it was."""

from __future__ import annotations

import os
import stat

import pytest

from asrforge.cli import main
from asrforge.io.append import SymlinkRefused, open_append
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
