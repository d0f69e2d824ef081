"""Callbacks: state per callback across a resume, options checked before training (by YAML path,
naming the config file), optional averaging, and the ``on_save`` kinds."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import yaml

from asrforge.callbacks import REGISTRY, EarlyStopping, Options, build_callbacks
from asrforge.cli import main
from asrforge.config import ConfigError
from asrforge.train.events import Callback, CallbackList, eval_metric_names
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


def _config_file(tmp_path, tones_dir, **sections) -> str:
    """A YAML file holding ``tiny_config``'s sections (for the CLI)."""
    cfg = tiny_config(tmp_path / "run", tones_dir, **sections)
    path = tmp_path / "run.yaml"
    path.write_text(cfg.to_yaml())
    return str(path)


def test_three_early_stopping_callbacks_resume_each_their_own_state(tmp_path, tones_dir):
    watched = (("wer", "min"), ("loss", "max"), ("loss", "min"))
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        train={"max_steps": 3},
        eval={"eval_steps": 1},
        callbacks=[
            {"name": "early_stopping", "monitor": m, "mode": mode, "patience": 10}
            for m, mode in watched
        ],
    )
    probe = EvalMetrics()
    Trainer(cfg, [probe, *build_callbacks(cfg)]).fit()
    saved = json.loads((tmp_path / "run/checkpoints/latest/callbacks.json").read_text())
    keys = ("early_stopping", "early_stopping#2", "early_stopping#3")
    for key, (monitor, mode) in zip(keys, watched, strict=True):
        best = (min if mode == "min" else max)(m[monitor] for m in probe.seen)
        assert saved[key]["best"] == best, (key, saved)
    assert len({json.dumps(saved[k]) for k in keys}) == 3  # three states, not one shared

    resumed = build_callbacks(cfg)
    Trainer(cfg, resumed).fit(resume=True)
    stoppers = [cb for cb in resumed if isinstance(cb, EarlyStopping)]
    assert [cb.monitor for cb in stoppers] == [m for m, _ in watched]
    assert [cb.state_dict() for cb in stoppers] == [saved[k] for k in keys]


@pytest.mark.fast
def test_callback_state_keys_by_id_and_old_checkpoints_keyed_by_name(tmp_path, tones_dir):
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        callbacks=[
            {"name": "early_stopping", "monitor": "wer"},
            {"name": "early_stopping", "monitor": "loss", "id": "es_loss"},
        ],
    )
    first, by_id = (cb for cb in build_callbacks(cfg) if isinstance(cb, EarlyStopping))
    cbs = CallbackList([first, by_id])
    assert list(cbs.state_dict()) == ["early_stopping", "es_loss"]
    # a checkpoint written when state was keyed by name alone: the first of that name gets it
    cbs.load_state_dict({"early_stopping": {"best": 0.5, "bad_evals": 2}})
    assert (first.best, first.bad_evals) == (0.5, 2) and by_id.best is None
    twice = tiny_config(
        tmp_path / "run",
        tones_dir,
        callbacks=[
            {"name": "early_stopping", "id": "es"},
            {"name": "early_stopping", "id": "es"},
        ],
    )
    with pytest.raises(ConfigError) as e:
        build_callbacks(twice)
    assert e.value.problems == ["callbacks.1.id: 'es' is already the id of callbacks.0"]


