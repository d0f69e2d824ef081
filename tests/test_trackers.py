"""W&B and MLflow callbacks: imported only when named, offline, resumed into the same run.

Neither package is a dependency (nor installed in the test environment): the tests inject a
recording stand-in module into ``sys.modules`` with the calls asrforge makes (``wandb.init`` ->
run ``.log``/``.finish``/``.id``; ``mlflow.tracking.MlflowClient``), and the tests against the
real packages run only when they are installed.
"""

from __future__ import annotations

import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from asrforge.callbacks import build_callbacks
from asrforge.config import ConfigError
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config
from tests.test_resume import PreemptAt

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


class FakeWandb:
    """Records what ``wandb`` is asked; runs are ``{"init": kwargs, "logs": [...], "exit": n}``."""

    def __init__(self):
        self.runs: list[dict] = []

    def init(self, **kwargs):
        record = {"init": kwargs, "logs": [], "exit": None}
        self.runs.append(record)
        run = types.SimpleNamespace(id=kwargs.get("id") or f"run{len(self.runs)}")
        run.log = lambda values, step: record["logs"].append((step, dict(values)))
        run.finish = lambda exit_code=0: record.update(exit=exit_code)
        return run


class FakeMlflowClient:
    store: dict = {}

    def __init__(self, tracking_uri):
        self.uri = tracking_uri
        self.store.setdefault("uris", []).append(tracking_uri)

    def get_experiment_by_name(self, name):
        exp = self.store.get("experiments", {}).get(name)
        return types.SimpleNamespace(experiment_id=exp) if exp else None

    def create_experiment(self, name):
        self.store.setdefault("experiments", {})[name] = "1"
        return "1"

    def create_run(self, exp_id, run_name):
        runs = self.store.setdefault("runs", {})
        run_id = f"r{len(runs)}"
        runs[run_id] = {"name": run_name, "params": {}, "metrics": [], "status": "RUNNING"}
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id))

    def log_param(self, run_id, key, value):
        self.store["runs"][run_id]["params"][key] = value

    def log_metric(self, run_id, key, value, step):
        self.store["runs"][run_id]["metrics"].append((step, key, value))

    def update_run(self, run_id, status):
        self.store["runs"][run_id]["status"] = status

    def set_terminated(self, run_id, status):
        self.store["runs"][run_id]["status"] = status


@pytest.fixture
def fake_wandb(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", _module("wandb", init=fake.init))
    return fake


@pytest.fixture
def fake_mlflow(monkeypatch):
    FakeMlflowClient.store = {}
    tracking = _module("mlflow.tracking", MlflowClient=FakeMlflowClient)
    monkeypatch.setitem(sys.modules, "mlflow", _module("mlflow", tracking=tracking))
    monkeypatch.setitem(sys.modules, "mlflow.tracking", tracking)
    return FakeMlflowClient.store


def _train(cfg, resume=False, extra=()):
    return Trainer(cfg, [*extra, *build_callbacks(cfg)]).fit(resume=resume)


def test_neither_package_is_imported_unless_named():
    code = (
        "import sys; import asrforge.callbacks, asrforge.train.loop; "
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_missing_package_is_a_config_error_naming_it(tmp_path, tones_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import and find_spec fail as if absent
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    cfg = tiny_config(tmp_path, tones_dir, callbacks=[{"name": "wandb"}, {"name": "mlflow"}])
    with pytest.raises(ConfigError) as e:
        build_callbacks(cfg)
    assert any("callbacks.0" in p and "pip install wandb" in p for p in e.value.problems)
    assert any("callbacks.1" in p and "pip install mlflow-skinny" in p for p in e.value.problems)


def test_wandb_logs_offline_and_a_resume_continues_its_run(tmp_path, tones_dir, fake_wandb):
    cb = [{"name": "wandb", "mode": "offline", "project": "p", "log_every": 1}]
    cfg = tiny_config(
        tmp_path / "run", tones_dir, callbacks=cb, train={"max_steps": 4}, eval={"eval_steps": 2}
    )
    assert _train(cfg, extra=[PreemptAt(2)]).status == "interrupted"
    _train(cfg, resume=True)
    first, second = fake_wandb.runs
    assert first["init"]["mode"] == "offline" and first["init"]["project"] == "p"
    assert first["init"]["dir"] == str(tmp_path / "run")
    assert first["init"]["config"]["optim"]["lr"] == cfg.optim.lr
    assert second["init"]["id"] == "run1" and second["init"]["resume"] == "allow"
    steps = [s for s, v in first["logs"] + second["logs"] if "train/loss" in v]
    assert steps == [1, 2, 3, 4]
    evals = [v for _, v in second["logs"] if "eval/wer" in v]
    assert evals and any(k.startswith("eval_en/") for k in evals[0])
    assert first["exit"] == 0 and second["exit"] == 0


def test_mlflow_logs_to_a_local_file_store_by_default(
    tmp_path, tones_dir, fake_mlflow, monkeypatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        callbacks=[{"name": "mlflow", "log_every": 2}],
        train={"max_steps": 4},
        eval={"eval_steps": 4},
    )
    _train(cfg)
    assert fake_mlflow["uris"] == [(tmp_path / "run" / "mlruns").resolve().as_uri()]
    (run,) = fake_mlflow["runs"].values()
    assert run["status"] == "FINISHED" and run["name"] == cfg.config_id
    assert run["params"]["optim.lr"] == str(cfg.optim.lr)
    assert [s for s, k, _ in run["metrics"] if k == "train/loss"] == [2, 4]
    assert any(k == "eval/wer" and s == 4 for s, k, _ in run["metrics"])
    state = json.loads((tmp_path / "run" / "checkpoints" / "latest" / "callbacks.json").read_text())
    assert state["mlflow"] == {"run_id": "r0"}


def test_real_wandb_offline(tmp_path, tones_dir, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        callbacks=[{"name": "wandb"}],
        train={"max_steps": 2},
        eval={"eval_steps": 2},
    )
    _train(cfg)
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_real_mlflow_file_store(tmp_path, tones_dir, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install mlflow-skinny)")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        callbacks=[{"name": "mlflow", "log_every": 1}],
        train={"max_steps": 2},
        eval={"eval_steps": 2},
    )
    _train(cfg)
    from mlflow.tracking import MlflowClient

    client = MlflowClient((tmp_path / "run" / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("asrforge").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]
