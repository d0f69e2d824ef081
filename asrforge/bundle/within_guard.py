"""An export within the forgetting guard (``asrforge export --within-guard``): the run's guard
measured on its fine-tuned weights interpolated with the starting model's, largest share
first, and the largest share within it exported as a bundle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from asrforge.bundle.contents import checkpoint_contents, read_run_config, with_lm
from asrforge.bundle.export import (
    check_same_start,
    contents_to_bundle,
    export_interpolated,
    finetuned_checkpoint,
    out_problem,
    start_weights,
)
from asrforge.checkpoint.average import interpolate_weights
from asrforge.errors import UserError
from asrforge.evaluation.guard import (
    build_guard,
    guard_language,
    log_text,
    measure_interpolations,
    recorded_gate,
    recorded_language,
)
from asrforge.model.build import BuiltModel
from asrforge.model.frames import window_seconds
from asrforge.model.tokenizer import SpecialTokens
from asrforge.run_layout import checkpoint_name
from asrforge.selection.guard_gate import GuardGate


def run_guard(cfg, run_dir: Path, contents, model):
    """The run's forgetting guard (``eval.guard``) for ``model``, transcribed in the language
    the run's guard records say, else the run's."""
    specials = SpecialTokens.from_tokenizer(
        contents.tokenizer, contents.inference.multilingual, cfg.data.language_tokens
    )
    features = contents.inference.features.extractor()
    built = BuiltModel(model, contents.tokenizer, specials, features)
    trained = contents.inference.trained_languages or contents.inference.languages
    language = recorded_language(run_dir) or guard_language(cfg, trained)
    return build_guard(cfg, built, language=language, window_seconds=window_seconds(model.config))


def export_within_guard(source: Path, weights: str, shares: tuple[float, ...], out: Path,
                         fmt: str, *, lm: Path | None, ct2_quantization: str | None,
                         max_shard_size: str | None, progress: Callable[[str], None],
                         say: Callable[[str], None],
                         overwrite: bool = False) -> tuple[Path, dict, GuardGate]:  # fmt: skip
    """Measure the run's guard on the fine-tuned weights of ``source`` interpolated with the
    starting model's, largest share first, and export the largest share within it to ``out``.

    Args:
        progress: gets the line saying what is measured, before the measuring.
        say: gets each measured share's line.
        overwrite: replace a bundle at ``out`` (checked before any measuring).

    Returns:
        The bundle written, the facts its ``source.within_guard`` records, and the guard's gate.

    Raises:
        UserError: a run without ``eval.guard``, no starting weights, or no share within it.
    """
    ckpt = finetuned_checkpoint(source)
    if (problem := out_problem(out, source, overwrite=overwrite)) is not None:
        raise UserError(problem)
    cfg = read_run_config(ckpt)
    if cfg.eval.guard is None:
        raise UserError(f"--within-guard: {ckpt} was trained without eval.guard: no guard to keep")
    gate = recorded_gate(ckpt, cfg.eval.guard.tolerance)
    start, start_from = start_weights(ckpt)
    contents = checkpoint_contents(ckpt, weights)
    if lm is not None:
        contents = with_lm(contents, lm)
    bundle = contents_to_bundle(contents)
    finetuned = check_same_start(contents.state, start, start_from, ckpt)
    guard = run_guard(cfg, ckpt.parent.parent, contents, bundle.model)
    measured_in = guard.precision
    if gate.precision is None:  # an older run's start, measured in its training's autocast
        measured_in += "; the start was recorded without its precision"
    progress(
        f"asrforge: measuring the forgetting guard ({len(guard.items)} item(s), "
        f"{'drift' if gate.kind == 'drift' else guard.metric}, start {gate.start:.4f}, "
        f"tolerance {gate.tolerance:g}, in {measured_in}) on {ckpt} interpolated with "
        f"{start_from}"
    )
    share, figures = measure_interpolations(
        guard, gate, bundle.model, start, finetuned, shares, device=bundle.device
    )
    for a, metrics in figures:
        why = gate.check(metrics)[1]
        say(f"  share {a:g}: {'within' if a == share else 'outside'}: {why};{log_text(metrics)}")
    if share is None:
        raise UserError(
            f"--within-guard: no share of {ckpt}'s weights in {', '.join(f'{a:g}' for a in shares)} "
            f"keeps the guard within start {gate.start:.4f} + tolerance {gate.tolerance:g} "
            f"(share {figures[-1][0]:g}: {gate.check(figures[-1][1])[1]}); nothing was exported "
            "(try smaller --shares)"
        )
    chosen = dict(figures)[share]
    facts = {
        "share": share,
        "finetuned": checkpoint_name(ckpt),
        "start": start_from,
        "guard_kind": gate.kind,
        "guard_start": gate.start,
        "guard_tolerance": gate.tolerance,
        "guard_precision": guard.precision,
        "guard_decode": guard.decode,
        "guard": chosen["guard_wer"],
        "measured": [measured_share(a, metrics, gate) for a, metrics in figures],
    }
    written = export_interpolated(
        contents,
        interpolate_weights(start, finetuned, share),
        facts,
        guard_figures(chosen),
        out,
        fmt,
        ct2_quantization=ct2_quantization,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
    )
    return written, facts, gate


def guard_figures(metrics: dict) -> dict:
    """The guard's figures of one measured share (``guard_*``: pooled, each language's, the
    language ID), as a bundle's ``source.metrics`` records what was measured of its weights."""
    return {k: v for k, v in metrics.items() if k.startswith("guard_")}


def measured_share(share: float, metrics: dict, gate: GuardGate) -> dict:
    """One share's entry of ``source.within_guard.measured``: its pooled figure, whether the gate
    took it and why, and each language's own figures (a guard of several languages)."""
    within, why = gate.check(metrics)
    entry = {"share": share, "guard": metrics["guard_wer"], "within": within, "why": why}
    if "guard_languages" in metrics:
        entry["languages"] = metrics["guard_languages"]
    if "guard_lid" in metrics:
        entry["lid"] = metrics["guard_lid"]
    return entry
