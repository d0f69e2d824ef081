"""The system monitor: where steady-state time and memory go, and whether the run is data-bound.

How it works: docs/training.md, "The system monitor (`callbacks/monitor.py`)".
"""

from __future__ import annotations

import logging
import os
import time

from pydantic import Field

from asrforge.callbacks.options import Options
from asrforge.train.events import Callback, Decision, RunInfo
from asrforge.train.state import TrainState

log = logging.getLogger("asrforge.train")
_MB = 2**20


def host_rss_bytes() -> int | None:
    """Resident set size of this process, from ``/proc`` (Linux); None where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _Window:
    """Sums over a span of steps: step, data-wait and evaluation seconds, the monitor's own."""

    def __init__(self) -> None:
        self.steps, self.step_s, self.wait_s, self.eval_s, self.own_s = 0, 0.0, 0.0, 0.0, 0.0

    def add_step(self, step_seconds: float, wait_seconds: float) -> None:
        self.steps += 1
        self.step_s += step_seconds
        self.wait_s += wait_seconds

    def fractions(self) -> dict[str, float]:
        if self.step_s <= 0:
            return {}
        wait = min(1.0, self.wait_s / self.step_s)
        ev = min(1.0 - wait, self.eval_s / self.step_s)
        return {
            "step_s": self.step_s / self.steps,
            "data_wait_s": self.wait_s / self.steps,
            "data_wait_frac": wait,
            "eval_frac": ev,
            "compute_frac": max(0.0, 1.0 - wait - ev),
            "overhead_frac": self.own_s / self.step_s,
        }


