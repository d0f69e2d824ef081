"""Experiment trackers: Weights & Biases (``wandb``) and MLflow.

Each package is imported only when a run names its callback (in ``on_train_begin``; the options
check only looks for it), so neither is a dependency. Both work without a network: W&B with
``mode: offline`` (or ``WANDB_MODE=offline``; ``wandb sync`` uploads later), MLflow with its
default here, a local file store under the run directory. A resumed run continues the same
tracker run: its id is part of the callback's checkpointed state.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from asrforge.callbacks.loggers import _StepAverager
from asrforge.callbacks.options import Options
from asrforge.train.events import Callback, Decision, RunInfo
from asrforge.train.state import TrainState


def _needs(package: str, pip_name: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ValueError(
            f"needs the {package} package, which is not installed (pip install {pip_name})"
        )


def eval_scalars(metrics: dict) -> dict[str, float]:
    """An evaluation's numbers as flat ``eval/<metric>`` and ``eval_<lang>/<metric>`` keys."""
    out = {
        f"eval/{k}": float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    for lang, m in (metrics.get("per_language") or {}).items():
        for k in ("wer", "cer", "loss"):
            if isinstance(m.get(k), int | float):
                out[f"eval_{lang}/{k}"] = float(m[k])
    return out


def _numbers(values: dict, prefix: str) -> dict[str, float]:
    return {
        f"{prefix}{k}": float(v)
        for k, v in values.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


class _Tracker(Callback):
    """What both trackers share: averaged training scalars every ``log_every`` steps, every
    evaluation's metrics, and the tracker run's id kept across a resume."""

    def __init__(self, log_every: int | None = None):
        self.log_every = log_every
        self.avg = _StepAverager()
        self.run_id: str | None = None

    def on_train_begin(self, state: TrainState, *, run: RunInfo) -> None:
        self.log_every = self.log_every or run.config.train.log_every
        self.start(run)

    def on_step_end(self, state: TrainState, *, metrics: dict) -> None:
        self.avg.add(metrics)
        if state.step % self.log_every == 0:
            self.log(_numbers(self.avg.summary(metrics), "train/"), state.step)
            self.avg.reset()

    def on_eval_end(self, state: TrainState, *, metrics: dict, decision: Decision) -> None:
        self.log(eval_scalars(metrics), state.step)

    def on_train_end(self, state: TrainState, *, result) -> None:
        self.finish(failed=result.status == "diverged")

    def on_exception(self, state: TrainState, *, error: BaseException) -> None:
        self.finish(failed=True)

    def state_dict(self) -> dict:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        self.run_id = state.get("run_id")

    # what each tracker implements
    def start(self, run: RunInfo) -> None:
        raise NotImplementedError

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def finish(self, failed: bool) -> None:
        raise NotImplementedError


class WandbLogger(_Tracker):
    """Weights & Biases: the resolved config, training scalars and evaluation metrics (overall
    and per language). Files go to ``output_dir/wandb``."""

    name = "wandb"

    class Options(Options):
        project: str = "asrforge"
        entity: str | None = None
        run_name: str | None = None
        """Default: the config's ``config_id``."""
        mode: Literal["online", "offline", "disabled"] | None = None
        """Default: wandb's own (``WANDB_MODE``, else online). ``offline`` needs no network;
        upload later with ``wandb sync output_dir/wandb/offline-run-*``."""
        tags: list[str] = Field(default_factory=list)
        log_every: int | None = Field(default=None, gt=0)
        """Steps per training point; default ``train.log_every``."""

        @model_validator(mode="after")
        def _installed(self):
            _needs("wandb", "wandb")
            return self

    def __init__(
        self,
        project: str = "asrforge",
        entity: str | None = None,
        run_name: str | None = None,
        mode: str | None = None,
        tags: list[str] | None = None,
        log_every: int | None = None,
    ):
        super().__init__(log_every)
        self.project, self.entity, self.run_name = project, entity, run_name
        self.mode, self.tags = mode, list(tags or [])
        self.run = None

    def start(self, run: RunInfo) -> None:
        import wandb

        out = Path(run.output_dir)
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.run_name or run.config.config_id,
            mode=self.mode,
            tags=self.tags or None,
            dir=str(out),
            config=run.config.to_plain(),
            id=self.run_id,  # a resumed asrforge run continues its W&B run
            resume="allow" if self.run_id else None,
        )
        self.run_id = self.run.id

    def log(self, values: dict[str, float], step: int) -> None:
        if values:
            self.run.log(values, step=step)

    def finish(self, failed: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None


class MLflowLogger(_Tracker):
    """MLflow: the resolved config as parameters, training scalars and evaluation metrics
    (overall and per language) as metrics by step."""

    name = "mlflow"

    class Options(Options):
        tracking_uri: str | None = None
        """Default: ``MLFLOW_TRACKING_URI`` if set, else a local file store,
        ``output_dir/mlruns`` (no server, no network, no database; ``mlflow ui
        --backend-store-uri output_dir/mlruns`` shows it). ``sqlite:///path/mlflow.db`` needs
        the full ``mlflow`` package (SQLAlchemy)."""
        experiment: str = "asrforge"
        run_name: str | None = None
        """Default: the config's ``config_id``."""
        log_every: int | None = Field(default=None, gt=0)
        """Steps per training point; default ``train.log_every``."""

        @model_validator(mode="after")
        def _installed(self):
            _needs("mlflow", "mlflow-skinny")
            return self

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "asrforge",
        run_name: str | None = None,
        log_every: int | None = None,
    ):
        super().__init__(log_every)
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.client = None

    def start(self, run: RunInfo) -> None:
        import os

        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            uri = (Path(run.output_dir).resolve() / "mlruns").as_uri()
            # MLflow >= 3.7 refuses its file store (in "maintenance mode") unless opted into;
            # it is the store that needs no server, database or extra package.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if self.run_id is None:  # a resumed run logs into the run it started
            found = self.client.get_experiment_by_name(self.experiment)
            exp_id = (
                found.experiment_id if found else self.client.create_experiment(self.experiment)
            )
            created = self.client.create_run(exp_id, run_name=self.run_name or run.config.config_id)
            self.run_id = created.info.run_id
            for key, value in _flat(run.config.to_plain()).items():
                self.client.log_param(self.run_id, key, value)
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.client.log_metric(self.run_id, key, value, step=step)

    def finish(self, failed: bool) -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
            self.client = None


def _flat(tree: Any, prefix: str = "") -> dict[str, str]:
    """``{"optim.lr": "0.001", ...}``: MLflow parameters are flat strings (at most 500 chars in
    older servers, so longer values are cut)."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): str(tree)[:500]}
