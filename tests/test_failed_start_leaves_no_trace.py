"""A run stopped by bad input (exit code 2) or Ctrl-C (exit code 130) before its first step leaves
its output directory as it found it: no ``train.log``, empty ``checkpoints/``, ``tokenizer/`` or
``eval_carve.json`` behind, and an existing run's files (its log included) as they were. A
``--resume`` into a directory that holds no run is refused before anything is made."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from asrforge.cli import main
from asrforge.train import setup
from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from asrforge.train.run_dir import RunDirBefore
from tests.conftest import tiny_config


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with a file's bytes (None for a directory)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(Path(dirpath, name), root)] = None
        for name in filenames:
            out[os.path.relpath(Path(dirpath, name), root)] = Path(dirpath, name).read_bytes()
    return out


BAD_INPUTS = {
    # found after the carve record was written, by a tokenizer with no kept row to learn from
    "no utterance left": ["data.languages=[de]", "data.eval_carve.size=4", "data.eval_split=held"],
    "no data": ["data.path=/nonexistent/asrforge-data"],
    # found after the tokenizer and the prepared-split cache were written
    "no noise files": ["data.augment.noise.path=/nonexistent/noise"],
}


@pytest.mark.fast
@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_a_failed_start_in_a_new_directory_removes_what_it_made(tmp_path, tones_dir, capsys, bad):
    cfg = tmp_path / "cfg.yaml"
    out = tmp_path / "runs" / "exp" / "run"
    cfg.write_text(tiny_config(out, tones_dir).to_yaml())
    assert main(["train", str(cfg), *BAD_INPUTS[bad]]) == 2
    assert "asrforge: error:" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # the parents it created too


@pytest.mark.fast
def test_a_failed_start_in_an_existing_directory_leaves_it_as_it_was(tmp_path, tones_dir, capsys):
    cfg = tmp_path / "cfg.yaml"
    out = tmp_path / "run"
    cfg.write_text(tiny_config(out, tones_dir).to_yaml())
    out.mkdir()
    (out / "train.log").write_text("an earlier attempt's log\n")
    (out / "notes.txt").write_text("mine\n")
    before = _tree(out)
    assert main(["train", str(cfg), *BAD_INPUTS["no utterance left"]]) == 2
    assert not (out / "eval_carve.json").exists()
    assert "asrforge: error:" in capsys.readouterr().err
    assert _tree(out) == before


def test_a_refused_resume_changes_nothing_in_the_run(tmp_path, tones_dir, capsys):
    cfg = tmp_path / "cfg.yaml"
    out = tmp_path / "run"
    cfg.write_text(
        tiny_config(out, tones_dir, train={"max_steps": 2}, eval={"eval_steps": None}).to_yaml()
    )
    assert main(["train", str(cfg)]) == 0
    before = _tree(out)
    # found once the run has logged its start and read its data: the log is cut back too
    assert main(["train", str(cfg), "--resume", *BAD_INPUTS["no noise files"]]) == 2
    assert "asrforge: error:" in capsys.readouterr().err
    assert _tree(out) == before


@pytest.mark.fast
def test_a_failed_start_leaves_the_run_started_beside_it_under_the_same_new_parent(tmp_path):
    runs = tmp_path / "runs"
    a, b = RunDirBefore.look(runs / "a"), RunDirBefore.look(runs / "b")
    for d in (runs / "a", runs / "b"):
        d.mkdir(parents=True, exist_ok=True)
        (d / "train.log").write_text("started\n")
    a.restore()
    assert not (runs / "a").exists()
    assert (runs / "b" / "train.log").read_text() == "started\n"
    b.restore()
    assert not runs.exists()  # the parent goes with the last run in it


@pytest.mark.fast
@pytest.mark.parametrize("where", ["listdir", "unlink"])
def test_an_undo_that_cannot_remove_an_entry_does_not_raise(tmp_path, monkeypatch, where):
    before = RunDirBefore.look(tmp_path)
    (tmp_path / "eval_carve.json").write_text("{}")
    busy = OSError(errno.EBUSY, "busy")
    if where == "listdir":
        monkeypatch.setattr(os, "listdir", lambda *a: (_ for _ in ()).throw(busy))
    else:
        monkeypatch.setattr(Path, "unlink", lambda *a, **k: (_ for _ in ()).throw(busy))
    before.restore()  # the error that stopped the run stays the one reported


def test_a_resume_refused_after_the_config_was_written_keeps_the_runs_config(tmp_path, tones_dir):
    cfg = tmp_path / "cfg.yaml"
    out = tmp_path / "run"
    cfg.write_text(
        tiny_config(out, tones_dir, train={"max_steps": 2}, eval={"eval_steps": None}).to_yaml()
    )
    assert main(["train", str(cfg)]) == 0
    before = (out / "config.yaml").read_bytes()
    # refused in on_train_begin, after start-up wrote the new config over the run's
    (out / "metrics.jsonl").rename(tmp_path / "elsewhere.jsonl")
    (out / "metrics.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    assert main(["train", str(cfg), "--resume", "train.max_steps=4"]) == 2
    assert (out / "config.yaml").read_bytes() == before


@pytest.mark.fast
def test_a_failed_start_removes_a_metrics_file_of_a_configured_name(tmp_path, tones_dir, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (tmp_path / "elsewhere.jsonl").write_text("not the run's\n")
    (out / "taken.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    cfg = tmp_path / "cfg.yaml"
    # the second logger is refused in on_train_begin, after the first created its file
    callbacks = [
        {"name": "metrics_jsonl", "filename": "custom.jsonl"},
        {"name": "metrics_jsonl", "id": "second", "filename": "taken.jsonl"},
    ]
    cfg.write_text(tiny_config(out, tones_dir, callbacks=callbacks).to_yaml())
    before = _tree(out)
    assert main(["train", str(cfg)]) == 2
    assert "taken.jsonl: a symlink" in capsys.readouterr().err
    assert _tree(out) == before


def _ctrl_c() -> None:
    raise KeyboardInterrupt


def _sigterm() -> None:
    # a scheduler's signal before the loop's handlers: by default it ended the process with
    # train.log and checkpoints/ left (and would end this test session: checked first)
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "SIGTERM not handled in set-up"
    os.kill(os.getpid(), signal.SIGTERM)
    pytest.fail("SIGTERM did not stop the set-up")


@pytest.mark.fast
@pytest.mark.parametrize("stop", [_ctrl_c, _sigterm], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_set_up_removes_what_the_start_made(
    tmp_path, tones_dir, capsys, monkeypatch, stop
):
    cfg = tmp_path / "cfg.yaml"
    out = tmp_path / "runs" / "run"
    cfg.write_text(tiny_config(out, tones_dir).to_yaml())
    made = []

    def interrupted(*args, **kwargs):
        # by now the start made the run directory, its train.log and checkpoints/
        made.extend(sorted(os.listdir(out)))
        stop()

    monkeypatch.setattr(setup, "setup_splits", interrupted)
    default = signal.getsignal(signal.SIGTERM)
    assert main(["train", str(cfg)]) == 130
    err = capsys.readouterr().err
    assert err.endswith("\nasrforge: interrupted\n") and "Traceback" not in err
    assert {"train.log", "checkpoints"} <= set(made)
    assert not (tmp_path / "runs").exists()
    assert signal.getsignal(signal.SIGTERM) is default  # handed back


class SignalAt(Callback):
    """Sends this process a signal at an event, as Ctrl-C right after set-up would."""

    name = "signal_at"

    def __init__(self, event: str, signum: int):
        self.event, self.signum = event, signum

    def on_train_begin(self, state, *, run):
        if self.event == "on_train_begin":
            os.kill(os.getpid(), self.signum)

    def on_step_begin(self, state, *, step):
        if self.event == "on_step_begin":
            os.kill(os.getpid(), self.signum)


@pytest.mark.fast
@pytest.mark.parametrize("event", ["on_train_begin", "on_step_begin"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_after_set_up_before_the_first_step_ends_stops_at_once(
    tmp_path, tones_dir, event, signum
):
    out = tmp_path / "runs" / "run"
    cfg = tiny_config(out, tones_dir, checkpoint={"checkpoint_every": 1})
    default = signal.getsignal(signum)
    # not "finishing this step, saving": nothing was trained or saved, so nothing is lost
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, [SignalAt(event, signum)]).fit()
    assert not (tmp_path / "runs").exists()
    assert signal.getsignal(signum) is default  # handed back


@pytest.mark.fast
@pytest.mark.parametrize("there", ["missing", "empty"])
def test_resume_into_a_directory_holding_no_run_is_refused(tmp_path, tones_dir, capsys, there):
    cfg = tmp_path / "cfg.yaml"
    out = tmp_path / "runs" / "mistyped"
    if there == "empty":
        out.mkdir(parents=True)
    cfg.write_text(tiny_config(out, tones_dir).to_yaml())
    assert main(["train", str(cfg), "--resume"]) == 2
    assert capsys.readouterr().err == (
        f"asrforge: error: --resume: output_dir {out} holds no run to continue (no checkpoints/ "
        "there); check output_dir, or leave out --resume to start a run\n"
    )
    assert (tmp_path / "runs").exists() == (there == "empty")
    assert not out.exists() or not os.listdir(out)
