"""Progress: a tqdm bar on a terminal; on a pipe or file, a log line every ``log_every`` steps."""

from __future__ import annotations

import logging
import sys

from pydantic import Field

from asrforge.callbacks.options import Options
from asrforge.train.events import Callback, Decision, RunInfo
from asrforge.train.state import TrainState

log = logging.getLogger("asrforge.train")


class ProgressBar(Callback):
    """Shows step, loss, lr and speed. Quiet (plain log lines) when stderr is not a TTY."""

    name = "progress"

    class Options(Options):
        log_every: int | None = Field(default=None, gt=0)
        """Optimizer steps between progress reports (ESPnet's ``log_interval``): a log line when
        stderr is not a terminal, else a refresh of the bar's loss, lr and speed. Default
        ``train.log_every``."""

    def __init__(self, log_every: int | None = None):
        self.bar = None
        self.log_every = log_every
        self.every = log_every or 10
        self.total = 0

    def on_train_begin(self, state: TrainState, *, run: RunInfo) -> None:
        self.every = self.log_every or run.config.train.log_every
        self.total = run.max_steps
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=state.step, unit="step", dynamic_ncols=True)

    def on_step_end(self, state: TrainState, *, metrics: dict) -> None:
        sps = metrics["samples"] / metrics["step_seconds"] if metrics.get("step_seconds") else 0.0
        if self.bar is not None:
            self.bar.update(1)
            if state.step % self.every == 0:
                self.bar.set_postfix(
                    loss=f"{metrics['loss']:.3f}", lr=f"{metrics['lr']:.2e}", sps=f"{sps:.1f}"
                )
        elif state.step % self.every == 0:
            log.info(
                "step %d/%d loss %.4f lr %.3g %.1f samples/s",
                state.step,
                self.total,
                metrics["loss"],
                metrics["lr"],
                sps,
            )

    def on_eval_end(self, state: TrainState, *, metrics: dict, decision: Decision) -> None:
        if self.bar is not None:
            self.bar.write(
                f"step {state.step}: wer {metrics['wer']:.3f} cer {metrics['cer']:.3f} "
                f"loss {metrics['loss']:.3f} — {decision.reason}"
            )

    def on_train_end(self, state: TrainState, *, result) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_exception(self, state: TrainState, *, error: BaseException) -> None:
        self.on_train_end(state, result=None)
