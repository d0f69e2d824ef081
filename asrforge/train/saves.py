"""When a run saves, and what its training checkpoint holds."""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from pathlib import Path

from asrforge.checkpoint import CheckpointContents, capture_rng_state
from asrforge.checkpoint.training import save_tokenizer
from asrforge.config import TrainConfig
from asrforge.io.atomic import TMP_PREFIX
from asrforge.model import lora
from asrforge.run_layout import step_dir_name
from asrforge.train.events import Decision
from asrforge.train.forward import WHISPER_PREFIX
from asrforge.train.records import scalars
from asrforge.train.setup import RunSetup
from asrforge.train.sharding import full_weights, save_optimizer_shards
from asrforge.train.state import TrainState

GUARD_META = (
    "guard_wer",
    "guard_start",
    "guard_tolerance",
    "guard_within",
    "guard_drift",
    "guard_lid",
    "guard_lid_start",
    "guard_lid_tolerance",
)
"""The forgetting guard's metrics a checkpoint's metadata names (``asrforge.evaluation.guard``)."""


def saves_this_step(
    cfg: TrainConfig,
    state: TrainState,
    decision: Decision | None,
    stopping: bool,
    run_ends: Callable[[], bool],
) -> bool:
    """Whether the loop saves a checkpoint after the step just taken.

    A save is asked for (``state.should_save`` raised) by a callback, by this step's
    evaluation (``decision``; ``checkpoint.save_on_eval``, a new best, or the best the guard
    refused), by ``checkpoint.checkpoint_every``, or by a stop signal (``stopping``). It waits when the run
    ends here (``run_ends()``) and the end-of-run evaluation (``eval.at_end``) follows: that
    evaluation's save is this step's.
    """
    if decision is not None:
        state.should_save |= cfg.checkpoint.save_on_eval or decision.save or decision.unguarded
    every = cfg.checkpoint.checkpoint_every
    if (every and state.step % every == 0) or stopping:
        state.should_save = True
    if not state.should_save or stopping:
        return state.should_save
    final_eval_follows = cfg.eval.at_end and state.last_eval_step != state.step
    return not (final_eval_follows and run_ends())


def save_run_checkpoint(
    setup: RunSetup,
    *,
    step,
    model,
    sharded_model=None,
    ema,
    optimizer,
    scheduler,
    scaler,
    state,
    callback_states,
    metrics,
    is_best,
) -> Path | None:
    """Write ``checkpoints/step-NNNNNN`` (main process only); raises CheckpointSaveError.

    With ``sharded_model`` (``train.distributed: fsdp``; ``model`` is the Whisper model inside
    it) every process first gathers the whole weights to rank zero and writes its optimizer
    shard into a staging directory beside the checkpoints, which the checkpoint takes in.
    """
    acc = setup.accelerator
    acc.wait_for_everyone()
    weights, staging = None, None
    if sharded_model is not None:
        weights = full_weights(sharded_model, WHISPER_PREFIX)
        # A temporary's name: a run killed mid-save leaves it for the next start to delete.
        staging = setup.checkpoints.root / f"{TMP_PREFIX}{step_dir_name(step)}-optimizer-shards"
        save_optimizer_shards(
            sharded_model, optimizer.optimizer, staging, acc.is_main_process, acc.wait_for_everyone
        )
        acc.wait_for_everyone()
    if not acc.is_main_process:
        return None
    try:
        return setup.checkpoints.save(
            step,
            CheckpointContents(
                model=weights if weights is not None else lora.checkpoint_weights(model),
                ema=ema.state_dict() if ema is not None else None,
                optimizer=None if staging is not None else optimizer.state_dict(),
                optimizer_dir=staging,
                scheduler=scheduler.state_dict(),
                scaler=scaler.state_dict() if scaler is not None else None,
                rng=capture_rng_state(),
                train_state=state.to_dict(),
                callbacks=callback_states,
                config_yaml=setup.cfg.to_yaml(),
                tokenizer_save=functools.partial(save_tokenizer, setup.model_bundle.tokenizer),
                meta=checkpoint_meta(setup, step, metrics or {}),
                max_shard_bytes=setup.cfg.checkpoint.max_shard_bytes,
            ),
            metrics=scalars(metrics) if metrics else None,
            is_best=is_best,
            unguarded_step=setup.selector.unguarded_step,
        )
    finally:
        # Taken into the checkpoint, or left by a failed save.
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def checkpoint_meta(setup: RunSetup, step: int, metrics: dict) -> dict:
    """What a checkpoint's metadata records of the run and of its evaluation (``metrics``)."""
    meta = {
        "step": step,
        "wer": metrics.get("wer"),
        "cer": metrics.get("cer"),
        "eval_loss": metrics.get("loss"),
        "config_id": setup.cfg.config_id,
        "seed": setup.cfg.seed,
        "multilingual": setup.model_bundle.specials.multilingual,  # the prompt, for export
        # the global batch, which a resume on another number of processes keeps
        "processes": setup.accelerator.num_processes,
        "micro_batches_per_step": setup.cfg.train.grad_accum * setup.accelerator.num_processes,
        "guard": {k: metrics[k] for k in GUARD_META if k in metrics} or None,
    }
    # A resume refuses a model or data set whose Hub branch has moved since (checkpoint.resume).
    if setup.hub_commits:
        meta["hub_commits"] = setup.hub_commits
    # The checkpoint holds the adapters only; export rebuilds the base from this.
    if setup.lora_base is not None:
        meta[lora.BASE_KEY] = setup.lora_base
    return meta
