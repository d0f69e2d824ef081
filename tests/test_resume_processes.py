"""A resume on another number of processes keeps the checkpoint's global batch (micro-batches a
step on all processes together) by setting ``train.grad_accum``, says so, and refuses where no
``grad_accum`` keeps it unless ``train.keep_global_batch`` is off."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from asrforge.checkpoint.resume import continue_epoch, keep_global_batch
from asrforge.errors import UserError
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config

log = logging.getLogger("test")


def checkpoint(processes, micro, batch_in_epoch=3):
    return SimpleNamespace(
        path=Path("/runs/x/checkpoints/step-000010"),
        manifest={"processes": processes, "micro_batches_per_step": micro},
        train_state={"batch_in_epoch": batch_in_epoch},
        config_yaml="",
    )


def resume_on(cfg, ckpt, processes: int) -> None:
    """What a resume's set-up does with the checkpoint's global batch and data position."""
    keep_global_batch(cfg, ckpt, processes, log)
    continue_epoch(cfg, ckpt, processes, log)


@pytest.mark.fast
@pytest.mark.parametrize(
    ("recorded", "micro", "now", "accum", "position"),
    [(2, 2, 1, 2, 6), (4, 4, 2, 2, 6), (1, 6, 3, 2, 1), (3, 6, 2, 3, 4)],
)
def test_another_number_of_processes_keeps_the_global_batch(
    tmp_path, tones_dir, caplog, recorded, micro, now, accum, position
):
    cfg = tiny_config(tmp_path, tones_dir)  # grad_accum 1, batch_size 8
    ckpt = checkpoint(recorded, micro)
    with caplog.at_level(logging.WARNING, logger="test"):
        resume_on(cfg, ckpt, now)
    assert cfg.train.grad_accum == accum and accum * now == micro
    assert f"keeps its global batch of {micro * 8} utterance(s)" in caplog.text
    # the epoch's micro-batches all processes took, shared out anew
    assert ckpt.train_state["batch_in_epoch"] == position


@pytest.mark.fast
def test_a_global_batch_no_grad_accum_keeps_is_refused_unless_allowed(tmp_path, tones_dir, caplog):
    cfg = tiny_config(tmp_path, tones_dir)
    with pytest.raises(UserError) as e:
        keep_global_batch(cfg, checkpoint(2, 2), 3, log)
    assert "2 micro-batch(es) a step on 2 process(es) (16 utterance(s)" in str(e.value)
    assert "2 does not divide by 3" in str(e.value) and "keep_global_batch: false" in str(e.value)
    allowed = tiny_config(tmp_path, tones_dir, train={"keep_global_batch": False})
    ckpt = checkpoint(2, 2, batch_in_epoch=4)
    with caplog.at_level(logging.WARNING, logger="test"):
        resume_on(allowed, ckpt, 3)
    assert allowed.train.grad_accum == 1
    assert "global batch changes from 16 to 24 utterance(s)" in caplog.text
    assert ckpt.train_state["batch_in_epoch"] == 2 and "2 are taken again" in caplog.text


@pytest.mark.fast
def test_a_record_of_the_wrong_type_is_refused_by_name(tmp_path, tones_dir):
    cfg = tiny_config(tmp_path, tones_dir)
    with pytest.raises(UserError, match="processes must be a positive integer, got '2'"):
        keep_global_batch(cfg, checkpoint("2", 2), 1, log)


def test_a_resumed_run_takes_the_recorded_micro_batches_a_step(tmp_path, tones_dir):
    sections = {"data": {"batch_size": 4}, "eval": {"eval_steps": 10}}
    first = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 2, "grad_accum": 2},
                        **sections)  # fmt: skip
    Trainer(first, []).fit()
    root = tmp_path / "run" / "checkpoints"
    manifest = json.loads((root / "step-000002" / "manifest.json").read_text())
    assert manifest["processes"] == 1 and manifest["micro_batches_per_step"] == 2
    # resumed with the config's grad_accum back at 1: the checkpoint's 2 a step are kept
    again = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 3}, **sections)
    Trainer(again, []).fit(resume=True)
    state = json.loads((root / "step-000003" / "train_state.json").read_text())
    assert state["batch_in_epoch"] == 6
    assert (
        "train.grad_accum 1 -> 2 keeps its global batch"
        in (tmp_path / "run" / "train.log").read_text()
    )
