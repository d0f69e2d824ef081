"""One run in progress (:class:`TrainingRun`): its built pieces, the prepared model and
optimizer, the EMA and the ``TrainState``, with the steps ``Trainer.fit`` calls in order (set-up,
the step loop, the end; the evaluations are :mod:`asrforge.train.evaluations`'s); and how a run
ended (:class:`FitResult`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from asrforge.checkpoint import TrainingCheckpoint, restore_rng_state
from asrforge.config import TrainConfig
from asrforge.data.dataset import UsableClipWatch, dropped_by_reason
from asrforge.data.rules import SkipReport
from asrforge.errors import CheckpointCorruptError, UserError
from asrforge.model.lora import load_model_state
from asrforge.run_layout import TRAIN_STATE_FILE
from asrforge.train.data_wait import DataWaitClock
from asrforge.train.evaluations import RunEvaluations
from asrforge.train.events import CallbackList, RunInfo
from asrforge.train.forgetting import StartingModel
from asrforge.train.forward import WHISPER_PREFIX, TrainingWhisper
from asrforge.train.optim import EMA, build_optimizer, build_scheduler, follow_config, main_lr
from asrforge.train.ranks import agree_to_stop, gather_dropped, placeholder_batch
from asrforge.train.records import write_skip_report
from asrforge.train.saves import save_run_checkpoint
from asrforge.train.setup import RunSetup
from asrforge.train.sharding import (
    check_processes,
    load_full_weights,
    load_optimizer_shards,
    shard_model,
)
from asrforge.train.state import TrainState
from asrforge.train.step import StepTally, finish_step, micro_batch_backward
from asrforge.train.time_budget import TimeBudget

log = logging.getLogger("asrforge.train")


@dataclass
class FitResult:
    """How a run ended."""

    status: str  # "completed", "stopped", "interrupted", "diverged"
    reason: str
    step: int
    best_step: int | None
    best: dict[str, float]
    """The evaluation of the best checkpoint (at ``best_step``): ``wer``, ``cer``, ``loss``, ..."""
    output_dir: Path
    last_metrics: dict = field(default_factory=dict)
    tracked_bests: dict[str, float] = field(default_factory=dict)
    """The bests the selection policy keeps over all evaluations (``best_wer``, ``best_loss``,
    ``best_cer``), which may come from evaluations other than the best checkpoint's."""
    start: dict[str, float] = field(default_factory=dict)
    """The evaluation of the starting model at step 0 (``eval.at_start``); empty without one."""
    refused: str | None = None
    """What the forgetting guard refused that the policy alone would have chosen, and where
    it is kept (``best-unguarded/``; :func:`~asrforge.selection.guard_gate.describe_refused`); None when
    it refused nothing the policy would have chosen."""
    out_of_time: bool = False
    """The run stopped at ``max_time`` with its resume state kept, for ``--resume`` to go on."""

    @property
    def improved_on_start(self) -> bool | None:
        """Whether a trained step became best over the evaluated starting model (None: the
        start was not evaluated)."""
        if not self.start:
            return None
        return self.best_step is not None and self.best_step > 0


