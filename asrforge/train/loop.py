"""The training loop: one visible function, ``Trainer.fit``, top to bottom.

Per micro-batch: forward (autocast) -> loss -> backward (scaled under fp16). Every
``grad_accum`` micro-batches: unscale -> clip -> step (skipped and counted on inf/nan) ->
zero grads -> LR step -> EMA. Every ``eval_steps``: evaluate -> selection policy -> save /
patience. Callbacks observe events and may raise ``state.should_stop`` / ``state.should_save``.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from asrforge.config import TrainConfig
from asrforge.data.dataset import dropped_by_reason
from asrforge.errors import CheckpointSaveError, RunIOError, UserError
from asrforge.model.lora import load_model_state
from asrforge.model.partial import encode_frozen_part, encode_trained_part, set_frozen_eval
from asrforge.train.data_wait import DataWaitClock
from asrforge.train.evaluate import evaluate, token_loss
from asrforge.train.events import Callback, CallbackList, Decision, RunInfo
from asrforge.train.guard import build_guard, log_text, run_language
from asrforge.train.longform import run_longform_eval
from asrforge.train.optim import EMA, build_optimizer, build_scheduler, main_lr
from asrforge.train.setup import RunSetup, choose_precision, model_width, prepare_run
from asrforge.train.state import TrainState

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


class Trainer:
    """Runs one training job described by a ``TrainConfig``.

    Args:
        cfg: the resolved config.
        callbacks: observers (see ``asrforge.callbacks.build_callbacks``).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        callbacks: list[Callback] | None = None,
        startup: dict[str, float] | None = None,
    ):
        self.cfg = cfg
        self.user_callbacks = list(callbacks or [])
        self.startup = dict(startup or {})  # phases timed before fit (the CLI's imports, config)
        self._signal: str | None = None

    # ------------------------------------------------------------------------------------------
    def fit(self, resume: bool = False, start_over: bool = False) -> FitResult:
        """Train until ``max_steps``, early stopping, a step cap, a signal or divergence.

        ``resume``: continue from the newest checkpoint that verifies; ``start_over``: train
        from step 0 when checkpoints exist but none verifies (they are set aside, not deleted).
        """
        cfg = self.cfg
        precision, why_precision = choose_precision(
            cfg.train.precision, cfg.train.device, model_width(cfg.model)
        )
        try:
            run: RunSetup = prepare_run(
                cfg, precision=precision, resume=resume, start_over=start_over
            )
        except (OSError, CheckpointSaveError) as e:  # e.g. the tokenizer's write on a full disk
            raise RunIOError(f"{_describe(e)}; the run stopped before its first step") from e
        acc, model, bundle = run.accelerator, run.model, run.model_bundle
        log.info("precision: %s (%s)", precision, why_precision)

        optimizer = build_optimizer(model, cfg.optim)
        max_steps = run.max_steps
        scheduler = build_scheduler(optimizer, cfg.optim, max_steps)
        model, optimizer = acc.prepare(model, optimizer)
        raw_model = acc.unwrap_model(model)
        state = TrainState()
        callbacks = CallbackList(self.user_callbacks, is_main=acc.is_main_process)
        top = (
            cfg.model.frozen_encoder_top
        )  # None: the whole encoder trains (asrforge.model.partial)

        if run.resume_from is not None:
            ckpt = run.resume_from
            load_model_state(raw_model, ckpt.model)  # the whole model, or its LoRA adapters
            optimizer.load_state_dict(ckpt.optimizer)
            scheduler.load_state_dict(ckpt.scheduler)
            if ckpt.scaler and acc.scaler is not None:
                acc.scaler.load_state_dict(ckpt.scaler)
            state = TrainState.from_dict(ckpt.train_state)
            if state.selection:
                run.selector.load_state_dict(state.selection)
            # the manifest holds the manager's records including this very checkpoint
            run.checkpoints.load_state_dict(ckpt.manifest.get("checkpoint_manager", {}))
            callbacks.load_state_dict(ckpt.callbacks)
            run.restore_rng(ckpt.rng)
            log.info(
                "resumed from %s at step %d (epoch %d, batch %d)",
                ckpt.path,
                state.step,
                state.epoch,
                state.batch_in_epoch,
            )
        # built from the weights training starts with: the resumed ones on a resume
        ema = EMA(raw_model, cfg.train.ema_decay) if cfg.train.ema_decay else None
        if ema is not None and run.resume_from is not None:
            if run.resume_from.ema is not None:
                ema.load_state_dict(run.resume_from.ema)
            else:
                log.info(
                    "EMA (decay %g) starts at step %d from the resumed weights (the checkpoint "
                    "has none)",
                    cfg.train.ema_decay,
                    state.step,
                )

        # the forgetting guard: the starting model's transcripts, once (a resume restored them)
        guard = build_guard(
            cfg, bundle, language=run_language(cfg, [u.language for u in run.train_set.utts]),
            window_seconds=raw_model.config.max_source_positions / 50,
        )
        if guard is not None and not run.selector.guard.started:
            if run.resume_from is not None:  # its starting model is gone
                raise UserError("eval.guard: the checkpoint holds no guard start (saved by a run "
                                "without eval.guard); remove eval.guard to resume it")
            guard.measure_start(raw_model, run.selector.guard, device=acc.device,
                                autocast=acc.autocast)
            state.selection = run.selector.state_dict()
            if acc.is_main_process:
                guard.write_records(run.output_dir, state.step, run.selector.guard)

        info = RunInfo(
            config=cfg,
            output_dir=run.output_dir,
            model=raw_model,
            tokenizer=bundle.tokenizer,
            n_params=run.n_params[0],
            n_trainable=run.n_params[1],
            precision=precision,
            device=str(acc.device),
            world_size=acc.num_processes,
            is_main=acc.is_main_process,
            n_train=len(run.train_set),
            n_eval=len(run.eval_set),
            selection=run.selector.why,
        )
        last_metrics: dict = {}
        status, reason = "completed", f"reached max_steps={max_steps}"
        self._install_signal_handlers()

        def do_eval() -> tuple[dict, Decision]:
            callbacks.call("on_eval_begin", state, split=cfg.data.eval_split)
            with ema.swapped_in(raw_model) if ema is not None else nullcontext():
                metrics, preds = evaluate(
                    raw_model,
                    run.eval_loader(),
                    tokenizer=bundle.tokenizer,
                    eot=bundle.specials.eot,
                    max_new_tokens=cfg.eval.max_new_tokens,
                    device=acc.device,
                    autocast=acc.autocast,
                    beam_size=cfg.eval.beam_size,
                )
                if guard is not None:
                    guard_metrics = guard.measure(raw_model, run.selector.guard,
                                                  device=acc.device, autocast=acc.autocast)
            if top is not None:  # evaluate() restored train mode everywhere
                set_frozen_eval(raw_model.model.encoder, top)
            metrics, preds = run.gather_eval(metrics, preds)
            metrics.update(
                run_longform_eval(run, raw_model, ema, step=state.step, autocast=acc.autocast)
            )
            if guard is not None:
                metrics.update(guard_metrics)
                if acc.is_main_process:
                    guard.write_records(run.output_dir, state.step, run.selector.guard)
            d = run.selector.update(metrics, step=state.step)
            decision = Decision(d.save, d.reason, d.should_stop, d.stop_reason)
            state.selection = run.selector.state_dict()
            state.last_eval_step = state.step
            if decision.save:
                state.best_step = state.step
                state.best = _numbers(metrics)
            run.write_eval_records(state.step, metrics, preds, decision)
            log.info(
                "eval step %d: loss %.4f wer %.4f cer %.4f n %d%s%s | %s",
                state.step,
                metrics["loss"],
                metrics["wer"],
                metrics["cer"],
                metrics["n"],
                f" rep-trap {metrics.get('rep_trap_count', 0)}",
                log_text(metrics),
                decision.reason,
            )
            callbacks.call("on_predict_end", state, predictions=preds)
            callbacks.call("on_eval_end", state, metrics=metrics, decision=decision)
            if decision.should_stop:
                state.should_stop = True
                state.stop_reason = decision.stop_reason
            return metrics, decision

        last_saved = [state.step if run.resume_from is not None else None]

        def save(kind: str, metrics: dict | None, is_best: bool) -> None:
            state.should_save = False
            last_saved[0] = state.step
            cb_states = callbacks.state_dict()
            path = run.save_checkpoint(  # a failure stops the run (the handler at the end of fit)
                step=state.step,
                model=raw_model,
                ema=ema,
                optimizer=optimizer,
                scheduler=scheduler,
                scaler=acc.scaler,
                state=state,
                callback_states=cb_states,
                metrics=metrics,
                is_best=is_best,
            )
            if path is not None:
                callbacks.call("on_save", state, path=path, kind="best" if is_best else kind)

        try:
            callbacks.call("on_train_begin", state, run=info)
            startup = {**self.startup, **run.startup}
            t_first = time.perf_counter()
            model.train()
            if top is not None:  # a frozen encoder (part) is a fixed function: no dropout
                set_frozen_eval(raw_model.model.encoder, top)
            accum, step_loss, step_samples, step_tokens = 0, 0.0, 0, 0
            task_losses: dict[str, list[float]] = {"asr": [], "lm": []}
            t_step = time.perf_counter()
            data_wait = DataWaitClock()  # seconds in the loader's next(): the system monitor's
            while state.step < max_steps and not state.should_stop:
                if cfg.train.max_epochs is not None and state.epoch >= cfg.train.max_epochs:
                    status, reason = "completed", f"reached max_epochs={cfg.train.max_epochs}"
                    break
                if state.batch_in_epoch == 0:
                    callbacks.call("on_epoch_begin", state, epoch=state.epoch)
                micro_batch = state.step * cfg.train.grad_accum + accum  # run-wide index
                for batch in data_wait.timed(run.train_loader(
                    state.epoch, state.batch_in_epoch, micro_batch, state.text_position
                )):
                    if accum == 0:
                        callbacks.call("on_step_begin", state, step=state.step + 1)
                    task = batch.get("task", "asr")
                    if task == "lm":  # a text-only batch (data.asr_ratio < 1): not in the epoch
                        state.text_position = batch["text_position"]
                    else:
                        state.batch_in_epoch += 1
                    state.dropped_utterances.extend(batch["dropped"])
                    if batch["dropped"]:
                        log.warning("dropped clips: %s", dropped_by_reason(batch))
                    accum += 1
                    if batch["size"]:
                        labels = batch["labels"].to(acc.device)
                        sync = accum == cfg.train.grad_accum
                        with acc.no_sync(model) if not sync else nullcontext(), acc.autocast():
                            if task == "lm":  # decoder only: without encoder states, no cross-attn
                                hidden = raw_model.model.decoder(
                                    input_ids=batch["decoder_input_ids"].to(acc.device),
                                    use_cache=False,
                                ).last_hidden_state
                                logits = raw_model.proj_out(hidden)
                            else:
                                encoder = raw_model.model.encoder
                                if "encoder_hidden_states" in batch:  # the frozen part's, cached
                                    frozen = batch["encoder_hidden_states"].to(acc.device)
                                elif top:  # frozen lower layers: run apart, in eval mode
                                    feats = batch["input_features"].to(acc.device)
                                    # SpecAugment, as WhisperModel.forward applies it in training
                                    # (a no-op unless the config's apply_spec_augment is on)
                                    feats = raw_model.model._mask_input_features(feats)  # noqa: SLF001
                                    frozen = encode_frozen_part(encoder, feats, top)
                                else:  # the whole encoder trains, or is frozen (eval mode)
                                    frozen = None
                                if frozen is None:
                                    inputs = {
                                        "input_features": batch["input_features"].to(acc.device)
                                    }
                                else:  # the trained top layers run here; the model's forward
                                    # below still runs through the DDP wrapper, which syncs
                                    # the gradients of every trainable parameter
                                    hidden = encode_trained_part(encoder, frozen, top)
                                    inputs = {"encoder_outputs": (hidden,)}
                                logits = model(
                                    **inputs,
                                    decoder_input_ids=batch["decoder_input_ids"].to(acc.device),
                                    use_cache=False,
                                ).logits
                            loss = token_loss(logits, labels)
                        acc.backward(loss / cfg.train.grad_accum)
                        step_loss += float(loss.detach()) / cfg.train.grad_accum
                        task_losses[task].append(float(loss.detach()))
                        step_samples += batch["size"]
                        step_tokens += int((labels >= 0).sum())
                    if accum < cfg.train.grad_accum:
                        continue

                    # ---- optimizer step: unscale -> clip -> step (or skip) -> schedule -> EMA
                    accum = 0
                    params = [p for p in raw_model.parameters() if p.requires_grad]
                    clip = cfg.optim.clip_grad_norm or float("inf")
                    grad_norm, skip, diverging = _optimizer_step(
                        acc, optimizer, params, clip, step_loss
                    )
                    skipped = skip is not None
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                    if ema is not None and not skipped:
                        ema.update(raw_model)
                    state.step += 1
                    state.samples_seen += step_samples
                    if skipped:
                        state.skipped_steps += 1
                        log.warning("step %d skipped: %s", state.step, skip)
                    if diverging:
                        state.consecutive_nonfinite += 1
                    elif not skipped:
                        state.consecutive_nonfinite = 0
                    if math.isfinite(step_loss):
                        rl = state.running_loss
                        state.running_loss = (
                            step_loss if rl is None else 0.98 * rl + 0.02 * step_loss
                        )
                    now = time.perf_counter()
                    metrics = {
                        "loss": step_loss,
                        "lr": main_lr(optimizer),  # the others by name in lr_groups
                        "lr_groups": {
                            g.get("name", str(i)): g["lr"]
                            for i, g in enumerate(optimizer.param_groups)
                        },
                        "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
                        "skipped": skipped,
                        "samples": step_samples,
                        "tokens": step_tokens,
                        "step_seconds": now - t_step,
                        "data_wait_seconds": data_wait.take(),
                    }
                    if acc.scaler is not None:  # fp16: the dynamic loss scale after this step
                        metrics["grad_scale"] = acc.scaler.get_scale()
                    if run.text is not None:  # per-task mean loss; None when the step had none
                        for name, values in task_losses.items():
                            metrics[f"loss_{name}"] = sum(values) / len(values) if values else None
                    step_loss, step_samples, step_tokens, t_step = 0.0, 0, 0, now
                    task_losses = {"asr": [], "lm": []}
                    callbacks.call("on_step_end", state, metrics=metrics)
                    if t_first is not None:
                        startup["first step"] = time.perf_counter() - t_first
                        t_first = None
                        log.info(
                            "time to first step %.1f s: %s",
                            sum(startup.values()),
                            ", ".join(f"{k} {v:.2f}" for k, v in startup.items()),
                        )

                    if state.consecutive_nonfinite >= cfg.train.max_consecutive_nonfinite:
                        status = "diverged"
                        reason = (
                            f"{state.consecutive_nonfinite} optimizer steps in a row had a non-finite "
                            f"loss or gradient (last at step {state.step}); try a lower optim.lr "
                            f"(now {cfg.optim.lr:g}), optim.clip_grad_norm, a longer optim.warmup_steps, "
                            "or train.precision: bf16 instead of fp16"
                        )
                        state.should_stop = True
                        break
                    is_best = False
                    if cfg.eval.eval_steps and state.step % cfg.eval.eval_steps == 0:
                        last_metrics, decision = do_eval()
                        is_best = decision.save
                        state.should_save |= cfg.checkpoint.save_on_eval or is_best
                    every = cfg.checkpoint.checkpoint_every
                    if every and state.step % every == 0:
                        state.should_save = True
                    if self._signal is not None:
                        status, reason = "interrupted", f"received {self._signal}"
                        state.should_stop = True
                        state.should_save = True
                    # when the run ends here, the end-of-run evaluation's save is this step's
                    final_eval_follows = (
                        self._signal is None
                        and cfg.eval.at_end
                        and state.last_eval_step != state.step
                        and _run_ends_after_this_step(state, run, max_steps)
                    )
                    if state.should_save and not final_eval_follows:
                        save(
                            "interrupt" if self._signal is not None else "step",
                            last_metrics if state.last_eval_step == state.step else None,
                            is_best,
                        )
                    if state.should_stop or state.step >= max_steps:
                        break
                else:
                    callbacks.call("on_epoch_end", state, epoch=state.epoch)
                    state.epoch += 1
                    state.batch_in_epoch = 0
                    continue
                break

            if state.should_stop and status == "completed":
                status, reason = "stopped", state.stop_reason or "stopped by a callback"
            if status in ("completed", "stopped"):
                if cfg.eval.at_end and state.last_eval_step != state.step:
                    last_metrics, decision = do_eval()
                    save("final", last_metrics, decision.save)
                elif last_saved[0] != state.step:
                    save("final", None, False)
            result = FitResult(
                status,
                reason,
                state.step,
                state.best_step,
                dict(state.best),
                run.output_dir,
                last_metrics,
                tracked_bests=_numbers(run.selector.state_dict().get("policy_state") or {}),
            )
            log.info("run %s at step %d: %s", status, state.step, reason)
            if guard is not None and state.best_step is None:
                log.warning("forgetting guard: no evaluation kept the guard within tolerance, so "
                            "no checkpoint became best; the starting model is still the better one")
            callbacks.call("on_train_end", state, result=result)
            # after on_train_end: the averaging callback reads the step checkpoints there
            if status in ("completed", "stopped") and cfg.checkpoint.after_run == "best":
                if acc.is_main_process:
                    run.checkpoints.prune_after_run()
            return result
        except (OSError, CheckpointSaveError) as e:
            # a file could not be written (a full disk, permissions): one message, no traceback
            previous = run.checkpoints.latest_valid(check_hashes=False)
            kept = (
                f"the checkpoint {previous} is intact (--resume continues from it)"
                if previous
                else "no checkpoint was written"
            )
            stop = CheckpointSaveError if isinstance(e, CheckpointSaveError) else RunIOError
            error = stop(f"{_describe(e)}; {kept}")
            log.error("run stopped at step %d: %s", state.step, error)
            callbacks.call("on_exception", state, error=error)
            raise error from e
        except BaseException as e:
            callbacks.call("on_exception", state, error=e)
            raise
        finally:
            self._restore_signal_handlers()
            run.close()

    # ------------------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        self._previous = {}

        def handler(signum, _frame):
            name = signal.Signals(signum).name
            if self._signal is not None:  # a second signal: stop now
                raise KeyboardInterrupt(name)
            self._signal = name
            log.warning("%s received: finishing this step, saving, then exiting", name)

        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = {}

    def _restore_signal_handlers(self) -> None:
        for sig, h in self._previous.items():
            signal.signal(sig, h)


