"""The forgetting guard is measured in one precision (``eval.guard.precision``, fp32 unless told)
at step 0, at every evaluation and in ``export --within-guard``, whatever the training
autocasts in: a start and a figure measured in two precisions would count their difference as
forgetting."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import asrforge.evaluation.guard as guard_module
from asrforge.errors import UserError
from asrforge.evaluation.guard import Guard
from asrforge.evaluation.guard_items import GuardItem
from asrforge.selection.guard_gate import GuardGate
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config


@pytest.fixture
def autocasts(monkeypatch) -> list:
    """The CPU autocast dtype (None: off) of each decoding call the guard makes."""
    seen: list = []
    decode = guard_module.greedy_decode

    def spy(*args, **kwargs):
        on = torch.is_autocast_enabled("cpu")
        seen.append(torch.get_autocast_dtype("cpu") if on else None)
        return decode(*args, **kwargs)

    monkeypatch.setattr(guard_module, "greedy_decode", spy)
    return seen


def guarded_run(tmp_path, tones_dir, **guard):
    """bf16 autocast training with a drift guard; a learning rate too small to change a
    transcript, so any share is within the guard."""
    guard = {"path": str(tones_dir), "split": "validation", "mode": "drift", "max_items": 2,
             **guard}  # fmt: skip
    return tiny_config(
        tmp_path / "run", tones_dir,
        train={"max_steps": 2, "precision": "bf16"}, eval={"eval_steps": 2, "guard": guard, "at_start": True},
        optim={"lr": 1e-9, "warmup_steps": 0},
    )  # fmt: skip


def test_a_bf16_run_measures_its_guard_in_fp32_at_the_start_in_training_and_at_export(
    tmp_path, tones_dir, autocasts, capsys
):
    from asrforge.cli import main

    Trainer(guarded_run(tmp_path, tones_dir), []).fit()
    assert len(autocasts) >= 2 and set(autocasts) == {None}  # step 0 and step 2: fp32
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["selection"]["guard"]["precision"] == "fp32"

    autocasts.clear()
    out = tmp_path / "bundle"
    argv = ["export", str(ckpt), "--within-guard", "--shares", "1.0", "--out", str(out)]
    assert main(argv) == 0
    assert "in fp32)" in capsys.readouterr().err
    assert autocasts and set(autocasts) == {None}


def test_a_guard_told_bf16_autocasts_to_it_and_records_it(tmp_path, tones_dir, autocasts):
    Trainer(guarded_run(tmp_path, tones_dir, precision="bf16"), []).fit()
    assert autocasts and set(autocasts) == {torch.bfloat16}
    state = json.loads(
        (tmp_path / "run" / "checkpoints" / "step-000002" / "train_state.json").read_text()
    )
    assert state["selection"]["guard"]["precision"] == "bf16"


@pytest.mark.fast
def test_a_start_measured_in_another_precision_is_refused():
    items = [GuardItem("g0", np.zeros(16, np.float32), "la la", "en")]
    guard = Guard(items, mode="drift", features=None, tokenizer=None, prompt=lambda lang: [0],
                  eot=0, batch_size=1, max_new_tokens=4, precision="fp32")  # fmt: skip
    gate = GuardGate(0.02)
    gate.set_start(0.0, "drift", {"g0": "la la"}, precision="bf16")
    with pytest.raises(UserError, match="start was measured in bf16, this config measures in fp32"):
        guard.measure(None, gate, device="cpu")
