"""The loop: events and payloads, callback failure handling, early stopping, non-finite steps."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from asrforge.callbacks import EarlyStopping, build_callbacks
from asrforge.config import ConfigError
from asrforge.train import step as step_module
from asrforge.train.events import Callback, CriticalCallbackError, Decision
from asrforge.train.loop import Trainer
from asrforge.train.state import TrainState
from tests.conftest import tiny_config


class Recorder(Callback):
    name = "recorder"

    def __init__(self):
        self.events: list[tuple[str, int, dict]] = []

    def _rec(self, event, state, **payload):
        self.state = state
        self.events.append((event, state.step, payload))

    def __getattribute__(self, item):
        if item.startswith("on_"):
            return lambda state, **payload: self._rec(item, state, **payload)
        return super().__getattribute__(item)


def test_events_fire_in_order_with_their_payloads(tmp_path, tones_dir):
    rec = Recorder()
    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 4}, eval={"eval_steps": 2})
    result = Trainer(cfg, [rec]).fit()
    names = [e for e, _, _ in rec.events]
    assert names[0] == "on_train_begin" and names[-1] == "on_train_end"
    assert names[1] == "on_epoch_begin"
    # every optimizer step: begin then end, in step order
    begins = [(s, p["step"]) for e, s, p in rec.events if e == "on_step_begin"]
    ends = [s for e, s, _ in rec.events if e == "on_step_end"]
    assert [p for _, p in begins] == [1, 2, 3, 4] and ends == [1, 2, 3, 4]
    # an evaluation at steps 2 and 4: eval_begin, predict_end, eval_end, then save
    evals = [(e, s) for e, s, _ in rec.events if e.startswith("on_eval") or e in ("on_predict_end", "on_save")]
    assert evals[:4] == [("on_eval_begin", 2), ("on_predict_end", 2), ("on_eval_end", 2), ("on_save", 2)]
    assert ("on_eval_end", 4) in evals
    payload = {e: p for e, _, p in rec.events}
    run = payload["on_train_begin"]["run"]
    from asrforge.train.precision import choose_precision

    assert run.n_params > run.n_train > 0
    assert run.precision == choose_precision("auto", "auto", 32)[0] == "no"  # d_model 32 < 256
    m = payload["on_step_end"]["metrics"]
    assert {"loss", "lr", "grad_norm", "skipped", "samples", "tokens", "step_seconds"} <= set(m)
    em, dec = payload["on_eval_end"]["metrics"], payload["on_eval_end"]["decision"]
    assert {"loss", "wer", "cer", "n", "per_language"} <= set(em) and em["n"] == 12
    assert isinstance(dec, Decision) and dec.reason
    preds = payload["on_predict_end"]["predictions"]
    assert len(preds) == 12 and {"uid", "ref", "hyp", "language"} <= set(preds[0])
    assert payload["on_save"]["path"].name.startswith("step-")
    assert result.status == "completed" and result.step == 4
    # the eval records and the resolved config are in the run dir
    assert (tmp_path / "run" / "eval" / "step-000002.jsonl").is_file()
    assert (tmp_path / "run" / "config.yaml").is_file()


class Boom(Callback):
    name = "boom"

    def __init__(self, critical: bool):
        self.critical = critical
        self.calls = 0

    def on_step_end(self, state, *, metrics):
        self.calls += 1
        raise RuntimeError("boom")


def test_failing_optional_callback_is_logged_and_training_goes_on(tmp_path, tones_dir, caplog):
    boom = Boom(critical=False)
    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 3}, eval={"eval_steps": None, "at_end": False})
    result = Trainer(cfg, [boom]).fit()
    assert result.status == "completed" and result.step == 3
    assert boom.calls == 3
    assert any("callback 'boom' failed in on_step_end" in r.getMessage() for r in caplog.records)


class _Stateful(Callback):
    def __init__(self, name: str, state, critical: bool = False):
        self.name, self.state, self.critical = name, state, critical

    def state_dict(self):
        return self.state


@pytest.mark.fast
def test_a_callback_state_that_cannot_be_saved_costs_that_state_not_the_checkpoint(caplog):
    import numpy as np

    from asrforge.train.events import CallbackList

    good = _Stateful("good", {"n": 3})
    callbacks = CallbackList([good, _Stateful("npstate", {"best": np.float32(0.5)}),
                              _Stateful("listy", [1, 2])])  # fmt: skip
    with caplog.at_level("ERROR", logger="asrforge.callbacks"):
        assert callbacks.state_dict() == {"good": {"n": 3}}
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "asrforge.callbacks")
    assert "callback 'npstate': its state_dict() cannot be saved (TypeError" in said
    assert "callback 'listy'" in said and "written without it" in said
    critical = CallbackList([_Stateful("must", {"x": object()}, critical=True)])
    with pytest.raises(CriticalCallbackError, match="'must': its state_dict"):
        critical.state_dict()


@pytest.mark.fast
def test_failing_critical_callback_stops_the_run(tmp_path, tones_dir):
    boom = Boom(critical=True)
    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 3}, eval={"eval_steps": None, "at_end": False})
    with pytest.raises(CriticalCallbackError, match="critical callback 'boom' failed in on_step_end"):
        Trainer(cfg, [boom]).fit()
    assert boom.calls == 1


@pytest.mark.fast
def test_early_stopping_stops_at_the_right_evaluation():
    es = EarlyStopping(monitor="wer", mode="min", patience=2, min_delta=0.01)
    state = TrainState()
    seen = []
    for wer in (0.9, 0.8, 0.795, 0.85, 0.7):
        if state.should_stop:
            break
        es.on_eval_end(state, metrics={"wer": wer}, decision=Decision(False, ""))
        seen.append(wer)
    # 0.795 is within min_delta of 0.8, 0.85 is worse: patience 2 runs out at the 4th eval
    assert seen == [0.9, 0.8, 0.795, 0.85] and state.should_stop
    assert "did not improve" in state.stop_reason
    restored = EarlyStopping(patience=2)
    restored.load_state_dict(es.state_dict())
    assert restored.best == 0.8 and restored.bad_evals == 2


def test_early_stopping_in_a_run_is_honoured_before_the_next_step(tmp_path, tones_dir):
    cfg = tiny_config(
        tmp_path / "run", tones_dir, train={"max_steps": 40}, eval={"eval_steps": 1},
        callbacks=[{"name": "early_stopping", "monitor": "loss", "mode": "max", "patience": 1}],
    )
    result = Trainer(cfg, build_callbacks(cfg)).fit()
    # loss falls, so in "max" mode the second evaluation is not an improvement: stop at step 2
    assert result.status == "stopped" and result.step == 2
    assert "early stopping" in result.reason


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(tmp_path, tones_dir, monkeypatch):
    real = step_module.token_loss
    calls = {"n": 0}

    def poisoned(logits, labels, reduction="mean"):
        calls["n"] += 1
        loss = real(logits, labels, reduction)
        return loss * math.nan if calls["n"] in (2, 4, 5) else loss

    monkeypatch.setattr(step_module, "token_loss", poisoned)
    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 10, "max_consecutive_nonfinite": 2},
                      eval={"eval_steps": None, "at_end": False})
    rec = Recorder()
    result = Trainer(cfg, [rec]).fit()
    skipped = [p["metrics"]["skipped"] for e, _, p in rec.events if e == "on_step_end"]
    assert skipped == [False, True, False, True, True]
    assert result.status == "diverged" and result.step == 5
    assert "lower optim.lr" in result.reason
    assert rec.state.skipped_steps == 3 and rec.state.consecutive_nonfinite == 2


@pytest.mark.fast
def test_external_callbacks_need_permission(tmp_path, tones_dir):
    cfg = tiny_config(tmp_path / "run", tones_dir, callbacks=[{"_target_": "os.system"}])
    with pytest.raises(ConfigError, match="--allow-external-callbacks"):
        build_callbacks(cfg)
    with pytest.raises(ConfigError, match="not a subclass"):
        build_callbacks(cfg, allow_external=True)
    cfg = tiny_config(tmp_path / "run", tones_dir, callbacks=[{"name": "early_stoping"}, {"name": "early_stopping", "patiense": 2}])
    with pytest.raises(ConfigError) as e:
        build_callbacks(cfg)
    assert e.value.problems == [
        "callbacks.0.name: unknown callback 'early_stoping' — did you mean early_stopping?",
        "callbacks.1.patiense: unknown field — did you mean callbacks.1.patience?",
    ]


def test_average_checkpoints_callback_writes_the_top_k_average(tmp_path, tones_dir):
    from safetensors.torch import load_file

    from asrforge.checkpoint.average import rank_checkpoints

    cfg = tiny_config(
        tmp_path / "run", tones_dir, train={"max_steps": 4}, eval={"eval_steps": 1},
        checkpoint={"save_total_limit": 1, "keep_best": [{"metric": "loss", "k": 2}]},
        callbacks=[{"name": "average_checkpoints", "metric": "loss", "k": 2}],
    )
    Trainer(cfg, build_callbacks(cfg)).fit()
    root = tmp_path / "run" / "checkpoints"
    out = root / "loss.ave_2best"
    assert (out / "manifest.json").is_file()
    best_two = rank_checkpoints(root, "loss", "min")[:2]
    a, b = (load_file(d / "model.safetensors") for _, _, d in best_two)
    avg = load_file(out / "model.safetensors")
    for name, t in avg.items():
        if t.is_floating_point():
            torch.testing.assert_close(t, (a[name] + b[name]) / 2)


def test_a_failed_save_stops_the_run_and_keeps_the_previous_checkpoint(tmp_path, tones_dir, monkeypatch):
    import errno

    from asrforge.checkpoint import training
    from asrforge.checkpoint.manifest import verify
    from asrforge.errors import CheckpointSaveError

    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 6},
                      eval={"eval_steps": None, "at_end": False},
                      checkpoint={"checkpoint_every": 2})
    real = training.write_training_files
    calls = {"n": 0}

    def disk_full(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "write_training_files", disk_full)
    rec = Recorder()
    with pytest.raises(CheckpointSaveError, match="No space left on device"):
        Trainer(cfg, [rec]).fit()
    assert rec.state.step == 4  # the run did not go on past the failed save
    latest = tmp_path / "run" / "checkpoints" / "latest"
    assert verify(latest)["step"] == 2
    assert not (tmp_path / "run" / "checkpoints" / "step-000004").exists()


@pytest.mark.fast
def test_precision_auto_on_cpu_follows_the_units_the_width_and_the_measured_speed(monkeypatch):
    import asrforge.train.precision as precision_module

    monkeypatch.setattr(precision_module.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision_module, "cpu_bf16_units", lambda: ["amx_bf16"])
    monkeypatch.setattr(precision_module, "cpu_bf16_speedup", lambda width: 1.9)
    precision, why = precision_module.choose_precision("auto", "auto", 384)
    assert precision == "bf16" and "amx_bf16" in why and "384" in why and "1.90x" in why
    # bf16 units that measure slower than fp32 (AVX512-BF16 without AMX): fp32, and why
    monkeypatch.setattr(precision_module, "cpu_bf16_units", lambda: ["avx512_bf16"])
    monkeypatch.setattr(precision_module, "cpu_bf16_speedup", lambda width: 0.62)
    precision, why = precision_module.choose_precision("auto", "auto", 384)
    assert precision == "no" and "0.62x" in why and "avx512_bf16" in why
    assert precision_module.choose_precision("auto", "auto", 32)[0] == "no"
    # width unknown: the safe side
    assert precision_module.choose_precision("auto", "auto", None)[0] == "no"
    assert precision_module.choose_precision("no", "auto", 384) == ("no", "set in train.precision")
    assert precision_module.choose_precision("fp32", "auto", 384) == ("no", "set in train.precision")
    monkeypatch.setattr(precision_module, "cpu_bf16_units", lambda: [])
    assert precision_module.choose_precision("auto", "auto", 384)[0] == "no"


@pytest.mark.fast
def test_the_bf16_probe_is_measured_once_per_machine_and_cached(monkeypatch, tmp_path):
    import asrforge.train.precision as precision_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []

    def fake_measure(width: int) -> float:
        measured.append(width)
        return 0.5 + width / 1000

    monkeypatch.setattr(precision_module, "measure_bf16_speedup", fake_measure)
    assert precision_module.cpu_bf16_speedup(384) == pytest.approx(0.884)
    assert precision_module.cpu_bf16_speedup(384) == pytest.approx(0.884)
    assert precision_module.cpu_bf16_speedup(512) == pytest.approx(1.012)
    assert measured == [384, 512]
    cached = json.loads((tmp_path / "asrforge" / "precision-probe.json").read_text())
    assert sorted(cached.values()) == [0.884, 1.012]
    assert all(precision_module.cpu_model_name() in key for key in cached)


def test_the_bf16_probe_measures_a_ratio_of_two_real_timings_leaving_the_rng_alone():
    from asrforge.train.precision import measure_bf16_speedup

    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    speedup = measure_bf16_speedup(64, repeats=1)
    assert 0.01 < speedup < 100
    assert torch.equal(torch.rand(3), want)  # the caller's random numbers did not move


@pytest.mark.fast
@pytest.mark.parametrize("unusable", ["read-only directory", "a file in the way"])
def test_an_unusable_probe_cache_costs_a_probe_not_the_run(monkeypatch, tmp_path, unusable):
    import asrforge.train.precision as precision_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if unusable == "a file in the way":
        (tmp_path / "asrforge").write_text("not a directory")
    else:
        (tmp_path / "asrforge").mkdir()
        (tmp_path / "asrforge").chmod(0o500)
        if os.access(tmp_path / "asrforge", os.W_OK):  # root writes anyway: fake the refusal
            def refuse(*args, **kwargs):
                raise OSError(30, "Read-only file system")

            monkeypatch.setattr(precision_module, "atomic_write_text", refuse)
            monkeypatch.setattr(precision_module, "exclusive", refuse)
    measured = []
    monkeypatch.setattr(
        precision_module, "measure_bf16_speedup", lambda width: measured.append(width) or 0.7
    )
    assert precision_module.cpu_bf16_speedup(384) == 0.7
    assert precision_module.cpu_bf16_speedup(384) == 0.7
    assert measured == [384, 384]  # measured each time, as nothing could be kept


def test_fp32_is_a_name_for_full_precision(tmp_path, tones_dir):
    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 1, "precision": "fp32"})
    assert cfg.train.precision == "fp32"
    rec = Recorder()
    Trainer(cfg, [rec]).fit()
    run = next(p["run"] for e, _, p in rec.events if e == "on_train_begin")
    assert run.precision == "no"


@pytest.mark.fast
def test_model_width_reads_a_pretrained_directory(tmp_path):
    from asrforge.config import ModelConfig
    from asrforge.train.precision import model_width

    assert model_width(ModelConfig(d_model=48)) == 48
    (tmp_path / "config.json").write_text('{"d_model": 384}')
    assert model_width(ModelConfig(pretrained=tmp_path)) == 384
    assert model_width(ModelConfig(pretrained=tmp_path / "missing")) is None


@pytest.mark.fast
def test_optimizer_is_fused_for_float_parameters_on_the_cpu():
    import torch

    from asrforge.config import OptimConfig
    from asrforge.train.optim import build_optimizer

    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(10, 4), "out": torch.nn.Linear(4, 4)})
    opt = build_optimizer(model, OptimConfig(lr=1e-3))
    assert opt.defaults["fused"] is True
    assert {g["name"] for g in opt.param_groups} == {"embeddings", "decay", "no_decay"}
    before = model["out"].weight.detach().clone()
    model["out"](model["embed_tokens"](torch.tensor([1, 2]))).sum().backward()
    opt.step()
    assert not torch.equal(before, model["out"].weight)


def test_two_processes_train_one_run(tmp_path, tones_dir):
    """torchrun with two CPU processes: one distributed run (not two one-process runs writing
    the same run dir): one cache build, one log line per step, the same weights on both ranks."""
    import subprocess
    import sys

    cfg = tiny_config(
        tmp_path / "run", tones_dir, train={"max_steps": 4}, eval={"eval_steps": None},
        data={"cache_features": True},
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "asrforge", "train", str(path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    log = (tmp_path / "run" / "train.log").read_text()
    # one run of two processes: rank zero alone logs to the run dir and builds the cache...
    assert "2 process(es)" in log
    assert log.count("step 4/4") == 1 and log.count("feature cache: computing") == 1
    # ...and alone writes to the console (the log lines and the result line once each)
    assert out.stdout.count("asrforge: completed at step 4") == 1
    assert out.stderr.count("asrforge run in") == 1 and out.stderr.count("step 4/4") == 1


@pytest.mark.fast
def test_a_trainer_given_what_it_does_not_take_says_what_it_takes(tmp_path, tones_dir):
    from asrforge.config import load_config

    cfg = tiny_config(tmp_path / "run", tones_dir)
    with pytest.raises(TypeError, match="cfg is a str, not a TrainConfig: load a YAML file"):
        Trainer("ft.yaml")
    for callbacks in (build_callbacks, [object()]):
        with pytest.raises(TypeError, match="callbacks must be a list of asrforge Callback"):
            Trainer(cfg, callbacks)
    (tmp_path / "ft.yaml").write_text(cfg.to_yaml())
    with pytest.raises(ConfigError, match="overrides: a list of 'dotted.key=value' strings, "
                       "got a str"):  # fmt: skip
        load_config(tmp_path / "ft.yaml", "optim.lr=2e-5")
    assert load_config(tmp_path / "ft.yaml", ["optim.lr=2e-5"]).optim.lr == 2e-5
