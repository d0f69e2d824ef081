"""The selection policies (by WER, by loss, the combined gate) and patience: is an evaluation
better than the best so far."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol


class Policy(Protocol):
    name: str
    reason: str
    """Which condition decided the last update, e.g. ``"wer 0.31 < best 0.35"``."""

    def update(self, metrics: Mapping[str, float]) -> bool: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class ByMetric:
    """Save when ``metrics[metric]`` is below the best value so far."""

    def __init__(self, metric: str):
        self.metric = metric
        self.name = f"by_{metric}"
        self.best: float | None = None
        self.reason = ""

    def update(self, metrics: Mapping[str, float]) -> bool:
        value = required_metric(metrics, self.metric, self.name)
        if not math.isfinite(value):
            self.reason = f"{self.metric} is {value}: never better"
            return False
        if self.best is None:
            self.reason = f"first evaluation: {self.metric} {short_number(value)}"
        elif improves(value, self.best):
            self.reason = f"{self.metric} {short_number(value)} < best {short_number(self.best)}"
        else:
            self.reason = f"{self.metric} {short_number(value)} >= best {short_number(self.best)}"
            return False
        self.best = value
        return True

    def state_dict(self) -> dict[str, Any]:
        return {f"best_{self.metric}": self.best}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = state[f"best_{self.metric}"]


class ByWer(ByMetric):
    """Save when the error rate is below its best: ``wer``, or ``cer`` for a language written
    without spaces (see :func:`error_metric`); the policy is ``by_wer`` either way.

    Args:
        metric: the error rate judged, ``"wer"`` or ``"cer"``.
    """

    def __init__(self, metric: str = "wer"):
        super().__init__(metric)
        self.name = "by_wer"


class ByLoss(ByMetric):
    """Save when ``loss < best_loss``."""

    def __init__(self):
        super().__init__("loss")


class CombinedGate:
    """Save when (``wer < best_wer`` or ``loss < best_loss``) and ``wer < best_wer + wer_tol``
    and ``loss < best_loss + loss_eps``; on a save each best takes the min. For a language
    written without spaces the error rate gated is ``cer`` (see :func:`error_metric`), with the
    same tolerance.

    Args:
        wer_tol: how much worse than its best the error rate may be on a save (absolute, 0.05).
        loss_eps: how much worse than its best the loss may be on a save (absolute, nats).
        metric: the error rate gated, ``"wer"`` or ``"cer"``.
    """

    name = "combined_gate"

    def __init__(self, wer_tol: float = 0.05, loss_eps: float = 0.05, metric: str = "wer"):
        if wer_tol < 0 or loss_eps < 0:
            raise ValueError(f"tolerances must be >= 0, got wer_tol={wer_tol} loss_eps={loss_eps}")
        self.wer_tol = wer_tol
        self.loss_eps = loss_eps
        self.metric = metric
        self.best_wer: float | None = None
        self.best_loss: float | None = None
        self.best_cer: float | None = None
        self.reason = ""

    def update(self, metrics: Mapping[str, float]) -> bool:
        m = self.metric
        err = required_metric(metrics, m, self.name)
        loss = required_metric(metrics, "loss", self.name)
        bad = [f"{k} is {v}" for k, v in ((m, err), ("loss", loss)) if not math.isfinite(v)]
        if bad:
            self.reason = " and ".join(bad) + ": never better"
            return False
        best_err = getattr(self, f"best_{m}")
        if best_err is None or self.best_loss is None:
            self.reason = f"first evaluation: {m} {short_number(err)}, loss {short_number(loss)}"
        else:
            better = []
            if improves(err, best_err):
                better.append(f"{m} {short_number(err)} < best {short_number(best_err)}")
            if improves(loss, self.best_loss):
                better.append(f"loss {short_number(loss)} < best {short_number(self.best_loss)}")
            if not better:
                self.reason = (
                    f"neither {m} {short_number(err)} < best {short_number(best_err)} "
                    f"nor loss {short_number(loss)} < best {short_number(self.best_loss)}"
                )
                return False
            outside = []
            if not err < best_err + self.wer_tol:
                outside.append(f"{m} {short_number(err)} >= best {short_number(best_err)} + wer_tol {short_number(self.wer_tol)}")
            if not loss < self.best_loss + self.loss_eps:
                outside.append(
                    f"loss {short_number(loss)} >= best {short_number(self.best_loss)} + loss_eps {short_number(self.loss_eps)}"
                )
            if outside:
                self.reason = f"{' and '.join(better)}, but {' and '.join(outside)}"
                return False
            self.reason = f"{' and '.join(better)}, within tolerances"
        self.best_loss = running_min(self.best_loss, loss)
        # both error rates' bests are kept (the one gated is always reported)
        for rate in ("wer", "cer"):
            value = float(metrics.get(rate, math.nan))
            if math.isfinite(value):
                setattr(self, f"best_{rate}", running_min(getattr(self, f"best_{rate}"), value))
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"best_wer": self.best_wer, "best_loss": self.best_loss, "best_cer": self.best_cer}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best_wer = state["best_wer"]
        self.best_loss = state["best_loss"]
        self.best_cer = state.get("best_cer")


def improves(
    value: float, best: float | None, *, mode: str = "min", min_delta: float = 0.0
) -> bool:
    """Whether ``value`` is a new best over ``best`` (None: nothing yet): lower (``mode="min"``)
    or higher (``"max"``) by more than ``min_delta``. A NaN or infinite value never improves."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    sign = 1.0 if mode == "min" else -1.0
    return sign * (best - value) > min_delta


def format_metrics(metrics: Mapping[str, float]) -> str:
    """``wer 0.3000, cer 0.1200, loss 1.2345``: the selection metrics ``metrics`` holds, as the
    log and the console name an evaluation ("" for none)."""
    return ", ".join(f"{k} {metrics[k]:.4f}" for k in ("wer", "cer", "loss") if k in metrics)


class Patience:
    """Counts evaluations in a row without improvement; it runs out at ``limit`` of them.

    Raises:
        ValueError: ``limit`` < 1.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"patience must be >= 1, got {limit}")
        self.limit = limit
        self.count = 0

    def update(self, improved: bool) -> bool:
        """Count one evaluation; True when patience has run out."""
        self.count = 0 if improved else self.count + 1
        return self.count >= self.limit


def required_metric(metrics: Mapping[str, float], key: str, policy: str) -> float:
    """``metrics[key]`` as a float (None reads as NaN); a KeyError naming ``policy`` when absent."""
    if key not in metrics:
        raise KeyError(f"policy {policy} needs metric {key!r}; got {sorted(metrics)}")
    value = metrics[key]
    return math.nan if value is None else float(value)


def finite_numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of ``metrics`` (they go to strict JSON: train_state.json)."""
    return {
        k: v
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def running_min(best: float | None, value: float) -> float:
    """The smaller of ``best`` (None: nothing yet) and ``value``."""
    return value if best is None else min(best, value)


def short_number(x: float) -> str:
    """``x`` to 4 significant digits, as the selection's reasons print figures."""
    return f"{x:.4g}"
