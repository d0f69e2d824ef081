"""Checkpoint selection: after each evaluation, is this the new best checkpoint, and should the
run stop?

How it works: docs/guard.md, "How the selector decides (`selection.py`)".
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml
from pydantic import TypeAdapter, ValidationError

from asrforge.config import ConfigError, GuardConfig, PolicyGroup, SelectionConfig, TrainConfig
from asrforge.errors import UserError
from asrforge.text.languages import (
    LANGUAGES,
    find_language_code,
    is_unspaced,
    primary_metric,
    resolve_language,
    unknown_language,
)

GROUPS_FILE = Path(__file__).with_name("selection_groups.yaml")
PATIENCE_FULL = 5
"""Default patience when every weight trains (the seed's SFT: full supervised fine-tuning)."""
PATIENCE_PARTIAL = 3
"""Default patience when part of the model is frozen: a frozen encoder or its lower layers, or
LoRA adapters on a frozen base (parameter-efficient training is not the seed's full SFT)."""


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


class GuardGate:
    """The forgetting guard's rule: a save needs ``guard_wer <= start + tolerance``.

    ``start`` is the guard's WER of the starting model, measured once at step 0
    (:meth:`set_start`); for a guard without references (``kind == "drift"``) it is 0 and
    ``start_transcripts`` holds the starting model's transcript of each item, against which later
    transcripts are scored. Both ride in the selector's state, so a resumed run keeps them.

    A multilingual guard also records the starting model's language-identification accuracy
    (``lid_start``): a save then also needs ``guard_lid >= lid_start - lid_tolerance``. A guard
    of several languages records each one's start (``language_starts``): a save then also needs
    every language within the tolerance of its own start, so a language too small to move the
    pooled figure is not forgotten unseen.

    Args:
        tolerance: how much worse than at the start the guard may be (absolute WER, e.g. 0.02).
        lid_tolerance: how much lower than at the start the language-identification accuracy
            may be (absolute, e.g. 0.05); None: not judged.
    """

    def __init__(self, tolerance: float, lid_tolerance: float | None = None):
        if tolerance < 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance}")
        if lid_tolerance is not None and lid_tolerance < 0:
            raise ValueError(f"lid_tolerance must be >= 0, got {lid_tolerance}")
        self.tolerance = tolerance
        self.lid_tolerance = lid_tolerance
        self.start: float | None = None
        self.kind: str | None = None
        self.start_transcripts: dict[str, str] = {}
        self.lid_start: float | None = None
        self.language_starts: dict[str, float] = {}

    @property
    def started(self) -> bool:
        return self.start is not None

    def set_start(
        self,
        wer: float,
        kind: str,
        transcripts: Mapping[str, str],
        lid: float | None = None,
        language_starts: Mapping[str, float] | None = None,
    ) -> None:
        """Record the starting model's guard WER, the guard's kind (``wer`` or ``drift``), its
        transcript of each item (id -> text), its language-identification accuracy (None:
        not measured) and each language's own figure (a guard of several languages)."""
        self.start, self.kind, self.start_transcripts = float(wer), kind, dict(transcripts)
        self.lid_start = None if lid is None else float(lid)
        self.language_starts = {k: float(v) for k, v in (language_starts or {}).items()}

    def check(self, metrics: Mapping[str, float]) -> tuple[bool, str]:
        """``(within tolerance, why)`` for one evaluation's ``guard_wer``."""
        if self.start is None:
            raise RuntimeError("the guard's start was never measured (GuardGate.set_start)")
        if "guard_wer" not in metrics:
            raise KeyError(f"the forgetting guard needs metric 'guard_wer'; got {sorted(metrics)}")
        # A drift guard says so; otherwise the reason names the error rate the guard judged by.
        name = "drift" if self.kind == "drift" else metrics.get("guard_metric") or self.kind
        within, why = self.within_tolerance(metrics["guard_wer"], self.start, f"guard {name}")
        if not within:
            return False, why
        for language, figure in (metrics.get("guard_languages") or {}).items():
            if language in self.language_starts:
                ok, language_why = self.check_language(language, figure["value"], figure["metric"])
                if not ok:
                    return False, language_why
        if not self.judges_lid or "guard_lid" not in metrics:
            return True, why
        within, lid_why = self.check_lid(metrics["guard_lid"])
        return (True, f"{why}; {lid_why}") if within else (False, lid_why)

    def check_language(self, language: str, value: float | None, metric: str) -> tuple[bool, str]:
        """``(within tolerance, why)`` for one language's figure in a guard of several."""
        name = "drift" if self.kind == "drift" else metric
        return self.within_tolerance(
            value, self.language_starts[language], f"guard {name} of {language!r}"
        )

    def within_tolerance(
        self, value: float | None, start: float, what: str = "guard"
    ) -> tuple[bool, str]:
        """``(value <= start + tolerance, why)``: the rule every guard figure is held to."""
        value = math.nan if value is None else float(value)
        what = f"{what} {short_number(value)}"
        if not math.isfinite(value):
            return False, f"{what}: never within tolerance"
        # The small margin absorbs float noise, so start + tolerance itself is within.
        if value > start + self.tolerance + 1e-12:
            return False, f"{what} > start {short_number(start)} + tolerance {short_number(self.tolerance)}"
        return True, f"{what} <= start {short_number(start)} + tolerance {short_number(self.tolerance)}"

    @property
    def judges_lid(self) -> bool:
        """Whether a save also needs the language-identification accuracy within tolerance."""
        return self.lid_start is not None and self.lid_tolerance is not None

    def check_lid(self, value: float | None) -> tuple[bool, str]:
        """``(within tolerance, why)`` for a language-identification accuracy."""
        if self.lid_start is None or self.lid_tolerance is None:
            raise RuntimeError("the guard judges no language identification (GuardGate.judges_lid)")
        value = math.nan if value is None else float(value)
        what = f"guard language-ID accuracy {short_number(value)}"
        limits = f"start {short_number(self.lid_start)} - tolerance {short_number(self.lid_tolerance)}"
        if not math.isfinite(value):
            return False, f"{what}: never within tolerance"
        # The same margin as for the WER: start - tolerance itself is within.
        if value >= self.lid_start - self.lid_tolerance - 1e-12:
            return True, f"{what} >= {limits}"
        return False, f"{what} < {limits}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "kind": self.kind,
            "tolerance": self.tolerance,
            "start_transcripts": dict(self.start_transcripts),
            # only a guard that measures language identification records its start
            **({"lid_start": self.lid_start} if self.lid_start is not None else {}),
            # only a guard of several languages records each one's start
            **({"language_starts": dict(self.language_starts)} if self.language_starts else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.start, self.kind = state["start"], state["kind"]
        self.start_transcripts = dict(state.get("start_transcripts") or {})
        self.lid_start = state.get("lid_start")
        self.language_starts = dict(state.get("language_starts") or {})


def describe_refused(
    step: int,
    refused: Mapping[str, float],
    before: Mapping[str, float],
    *,
    before_step: int | None,
    selected_on: str,
    guard_kind: str | None,
) -> str:
    """What the forgetting guard kept from the run: the step it refused that the policy alone
    would have chosen (``refused``: its metrics), what the policy's metrics did from
    ``before`` (the evaluation at ``before_step``: the start, else the best), how far the guard
    drifted, and where that checkpoint is."""
    names = selected_on.split(" and ")
    since = f" since step {before_step}" if before_step is not None else ""
    changes = ", ".join(
        f"{m} {before[m]:.4f} -> {refused[m]:.4f}{since}"
        for m in names
        if m in before and m in refused
    ) or format_metrics(refused)
    guard = ""
    lid_refused = (
        "guard_lid" in refused
        and refused["guard_lid"]
        < refused.get("guard_lid_start", 0.0) - refused.get("guard_lid_tolerance", 0.0) - 1e-12
    )
    languages_refused = {
        language: figure
        for language, figure in (refused.get("guard_languages") or {}).items()
        if not figure["within"]
    }
    wer_refused = (
        not (lid_refused or languages_refused)
        or refused.get("guard_wer", 0.0)
        > refused.get("guard_start", 0.0) + refused.get("guard_tolerance", 0.0) + 1e-12
    )
    if "guard_wer" in refused and wer_refused:
        # a guard with references names its metric: CER for unspaced scripts, else WER
        name = "drift" if guard_kind == "drift" else refused.get("guard_metric", "wer")
        guard = (
            f"; guard {name} {refused['guard_wer']:.4f} > start "
            f"{refused.get('guard_start', 0.0):.4f} + tolerance "
            f"{refused.get('guard_tolerance', 0.0):g}"
        )
    for language, figure in languages_refused.items():
        name = "drift" if guard_kind == "drift" else figure["metric"]
        guard += (
            f"; guard {name} of {language!r} {figure['value']:.4f} > start "
            f"{figure['start']:.4f} + tolerance {refused.get('guard_tolerance', 0.0):g}"
        )
    if lid_refused:
        guard += (
            f"; guard language-ID accuracy {refused['guard_lid']:.4f} < start "
            f"{refused.get('guard_lid_start', 0.0):.4f} - tolerance "
            f"{refused.get('guard_lid_tolerance', 0.0):g}"
        )
    return (
        f"the forgetting guard refused step {step}, the best by the selection policy alone "
        f"({changes}{guard}); it is kept in checkpoints/best-unguarded/ (`asrforge export "
        f"RUN --within-guard` finds the share of it that stays within the guard)"
    )


WITHIN_GUARD_SHARES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
"""The shares of the fine-tuned weights an export within the guard tries, largest first."""


def largest_share_within(
    measure: Callable[[float], Mapping[str, Any]], shares: Iterable[float], gate: GuardGate
) -> tuple[float | None, list[tuple[float, float]]]:
    """The largest of ``shares`` whose guard metrics (``measure(share)``, the guard's metrics of
    the weights interpolated with that share of the fine-tuned ones) ``gate`` accepts, and the
    ``(share, guard_wer)`` pairs measured. Shares are measured largest first, up to the first
    accepted one (None: none is within the tolerance)."""
    figures = []
    for share in sorted(set(shares), reverse=True):
        metrics = measure(share)
        figures.append((share, metrics["guard_wer"]))
        if gate.check(metrics)[0]:
            return share, figures
    return None, figures


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


@dataclass(frozen=True)
class Decision:
    """What one evaluation decided: the selector's verdict, the ``on_eval_end`` payload."""

    save: bool
    """This evaluation's checkpoint is the new best."""
    reason: str
    """Which condition decided ``save``."""
    should_stop: bool = False
    """Patience has run out, or the step cap is reached."""
    stop_reason: str | None = None
    unguarded: bool = False
    """The guard alone refused this evaluation, which the policy without a guard would have
    saved: its checkpoint is the best refused one (``best-unguarded/``)."""


class Selector:
    """A policy plus patience and a step cap; its state rides in the training checkpoint.

    Args:
        policy: the save rule.
        patience: evaluations in a row without a save after which ``should_stop`` is set. With
            a guard, an evaluation the guard alone refused still counts as progress when the
            policy, ignoring the guard, would have saved it (see the module docstring).
        max_steps: optimizer-step cap of this run's group (None: no cap). The loop trains for
            ``min(train.max_steps, max_steps)``; an update at ``step >= max_steps`` also stops.
        why: a sentence saying where the policy, cap and patience came from.
        guard: the forgetting guard's gate (None: no guard).
        error_metric: the error rate the policy judges, ``"wer"`` or ``"cer"``
            (:func:`error_metric`); recorded in the state and the evaluation records.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        patience: int,
        max_steps: int | None,
        why: str = "",
        guard: GuardGate | None = None,
        error_metric: str = "wer",
    ):
        self.policy = policy
        self.error_metric = error_metric
        self.without_save = Patience(patience)
        self.max_steps = max_steps
        self.why = why
        self.guard = guard
        self.n_evals = 0
        self.best_step: int | None = None
        """The step of the evaluation whose checkpoint is the best."""
        self.best: dict[str, float] = {}
        """That evaluation's metrics (``wer``, ``cer``, ``loss``, ``n``, ...; finite numbers)."""
        self.held_out_state: dict[str, Any] | None = None
        """With a guard: the policy's bests over every evaluation, refused ones included, as if
        there were no guard; patience judges progress by them (None: no guard, or nothing
        evaluated yet)."""
        self.start: dict[str, float] = {}
        """The evaluation of the starting model (step 0, ``eval.at_start``); empty without one.
        Being the first evaluation, it seeds the policy's bests: a trained step becomes best
        only by beating it, and patience counts from it."""
        self.unguarded_step: int | None = None
        """With a guard: the step of the best evaluation the guard alone refused, better by the
        policy than every evaluation before it, refused ones included (None: none, or a later
        evaluation within the guard beat it)."""
        self.unguarded: dict[str, float] = {}
        """That evaluation's metrics, the guard's (``guard_wer``, ``guard_start``, ...) included."""

    @property
    def patience(self) -> int:
        return self.without_save.limit

    @property
    def evals_without_save(self) -> int:
        return self.without_save.count

    @property
    def tracked_bests(self) -> dict[str, float]:
        """The policy's own bests over all saved evaluations (``best_wer``, ``best_loss``,
        ``best_cer``), which may come from evaluations other than the best checkpoint's."""
        return finite_numbers(self.policy.state_dict())

    @property
    def policy_name(self) -> str:
        return self.policy.name

    @property
    def selected_on(self) -> str:
        """What the policy judges: ``loss``, the error rate (``wer`` or ``cer``), or both."""
        if self.policy.name == "by_loss":
            return "loss"
        if self.policy.name == "by_wer":
            return self.error_metric
        return f"{self.error_metric} and loss"

    def update(self, metrics: Mapping[str, float], step: int | None = None) -> Decision:
        """Judge one evaluation.

        Args:
            metrics: at least the keys the policy reads (``wer``, ``loss``; ``cer`` optional), and
                ``guard_wer`` with a guard.
            step: the optimizer step evaluated, for ``best_step`` and the step cap.
        """
        before = self.policy.state_dict()
        save = self.policy.update(metrics)
        reason = self.policy.reason
        unguarded = False
        if step == 0:  # the starting model, before any optimizer step
            self.start = finite_numbers(metrics)
            reason = f"the starting model (step 0), {reason}"
        progressed = save
        if self.guard is not None:
            within, why = self.guard.check(metrics)
            after = self.policy.state_dict()
            progressed = self._held_out_progress(metrics, before)
            # A refused save leaves the policy's bests where they were.
            if save and not within:
                self.policy.load_state_dict(before)
                save = False
                reason = f"{reason}, but {why}"
            else:
                self.policy.load_state_dict(after)
                reason = f"{reason}; {why}"
            # The best evaluation by the policy alone is kept beside best/ while the guard
            # refuses it, so what the run learned outlives the guard's verdict.
            if progressed:
                unguarded = not within
                self.unguarded_step = step if unguarded else None
                self.unguarded = finite_numbers(metrics) if unguarded else {}
        self.n_evals += 1
        if save:
            self.best_step, self.best = step, finite_numbers(metrics)
        stop_reason = None
        # patience counts evaluations without held-out progress: drift alone must not stop a
        # run that still improves on held-out data (the guard still decides what is best)
        if self.without_save.update(save or progressed):
            stop_reason = (
                f"no new best in {self.evals_without_save} evaluations (patience {self.patience})"
                if self.held_out_state is None
                else f"held-out metrics did not improve in {self.evals_without_save} evaluations "
                f"(patience {self.patience})"
            )
        elif step is not None and self.max_steps is not None and step >= self.max_steps:
            stop_reason = f"step {step} reached max_steps {self.max_steps}"
        return Decision(save, reason, stop_reason is not None, stop_reason, unguarded)

    def _held_out_progress(self, metrics: Mapping[str, float], before: dict[str, Any]) -> bool:
        """Would the policy have saved this evaluation if the guard had never refused one? The
        held-out bests that answers it (:attr:`held_out_state`) move as if there were no guard.
        Leaves the policy in that state; the caller restores its own."""
        self.policy.load_state_dict(
            self.held_out_state if self.held_out_state is not None else before
        )
        progressed = self.policy.update(metrics)
        self.held_out_state = self.policy.state_dict()
        return progressed

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: the policy's bests, the patience counter and the guard's start."""
        state = {
            "policy": self.policy.name,
            "error_metric": self.error_metric,
            "policy_state": self.policy.state_dict(),
            "evals_without_save": self.evals_without_save,
            "n_evals": self.n_evals,
            "best_step": self.best_step,
            "best": dict(self.best),
            "start": dict(self.start),
        }
        if self.guard is not None:
            state["guard"] = self.guard.state_dict()
            state["held_out_state"] = self.held_out_state
            state["unguarded_step"] = self.unguarded_step
            state["unguarded"] = dict(self.unguarded)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            UserError: the state was saved under a different policy than this run's config, or
                without the forgetting guard this run has (its start cannot be measured now).
        """
        if state["policy"] != self.policy.name:
            raise UserError(
                f"the checkpoint's selection state is for policy {state['policy']!r}, but this "
                f"run selects with {self.policy.name!r}; resume with the same selection config"
            )
        # A state from before the metric was recorded judged WER.
        saved = state.get("error_metric", "wer")
        if saved != self.error_metric and self.policy.name != "by_loss":
            raise UserError(
                f"selection.unspaced_error_rate: the checkpoint's selection judged by "
                f"{saved.upper()}, this run by {self.error_metric.upper()}; set "
                f"selection.unspaced_error_rate: {saved} to resume it"
            )
        if self.guard is not None:
            if not (state.get("guard") or {}).get("kind"):
                raise UserError(
                    "eval.guard: the checkpoint was saved by a run without the forgetting guard; "
                    "the guard compares with the run's starting model, which a resumed run no "
                    "longer has: remove eval.guard to resume, or start a new run"
                )
            self.guard.load_state_dict(state["guard"])
        self.policy.load_state_dict(state["policy_state"])
        self.without_save.count = int(state["evals_without_save"])
        self.n_evals = int(state["n_evals"])
        self.best_step = state.get("best_step")
        self.best = dict(state.get("best") or {})
        self.held_out_state = state.get("held_out_state")  # None from a run before it existed
        # a run resumed without the guard has nothing refused: best-unguarded/ goes at its next save
        if self.guard is not None:
            self.unguarded_step = state.get("unguarded_step")
            self.unguarded = dict(state.get("unguarded") or {})
        # An empty start means the starting model was not evaluated.
        self.start = dict(state.get("start") or {})


def build_selector(
    cfg: SelectionConfig,
    language: str | None,
    partial: bool,
    guard: GuardConfig | None = None,
    *,
    trains: str | None = None,
    chosen_by: str | None = None,
) -> Selector:
    """The selector for a run: policy, patience and step cap from config and language table.

    Args:
        cfg: the ``selection`` section.
        language: the run's language (code or English name); ``cfg.language`` wins when set.
        partial: only part of the model trains (a frozen encoder or encoder layers, LoRA
            adapters on a frozen base): default patience 3, else 5.
        guard: the ``eval.guard`` section: every save must keep the guard within its tolerance.
        trains: what trains, as the reason for the default patience says it (default: "part of
            the model trains" or "the whole model trains", by ``partial``).
        chosen_by: the rule that made ``language`` the run's (:func:`run_language`), for
            :attr:`Selector.why`.

    Raises:
        UserError: no language, an unknown language, or an invalid group table (ConfigError).
    """
    field = "selection.language" if cfg.language is not None else "selection"
    language = cfg.language if cfg.language is not None else language
    if language is None:
        raise UserError("selection: no language to pick the policy by; set selection.language")
    source, groups = group_table(cfg)
    where = source if cfg.groups is not None else None
    group_name = resolve_group(language, groups, where=where, field=field)
    group = groups[group_name]
    code = find_language_code(language)
    who = f"language {language!r} ({LANGUAGES[code]})" if code else f"language {language!r}"
    if chosen_by is not None:
        who = f"{who}, {chosen_by},"
    in_group = f"{who} is in group {group_name} of {source}"

    if cfg.policy == "auto":
        policy_name = group.policy
        parts = [f"{in_group} → {policy_name}"]
    else:
        policy_name = cfg.policy
        parts = [f"selection.policy set in config → {policy_name} ({in_group}: {group.policy})"]
    metric = error_metric(language, cfg)
    if policy_name != "by_loss" and is_unspaced(language):
        why_metric = (
            "CER: the language is written without spaces (selection.unspaced_error_rate: wer "
            "judges by WER)"
            if metric == "cer"
            else "WER, though the language is written without spaces "
            "(selection.unspaced_error_rate: wer)"
        )
        parts[0] = f"{parts[0]} on {why_metric}"
    if cfg.max_steps is not None:
        max_steps = cfg.max_steps
        parts.append(f"max_steps {max_steps} (selection.max_steps)")
    else:
        max_steps = group.max_steps
        parts.append(f"max_steps {max_steps} (group {group_name})" if max_steps else "no step cap")
    if cfg.patience is not None:
        patience = cfg.patience
        parts.append(f"patience {patience} (selection.patience)")
    else:
        patience = PATIENCE_PARTIAL if partial else PATIENCE_FULL
        if trains is None:
            trains = "part of the model trains" if partial else "the whole model trains"
        parts.append(f"patience {patience} ({trains})")

    policy: Policy
    if policy_name == "by_wer":
        policy = ByWer(metric)
    elif policy_name == "by_loss":
        policy = ByLoss()
    else:
        policy = CombinedGate(wer_tol=cfg.wer_tol, loss_eps=cfg.loss_eps, metric=metric)
    gate = None
    if guard is not None:
        gate = GuardGate(guard.tolerance, guard.lid_tolerance)
        parts.append(f"forgetting guard {guard.path} (tolerance {guard.tolerance:g})")
    return Selector(
        policy,
        patience=patience,
        max_steps=max_steps,
        why=", ".join(parts),
        guard=gate,
        error_metric=metric,
    )


def error_metric(language: str, cfg: SelectionConfig) -> str:
    """The error rate a policy's ``wer`` stands for in a run of ``language``: ``"cer"`` for a
    language written without spaces, where a word error is a whole sentence's (unless
    ``selection.unspaced_error_rate`` is ``wer``), else ``"wer"``."""
    if cfg.unspaced_error_rate == "wer":
        return "wer"
    return primary_metric(language)


def run_language(cfg: TrainConfig, counts: Mapping[str, int]) -> tuple[str, str]:
    """The language whose group picks the policy, and the rule that chose it:
    ``selection.language``, else the first of ``data.languages``, else the training split's most
    frequent language (of a tie, the one met first).

    Args:
        cfg: the run's config.
        counts: utterances per language of the training split.

    Raises:
        UserError: no language at all.
    """
    if cfg.selection.language is not None:
        return cfg.selection.language, "set in selection.language"
    if cfg.data.languages:
        return cfg.data.languages[0], "the first of data.languages"
    if not counts:
        raise UserError("selection: no language to pick the policy by; set selection.language")
    language, n = Counter(counts).most_common(1)[0]
    total = sum(counts.values())
    return language, f"the most frequent language of the training split ({n} of {total})"


def mixed_groups(cfg: TrainConfig, counts: Mapping[str, int], language: str, rule: str) -> str:
    """A warning when the run's languages (``data.languages``, else the training split's) fall
    in more than one group of the table, naming the groups and the rule that picked the policy;
    "" when they share one or ``selection.language`` chose. A language no group can place is
    left to :func:`build_selector` to name."""
    if cfg.selection.language is not None:
        return ""
    source, groups = group_table(cfg.selection)
    where = source if cfg.selection.groups is not None else None
    members: dict[str, list[str]] = {}
    for entry in cfg.data.languages or list(counts):
        try:
            members.setdefault(resolve_group(entry, groups, where=where), []).append(entry)
        except UserError:
            continue
    if len(members) < 2:
        return ""
    spread = "; ".join(
        f"group {name} ({groups[name].policy}): {', '.join(langs)}"
        for name, langs in members.items()
    )
    return (
        f"selection: the run's languages fall in different groups of {source} ({spread}); the "
        f"policy and step cap follow {language!r}, {rule}: set selection.language to the "
        "language whose group should decide, or selection.policy and selection.max_steps"
    )


def group_table(cfg: SelectionConfig) -> tuple[str, dict[str, PolicyGroup]]:
    """The run's language-group table and where it comes from: ``selection.groups``, else the
    shipped file."""
    if cfg.groups is not None:
        return "selection.groups", cfg.groups
    return GROUPS_FILE.name, default_groups()


def default_groups() -> dict[str, PolicyGroup]:
    """The shipped language-group table (``asrforge/selection_groups.yaml``)."""
    data = yaml.safe_load(GROUPS_FILE.read_text())
    try:
        return TypeAdapter(dict[str, PolicyGroup]).validate_python(data)
    except ValidationError as e:
        raise ConfigError([str(e)], str(GROUPS_FILE)) from None


def resolve_group(
    language: str,
    groups: Mapping[str, PolicyGroup],
    *,
    where: str | None = "selection.groups",
    field: str = "selection",
) -> str:
    """The name of the group that holds ``language`` (by code or name; else the catch-all group,
    the one with an empty ``languages`` list).

    Args:
        language: a code or English name.
        groups: the table, group name -> group.
        where: the YAML path of the table, prefixed to each problem (None for the shipped file).
        field: the YAML path named when ``language`` itself is the problem.

    Raises:
        ConfigError: the table names an unknown language, a language twice, or two catch-alls.
        UserError: ``language`` is unknown, or in no group while there is no catch-all.
    """
    prefix = f"{where}." if where else ""
    owner: dict[str, str] = {}
    catch_all: list[str] = []
    problems = []
    for name, group in groups.items():
        if not group.languages:
            catch_all.append(name)
        for i, entry in enumerate(group.languages):
            code = find_language_code(entry)
            if code is None:
                problems.append(unknown_language(entry, f"{prefix}{name}.languages.{i}"))
            elif code in owner and owner[code] != name:
                problems.append(
                    f"{prefix}{name}.languages.{i}: {entry!r} is also in group {owner[code]}"
                )
            else:
                owner[code] = name
    if len(catch_all) > 1:
        problems.append(
            f"{where or 'groups'}: groups {', '.join(catch_all)} all have an empty languages "
            f"list; at most one group may take the rest"
        )
    if problems:
        raise ConfigError(problems, None if where else str(GROUPS_FILE))

    code = resolve_language(language, field)
    if code in owner:
        return owner[code]
    if catch_all:
        return catch_all[0]
    raise UserError(
        f"{field}: language {language!r} is in no group of {where or GROUPS_FILE.name}, and no "
        f"group has an empty languages list to take the rest"
    )


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
