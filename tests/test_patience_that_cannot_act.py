"""Patience configured on a run that evaluates no step before its last one can never stop it:
the run warns at start, naming the patience setting and ``eval.eval_steps``."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from asrforge.config import load_config
from asrforge.train.setup import build_run_selector

pytestmark = pytest.mark.fast


def _warnings(tmp_path, caplog, **sections) -> list[str]:
    data = {"output_dir": str(tmp_path / "run"), "data": {"path": str(tmp_path / "data")}}
    cfg = load_config(data={**data, "train": {"max_steps": 50}, **sections})
    with caplog.at_level(logging.INFO, logger="asrforge.train"):
        build_run_selector(cfg, Counter({"en": 4}))
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(
    "sections, named",
    [
        ({"selection": {"patience": 2}}, "selection.patience 2"),
        (
            {"callbacks": [{"name": "early_stopping", "patience": 2}]},
            "callbacks.0 (early_stopping)",
        ),
    ],
)
@pytest.mark.parametrize(
    "eval_steps, schedule",
    [(None, "eval.eval_steps is null"), (50, "eval.eval_steps 50 is not below the run's 50")],
)
def test_patience_without_an_evaluation_before_the_end_warns(
    tmp_path, caplog, sections, named, eval_steps, schedule
):
    [warning] = _warnings(tmp_path, caplog, eval={"eval_steps": eval_steps}, **sections)
    assert f"{named} can never stop this run early: {schedule}" in warning


def test_patience_with_evaluations_during_training_says_nothing(tmp_path, caplog):
    sections = {"selection": {"patience": 2}, "eval": {"eval_steps": 10}}
    assert _warnings(tmp_path, caplog, **sections) == []


def test_the_default_patience_and_a_disabled_callback_say_nothing(tmp_path, caplog):
    callbacks = [{"name": "early_stopping", "enabled": False}]
    assert _warnings(tmp_path, caplog, callbacks=callbacks) == []
