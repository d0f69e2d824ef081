"""The training loop: ``Trainer.fit`` builds the run, evaluates the starting model when asked,
trains in one visible loop (``Trainer._train``: step, evaluate, save) and finishes the run.

Per micro-batch: forward (autocast) -> loss -> backward (scaled under fp16). Every
``grad_accum`` micro-batches: unscale -> clip -> step (skipped and counted on inf/nan) ->
zero grads -> LR step -> EMA. Every ``eval_steps``: evaluate -> selection policy -> save /
patience. Callbacks observe events and may raise ``state.should_stop`` / ``state.should_save``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path

from asrforge.config import TrainConfig
from asrforge.errors import CheckpointSaveError, RunIOError, UserError
from asrforge.hub import pinned
from asrforge.io.directories import refuse_links_under
from asrforge.run_layout import CHECKPOINTS
from asrforge.selection.policies import format_metrics
from asrforge.train.events import Callback, CallbackList
from asrforge.train.precision import choose_precision, model_width
from asrforge.train.ranks import agree_to_stop
from asrforge.train.run import FitResult, TrainingRun
from asrforge.train.run_dir import RunDirBefore
from asrforge.train.run_log import is_rank_zero
from asrforge.train.saves import saves_this_step
from asrforge.train.setup import prepare_run
from asrforge.train.state import TrainState
from asrforge.train.time_budget import TimeBudget

log = logging.getLogger("asrforge.train")

NOT_IMPROVED = "no step improved on the starting model"
"""Appended to the reason of a run whose best checkpoint is the evaluated start (step 0)."""
NOT_EVALUATED = "no trained step was evaluated"
"""Appended instead when nothing after step 0 was evaluated: the start is best by default."""


class Trainer:
    """Runs one training job described by a ``TrainConfig``.

    Args:
        cfg: the resolved config.
        callbacks: observers (see ``asrforge.callbacks.build_callbacks``).
        startup: seconds of the start-up phases timed before ``fit`` (the CLI's imports, config).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        callbacks: list[Callback] | None = None,
        startup: dict[str, float] | None = None,
    ):
        if not isinstance(cfg, TrainConfig):
            raise TypeError(
                f"Trainer: cfg is a {type(cfg).__name__}, not a TrainConfig: load a YAML file "
                "with asrforge.load_config(path)"
            )
        if callable(callbacks) or not all(isinstance(c, Callback) for c in callbacks or []):
            raise TypeError(
                "Trainer: callbacks must be a list of asrforge Callback objects (subclasses of "
                "asrforge.train.events.Callback), e.g. build_callbacks(cfg) + [mine]"
            )
        self.cfg = cfg
        self.user_callbacks = list(callbacks or [])
        self.startup = dict(startup or {})
        self._signal: str | None = None
        self._run: TrainingRun | None = None
        self._start: tuple[int, int | None] | None = None
        """(clips trained, last saved step) of the run as built: a run that changed neither
        never began (its steps, if any, held no clip)."""

    # ------------------------------------------------------------------------------------------
    def fit(self, resume: bool = False, start_over: bool = False) -> FitResult:
        """Train until ``max_steps``, early stopping, a step cap, ``max_time``, a signal or
        divergence.

        ``resume``: continue from the newest checkpoint that verifies (refused when
        ``output_dir`` holds no run: no ``checkpoints/``); ``start_over``: train
        from step 0 when checkpoints exist but none verifies (they are set aside, not deleted).
        A run stopped by bad input (UserError), Ctrl-C or SIGTERM before it trained a clip or
        saved leaves its directory as it found it (:mod:`asrforge.train.run_dir`); under
        torchrun, rank zero undoes it once its own set-up stops.
        """
        entries = [name for cb in self.user_callbacks for name in cb.run_entries()]
        # O_NOFOLLOW guards a file's last component only: a linked eval/ would carry writes out
        refuse_links_under(Path(self.cfg.output_dir))
        before = RunDirBefore.look(Path(self.cfg.output_dir), entries)
        # a mistyped output_dir would otherwise train a new run from step 0 under --resume
        if resume and not before.holds_run:
            raise UserError(
                f"--resume: output_dir {before.path} holds no run to continue (no "
                f"{CHECKPOINTS}/ there); check output_dir, or leave out --resume to start a run"
            )
        self._run = None
        try:
            return self._fit(resume=resume, start_over=start_over)
        except (UserError, KeyboardInterrupt):
            if not self._began() and is_rank_zero():
                before.restore()
            raise

    def _began(self) -> bool:
        """Whether the run trained a clip or saved a checkpoint since it was built: steps whose
        every clip was dropped trained nothing."""
        run = self._run
        return run is not None and (run.state.samples_seen, run.last_saved_step) != self._start

    def _fit(self, *, resume: bool, start_over: bool) -> FitResult:
        max_time = self.cfg.train.max_time
        # the budget counts this process's whole life: a scheduler's time limit does
        budget = (
            TimeBudget(self.cfg.train.max_time_seconds, max_time, sum(self.startup.values()))
            if max_time is not None
            else None
        )
        # The start-up reads one commit of each Hub repository it names.
        with pinned(), _sigterm_interrupts_set_up():
            run = self._start_run(resume=resume, start_over=start_over, budget=budget)
        state, callbacks = run.state, run.callbacks  # the resumed state on a resume
        self._install_signal_handlers()
        try:
            callbacks.call("on_train_begin", state, run=run.info())
            run.evaluations.evaluate_start()
            ended = self._train(run)
            return self._finish(run, ended)
        except (OSError, CheckpointSaveError) as e:
            raise _write_failed(run, e) from e
        except BaseException as e:
            callbacks.call("on_exception", state, error=e)
            raise
        finally:
            self._restore_signal_handlers()
            run.setup.close()

    def _start_run(
        self, *, resume: bool, start_over: bool, budget: TimeBudget | None
    ) -> TrainingRun:
        """The run built, restored from its checkpoint on a resume, with its EMA and guard."""
        run = self._build_run(resume=resume, start_over=start_over, budget=budget)
        if run.setup.resume_from is not None:
            run.restore(run.setup.resume_from)
        self._run, self._start = run, (run.state.samples_seen, run.last_saved_step)
        # The EMA starts from the weights training starts with: the resumed ones on a resume.
        run.start_ema()
        run.evaluations.start_guard()
        return run

    def _train(self, run: TrainingRun) -> tuple[str, str] | None:
        """Steps, each evaluated and saved when due, until a stop.

        Returns:
            (status, reason) when the loop itself ends the run (a divergence or a signal),
            else None.
        """
        cfg, state, callbacks = self.cfg, run.state, run.callbacks
        run.setup.startup.restart()  # "first step" counts from here
        run.model.train()  # TrainingWhisper.train keeps a frozen encoder part in eval mode
        # One rank stopping alone would leave the others waiting in the first step's all-reduce.
        if run.acc.num_processes > 1 and not self._began():
            signal_name, _ = agree_to_stop(run.acc, self._signal, None)
            if signal_name is not None:
                raise KeyboardInterrupt(signal_name)
        batches = run.micro_batches()
        while state.step < run.max_steps and not state.should_stop:
            metrics = run.train_step(batches)
            # No metrics means the data ran out (train.max_epochs).
            if metrics is None:
                return None
            # several processes stop at the same step, or the others wait for the stopped one
            agreed_signal = run.agree_to_stop(self._signal)
            callbacks.call("on_step_end", state, metrics=metrics)
            run.setup.startup.first_step_taken()
            if state.consecutive_nonfinite >= cfg.train.max_consecutive_nonfinite:
                # No evaluation and no save of a diverged model.
                return "diverged", _divergence(state, cfg)
            decision = run.evaluations.evaluate_and_select() if run.evaluation_due() else None
            # one process: a signal received during this step's evaluation stops it too
            stop_signal = self._signal if run.acc.num_processes == 1 else agreed_signal
            if stop_signal is not None:
                state.should_stop = True
            stopping = stop_signal is not None
            if saves_this_step(cfg, state, decision, stopping, run.ends_after_this_step):
                evaluated = state.last_eval_step == state.step
                run.save_checkpoint(
                    "interrupt" if stopping else "step",
                    run.evaluations.last_metrics if evaluated else None,
                    decision is not None and decision.save,
                )
            if stopping:
                return "interrupted", f"received {stop_signal}"
        return None

    def _finish(self, run: TrainingRun, ended: tuple[str, str] | None) -> FitResult:
        """The end of a run: the last evaluation and save, the skip report, the result and
        ``on_train_end``, ``checkpoint.after_run``, and every rank waiting for rank zero."""
        cfg, state = self.cfg, run.state
        status, reason = ended or run.end_reason()
        finished = status in ("completed", "stopped")
        if finished:
            if cfg.eval.at_end and state.last_eval_step != state.step:
                decision = run.evaluations.evaluate_and_select()
                run.save_checkpoint("final", run.evaluations.last_metrics, decision.save)
            elif run.last_saved_step != state.step:
                run.save_checkpoint("final", None, False)
        if run.last_saved_step != state.step:  # the save wrote it otherwise
            run.gather_dropped()
            run.write_skip_report()
        # the last step is kept beside best/ when no evaluation judged any trained step
        keep_last = (
            run.evaluations.start_stayed_best() and not run.evaluations.trained_step_evaluated()
        )
        if finished:
            reason = _explain_start_best(run, reason, keep_last)
        result = run.result(status, reason)
        log.info("run %s at step %d: %s", status, state.step, reason)
        if result.refused is not None:
            log.warning("%s", result.refused)
        if run.evaluations.guard is not None and result.best_step is None:
            log.warning(
                "forgetting guard: no evaluation kept the guard within tolerance, so "
                "no checkpoint became best; the starting model is still the better one"
            )
        run.callbacks.call("on_train_end", state, result=result)
        # after on_train_end: the averaging callback reads the step checkpoints there
        # a run out of time is continued with --resume: its resume state stays
        if finished and cfg.checkpoint.after_run == "best" and run.out_of_time is None:
            if run.acc.is_main_process:
                run.setup.checkpoints.prune_after_run(keep_latest=keep_last)
        # the other ranks exit only once rank zero's last save is on disk: a launcher
        # (torchrun) stops every rank as soon as one exits non-zero (75 after a signal)
        run.acc.wait_for_everyone()
        return result

    # ------------------------------------------------------------------------------------------
    def _build_run(
        self, *, resume: bool, start_over: bool, budget: TimeBudget | None
    ) -> TrainingRun:
        cfg = self.cfg
        precision, why_precision = choose_precision(
            cfg.train.precision, cfg.train.device, model_width(cfg.model)
        )
        try:
            setup = prepare_run(
                cfg, precision=precision, resume=resume, start_over=start_over, startup=self.startup
            )
        except (OSError, CheckpointSaveError) as e:  # e.g. the tokenizer's write on a full disk
            raise RunIOError(f"{_describe(e)}; the run stopped before its first step") from e
        log.info("precision: %s (%s)", precision, why_precision)
        callbacks = CallbackList(self.user_callbacks, is_main=setup.accelerator.is_main_process)
        return TrainingRun(cfg, setup, callbacks, precision, budget)

    def _install_signal_handlers(self) -> None:
        self._previous = {}

        def handler(signum, _frame):
            name = signal.Signals(signum).name
            # Before the run began nothing is lost by stopping at once, and the start is undone
            # as in set-up; several processes agree on it before the first step instead.
            one = self._run is not None and self._run.acc.num_processes == 1
            # A second signal stops the run at once.
            if self._signal is not None or (one and not self._began()):
                raise KeyboardInterrupt(name)
            self._signal = name
            log.warning("%s received: finishing this step, saving, then exiting", name)

        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, handler)
        except ValueError:
            # Only the main thread may set signal handlers, so other threads leave them alone.
            self._previous = {}

    def _restore_signal_handlers(self) -> None:
        for sig, h in self._previous.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def _sigterm_interrupts_set_up():
    """During set-up, SIGTERM raises ``KeyboardInterrupt`` as Ctrl-C does: by default it would
    end the process with the start half made, where an interruption undoes it. The loop's own
    handlers take over once the run is built."""

    def handler(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # Only the main thread may set handlers, and one C code set could not be put back (None).
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if previous is None:
        yield
        return
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _explain_start_best(run: TrainingRun, reason: str, keep_last: bool) -> str:
    """``reason`` of a finished run, with why best/ holds the starting weights when it does
    (warned)."""
    cfg, state = run.cfg, run.state
    if keep_last:
        log.warning(
            "%s (eval.eval_steps %s, eval.at_end %s): best/ holds the starting weights "
            "(step 0, %s) because nothing after it was measured; the last step, %d, is "
            "kept beside it",
            NOT_EVALUATED,
            cfg.eval.eval_steps,
            cfg.eval.at_end,
            format_metrics(run.setup.selector.start),
            state.step,
        )
        return f"{reason}; {NOT_EVALUATED}"
    if run.evaluations.start_stayed_best():
        # With a best refused by the guard, the policy alone did find a better step.
        why = (
            "the forgetting guard refused every step the selection policy would have chosen"
            if run.setup.selector.unguarded_step is not None
            else "fine-tuning as configured made no evaluated step better by the selection policy"
        )
        log.warning(
            "%s: best/ holds the starting weights (step 0, %s); %s",
            NOT_IMPROVED,
            format_metrics(run.setup.selector.start),
            why,
        )
        return f"{reason}; {NOT_IMPROVED}"
    return reason


def _write_failed(run: TrainingRun, e: OSError | CheckpointSaveError) -> Exception:
    """The error a run stops with when a file could not be written (a full disk,
    permissions): one message, no traceback; logged and told to the callbacks."""
    previous = run.setup.checkpoints.latest_valid(check_hashes=False)
    kept = (
        f"the checkpoint {previous} is intact (--resume continues from it)"
        if previous
        else "no checkpoint was written"
    )
    stop = CheckpointSaveError if isinstance(e, CheckpointSaveError) else RunIOError
    error = stop(f"{_describe(e)}; {kept}")
    log.error("run stopped at step %d: %s", run.state.step, error)
    run.callbacks.call("on_exception", run.state, error=error)
    return error


def _divergence(state: TrainState, cfg: TrainConfig) -> str:
    return (
        f"{state.consecutive_nonfinite} optimizer steps in a row had a non-finite "
        f"loss or gradient (last at step {state.step}); try a lower optim.lr "
        f"(now {cfg.optim.lr:g}), optim.clip_grad_norm, a longer optim.warmup_steps, "
        "or train.precision: bf16 instead of fp16"
    )


def _describe(e: OSError | CheckpointSaveError) -> str:
    if isinstance(e, CheckpointSaveError):  # its message names the path
        return str(e)
    what = e.strerror or str(e)
    return f"{e.filename}: {what}" if e.filename else what
