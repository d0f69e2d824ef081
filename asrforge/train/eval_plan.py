"""Which steps a run's settings evaluate, and what that leaves patience and ``best/`` to act on.

A run evaluates its starting model at step 0 (``eval.at_start``), every ``eval.eval_steps``
optimizer steps, and after its last step (``eval.at_end``). Patience (``selection.patience``,
the ``early_stopping`` callback) can stop a run only at an evaluation before its last step, and
``best/`` can only hold a trained step that some evaluation measured. :func:`plan_warnings` says
at start when the settings leave either with nothing to act on, naming the settings.
"""

from __future__ import annotations

from asrforge.config import TrainConfig


def evaluates_before_the_end(cfg: TrainConfig, max_steps: int) -> bool:
    """Whether an evaluation falls on a step before the run's last one (``max_steps``)."""
    every = cfg.eval.eval_steps
    return every is not None and every < max_steps


def evaluates_a_trained_step(cfg: TrainConfig, max_steps: int) -> bool:
    """Whether any evaluation measures a trained step (one after step 0)."""
    every = cfg.eval.eval_steps
    return cfg.eval.at_end or (every is not None and every <= max_steps)


def plan_warnings(cfg: TrainConfig, max_steps: int, patience: int) -> list[str]:
    """The start-up warnings of a schedule that leaves configured patience, or the choice of
    ``best/``, nothing to act on.

    Args:
        cfg: the run's config.
        max_steps: the step the run trains to (``train.max_steps`` or the group's lower cap).
        patience: the selector's patience (``selection.patience`` when set).
    """
    warnings = []
    every = cfg.eval.eval_steps
    schedule = (
        "eval.eval_steps is null"
        if every is None
        else f"eval.eval_steps {every} is not below the run's {max_steps} steps"
    )
    stoppers = []
    if cfg.selection.patience is not None:
        stoppers.append(f"selection.patience {patience}")
    for i, spec in enumerate(cfg.callbacks):
        if spec.name == "early_stopping" and spec.options.get("enabled", True) is not False:
            stoppers.append(f"callbacks.{i} (early_stopping)")
    if stoppers and not evaluates_before_the_end(cfg, max_steps):
        warnings.append(
            f"{' and '.join(stoppers)} can never stop this run early: {schedule}, so no step "
            "before the last is evaluated; set eval.eval_steps below train.max_steps for "
            "patience to act"
        )
    if cfg.evaluates_at_start and not evaluates_a_trained_step(cfg, max_steps):
        warnings.append(
            f"eval.at_start is on, but {schedule} and eval.at_end is false: no trained step "
            "is evaluated, so best/ holds the starting weights; the last step is kept beside "
            "it whatever checkpoint.after_run says (set eval.at_end: true to judge it)"
        )
    return warnings