class TrainingRun:
    """One run's pieces and its progress: the set-up (data, selector, checkpoints), the prepared
    model (:class:`~asrforge.train.forward.TrainingWhisper`, DDP-wrapped with several processes)
    and optimizer, the schedule, the EMA, the callbacks, the ``TrainState`` and its evaluations
    (:class:`~asrforge.train.evaluations.RunEvaluations`: the forgetting guard, selection and
    records). :meth:`Trainer.fit` calls its steps in order."""

    def __init__(
        self,
        cfg: TrainConfig,
        setup: RunSetup,
        callbacks: CallbackList,
        precision: str,
        budget: TimeBudget | None = None,
    ):
        self.cfg, self.setup, self.callbacks, self.precision = cfg, setup, callbacks, precision
        self.budget = budget
        """The wall-clock budget (``train.max_time``); None without one."""
        self.out_of_time: str | None = None
        """The stop reason once the budget stopped the run (kept off the state: a resumed run
        has a new budget)."""
        self.acc = setup.accelerator
        self.loaders = setup.loaders
        self.whisper = setup.model  # what is saved, evaluated and shown to callbacks
        self.max_steps = setup.max_steps
        training_model = TrainingWhisper(self.whisper, cfg.model.trained_top_encoder_layers)
        self.sharded = cfg.train.distributed == "fsdp"
        if self.sharded:
            check_processes(self.acc.num_processes, precision, self.acc.distributed_type.name)
            # The optimizer follows the sharding: it must hold the sharded parameters.
            self.model = shard_model(training_model.to(self.acc.device), precision, self.acc.device)
            optimizer = build_optimizer(self.whisper, cfg.optim)
            self.optimizer = self.acc.prepare(optimizer)
        else:
            optimizer = build_optimizer(self.whisper, cfg.optim)
            self.model, self.optimizer = self.acc.prepare(training_model, optimizer)
        self.scheduler = build_scheduler(optimizer, cfg.optim, self.max_steps)
        # Taken before a resume loads its checkpoint: the start of the run it continues.
        self.start = StartingModel.of_run(cfg, training_model)
        self.state = TrainState(train_data=setup.train_data)
        self.ema: EMA | None = None
        self.evaluations = RunEvaluations(self)
        """The guard, each evaluation and the selector's judgement of it."""
        self.last_saved_step: int | None = None
        self.stop_error: str | None = None
        """(several processes) The error this process's data stopped the run with, mid-step:
        raised by every process at the step's end (:meth:`agree_to_stop`)."""

    # -- start ---------------------------------------------------------------------------------
    def restore(self, ckpt: TrainingCheckpoint) -> None:
        """Continue from ``ckpt`` exactly: weights (or LoRA adapters), optimizer, schedule, loss
        scale, progress and data position, selection state, checkpoint records, callbacks'
        states and the RNG."""
        if self.sharded:
            if ckpt.optimizer_dir is None:
                raise UserError(
                    f"{ckpt.path}: saved by a run without train.distributed: fsdp (its optimizer "
                    "state is whole); resume it with train.distributed: ddp"
                )
            load_full_weights(self.model, ckpt.model, WHISPER_PREFIX)
            load_optimizer_shards(self.model, self.optimizer.optimizer, ckpt.optimizer_dir)
        elif ckpt.optimizer_dir is not None:
            raise UserError(
                f"{ckpt.path}: saved by a run with train.distributed: fsdp (its optimizer state "
                "is sharded); resume it with train.distributed: fsdp"
            )
        else:
            load_model_state(self.whisper, ckpt.model)
            self.optimizer.load_state_dict(ckpt.optimizer)
        self.scheduler.load_state_dict(ckpt.scheduler)
        saved_lr = main_lr(self.optimizer)
        # A resume may change the learning rate and its schedule: they apply from this step on.
        follow_config(self.optimizer, self.scheduler, self.cfg.optim)
        if (lr := main_lr(self.optimizer)) != saved_lr:
            step = self.scheduler.last_epoch + 1
            log.info(
                "resume: learning rate %g at step %d on this config's schedule (%g on the "
                "checkpoint's)", lr, step, saved_lr,
            )  # fmt: skip
        if ckpt.scaler and self.acc.scaler is not None:
            self.acc.scaler.load_state_dict(ckpt.scaler)
        try:
            state = self.state = TrainState.from_dict(ckpt.train_state)
            # set-up checked the data against the checkpoint's (or it recorded none)
            state.train_data = self.setup.train_data
            # A checkpoint from before the selector kept "best" has it in the training state.
            if state.selection:
                self.setup.selector.load_state_dict({"best": state.best, **state.selection})
        except ValueError as e:
            raise CheckpointCorruptError(f"{ckpt.path / TRAIN_STATE_FILE}: {e}") from None
        # the manifest holds the manager's records including this very checkpoint
        try:
            self.setup.checkpoints.load_state_dict(ckpt.manifest.get("checkpoint_manager", {}))
        except ValueError as e:
            raise CheckpointCorruptError(f"{ckpt.path / 'manifest.json'}: {e}") from None
        try:
            self.callbacks.load_state_dict(ckpt.callbacks)
        except ValueError as e:
            raise CheckpointCorruptError(f"{ckpt.path / 'callbacks.json'}: {e}") from None
        restore_rng_state(ckpt.rng)
        self.last_saved_step = state.step
        # start-up wrote the up-front skips only: the clips dropped before the checkpoint too
        self.write_skip_report()
        log.info(
            "resumed from %s at step %d (epoch %d, batch %d)",
            ckpt.path,
            state.step,
            state.epoch,
            state.batch_in_epoch,
        )

    def start_ema(self) -> None:
        """The EMA of the weights (``train.ema_decay``), from the current weights or the resumed
        checkpoint's average."""
        decay, resumed = self.cfg.train.ema_decay, self.setup.resume_from
        if not decay:
            return
        self.ema = EMA(self.whisper, decay)
        if resumed is not None and resumed.ema is not None:
            self.ema.load_state_dict(resumed.ema)
        elif resumed is not None:
            log.info(
                "EMA (decay %g) starts at step %d from the resumed weights (the checkpoint "
                "has none)",
                decay,
                self.state.step,
            )

    def info(self) -> RunInfo:
        """The ``on_train_begin`` payload."""
        setup, acc = self.setup, self.acc
        return RunInfo(
            config=self.cfg,
            output_dir=setup.output_dir,
            model=self.whisper,
            tokenizer=setup.model_bundle.tokenizer,
            n_params=setup.n_params[0],
            n_trainable=setup.n_params[1],
            precision=self.precision,
            device=str(acc.device),
            world_size=acc.num_processes,
            is_main=acc.is_main_process,
            n_train=len(setup.train_set),
            n_eval=len(setup.eval_set),
            selection=setup.selector.why,
            max_steps=self.max_steps,
            loader_workers=self.loaders.loader_workers,
            resumed=setup.resume_from is not None,
        )

    # -- train ---------------------------------------------------------------------------------
    def micro_batches(self) -> Iterator[dict]:
        """The training micro-batches from the state's data position on, epoch after epoch,
        with the epoch events; they end at ``train.max_epochs`` or when a callback stops the run
        at an epoch's end. Starts the step clock."""
        self._step_started = time.perf_counter()
        # The seconds spent in the loader's next(), for the system monitor.
        self.data_wait = DataWaitClock()
        return self._epochs()

    def _epochs(self) -> Iterator[dict]:
        cfg, state = self.cfg, self.state
        taken = state.step * cfg.train.grad_accum  # the run-wide index of the next micro-batch
        # Raised from here, its error stops every process at the step's end (_next_batch).
        usable = UsableClipWatch(
            cfg.data.train_split,
            str(cfg.data.path),
            clips_per_epoch=len(self.loaders.train_set),
            kept=state.samples_seen > 0,
        )
        while cfg.train.max_epochs is None or state.epoch < cfg.train.max_epochs:
            if state.batch_in_epoch == 0:
                self.callbacks.call("on_epoch_begin", state, epoch=state.epoch)
            loader = self.loaders.train_loader(
                state.epoch, state.batch_in_epoch, taken, state.text_position
            )
            for batch in self.data_wait.timed(loader):
                taken += 1
                usable.see(batch)
                yield batch
            self.callbacks.call("on_epoch_end", state, epoch=state.epoch)
            state.epoch += 1
            state.batch_in_epoch = 0
            if state.should_stop:
                return

    def train_step(self, batches: Iterator[dict]) -> dict | None:
        """One optimizer step: ``train.grad_accum`` micro-batches forward and backward, then
        unscale -> clip -> step (or skip on a non-finite loss or gradient) -> zero grads ->
        schedule -> EMA.

        Returns:
            The step's metrics (the ``on_step_end`` payload), or None when the micro-batches
            ran out before the step was complete (its gradients are dropped).
        """
        with self.timed("step"):
            return self._train_step(batches)

    def _train_step(self, batches: Iterator[dict]) -> dict | None:
        cfg, state, acc = self.cfg, self.state, self.acc
        accum = cfg.train.grad_accum
        tally = StepTally()
        for i in range(accum):
            batch = None if self.stop_error else self._next_batch(batches)
            if batch is None and not self.stop_error:
                return None
            if i == 0:
                self.callbacks.call("on_step_begin", state, step=state.step + 1)
            if batch is not None:
                self._advance_data_position(batch)
            # every clip of it was dropped, or (several processes) this process's data stopped
            empty = batch is None or not batch["size"]
            if empty and acc.num_processes == 1:
                continue
            sync = i == accum - 1
            if empty:
                placeholder = placeholder_batch(
                    self.whisper.config, self.setup.model_bundle.specials.sot
                )
                micro_batch_backward(
                    acc, self.model, placeholder, accum=accum, sync=sync, placeholder=True
                )
            else:
                loss, labels, distill = micro_batch_backward(
                    acc, self.model, batch, accum=accum, sync=sync, start=self.start
                )
                tally.add(batch, loss, labels, accum, distill)

        clip = cfg.optim.clip_grad_norm or float("inf")
        grad_norm, skip, diverging = finish_step(
            acc, self.optimizer, self.scheduler, self.ema, self.whisper, clip, tally, self.start
        )
        self._count_step(tally, skip, diverging)
        return self._step_metrics(tally, grad_norm, skipped=skip is not None)

    def _next_batch(self, batches: Iterator[dict]) -> dict | None:
        """The next micro-batch, or None when the data ran out or (several processes) stopped
        the run with an error, kept in :attr:`stop_error`."""
        try:
            return next(batches, None)
        except UserError as e:  # e.g. a streamed language without a token, met mid-stream
            if self.acc.num_processes == 1:
                raise
            # the others wait in this step's gradient sync: this process finishes the step with
            # placeholder passes, and every process raises the error at the step's end
            self.stop_error = str(e)
            return None

    def agree_to_stop(self, signal_name: str | None) -> str | None:
        """The stop every process makes after this step (see
        :func:`asrforge.train.ranks.agree_to_stop`): the signal's name, or None. Running out of
        time (:meth:`runs_out_of_time`) on any process stops the run (``state.should_stop``)
        with the reason in :attr:`out_of_time`."""
        out_of_time = self.runs_out_of_time()
        signal_name, out_of_time = agree_to_stop(
            self.acc, signal_name, self.stop_error, out_of_time
        )
        if out_of_time and self.budget is not None:
            self.state.should_stop = True
            end_evaluates = self.cfg.eval.at_end or self.evaluation_due()
            self.out_of_time = self.budget.reason(
                self.state.step + 1, evaluations=int(end_evaluates)
            )
            log.info("%s", self.out_of_time)
        return signal_name

    def runs_out_of_time(self) -> bool:
        """Whether the step after this one would leave too little of ``train.max_time`` for the
        run's end: this step's evaluation and save when they are due, the next step (the
        longest so far), and the last evaluation (when one follows) and save."""
        if self.budget is None or self.ends_after_this_step():
            return False
        step, every = self.state.step, self.cfg.checkpoint.checkpoint_every
        due = self.evaluation_due()
        saves_now = due or bool(every and step % every == 0)
        eval_every = self.cfg.eval.eval_steps
        end_evaluates = self.cfg.eval.at_end or bool(eval_every and (step + 1) % eval_every == 0)
        return self.budget.runs_out(
            evaluations=int(due) + int(end_evaluates), saves=int(saves_now) + 1
        )

    def timed(self, kind: str):
        """Time the body for the budget (see :meth:`TimeBudget.timed`); nothing without one."""
        return nullcontext() if self.budget is None else self.budget.timed(kind)

    def _advance_data_position(self, batch: dict) -> None:
        state = self.state
        # Text-only batches (data.asr_ratio < 1) have their own position, outside the epoch.
        if batch.get("task", "asr") == "lm":
            state.text_position = batch["text_position"]
        else:
            state.batch_in_epoch += 1
            state.stream_position = batch.get("stream_position", state.stream_position)
        if batch["dropped"]:
            by_reason = dropped_by_reason(batch)
            log.warning("dropped clips: %s", by_reason)
            if batch.get("task", "asr") != "lm":
                self._record_dropped(by_reason)

    def _count_step(self, tally: StepTally, skip: str | None, diverging: bool) -> None:
        state = self.state
        state.step += 1
        state.samples_seen += tally.samples
        if skip is not None:
            state.skipped_steps += 1
            log.warning("step %d skipped: %s", state.step, skip)
        if diverging:
            state.consecutive_nonfinite += 1
        elif skip is None:
            state.consecutive_nonfinite = 0
        if math.isfinite(tally.loss):
            rl = state.running_loss
            state.running_loss = tally.loss if rl is None else 0.98 * rl + 0.02 * tally.loss

    def _step_metrics(self, tally: StepTally, grad_norm: float, skipped: bool) -> dict:
        now = time.perf_counter()
        groups = self.optimizer.param_groups
        metrics = {
            "loss": tally.loss,
            "lr": main_lr(self.optimizer),  # the others by name in lr_groups
            "lr_groups": {g.get("name", str(i)): g["lr"] for i, g in enumerate(groups)},
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
            "skipped": skipped,
            "samples": tally.samples,
            "tokens": tally.tokens,
            "step_seconds": now - self._step_started,
            "data_wait_seconds": self.data_wait.take(),
        }
        self._step_started = now
        # Under fp16, the dynamic loss scale after this step.
        if self.acc.scaler is not None:
            metrics["grad_scale"] = self.acc.scaler.get_scale()
        # The mean distillation term over the micro-batches that had one (train.distill_weight).
        if self.cfg.train.distill_weight:
            metrics["distill"] = sum(tally.distill) / len(tally.distill) if tally.distill else None
        # The mean loss of each task, None when the step had no batch of it.
        if self.loaders.text is not None:
            for name, values in tally.task_losses.items():
                metrics[f"loss_{name}"] = sum(values) / len(values) if values else None
        return metrics

    def save_checkpoint(self, kind: str, metrics: dict | None, is_best: bool) -> None:
        """``checkpoints/step-NNNNNN`` with everything a resume needs; ``on_save`` names it
        ``best`` when ``is_best``, else ``kind``. A failed save raises (the run stops)."""
        state = self.state
        state.should_save = False
        self.last_saved_step = state.step
        self.gather_dropped()
        self.write_skip_report()
        with self.timed("save"):
            path = save_run_checkpoint(
                self.setup,
                step=state.step,
                model=self.whisper,
                sharded_model=self.model if self.sharded else None,
                ema=self.ema,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                scaler=self.acc.scaler,
                state=state,
                callback_states=self.callbacks.state_dict(),
                metrics=metrics,
                is_best=is_best,
            )
        if path is not None:
            self.callbacks.call("on_save", state, path=path, kind="best" if is_best else kind)

    def gather_dropped(self) -> None:
        """Every process's dropped clips into each one's state: the checkpoint (rank zero's)
        and the skip report hold them all. Every process calls it at the same point."""
        for part in gather_dropped(self.acc, self.state.dropped):
            self._record_dropped(part)

    def _record_dropped(self, by_reason: dict[str, list[str]]) -> None:
        """Add clips the workers dropped to the state, each once per reason (the next epoch
        drops them again), merged as the skip report merges them."""
        split = self.cfg.data.train_split
        merged = SkipReport(split, skipped=self.state.dropped).with_dropped(by_reason)
        self.state.dropped = merged.skipped

    def write_skip_report(self) -> None:
        """``skipped-<split>.json`` with the clips dropped up to this step (main process only)."""
        state, setup = self.state, self.setup
        if self.acc.is_main_process:
            write_skip_report(
                setup.output_dir, setup.train_skipped, state.dropped, f" up to step {state.step}"
            )

    def evaluation_due(self) -> bool:
        """Whether the step just taken is evaluated (every ``eval.eval_steps``)."""
        every = self.cfg.eval.eval_steps
        return bool(every) and self.state.step % every == 0

    def ends_after_this_step(self) -> bool:
        """Whether the loop stops after the step just taken: a stop flag, ``max_steps``, or the
        last speech batch of the last epoch (``train.max_epochs``) consumed."""
        state = self.state
        if state.should_stop or state.step >= self.max_steps:
            return True
        max_epochs = self.cfg.train.max_epochs
        return (
            max_epochs is not None
            and state.epoch + 1 >= max_epochs
            and state.batch_in_epoch >= self.loaders.batches_per_epoch
        )

    def end_reason(self) -> tuple[str, str]:
        """(status, reason) of a run the loop ended without a divergence or a signal."""
        state, max_epochs = self.state, self.cfg.train.max_epochs
        if self.out_of_time is not None:
            return "stopped", self.out_of_time
        if state.should_stop:
            return "stopped", state.stop_reason or "stopped by a callback"
        if state.step < self.max_steps and max_epochs is not None:
            return "completed", f"reached max_epochs={max_epochs}"
        return "completed", f"reached max_steps={self.max_steps}"

    def result(self, status: str, reason: str) -> FitResult:
        selector = self.setup.selector  # the owner of the run's best
        return FitResult(
            status,
            reason,
            self.state.step,
            selector.best_step,
            dict(selector.best),
            self.setup.output_dir,
            self.evaluations.last_metrics,
            tracked_bests=selector.tracked_bests,
            start=dict(selector.start),
            refused=self.evaluations.refused(),
            out_of_time=self.out_of_time is not None,
        )
