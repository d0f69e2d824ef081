"""Experiment trackers: Weights & Biases (``wandb``) and MLflow.

Each package is imported only when a run names its callback (in ``on_train_begin``; the options
check only looks for it), so neither is a dependency. Both work without a network: W&B with
``mode: offline`` (or ``WANDB_MODE=offline``; ``wandb sync`` uploads later), MLflow with its
default here, a local file store under the run directory. Offline means no network attempt at
all: each library's own usage telemetry is switched off too (see ``start``). A resumed run
continues the same tracker run: its id is part of the callback's checkpointed state.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

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
        self.started = False

    def on_train_begin(self, state: TrainState, *, run: RunInfo) -> None:
        self.log_every = self.log_every or run.config.train.log_every
        self.start(run)
        self.started = True

    def on_step_end(self, state: TrainState, *, metrics: dict) -> None:
        self.avg.add(metrics)
        if state.step % self.log_every == 0:
            # a tracker that failed to start (W&B without a login, say) reported it once, in
            # on_train_begin; it does not repeat that as an error at every logging step
            if self.started:
                self.log(_numbers(self.avg.summary(metrics), "train/"), state.step)
            self.avg.reset()

    def on_eval_end(self, state: TrainState, *, metrics: dict, decision: Decision) -> None:
        if self.started:
            self.log(eval_scalars(metrics), state.step)

    def on_train_end(self, state: TrainState, *, result) -> None:
        self.finish(failed=result.status == "diverged")

    def on_exception(self, state: TrainState, *, error: BaseException) -> None:
        self.finish(failed=True)

    def state_dict(self) -> dict:
        # the open averaging window too: a resumed run's first point averages the same steps
        # as an uninterrupted run's (as in metrics.jsonl and TensorBoard)
        return {"run_id": self.run_id, "window": self.avg.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.run_id = state.get("run_id")
        if "window" in state:  # checkpoints before the window was saved have none
            self.avg.load_state_dict(state["window"])

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

        if self.mode in ("offline", "disabled"):
            # wandb's usage analytics read the process-wide settings, not init's mode: with
            # init(mode="offline") alone, wandb 0.31 still contacts its server at exit
            wandb.setup(settings=wandb.Settings(mode=self.mode))
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
    (overall and per language) as metrics by step. Names keep one ``/``: ``train/lr/decay``
    is ``train/lr.decay`` here (see ``mlflow_key``)."""

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
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            uri = (Path(run.output_dir).resolve() / "mlruns").as_uri()
        scheme = urlparse(uri).scheme
        if scheme in ("", "file"):
            # MLflow >= 3.7 refuses its file store (in "maintenance mode") unless opted into;
            # it is the store that needs no server, database or extra package.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if scheme in ("", "file", "sqlite"):
            # MLflow's usage telemetry (on unless CI is set) fetches its config from mlflow.org
            # when mlflow is imported: a run with a local store makes no network attempt.
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        if self.run_id is None:  # a resumed run logs into the run it started
            found = self.client.get_experiment_by_name(self.experiment)
            exp_id = (
                found.experiment_id if found else self.client.create_experiment(self.experiment)
            )
            created = self.client.create_run(exp_id, run_name=self.run_name or run.config.config_id)
            self.run_id = created.info.run_id
            params = [Param(mlflow_key(k), v) for k, v in _flat(run.config.to_plain()).items()]
            self.client.log_batch(self.run_id, params=params)  # in chunks of 100
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for k, v in values.items()]
        if metrics:  # one request per point, not one per metric
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, failed: bool) -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
            self.client = None


def mlflow_key(key: str) -> str:
    """``train/lr/embeddings`` -> ``train/lr.embeddings``: an MLflow name for a metric or param.

    MLflow's file store keeps each metric in a file named by its key, so ``train/lr`` (a file)
    and ``train/lr/embeddings`` (a file in a directory of that name) cannot both exist; only
    the first ``/`` (the namespace MLflow's UI groups charts by) stays a ``/``. Characters MLflow
    refuses (it allows letters, digits, ``_ - . /`` and space) become ``_``.
    """
    head, sep, rest = key.partition("/")
    return re.sub(r"[^\w\-. /]", "_", head + sep + rest.replace("/", "."))


def _flat(tree: Any, prefix: str = "") -> dict[str, str]:
    """``{"optim.lr": "0.001", ...}``: MLflow parameters are flat strings (at most 500 chars in
    older servers, so longer values are cut)."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): str(tree)[:500]}
