"""Checkpoint averaging as a callback: the top-k checkpoints by a metric, averaged at the end of
fit (and optionally after every evaluation that changes the top-k)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from pydantic import Field

from asrforge.callbacks.options import EvalMetric, Options
from asrforge.checkpoint.average import average_top_k, rank_checkpoints
from asrforge.train.events import Callback, Decision, RunInfo
from asrforge.train.state import TrainState

log = logging.getLogger("asrforge.callbacks")


class AverageCheckpoints(Callback):
    """Writes ``checkpoints/<metric>.ave_<k>best/`` (weights averaged over the k best checkpoints
    by ``metric``, with its own manifest). Critical by default: a failed average is an error."""

    name = "average_checkpoints"
    critical = True

    class Options(Options):
        metric: EvalMetric = "wer"
        """The evaluation metric (as in the checkpoints' manifests) to rank checkpoints by
        (``wer``, ``cer``, ``loss``, ...)."""
        k: int = Field(default=5, gt=0)
        mode: Literal["min", "max"] | None = None
        """Default: ``min`` for error rates and losses."""
        after_each_eval: bool = False
        """Also re-average after every evaluation that changes the top-k."""

    def __init__(
        self,
        metric: str = "wer",
        k: int = 5,
        mode: str | None = None,
        after_each_eval: bool = False,
    ):
        self.metric, self.k, self.mode, self.after_each_eval = metric, k, mode, after_each_eval
        self.root: Path | None = None
        self._members: list[int] = []
        self.written: Path | None = None

    def on_train_begin(self, state: TrainState, *, run: RunInfo) -> None:
        self.root = Path(run.output_dir) / "checkpoints"

    def _top(self) -> list[int]:
        mode = self.mode or ("max" if self.metric.startswith(("acc", "bleu")) else "min")
        return [step for _, step, _ in rank_checkpoints(self.root, self.metric, mode)[: self.k]]

    def _average(self) -> None:
        members = self._top()
        if not members:
            log.warning("average_checkpoints: no checkpoint has metric %r yet", self.metric)
            return
        self.written = average_top_k(self.root, self.metric, self.k, mode=self.mode)
        self._members = members
        log.info(
            "average_checkpoints: averaged steps %s by %s into %s",
            members,
            self.metric,
            self.written,
        )

    def on_save(self, state: TrainState, *, path: Path, kind: str) -> None:
        if self.after_each_eval and self.root is not None and self._top() != self._members:
            self._average()

    def on_eval_end(self, state: TrainState, *, metrics: dict, decision: Decision) -> None:
        pass  # the checkpoint of this evaluation is saved after this event: see on_save

    def on_train_end(self, state: TrainState, *, result) -> None:
        if self.root is not None:
            self._average()

    def state_dict(self) -> dict:
        return {"members": self._members}

    def load_state_dict(self, state: dict) -> None:
        self._members = list(state.get("members", []))
