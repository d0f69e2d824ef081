"""The forgetting guard's gate: a save keeps the guard within its tolerance of the start; the
step the guard refused, and the largest share of the fine-tuned weights within it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from asrforge.selection.policies import format_metrics, short_number


def within(value: float, start: float, tolerance: float) -> bool:
    """The rule every guard figure is held to: ``value <= start + tolerance`` (nan: never)."""
    # The small margin absorbs float noise, so start + tolerance itself is within.
    return math.isfinite(value) and value <= start + tolerance + 1e-12


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
        self.precision: str | None = None
        """What the start was measured in (None: recorded by an older asrforge, which
        measured it in the training's autocast)."""
        self.decode: str | None = None
        """How the start was decoded, ``eval.guard.decode`` (None: recorded by an older
        asrforge, which decoded as ``prompt``)."""

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
        precision: str | None = None,
        decode: str | None = None,
    ) -> None:
        """Record the starting model's guard WER, the guard's kind (``wer`` or ``drift``), its
        transcript of each item (id -> text), its language-identification accuracy (None:
        not measured), each language's own figure (a guard of several languages), and the
        precision it was measured in and how it was decoded."""
        self.start, self.kind, self.start_transcripts = float(wer), kind, dict(transcripts)
        self.precision, self.decode = precision, decode
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
        if not within(value, start, self.tolerance):
            return (
                False,
                f"{what} > start {short_number(start)} + tolerance {short_number(self.tolerance)}",
            )
        return (
            True,
            f"{what} <= start {short_number(start)} + tolerance {short_number(self.tolerance)}",
        )

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
        limits = (
            f"start {short_number(self.lid_start)} - tolerance {short_number(self.lid_tolerance)}"
        )
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
            **({"precision": self.precision} if self.precision is not None else {}),
            **({"decode": self.decode} if self.decode is not None else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.start, self.kind = state["start"], state["kind"]
        self.start_transcripts = dict(state.get("start_transcripts") or {})
        self.lid_start = state.get("lid_start")
        self.language_starts = dict(state.get("language_starts") or {})
        self.precision = state.get("precision")
        self.decode = state.get("decode")


def describe_refused(
    step: int,
    refused: Mapping[str, float],
    before: Mapping[str, float],
    *,
    before_step: int | None,
    selected_on: str,
    why: str,
) -> str:
    """What the forgetting guard kept from the run: the step it refused that the policy alone
    would have chosen (``refused``: its metrics), what the policy's metrics did from
    ``before`` (the evaluation at ``before_step``: the start, else the best), why the guard
    refused it (:meth:`GuardGate.check`'s reason), and where that checkpoint is."""
    names = selected_on.split(" and ")
    since = f" since step {before_step}" if before_step is not None else ""
    changes = ", ".join(
        f"{m} {before[m]:.4f} -> {refused[m]:.4f}{since}"
        for m in names
        if m in before and m in refused
    ) or format_metrics(refused)
    return (
        f"the forgetting guard refused step {step}, the best by the selection policy alone "
        f"({changes}; {why}); it is kept in checkpoints/best-unguarded/ (`asrforge export "
        f"RUN --within-guard` finds the share of it that stays within the guard)"
    )


WITHIN_GUARD_SHARES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
"""The shares of the fine-tuned weights an export within the guard tries, largest first."""


def largest_share_within(
    measure: Callable[[float], Mapping[str, Any]], shares: Iterable[float], gate: GuardGate
) -> tuple[float | None, list[tuple[float, Mapping[str, Any]]]]:
    """The largest of ``shares`` whose guard metrics (``measure(share)``, the guard's metrics of
    the weights interpolated with that share of the fine-tuned ones) ``gate`` accepts, and the
    ``(share, metrics)`` pairs measured. Shares are measured largest first, up to the first
    accepted one (None: none is within the tolerance)."""
    figures = []
    for share in sorted(set(shares), reverse=True):
        metrics = measure(share)
        figures.append((share, metrics))
        if gate.check(metrics)[0]:
            return share, figures
    return None, figures
