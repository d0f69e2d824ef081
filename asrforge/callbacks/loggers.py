"""Metric loggers: JSONL, TensorBoard, and the learning-rate monitor."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from pydantic import Field

from asrforge.callbacks.options import Options
from asrforge.errors import CheckpointSaveError
from asrforge.io.append import open_append, read_appended
from asrforge.io.atomic import atomic_write_bytes
from asrforge.run_layout import (
    METRICS_FILE,
    METRICS_REPLACED_FILE,
    current_metrics,
    step_record,
)
from asrforge.train.events import Callback, Decision, RunInfo
from asrforge.train.state import TrainState

log = logging.getLogger("asrforge.train")


class _StepAverager:
    """Averages per-step metrics over a logging window of ``log_every`` optimizer steps."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.n, self.sums, self.samples, self.tokens, self.seconds, self.skipped = (
            0,
            {},
            0,
            0,
            0.0,
            0,
        )

    def add(self, m: dict) -> None:
        self.n += 1
        for k in [k for k in m if k.startswith("loss")] + ["grad_norm"]:  # loss, loss_asr, ...
            v = m.get(k)
            if isinstance(v, float) and math.isfinite(v):
                s, c = self.sums.get(k, (0.0, 0))
                self.sums[k] = (s + v, c + 1)
        self.samples += m.get("samples", 0)
        self.tokens += m.get("tokens", 0)
        self.seconds += m.get("step_seconds", 0.0)
        self.skipped += int(bool(m.get("skipped")))

    def state_dict(self) -> dict:
        """The open window, saved with each checkpoint: a resumed run's first line then averages
        the same steps as an uninterrupted run's."""
        return {
            "n": self.n,
            "sums": {k: list(v) for k, v in self.sums.items()},
            "samples": self.samples,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.n, self.samples, self.tokens = state["n"], state["samples"], state["tokens"]
        self.seconds, self.skipped = state["seconds"], state["skipped"]
        self.sums = {k: (s, c) for k, (s, c) in state["sums"].items()}

    def summary(self, last: dict) -> dict:
        out = {k: s / c for k, (s, c) in self.sums.items() if c}
        out.update(
            lr=last.get("lr"),
            samples_per_s=self.samples / self.seconds if self.seconds else None,
            tokens_per_s=self.tokens / self.seconds if self.seconds else None,
            skipped_steps=self.skipped,
        )
        # lr/ (lr_monitor) and sys/ (system_monitor) are already per window: the last values
        out.update(
            {k: v for k, v in last.items() if k.startswith(("lr/", "sys/")) or k == "grad_scale"}
        )
        return out


def _top_entry(rel: str) -> frozenset[str]:
    """The top-level name of the run directory that ``rel`` (relative to it) creates."""
    parts = Path(rel).parts
    # a path outside the run directory is not the run's to remove
    if not parts or Path(rel).is_absolute() or parts[0] == "..":
        return frozenset()
    return frozenset({parts[0]})


def _record(line: bytes) -> dict | None:
    """The JSON object with an integer ``step`` that ``line`` holds, else None."""
    try:
        return step_record(line)
    except ValueError:
        return None


def cut_metrics(path: Path, begin: dict) -> None:
    """Rewrite the metrics file ``path`` (atomically) without the records whose steps the start
    ``begin`` logs again (:func:`~asrforge.run_layout.current_metrics`) and without a last line
    a crash cut short; each step then has one record of each event. The records taken out are
    appended to :data:`~asrforge.run_layout.METRICS_REPLACED_FILE` beside it first, so nothing
    an earlier attempt logged is lost. Everything else, lines that are no record included, stays
    as it was written. A missing file, or one with nothing to cut, is left alone.

    Raises:
        LinkRefused: ``path`` or the file beside it is a link.
        OSError: they cannot be read, written or replaced.
    """
    data = read_appended(path)
    if not data:
        return
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends a line; else what a crash left of the last one
    torn = bool(tail) and _record(tail) is None
    if tail and not torn:
        lines.append(tail)
    parsed = [_record(line) for line in lines]
    current = {id(r) for r in current_metrics([*(r for r in parsed if r is not None), begin])}
    keep = [r is None or id(r) in current for r in parsed]
    if all(keep) and not torn:
        return
    kept = [line for line, k in zip(lines, keep, strict=True) if k]
    cut = [line for line, k in zip(lines, keep, strict=True) if not k]
    if cut:
        with open_append(path.with_name(METRICS_REPLACED_FILE)) as f:
            f.write(b"".join(line + b"\n" for line in cut).decode("utf-8", "replace"))
            f.flush()
            os.fsync(f.fileno())
    try:
        atomic_write_bytes(path, b"".join(line + b"\n" for line in kept))
    except CheckpointSaveError as e:
        # as a failed append: a full disk stops the run
        raise (e.__cause__ or e) from None
    log.info(
        "%s: %d record(s) of steps this run logs again (it starts at step %d) moved to %s%s",
        path,
        len(cut),
        begin["step"],
        METRICS_REPLACED_FILE,
        f", and a last line cut short ({len(tail)} bytes) dropped" if torn else "",
    )


class MetricsJsonl(Callback):
    """``metrics.jsonl`` in the run dir: one JSON object per line, flushed after each write.
    Training lines are averaged over ``log_every`` steps (default ``train.log_every``); every
    evaluation and save gets a line of its own. A run that starts again in the same directory
    first takes out the records of the steps it logs again (:func:`cut_metrics`)."""

    name = "metrics_jsonl"

    class Options(Options):
        log_every: int | None = Field(default=None, gt=0)
        """Steps per training line; default ``train.log_every``."""
        filename: str = METRICS_FILE

    def __init__(self, log_every: int | None = None, filename: str = METRICS_FILE):
        self.log_every, self.filename = log_every, filename
        self.avg = _StepAverager()
        self.fh = None

    def _write(self, obj: dict) -> None:
        try:
            self.fh.write(json.dumps(obj, default=str) + "\n")
            self.fh.flush()
        except OSError as e:
            e.filename = e.filename or self.fh.name  # a failed flush does not say which file
            raise

    def run_entries(self) -> frozenset[str]:
        return _top_entry(self.filename)

    def on_train_begin(self, state: TrainState, *, run: RunInfo) -> None:
        self.log_every = self.log_every or run.config.train.log_every
        path = Path(run.output_dir) / self.filename
        begin = {
            "event": "train_begin",
            "time": time.time(),
            "step": state.step,
            "resumed": run.resumed,
            "n_params": run.n_params,
            "precision": run.precision,
            "device": run.device,
            "selection": run.selection,
        }
        cut_metrics(path, begin)
        self.fh = open_append(path)
        self._write(begin)

    def on_step_end(self, state: TrainState, *, metrics: dict) -> None:
        self.avg.add(metrics)
        if state.step % self.log_every == 0:
            self._write(
                {
                    "event": "train",
                    "step": state.step,
                    "epoch": state.epoch,
                    "time": time.time(),
                    **self.avg.summary(metrics),
                }
            )
            self.avg.reset()

    def state_dict(self) -> dict:
        return {"window": self.avg.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "window" in state:  # checkpoints before the window was saved have none
            self.avg.load_state_dict(state["window"])

    def on_eval_end(self, state: TrainState, *, metrics: dict, decision: Decision) -> None:
        self._write(
            {
                "event": "eval",
                "step": state.step,
                "time": time.time(),
                **metrics,
                "save": decision.save,
                "reason": decision.reason,
            }
        )

    def on_save(self, state: TrainState, *, path: Path, kind: str) -> None:
        self._write({"event": "save", "step": state.step, "path": str(path), "kind": kind})

    def on_train_end(self, state: TrainState, *, result) -> None:
        if self.fh is not None:
            try:
                record = {
                    "event": "train_end",
                    "step": state.step,
                    "status": result.status,
                    "reason": result.reason,
                    "best_step": result.best_step,
                    "best": result.best,
                    "tracked_bests": result.tracked_bests,
                }
                # what the forgetting guard refused and where it is kept, when it refused one
                if getattr(result, "refused", None) is not None:
                    record["refused"] = result.refused
                # a matrix launcher continues a run that ran out of time rather than finishing it
                if getattr(result, "out_of_time", False):
                    record["out_of_time"] = True
                self._write(record)
            finally:
                self._close()

    def on_exception(self, state: TrainState, *, error: BaseException) -> None:
        if self.fh is not None:
            try:
                self._write({"event": "exception", "step": state.step, "error": repr(error)})
            finally:
                self._close()

    def _close(self) -> None:
        fh, self.fh = self.fh, None
        try:
            fh.close()
        except OSError:
            # The failed write that left data to flush (a full disk) raised already.
            pass


class TensorBoardLogger(Callback):
    """TensorBoard event files under ``output_dir/tensorboard``: training scalars every
    ``log_every`` steps and every evaluation metric (overall and per language)."""

    name = "tensorboard"

    class Options(Options):
        log_every: int | None = Field(default=None, gt=0)
        subdir: str = "tensorboard"

    def __init__(self, log_every: int | None = None, subdir: str = "tensorboard"):
        self.log_every, self.subdir = log_every, subdir
        self.avg = _StepAverager()
        self.writer = None

    def run_entries(self) -> frozenset[str]:
        return _top_entry(self.subdir)

    def on_train_begin(self, state: TrainState, *, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_every = self.log_every or run.config.train.log_every
        # a resumed run (from step-000000 too: eval.at_start) re-logs the steps after its
        # checkpoint, so the dead process's points from there on are purged
        self.writer = SummaryWriter(
            log_dir=str(Path(run.output_dir) / self.subdir),
            purge_step=state.step + 1 if run.resumed else None,
        )

    def on_step_end(self, state: TrainState, *, metrics: dict) -> None:
        self.avg.add(metrics)
        if state.step % self.log_every == 0:
            for k, v in self.avg.summary(metrics).items():
                if isinstance(v, int | float) and v is not None:
                    self.writer.add_scalar(f"train/{k}", v, state.step)
            self.avg.reset()

    def state_dict(self) -> dict:
        return {"window": self.avg.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "window" in state:
            self.avg.load_state_dict(state["window"])

    def on_eval_end(self, state: TrainState, *, metrics: dict, decision: Decision) -> None:
        for k, v in metrics.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                self.writer.add_scalar(f"eval/{k}", v, state.step)
        for lang, m in (metrics.get("per_language") or {}).items():
            for k in ("wer", "cer", "loss"):
                if isinstance(m.get(k), int | float):
                    self.writer.add_scalar(f"eval_{lang}/{k}", m[k], state.step)
        self.writer.flush()

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def on_train_end(self, state: TrainState, *, result) -> None:
        self._close()

    def on_exception(self, state: TrainState, *, error: BaseException) -> None:
        self._close()


class LRMonitor(Callback):
    """Adds each parameter group's learning rate (``lr/<group>``) to the step metrics the
    loggers write, and logs when warmup ends."""

    name = "lr_monitor"
    rank_zero_only = True

    class Options(Options):
        """No options: the groups and the warmup length come from the run."""

    def __init__(self):
        self.warmup_steps = 0

    def on_train_begin(self, state: TrainState, *, run: RunInfo) -> None:
        self.warmup_steps = run.config.optim.warmup_steps

    def on_step_end(self, state: TrainState, *, metrics: dict) -> None:
        for group, lr in (metrics.get("lr_groups") or {}).items():
            metrics[f"lr/{group}"] = lr
        if self.warmup_steps and state.step == self.warmup_steps:
            import logging

            logging.getLogger("asrforge.train").info(
                "warmup done at step %d: lr %.3g", state.step, metrics.get("lr", float("nan"))
            )
