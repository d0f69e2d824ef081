"""Callbacks: state per callback across a resume, options checked before training (by YAML path,
naming the config file), optional averaging, and the ``on_save`` kinds."""

from __future__ import annotations

import os
import signal

from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config


class EvalMetrics(Callback):
    name = "eval_metrics"

    def __init__(self):
        self.seen: list[dict] = []
        self.saves: list[str] = []

    def on_eval_end(self, state, *, metrics, decision):
        self.seen.append(dict(metrics))

    def on_save(self, state, *, path, kind):
        self.saves.append(kind)


class SigtermAt(Callback):
    name = "sigterm_at"

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, state, *, metrics):
        if state.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_save_on_a_signal_has_kind_interrupt(tmp_path, tones_dir):
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        train={"max_steps": 5},
        eval={"eval_steps": None, "at_end": False},
        checkpoint={"checkpoint_every": 1},
    )
    probe = EvalMetrics()
    result = Trainer(cfg, [SigtermAt(2), probe]).fit()
    assert result.status == "interrupted" and result.step == 2
    assert probe.saves == ["step", "interrupt"]