def test_evaluation_metric_names_are_what_an_evaluation_produces(tmp_path, tones_dir):
    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 1}, eval={"eval_steps": 1})
    probe = EvalMetrics()
    Trainer(cfg, [probe]).fit()
    (metrics,) = probe.seen
    numbers = {
        k for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    assert numbers == set(eval_metric_names())
    assert {"wer", "cer", "loss", "wer_raw", "cer_raw"} <= numbers


@pytest.mark.fast
def test_a_monitor_no_evaluation_produces_stops_the_cli_before_training(
    tmp_path, tones_dir, capsys
):
    path = _config_file(
        tmp_path,
        tones_dir,
        callbacks=[
            {"name": "early_stopping", "monitor": "wer_rw"},
            {"name": "average_checkpoints", "metric": "bleu"},
        ],
    )
    assert main(["train", path]) == 2
    err = capsys.readouterr().err
    assert f"invalid config {path}:" in err  # the file is named
    lines = [line.strip() for line in err.splitlines()]
    produces = f"(it produces: {', '.join(eval_metric_names())})"
    assert (
        "callbacks.0.monitor: 'wer_rw' is not a metric evaluation produces, did you mean 'wer_raw'? "
        + produces
    ) in lines
    assert f"callbacks.1.metric: 'bleu' is not a metric evaluation produces {produces}" in lines
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.fast
def test_averaging_a_lora_runs_checkpoints_is_refused_before_training(tmp_path, tones_dir, capsys):
    pytest.importorskip("peft")
    path = _config_file(
        tmp_path,
        tones_dir,
        model={"lora": {"r": 4, "alpha": 8}},
        callbacks=[{"name": "average_checkpoints", "metric": "loss", "k": 2}],
    )
    assert main(["train", path]) == 2
    lines = [line.strip() for line in capsys.readouterr().err.splitlines()]
    assert (
        "callbacks.0: average_checkpoints with model.lora: the mean of LoRA adapters' factors, "
        "mean(B) @ mean(A), is not the mean of their updates B @ A; export merges one "
        "checkpoint's adapters instead"
    ) in lines
    assert not (tmp_path / "run").exists()


@pytest.mark.fast
def test_every_builtin_callback_has_an_options_schema(tmp_path, tones_dir, capsys):
    for cls in REGISTRY.values():
        assert issubclass(cls.Options, Options), cls.name
    path = _config_file(
        tmp_path,
        tones_dir,
        callbacks=[
            {"name": "progress", "refresh": 5},
            {"name": "lr_monitor", "foo": 1},
            {"name": "progress", "log_every": 0},
        ],
    )
    assert main(["train", path]) == 2  # was a TypeError traceback, exit 1
    err = capsys.readouterr().err
    assert f"invalid config {path}:" in err
    lines = [line.strip() for line in err.splitlines()]
    assert "callbacks.0.refresh: unknown field" in lines
    assert "callbacks.1.foo: unknown field" in lines
    assert "callbacks.2.log_every: must be > 0, got 0" in lines


def test_progress_log_every_sets_the_report_interval(tmp_path, tones_dir, caplog):
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        train={"max_steps": 3, "log_every": 2},
        eval={"eval_steps": None, "at_end": False},
        callbacks=[{"name": "progress", "log_every": 1}],
    )
    with caplog.at_level(logging.INFO, logger="asrforge.train"):
        Trainer(cfg, build_callbacks(cfg)).fit()
    steps = [
        r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("step ")
    ]
    assert steps == ["1/3", "2/3", "3/3"]  # every step, not every train.log_every=2


def test_progress_counts_to_the_step_the_selection_group_caps_the_run_at(
    tmp_path, tones_dir, caplog
):
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        train={"max_steps": 6, "log_every": 1},
        eval={"eval_steps": None, "at_end": False},
        selection={"max_steps": 3},
        callbacks=[{"name": "progress"}],
    )
    with caplog.at_level(logging.INFO, logger="asrforge.train"):
        Trainer(cfg, build_callbacks(cfg)).fit()
    steps = [
        r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("step ")
    ]
    assert steps == ["1/3", "2/3", "3/3"]  # not out of train.max_steps=6


def test_a_failing_average_does_not_fail_a_good_run(tmp_path, tones_dir, monkeypatch, caplog):
    from asrforge.callbacks import averaging

    def broken(*args, **kwargs):  # not a full disk: that stops any run (test_write_failures)
        raise ValueError("a checkpoint's weights could not be averaged")

    monkeypatch.setattr(averaging, "average_top_k", broken)
    path = _config_file(
        tmp_path,
        tones_dir,
        train={"max_steps": 2},
        eval={"eval_steps": 1},
        callbacks=[{"name": "average_checkpoints", "metric": "loss", "k": 2}],
    )
    with caplog.at_level(logging.ERROR, logger="asrforge.callbacks"):
        assert main(["train", path]) == 0  # was exit 1: the callback was critical
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(
        "average_checkpoints: averaging steps" in m and "FAILED" in m and "asrforge average" in m
        for m in errors
    ), errors
    assert (
        "optional callbacks failed during this run (callback.event: times): "
        "average_checkpoints.on_train_end: 1" in errors[-1]
    )  # repeated at the end
    assert (tmp_path / "run/checkpoints/latest/manifest.json").is_file()
    # critical: true restores the old behaviour
    data = yaml.safe_load(open(path))
    data["callbacks"][0]["critical"] = True
    data["output_dir"] = str(tmp_path / "run2")
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    assert main(["train", path]) == 1


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


@pytest.mark.fast
def test_a_callback_that_stops_the_run_without_a_reason_is_named_as_its_stopper():
    from asrforge.train.events import Callback, CallbackList
    from asrforge.train.state import TrainState

    class Enough(Callback):
        name = "enough"

        def on_step_end(self, state, **_):
            state.should_stop = state.step >= 2

    class Says(Callback):
        name = "says"

        def on_step_end(self, state, **_):
            state.should_stop, state.stop_reason = True, "said why"

    state = TrainState(step=1)
    callbacks = CallbackList([Enough()])
    callbacks.call("on_step_end", state)
    assert not state.should_stop and state.stop_reason is None
    state.step = 2
    callbacks.call("on_step_end", state)
    assert state.stop_reason == "stopped by the callback 'enough' in on_step_end"
    said = TrainState()
    CallbackList([Says(), Enough()]).call("on_step_end", said)
    assert said.stop_reason == "said why"