def _describe(e: OSError | CheckpointSaveError) -> str:
    if isinstance(e, CheckpointSaveError):  # its message names the path
        return str(e)
    what = e.strerror or str(e)
    return f"{e.filename}: {what}" if e.filename else what


def _numbers(metrics: dict) -> dict[str, float]:
    return {
        k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _run_ends_after_this_step(state: TrainState, run: RunSetup, max_steps: int) -> bool:
    """Whether the loop stops after the step just taken: a stop flag, ``max_steps``, or the last
    speech batch of the last epoch (``train.max_epochs``) consumed."""
    if state.should_stop or state.step >= max_steps:
        return True
    max_epochs = run.cfg.train.max_epochs
    return (
        max_epochs is not None
        and state.epoch + 1 >= max_epochs
        and state.batch_in_epoch >= run.batches_per_epoch
    )


def _optimizer_step(
    acc, optimizer, params, clip: float, loss: float
) -> tuple[float, str | None, bool]:
    """unscale -> clip -> step, or skip the step on a non-finite loss or gradient.

    Returns:
        (the gradient norm before clipping, why the step was skipped or None, whether the skip
        counts towards ``train.max_consecutive_nonfinite``). Under fp16 a gradient overflow
        while the loss scale is above 1 does not count: that is the scaler finding its scale
        (the first steps overflow at 65536), not the run diverging (DeepSpeed's
        ``min_loss_scale`` is 1 for the same reason).
    """
    scaler = acc.scaler
    scale = scaler.get_scale() if scaler is not None else None
    grad_norm = float(acc.clip_grad_norm_(params, clip))  # unscales the gradients under fp16
    if math.isfinite(loss) and math.isfinite(grad_norm):
        optimizer.step()  # under fp16: scaler.step + scaler.update
        skipped = acc.optimizer_step_was_skipped
        return grad_norm, "the loss scaler skipped it" if skipped else None, False
    if scaler is None:
        return grad_norm, f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'}", True
    # fp16: the optimizer must not step, and the scaler must still update: its unscale_ above
    # found the inf/nan, update() lowers the scale and ends the step (the next unscale_ raises
    # otherwise). Calling optimizer.step() for the scaler to skip would not do: the fused AdamW
    # kernel is called even then (it skips inside), so accelerate cannot tell it was skipped.
    scaler.update()
    if not math.isfinite(loss):
        return grad_norm, "non-finite loss", True
    why = f"fp16 gradient overflow at loss scale {scale:g}, lowered to {scaler.get_scale():g}"
    return grad_norm, why, scale <= 1.0
