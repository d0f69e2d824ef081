"""fp16 with dynamic loss scaling, on the CPU as on a GPU: an overflow skips the step, counts it,
lowers the scale, and training goes on; a run that keeps producing inf/nan still ends diverged."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from asrforge.train import step as step_module
from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from asrforge.train.precision import choose_precision
from tests.conftest import tiny_config


class Steps(Callback):
    name = "steps"

    def __init__(self):
        self.metrics: list[dict] = []
        self.precision = None

    def on_train_begin(self, state, *, run):
        self.precision = run.precision

    def on_step_end(self, state, *, metrics):
        self.metrics.append(dict(metrics))


def fp16_config(tmp_path, tones_dir, **train):
    return tiny_config(
        tmp_path / "run",
        tones_dir,
        train={"precision": "fp16", **train},
        eval={"eval_steps": None, "at_end": False},
    )


def poison_losses(monkeypatch, calls: set[int] | None):
    """Multiply the loss of the given micro-batches (1-based; None: all) by inf."""
    real, n = step_module.token_loss, [0]

    def poisoned(logits, labels, reduction="mean"):
        n[0] += 1
        loss = real(logits, labels, reduction)
        return loss * math.inf if calls is None or n[0] in calls else loss

    monkeypatch.setattr(step_module, "token_loss", poisoned)


@pytest.mark.fast
def test_fp16_is_kept_on_the_cpu():
    assert choose_precision("fp16", "cpu", 32)[0] == "fp16"
    assert choose_precision("fp16", "auto", 384)[0] == "fp16"


def test_an_overflow_skips_the_step_lowers_the_scale_and_training_goes_on(
    tmp_path, tones_dir, monkeypatch
):
    poison_losses(monkeypatch, {3})
    rec = Steps()
    result = Trainer(fp16_config(tmp_path, tones_dir, max_steps=6), [rec]).fit()
    assert rec.precision == "fp16"
    assert (
        result.status == "completed" and result.step == 6
    )  # no "unscale_() has already been called"
    m = rec.metrics
    assert m[2]["skipped"] and m[2]["grad_norm"] is None and not math.isfinite(m[2]["loss"])
    # the scale that overflowed (the step before's) was halved
    assert m[2]["grad_scale"] == m[1]["grad_scale"] / 2
    assert not m[-1]["skipped"] and math.isfinite(m[-1]["loss"])
    latest = tmp_path / "run" / "checkpoints" / "latest"
    state = json.loads((latest / "train_state.json").read_text())
    assert state["skipped_steps"] == sum(x["skipped"] for x in m) >= 1
    assert torch.load(latest / "scaler.pt", weights_only=True)["scale"] == m[-1]["grad_scale"]


def test_the_scale_calibrating_is_not_divergence(tmp_path, tones_dir, monkeypatch):
    # A huge initial scale: the first steps' gradients overflow (the loss is finite) until the
    # scaler has halved it enough. More overflows in a row than max_consecutive_nonfinite, and the
    # run still trains to max_steps.
    monkeypatch.setattr(
        torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0**22)
    )
    rec = Steps()
    cfg = fp16_config(tmp_path, tones_dir, max_steps=9, max_consecutive_nonfinite=2)
    result = Trainer(cfg, [rec]).fit()
    skipped = [x["skipped"] for x in rec.metrics]
    assert result.status == "completed" and result.step == 9, skipped
    first_trained = skipped.index(False)
    assert first_trained > 2 and all(skipped[:first_trained])
    assert all(math.isfinite(x["loss"]) for x in rec.metrics)
    scales = [x["grad_scale"] for x in rec.metrics[:first_trained]]
    assert scales == [2.0 ** (21 - i) for i in range(first_trained)]
    assert rec.metrics[-1]["loss"] < rec.metrics[first_trained]["loss"]  # it trains


def test_a_run_that_is_all_inf_still_diverges_under_fp16(tmp_path, tones_dir, monkeypatch):
    poison_losses(monkeypatch, None)
    rec = Steps()
    result = Trainer(
        fp16_config(tmp_path, tones_dir, max_steps=20, max_consecutive_nonfinite=4), [rec]
    ).fit()
    assert result.status == "diverged" and result.step == 4
    assert all(x["skipped"] for x in rec.metrics)
    assert [x["grad_scale"] for x in rec.metrics] == [2.0**15, 2.0**14, 2.0**13, 2.0**12]
