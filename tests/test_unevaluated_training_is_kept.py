"""A run that evaluates its start (step 0) but no trained step never ends with every trained step
deleted: ``checkpoint.after_run: best`` keeps the last step beside ``best/`` and the run says
why, at start and at the end."""

from __future__ import annotations

import logging

from asrforge.train.loop import Trainer
from tests.conftest import tiny_config


def test_the_last_step_is_kept_when_only_the_start_was_evaluated(tmp_path, tones_dir, caplog):
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        train={"max_steps": 3},
        eval={"eval_steps": None, "at_end": False, "at_start": True},
        checkpoint={"after_run": "best"},
    )
    with caplog.at_level(logging.INFO, logger="asrforge"):
        result = Trainer(cfg).fit()
    assert result.status == "completed" and result.best_step == 0
    assert result.reason.endswith("no trained step was evaluated")
    ckpts = tmp_path / "run" / "checkpoints"
    # best/ holds the start, and the trained weights survive the pruning
    assert (ckpts / "step-000003" / "model.safetensors").is_file()
    assert (ckpts / "best" / "model.safetensors").is_file()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "no trained step is evaluated" in w and "eval.at_end is false" in w for w in warnings
    )
    assert any("the last step, 3, is kept beside it" in w for w in warnings)
    assert not any("no step improved on the starting model" in w for w in warnings)


def test_a_run_that_evaluated_a_trained_step_is_pruned_as_before(tmp_path, tones_dir):
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        train={"max_steps": 3},
        eval={"eval_steps": None, "at_end": True, "at_start": True},
        checkpoint={"after_run": "best"},
    )
    result = Trainer(cfg).fit()
    ckpts = tmp_path / "run" / "checkpoints"
    assert not result.reason.endswith("no trained step was evaluated")
    steps = sorted(p.name for p in ckpts.glob("step-*"))
    # only best/ stays: the final step was judged (it is best/ itself when it won)
    assert steps == [] and (ckpts / "best").is_dir()
