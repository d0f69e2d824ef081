"""The selector: a policy, patience, a step cap and the guard's gate, whose state rides in the
training checkpoint; built from the config and the language-group table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asrforge.config import GuardConfig, SelectionConfig
from asrforge.errors import UserError
from asrforge.io.records import (
    COUNT,
    MAPPING,
    NUMBER,
    TEXT,
    mapping_of,
    optional,
    record_problems,
)
from asrforge.selection.groups import error_metric, group_table, resolve_group
from asrforge.selection.guard_gate import GuardGate
from asrforge.selection.policies import (
    ByLoss,
    ByWer,
    CombinedGate,
    Patience,
    Policy,
    finite_numbers,
)
from asrforge.text.languages import (
    LANGUAGES,
    find_language_code,
    is_unspaced,
)

PATIENCE_FULL = 5
"""Default patience when every weight trains (the seed's SFT: full supervised fine-tuning)."""


PATIENCE_PARTIAL = 3
"""Default patience when part of the model is frozen: a frozen encoder or its lower layers, or
LoRA adapters on a frozen base (parameter-efficient training is not the seed's full SFT)."""


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
        self.unguarded_why: str = ""
        """Why the guard refused that evaluation, in the gate's words (which figure was out of
        tolerance: the pooled one, a language's or the language identification's)."""

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
                self.unguarded_why = why if unguarded else ""
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
            state["unguarded_why"] = self.unguarded_why
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            UserError: the state was saved under a different policy than this run's config, or
                without the forgetting guard this run has (its start cannot be measured now).
            ValueError: a field is missing or not of its kind (a damaged or altered record).
        """
        problems = selection_state_problems(state)
        if problems:
            raise ValueError("; ".join(problems))
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
            # a state from before the reason was kept: the gate judges the figures it kept again
            self.unguarded_why = state.get("unguarded_why") or (
                self.guard.check(self.unguarded)[1] if "guard_wer" in self.unguarded else ""
            )
        # An empty start means the starting model was not evaluated.
        self.start = dict(state.get("start") or {})


_STATE_KINDS = {
    "policy": TEXT, "error_metric": TEXT, "policy_state": mapping_of(optional(NUMBER)),
    "evals_without_save": COUNT, "n_evals": COUNT, "best_step": optional(COUNT),
    "best": MAPPING, "start": MAPPING, "guard": MAPPING, "held_out_state": optional(MAPPING),
    "unguarded_step": optional(COUNT), "unguarded": MAPPING, "unguarded_why": optional(TEXT),
}  # fmt: skip
_GUARD_KINDS = {
    "start": optional(NUMBER), "kind": TEXT, "tolerance": NUMBER,
    "start_transcripts": mapping_of(TEXT), "lid_start": optional(NUMBER),
    "language_starts": mapping_of(NUMBER), "precision": optional(TEXT), "decode": optional(TEXT),
}  # fmt: skip


def selection_state_problems(state: Any) -> list[str]:
    """What in a saved selection state (:meth:`Selector.state_dict`) is missing or not of its
    kind, by field (``selection.guard.start: '0.2' is not a number or null``)."""
    required = ("policy", "policy_state", "evals_without_save", "n_evals")
    problems = record_problems(state, _STATE_KINDS, "selection", required)
    if not problems and state.get("guard"):
        problems = record_problems(state["guard"], _GUARD_KINDS, "selection.guard", ("start", "kind"))
    return problems


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
