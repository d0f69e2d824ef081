"""Early stopping on an evaluation metric."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import Field

from asrforge.callbacks.options import EvalMetric, Options
from asrforge.io.records import COUNT, NUMBER, optional, record_problems
from asrforge.selection.policies import Patience, improves
from asrforge.selection.selector import Decision
from asrforge.train.events import Callback
from asrforge.train.state import TrainState

log = logging.getLogger("asrforge.callbacks")


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience``
    evaluations in a row. Sets ``state.should_stop``; the loop honours it before the next step."""

    name = "early_stopping"
    rank_zero_only = False  # every process must stop at the same step

    class Options(Options):
        monitor: EvalMetric = "wer"
        """The evaluation metric to watch (``wer``, ``cer``, ``loss``, ``wer_raw``, ...)."""
        mode: Literal["min", "max"] = "min"
        patience: int = Field(default=3, gt=0)
        """Evaluations without improvement before stopping."""
        min_delta: float = Field(default=0.0, ge=0)
        """An improvement smaller than this does not count."""

    def __init__(
        self, monitor: str = "wer", mode: str = "min", patience: int = 3, min_delta: float = 0.0
    ):
        self.monitor, self.mode, self.min_delta = monitor, mode, min_delta
        self.best: float | None = None
        self.without_improvement = Patience(patience)  # the selector's patience code

    @property
    def patience(self) -> int:
        return self.without_improvement.limit

    @property
    def bad_evals(self) -> int:
        return self.without_improvement.count

    def on_eval_end(self, state: TrainState, *, metrics: dict, decision: Decision) -> None:
        if self.monitor not in metrics:
            raise KeyError(f"early_stopping: metric {self.monitor!r} not in {sorted(metrics)}")
        value = float(metrics[self.monitor])
        improved = improves(value, self.best, mode=self.mode, min_delta=self.min_delta)
        if improved:
            self.best = value
        if self.without_improvement.update(improved):
            state.should_stop = True
            state.stop_reason = (
                f"early stopping: {self.monitor} did not improve on {self.best} for "
                f"{self.bad_evals} evaluations (patience {self.patience})"
            )
            log.info(state.stop_reason)

    def state_dict(self) -> dict:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict) -> None:
        problems = record_problems(state, {"best": optional(NUMBER), "bad_evals": COUNT})
        if problems:
            raise ValueError("; ".join(problems))
        self.best = state.get("best")
        self.without_improvement.count = int(state.get("bad_evals", 0))
