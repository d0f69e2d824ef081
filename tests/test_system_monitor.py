"""The system monitor: its fields, its cost, and the data-bound diagnosis."""

from __future__ import annotations

import json
import logging
import statistics
import time

import pytest
from accelerate.state import AcceleratorState

from asrforge.callbacks import build_callbacks
from asrforge.callbacks.monitor import SystemMonitor, _Window
from asrforge.train.data_wait import DataWaitClock
from asrforge.train.events import RunInfo
from asrforge.train.loaders import RunLoaders
from asrforge.train.state import TrainState
from tests.conftest import tiny_config

SLEEP = 0.6  # seconds per batch: longer than a tiny model's step, even on a busy machine


def _records(run_dir, event):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def test_fields_and_diagnosis_on_a_loader_made_slow(tmp_path, tones_dir, monkeypatch, caplog):
    from asrforge.train.loop import Trainer

    slow_loader = RunLoaders.train_loader

    def slowed(self, *args, **kwargs):
        for batch in slow_loader(self, *args, **kwargs):
            time.sleep(SLEEP)
            yield batch

    monkeypatch.setattr(RunLoaders, "train_loader", slowed)
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        data={"max_eval_samples": 4},
        callbacks=[{"name": "system_monitor", "data_bound_frac": 0.1}],
    )
    AcceleratorState._reset_state()
    try:
        with caplog.at_level(logging.INFO, logger="asrforge.train"):
            Trainer(cfg, build_callbacks(cfg)).fit()
    finally:
        AcceleratorState._reset_state()

    train = _records(tmp_path / "run", "train")
    assert [r["step"] for r in train] == [2, 4, 6]  # throttled like the loggers (log_every 2)
    for r in train:
        wait, ev, comp = r["sys/data_wait_frac"], r["sys/eval_frac"], r["sys/compute_frac"]
        assert 0 <= wait <= 1 and 0 <= ev <= 1 and 0 <= comp <= 1
        assert abs(wait + ev + comp - 1) < 1e-6
        assert 50 < r["sys/host_rss_mb"] < 64_000  # a python process with torch loaded
        assert "sys/device_allocated_mb" not in r  # CPU run: no CUDA fields
    # every step slept SLEEP in the loader (one micro-batch per step), and the clock saw it
    for r in train:
        assert SLEEP <= r["sys/data_wait_s"] < r["sys/step_s"]
        assert r["sys/data_wait_frac"] > 0.1
    # the evaluation after step 3 lands in step 4's window
    assert train[1]["sys/eval_frac"] > 0 and train[0]["sys/eval_frac"] == 0
    # the monitor's own cost, measured by itself: under 1% of step time
    assert statistics.median(r["sys/overhead_frac"] for r in train) < 0.01

    evals = _records(tmp_path / "run", "eval")
    assert len(evals) == 2
    assert [r["system"]["steps"] for r in evals] == [2, 3]  # step 1 is start-up, left out
    for r in evals:
        system = r["system"]
        assert system["data_wait_frac"] > 0.1
        assert system["diagnosis"].endswith(
            "of step time waiting for data: raise data.num_workers (now 0) or enable "
            "data.cache_features"
        )
    assert "of step time waiting for data" in caplog.text
    assert "system since the last evaluation: 3 steps, " in caplog.text
    # the summary is not a metric: manifests keep scalars only
    manifest = json.loads((tmp_path / "run/checkpoints/step-000003/manifest.json").read_text())
    assert "system" not in manifest["metrics"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    tb.Reload()
    assert "train/sys/data_wait_frac" in tb.Tags()["scalars"]


@pytest.mark.fast
def test_diagnosis_only_when_data_bound_and_names_the_fixes_that_apply():
    mon = SystemMonitor(data_bound_frac=0.2)
    mon.num_workers, mon.cache_features = 2, False
    assert mon.diagnosis(0.1) is None and mon.diagnosis(None) is None
    assert mon.diagnosis(0.38) == (
        "38% of step time waiting for data: raise data.num_workers (now 2) or enable "
        "data.cache_features"
    )
    mon.cache_features = True
    assert mon.diagnosis(0.5) == "50% of step time waiting for data: raise data.num_workers (now 2)"
    w = _Window()
    w.add_step(1.0, 0.1)
    w.add_step(1.0, 0.1)
    w.eval_s = 0.5
    assert w.fractions()["data_wait_frac"] == 0.1 and w.fractions()["compute_frac"] == 0.65


@pytest.mark.fast
def test_the_data_wait_clock_counts_only_the_time_in_next():
    def slow():
        for i in range(3):
            time.sleep(0.02)
            yield i

    clock = DataWaitClock()
    for _ in clock.timed(slow()):
        time.sleep(0.05)  # the "step": not counted
    waited = clock.take()
    assert 0.055 < waited < 0.12 and clock.take() == 0.0


def test_the_step_0_evaluation_is_no_part_of_the_first_window(tmp_path, tones_dir):
    """``eval.at_start`` evaluates before the step clock starts: its seconds are in no step's
    time, so they must not make the first steps look like evaluation (eval_frac ~1, compute 0)."""
    from asrforge.train.loop import Trainer

    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        train={"max_steps": 2},
        eval={"at_start": True, "eval_steps": None},
        callbacks=[{"name": "system_monitor"}],
    )
    AcceleratorState._reset_state()
    try:
        Trainer(cfg, build_callbacks(cfg)).fit()
    finally:
        AcceleratorState._reset_state()
    assert [r["step"] for r in _records(tmp_path / "run", "eval")] == [0, 2]
    (first,) = _records(tmp_path / "run", "train")
    assert first["step"] == 2 and first["sys/eval_frac"] == 0 and first["sys/compute_frac"] > 0


@pytest.mark.fast
def test_the_advice_names_the_workers_auto_resolved_to(tmp_path, tones_dir):
    cfg = tiny_config(tmp_path / "run", tones_dir, data={"num_workers": "auto"})
    run = RunInfo(
        config=cfg, output_dir=tmp_path, model=None, tokenizer=None, n_params=1, n_trainable=1,
        precision="no", device="cpu", world_size=1, is_main=True, n_train=1, n_eval=1,
        loader_workers=3,
    )  # fmt: skip
    mon = SystemMonitor(data_bound_frac=0.2)
    mon.on_train_begin(TrainState(), run=run)
    assert "raise data.num_workers (now 3)" in mon.diagnosis(0.5)