class SystemMonitor(Callback):
    """Per logged step: data wait against compute, host RSS, device memory and utilization
    (see the module doc); a summary and a data-bound diagnosis at each evaluation."""

    name = "system_monitor"
    rank_zero_only = True

    class Options(Options):
        log_every: int | None = Field(default=None, gt=0)
        """Steps per measurement; default ``train.log_every``."""
        data_bound_frac: float = Field(default=0.2, gt=0, le=1)
        """Warn when waiting for data takes more than this share of the step time."""
        nvml: bool = True
        """Read GPU utilization through NVML when ``pynvml`` can be imported."""

    def __init__(
        self, log_every: int | None = None, data_bound_frac: float = 0.2, nvml: bool = True
    ):
        self.log_every, self.data_bound_frac, self.use_nvml = log_every, data_bound_frac, nvml
        self.window, self.since_eval = _Window(), _Window()
        self.num_workers: int | None = None
        self.cache_features = False
        self.cuda = None  # the torch.cuda module when a CUDA device trains
        self.nvml_handle = None
        self._eval_t0: float | None = None
        self._warm = False

    # -- events --------------------------------------------------------------------------------

    def on_train_begin(self, state: TrainState, *, run: RunInfo) -> None:
        cfg = run.config
        self.log_every = self.log_every or cfg.train.log_every
        self.num_workers, self.cache_features = run.loader_workers, cfg.data.cache_features
        if str(run.device).startswith("cuda"):
            import torch

            self.cuda = torch.cuda
            if self.use_nvml:
                self.nvml_handle = _nvml_handle(torch.cuda.current_device())

    def on_step_end(self, state: TrainState, *, metrics: dict) -> None:
        t0 = time.perf_counter()
        step_s = float(metrics.get("step_seconds") or 0.0)
        wait_s = float(metrics.get("data_wait_seconds") or 0.0)
        if self._warm:
            self.window.add_step(step_s, wait_s)
            self.since_eval.add_step(step_s, wait_s)
        # the first step of a run (or resume) is start-up (lazy init, first allocations, worker
        # start), which the loop already reports as "time to first step": not steady state
        self._warm = True
        if state.step % self.log_every == 0:
            metrics.update({f"sys/{k}": v for k, v in self._sample(self.window).items()})
            self.window = _Window()
        self._charge(t0)

    def on_eval_begin(self, state: TrainState, *, split: str) -> None:
        self._eval_t0 = time.perf_counter()

    def on_eval_end(self, state: TrainState, *, metrics: dict, decision: Decision) -> None:
        t0 = time.perf_counter()
        if self._eval_t0 is not None:
            # the pause is inside the next step's step_seconds: count it in those windows (the
            # starting model's, eval.at_start, is before the step clock starts: in no step's)
            seconds = t0 - self._eval_t0 if state.step > 0 else 0.0
            self.window.eval_s += seconds
            self.since_eval.eval_s += seconds
            self._eval_t0 = None
        summary = self.summary(self.since_eval)
        # nested: metrics.jsonl writes it; the checkpoint manifest and top-k keep scalars only
        metrics["system"] = summary
        log.info("system since the last evaluation: %s", _describe(summary))
        if summary.get("diagnosis"):
            log.warning("%s", summary["diagnosis"])
        self.since_eval = _Window()
        self._charge(t0)

    # -- measurements --------------------------------------------------------------------------

    def summary(self, window: _Window) -> dict:
        """The measurements over ``window`` plus ``diagnosis`` (None when not data-bound)."""
        out = {"steps": window.steps, **self._sample(window, reset_peak=False)}
        out["diagnosis"] = self.diagnosis(out.get("data_wait_frac"))
        return out

    def diagnosis(self, data_wait_frac: float | None) -> str | None:
        """A plain sentence when waiting for data exceeds ``data_bound_frac`` of step time."""
        if data_wait_frac is None or data_wait_frac <= self.data_bound_frac:
            return None
        fixes = [f"raise data.num_workers (now {self.num_workers})"]
        if not self.cache_features:
            fixes.append("enable data.cache_features")
        return f"{data_wait_frac:.0%} of step time waiting for data: {' or '.join(fixes)}"

    def _sample(self, window: _Window, reset_peak: bool = True) -> dict:
        out: dict = dict(window.fractions())
        rss = host_rss_bytes()
        if rss is not None:
            out["host_rss_mb"] = rss / _MB
        if self.cuda is not None:
            out["device_allocated_mb"] = self.cuda.memory_allocated() / _MB
            out["device_reserved_mb"] = self.cuda.memory_reserved() / _MB
            out["device_peak_mb"] = self.cuda.max_memory_allocated() / _MB
            if reset_peak:  # each logged window reports its own peak
                self.cuda.reset_peak_memory_stats()
        if self.nvml_handle is not None:
            util = _nvml_utilization(self.nvml_handle)
            if util is not None:
                out["device_util"] = util
        return out

    def _charge(self, t0: float) -> None:
        own = time.perf_counter() - t0
        self.window.own_s += own
        self.since_eval.own_s += own


def _describe(summary: dict) -> str:
    parts = [f"{summary['steps']} steps"]
    names = (
        ("data_wait_frac", "waiting for data"),
        ("eval_frac", "evaluating"),
        ("compute_frac", "computing"),
    )
    parts += [f"{summary[k]:.0%} {label}" for k, label in names if k in summary]
    units = (
        ("host_rss_mb", "host RSS"),
        ("device_peak_mb", "device peak"),
        ("device_reserved_mb", "device reserved"),
    )
    parts += [f"{label} {summary[k]:.0f} MiB" for k, label in units if k in summary]
    if "device_util" in summary:
        parts.append(f"GPU {summary['device_util']:.0f}% busy")
    return ", ".join(parts)


def _nvml_handle(device_index: int):
    """An NVML handle for the CUDA device, or None without ``pynvml`` or a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(_physical_index(device_index))
    except Exception:
        # Utilization is optional, so an ImportError or NVMLError leaves it out.
        return None


def _physical_index(device_index: int) -> int:
    """NVML numbers every GPU; CUDA only the visible ones (``CUDA_VISIBLE_DEVICES``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if device_index < len(ids) and ids[device_index].isdigit():
        return int(ids[device_index])
    return device_index


def _nvml_utilization(handle) -> float | None:
    try:
        import pynvml

        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:
        return None
