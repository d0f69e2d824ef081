"""The training step reads the device back once: the micro-batches' losses and the gradient
norm in one transfer, not a value per micro-batch (each read makes the host wait for the device,
which on a GPU leaves it idle between kernels)."""

from __future__ import annotations

import sys

import pytest
import torch

from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
"""The Tensor methods that bring a value from the device to the host."""


class ReadsPerStep(Callback):
    """Counts asrforge's own reads of tensor values between each step's begin and end."""

    name = "reads_per_step"

    def __init__(self):
        self.counting = False
        self.current: list[str] = []
        self.steps: list[list[str]] = []

    def on_step_begin(self, state, **payload):
        self.counting, self.current = True, []

    def on_step_end(self, state, **payload):
        self.counting = False
        self.steps.append(self.current)

    def note(self, where: str) -> None:
        if self.counting:
            self.current.append(where)


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_a_training_step_reads_the_device_once(tmp_path, tones_dir, monkeypatch, grad_accum):
    counter = ReadsPerStep()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            # torch's own reads (the optimizer's step counters live on the host) are not ours
            if "/asrforge/" in caller.replace("\\", "/"):
                counter.note(f"{_name} in {caller.rsplit('/', 1)[-1]}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    cfg = tiny_config(
        tmp_path / "run", tones_dir,
        train={"max_steps": 4, "grad_accum": grad_accum, "log_every": 1},
        eval={"eval_steps": None, "at_end": False},
    )  # fmt: skip
    assert Trainer(cfg, [counter]).fit().status == "completed"
    assert len(counter.steps) == 4
    for reads in counter.steps:
        assert reads == ["tolist in step.py"], reads
