"""W&B and MLflow callbacks: imported only when named, offline, resumed into the same run.

The tests train against the real ``wandb`` and ``mlflow`` packages (both in the ``dev`` extra;
they skip where missing) and read back what was logged with each library's own reader:
``wandb leet inspect --json`` for an offline run's ``.wandb`` file, ``MlflowClient`` for the
file store. Stand-in modules remain only where the real packages cannot serve: a package that
is not installed, and a tracker that fails to start.
"""

from __future__ import annotations

import importlib.machinery
import json
import logging
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from asrforge.callbacks import build_callbacks
from asrforge.callbacks.trackers import mlflow_key
from asrforge.config import ConfigError
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config
from tests.test_resume import PreemptAt

ROOT = Path(__file__).resolve().parents[1]


def _train(cfg, resume=False, extra=()):
    return Trainer(cfg, [*extra, *build_callbacks(cfg)]).fit(resume=resume)


def _jsonl_train_losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r.get("event") == "train"}


# --- import and installation --------------------------------------------------------------------


def test_neither_package_is_imported_unless_named():
    code = (
        "import sys; import asrforge.callbacks, asrforge.train.loop; "
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.fast
def test_a_missing_package_is_a_config_error_naming_it(tmp_path, tones_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import and find_spec fail as if absent
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    cfg = tiny_config(tmp_path, tones_dir, callbacks=[{"name": "wandb"}, {"name": "mlflow"}])
    with pytest.raises(ConfigError) as e:
        build_callbacks(cfg)
    assert any("callbacks.0" in p and "pip install wandb" in p for p in e.value.problems)
    assert any("callbacks.1" in p and "pip install mlflow-skinny" in p for p in e.value.problems)


def test_a_tracker_that_cannot_start_reports_it_once_and_the_run_goes_on(
    tmp_path, tones_dir, monkeypatch, caplog
):
    # W&B online without a login raises in wandb.init; every later step must not add an error
    def init(**kwargs):
        raise RuntimeError("No API key configured")

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = tiny_config(
        tmp_path, tones_dir, callbacks=[{"name": "wandb", "log_every": 1}], train={"max_steps": 3}
    )
    with caplog.at_level(logging.ERROR):
        assert _train(cfg).status == "completed"
    failures = [r.getMessage() for r in caplog.records if "callback 'wandb' failed" in r.message]
    assert len(failures) == 1 and "on_train_begin" in failures[0], failures


# --- W&B ----------------------------------------------------------------------------------------


def _wandb_records(run_dir: Path) -> list[dict]:
    """An offline run directory's records, read by wandb's own reader of its ``.wandb`` log."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_wandb_offline_logs_and_a_resume_continues_its_run(tmp_path, tones_dir, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the config's mode alone makes it offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    cb = [{"name": "wandb", "mode": "offline", "project": "p", "log_every": 1}]
    cfg = tiny_config(
        tmp_path / "run", tones_dir, callbacks=cb, train={"max_steps": 4}, eval={"eval_steps": 2}
    )
    assert _train(cfg, extra=[PreemptAt(2)]).status == "interrupted"
    assert _train(cfg, resume=True).status == "completed"

    first, second = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    runs, history, exits = [], [], []
    for run_dir in (first, second):
        records = _wandb_records(run_dir)
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        runs.append(run)
        history += [r["history"]["item"] for r in records if r["type"] == "history"]
        exits += [r["exit"]["exit_code"] for r in records if r["type"] == "exit"]
    assert runs[0]["run_id"] == runs[1]["run_id"] == first.name.rsplit("-", 1)[1]
    assert runs[1].get("resume") is True and runs[0]["project"] == "p"
    assert runs[0]["config"]["update"]["optim"]["lr"] == cfg.optim.lr
    assert [h["_step"] for h in history if "train/loss" in h] == [1, 2, 3, 4]
    assert [h["_step"] for h in history if "eval/wer" in h] == [2, 4]
    assert all("eval_en/wer" in h and "eval_es/wer" in h for h in history if "eval/wer" in h)
    assert exits == [0, 0]
    state = json.loads((tmp_path / "run" / "checkpoints" / "latest" / "callbacks.json").read_text())
    assert state["wandb"]["run_id"] == runs[0]["run_id"]


# The callback with the real library in a fresh process, with no CI variables (MLflow sends no
# telemetry under CI) and no WANDB_MODE: every name lookup and internet socket Python opens, up
# to the process's last atexit hook, is recorded.
NETWORK_PROBE = """
import atexit, sys, threading
from types import SimpleNamespace as NS
attempts = []
def audit(event, args):
    if event == "socket.getaddrinfo" or (event == "socket.connect" and not isinstance(args[1], str)):
        attempts.append(f"{event}{args[1:]} in thread {threading.current_thread().name}")
sys.addaudithook(audit)
atexit.register(lambda: print("NETWORK", attempts, flush=True))  # registered first: runs last
from asrforge.callbacks.trackers import MLflowLogger, WandbLogger
cb = {"wandb": lambda: WandbLogger(mode="offline"), "mlflow": MLflowLogger}[sys.argv[1]]()
config = NS(config_id="probe", train=NS(log_every=1), to_plain=lambda: {"optim": {"lr": 0.001}})
state = NS(step=1)
cb.on_train_begin(state, run=NS(output_dir=sys.argv[2], config=config))
cb.on_step_end(state, metrics={"loss": 2.0, "lr": 0.001, "lr/decay": 0.001})
cb.on_eval_end(state, metrics={"wer": 0.5, "per_language": {"en": {"wer": 0.5}}}, decision=None)
cb.on_train_end(state, result=NS(status="completed"))
"""


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_an_offline_tracker_makes_no_network_attempt(tmp_path, tracker):
    pytest.importorskip(tracker, reason=f"{tracker} is not installed")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", NETWORK_PROBE, tracker, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "NETWORK []" in out.stdout.splitlines(), out.stdout + out.stderr
    assert list((tmp_path / "run").iterdir()), "the tracker wrote nothing"


# --- MLflow -------------------------------------------------------------------------------------


def test_mlflow_logs_to_a_local_file_store_and_a_resume_continues_its_run(
    tmp_path, tones_dir, monkeypatch, caplog
):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install mlflow-skinny)")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    cfg = tiny_config(
        out,
        tones_dir,
        callbacks=[{"name": "mlflow", "log_every": 2}],
        train={"max_steps": 4},
        eval={"eval_steps": 2},
    )
    with caplog.at_level(logging.ERROR):
        # stopped at step 3, inside a logging window: step 4's point averages steps 3 and 4
        assert _train(cfg, extra=[PreemptAt(3)]).status == "interrupted"
        assert _train(cfg, resume=True).status == "completed"
    assert not [r for r in caplog.records if "callback 'mlflow' failed" in r.message]

    client = MlflowClient((out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("asrforge").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["optim.lr"] == str(cfg.optim.lr)
    state = json.loads((out / "checkpoints" / "latest" / "callbacks.json").read_text())
    assert state["mlflow"]["run_id"] == run.info.run_id

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    # the same averaged points as metrics.jsonl, across the resume
    losses = history("train/loss")
    assert list(losses) == [2, 4]
    for step, loss in _jsonl_train_losses(out).items():
        assert math.isclose(losses[step], loss, rel_tol=1e-6), (step, losses, loss)
    # lr_monitor's train/lr/<group> next to train/lr: two names MLflow's file store cannot hold
    assert list(history("train/lr.decay")) == [2, 4] and list(history("train/lr")) == [2, 4]
    assert "train/sys.step_s" in run.data.metrics  # system_monitor's, after the lr/ ones
    assert list(history("eval/wer")) == [2, 4] and list(history("eval_en/wer")) == [2, 4]


@pytest.mark.fast
def test_mlflow_names_keep_one_namespace_and_only_characters_mlflow_accepts():
    assert mlflow_key("train/loss") == "train/loss"
    assert mlflow_key("train/lr/embeddings") == "train/lr.embeddings"
    assert mlflow_key("eval_zh-HK/wer") == "eval_zh-HK/wer"
    assert mlflow_key("optim.betas") == "optim.betas"
    assert mlflow_key("data.language_tokens.<|en|>") == "data.language_tokens.__en__"
