"""Checkpoint averaging as a callback: the top-k checkpoints by a metric, averaged at the end of
fit (and optionally after every evaluation that changes the top-k)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from pydantic import Field

from asrforge.callbacks.options import EvalMetric, Options
from asrforge.checkpoint.average import LORA_REASON, average_top_k, rank_checkpoints
from asrforge.checkpoint.manifest import read_manifest
from asrforge.run_layout import RunLayout
from asrforge.train.events import Callback, Decision, RunInfo
from asrforge.train.state import TrainState

log = logging.getLogger("asrforge.callbacks")


class AverageCheckpoints(Callback):
    """Writes ``checkpoints/<metric>.ave_<k>best/`` (weights averaged over the k best checkpoints
    by ``metric``, with its own manifest). Optional by default: the average is a copy that
    ``asrforge average`` rebuilds from the checkpoints, so its failure is logged as an error with
    that command and the run goes on (``critical: true`` makes it stop the run)."""

    name = "average_checkpoints"

    class Options(Options):
        metric: EvalMetric = "wer"
        """The evaluation metric (as in the checkpoints' manifests) to rank checkpoints by
        (``wer``, ``cer``, ``loss``, ...)."""
        k: int = Field(default=5, gt=0)
        mode: Literal["min", "max"] | None = None
        """Default: ``min`` for error rates and losses."""
        after_each_eval: bool = False
        """Also re-average after every evaluation that changes the top-k."""
        weights: Literal["ema", "raw"] | None = None
        """Which weights of each checkpoint: ``ema`` or ``raw``; default the EMA weights when
        the run keeps them (``train.ema_decay``), as ``asrforge export`` takes them."""

    def __init__(
        self,
        metric: str = "wer",
        k: int = 5,
        mode: str | None = None,
        after_each_eval: bool = False,
        weights: str | None = None,
    ):
        self.metric, self.k, self.mode, self.after_each_eval = metric, k, mode, after_each_eval
        self.weights = weights
        self.root: Path | None = None
        self._members: list[int] = []
        self.written: Path | None = None

    def config_problems(self, cfg) -> list[str]:
        if cfg.model.lora is not None:
            return [f"{self.name} with model.lora: {LORA_REASON}; export merges one checkpoint's "
                    "adapters instead"]  # fmt: skip
        return []

    def on_train_begin(self, state: TrainState, *, run: RunInfo) -> None:
        self.root = RunLayout(Path(run.output_dir)).checkpoints.root

    def _top(self) -> list[int]:
        mode = self.mode or ("max" if self.metric.startswith(("acc", "bleu")) else "min")
        return [step for _, step, _ in rank_checkpoints(self.root, self.metric, mode)[: self.k]]

    def _average(self) -> None:
        members = self._top()
        if not members:
            log.warning("average_checkpoints: no checkpoint has metric %r yet", self.metric)
            return
        try:
            self.written = average_top_k(
                self.root, self.metric, self.k, mode=self.mode, weights=self.weights
            )
        except Exception as e:
            mode = f" --mode {self.mode}" if self.mode else ""
            log.error(
                "average_checkpoints: averaging steps %s by %s FAILED (%s: %s); the checkpoints "
                "are intact, rebuild the average with: asrforge average %s --metric %s --k %d%s",
                members,
                self.metric,
                type(e).__name__,
                e,
                self.root.parent,
                self.metric,
                self.k,
                mode,
            )
            raise
        self._members = members
        log.info(
            "average_checkpoints: averaged the %s weights of steps %s by %s into %s",
            read_manifest(self.written).get("weights"),
            members,
            self.metric,
            self.written,
        )

    def on_save(self, state: TrainState, *, path: Path, kind: str) -> None:
        if self.after_each_eval and self.root is not None and self._top() != self._members:
            self._average()

    def on_eval_end(self, state: TrainState, *, metrics: dict, decision: Decision) -> None:
        # This evaluation's checkpoint is saved after this event, so on_save averages.
        pass

    def on_train_end(self, state: TrainState, *, result) -> None:
        if self.root is not None:
            self._average()

    def state_dict(self) -> dict:
        return {"members": self._members}

    def load_state_dict(self, state: dict) -> None:
        self._members = list(state.get("members", []))
