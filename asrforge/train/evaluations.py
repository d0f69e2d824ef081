"""A run's evaluations (:class:`RunEvaluations`): the forgetting guard's start, the step-0
evaluation, each evaluation with the guard and long-form, the selector fed, the eval and guard
records written, and what the selection made of the run."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import TYPE_CHECKING

from asrforge.errors import UserError
from asrforge.evaluation.batch_size import eval_batch_size
from asrforge.evaluation.evaluate import check_scored, evaluate
from asrforge.evaluation.guard import build_guard, guard_language, log_text
from asrforge.evaluation.longform import run_longform_eval
from asrforge.model.decoding import DecodeOptions, capture_for
from asrforge.model.frames import window_seconds
from asrforge.selection.guard_gate import describe_refused
from asrforge.train.events import Decision
from asrforge.train.ranks import gather_eval
from asrforge.train.records import write_eval_records
from asrforge.train.sharding import whole_weights

if TYPE_CHECKING:
    from asrforge.train.run import TrainingRun

log = logging.getLogger("asrforge.train")


class RunEvaluations:
    """The evaluations of one :class:`~asrforge.train.run.TrainingRun`: it reads the run's
    model, state and set-up, and keeps the guard and the last evaluation's metrics."""

    def __init__(self, run: TrainingRun):
        self.run = run
        self.guard = None
        self.last_metrics: dict = {}
        """The metrics of the last evaluation."""
        self.guard_at_start: dict | None = None
        """The guard's metrics of the starting model, measured by :meth:`start_guard` (the
        step-0 evaluation reuses them rather than transcribing the guard set again)."""

    def start_guard(self) -> None:
        """The forgetting guard: the starting model's transcripts, once (a resume restored
        them with the selection state)."""
        setup, acc = self.run.setup, self.run.acc
        language = guard_language(self.run.cfg, setup.train_languages)
        self.guard = build_guard(
            self.run.cfg,
            setup.model_bundle,
            language=language,
            window_seconds=window_seconds(self.run.whisper.config),
        )
        gate = setup.selector.guard
        if self.guard is None or gate.started:
            return
        if setup.resume_from is not None:  # its starting model is gone
            raise UserError(
                "eval.guard: the checkpoint holds no guard start (saved by a run "
                "without eval.guard); remove eval.guard to resume it"
            )
        with whole_weights(self.run.model):
            self.guard_at_start = self.guard.measure_start(
                self.run.whisper, gate, device=acc.device
            )
        self.run.state.selection = setup.selector.state_dict()
        if acc.is_main_process:
            self.guard.write_records(setup.output_dir, self.run.state.step, gate)

    def evaluate_start(self) -> None:
        """``eval.at_start``: evaluate the starting model at step 0, which seeds the selector's
        bests, and save it when it is best (best/ must be able to hold the starting weights)."""
        if self.start_needs_evaluation() and self.evaluate_and_select().save:
            self.run.save_checkpoint("start", self.last_metrics, True)

    def start_needs_evaluation(self) -> bool:
        """Whether the starting model is evaluated now (``eval.at_start``): at step 0, never
        evaluated yet; a resumed run's step-0 result is in its selection state already."""
        state = self.run.state
        return self.run.cfg.evaluates_at_start and state.step == 0 and state.last_eval_step is None

    def start_stayed_best(self) -> bool:
        """The starting model was evaluated and no later evaluation beat it."""
        selector = self.run.setup.selector
        return bool(selector.start) and selector.best_step == 0

    def trained_step_evaluated(self) -> bool:
        """Whether an evaluation measured a step after step 0 (a resumed run's included)."""
        last = self.run.state.last_eval_step
        return last is not None and last > 0

    def evaluate_and_select(self) -> Decision:
        """Evaluate (with the EMA weights when there are some; the guard and long-form too),
        let the selector judge, write the records and tell the callbacks."""
        state, setup, cb = self.run.state, self.run.setup, self.run.callbacks
        cb.call("on_eval_begin", state, split=self.run.cfg.data.eval_split)
        with self.run.timed("evaluation"), whole_weights(self.run.model):
            metrics, preds = self._evaluate()
        decision = setup.selector.update(metrics, step=state.step)
        state.selection = setup.selector.state_dict()
        state.last_eval_step = state.step
        state.best_step, state.best = setup.selector.best_step, dict(setup.selector.best)
        if self.run.acc.is_main_process:
            write_eval_records(
                setup.output_dir,
                state.step,
                metrics,
                preds,
                decision,
                setup.selector.selected_on,
                setup.model_bundle.specials,
                self.run.cfg.eval.normalizer,
            )
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
        cb.call("on_predict_end", state, predictions=preds)
        cb.call("on_eval_end", state, metrics=metrics, decision=decision)
        if decision.should_stop:
            state.should_stop = True
            state.stop_reason = decision.stop_reason
        self.last_metrics = metrics
        return decision

    def _evaluate(self) -> tuple[dict, list[dict]]:
        """Metrics and predictions of the evaluation split, gathered from every process."""
        setup, acc, ema, whisper = self.run.setup, self.run.acc, self.run.ema, self.run.whisper
        guard_metrics: dict = {}
        data = self.run.cfg.data
        # One process only: ranks probing apart could cut the split into different batches.
        probe = whisper if acc.num_processes == 1 else None
        batch_size = eval_batch_size(
            data.eval_batch_size, data.batch_size, probe, acc.device,
            max_new_tokens=self.run.cfg.eval.max_new_tokens, autocast=acc.autocast,
        )  # fmt: skip
        with ema.swapped_in(whisper) if ema is not None else nullcontext():
            metrics, preds = evaluate(
                whisper,
                self.run.loaders.eval_loader(batch_size),
                tokenizer=setup.model_bundle.tokenizer,
                eot=setup.model_bundle.specials.eot,
                max_new_tokens=self.run.cfg.eval.max_new_tokens,
                device=acc.device,
                autocast=acc.autocast,
                options=DecodeOptions(
                    beam_size=self.run.cfg.eval.beam_size,
                    capture=capture_for(self.run.cfg.eval.compile, acc.device),
                ),
                normalizer=self.run.cfg.eval.normalizer,
            )
            if self.guard is not None and self.run.state.step == 0 and self.guard_at_start:
                # The starting model's own guard figures: drift 0 by definition.
                guard_metrics = self.guard_at_start
            elif self.guard is not None:
                guard_metrics = self.guard.measure(whisper, setup.selector.guard, device=acc.device)
        self.run.model.train()  # evaluate() restored the train mode everywhere, the frozen part's too
        metrics, preds = gather_eval(acc, metrics, preds, self.run.cfg.eval.normalizer)
        # Every process holds the gathered figures, so each stops alike.
        check_scored(metrics, data.eval_split, data.stream.eval_path or data.path)
        metrics.update(
            run_longform_eval(setup, whisper, ema, step=self.run.state.step, autocast=acc.autocast)
        )
        if self.guard is not None:
            metrics.update(guard_metrics)
            if acc.is_main_process:
                self.guard.write_records(
                    setup.output_dir, self.run.state.step, setup.selector.guard
                )
        return metrics, preds

    def refused(self) -> str | None:
        """:attr:`~asrforge.train.run.FitResult.refused` of this run now."""
        selector = self.run.setup.selector
        if selector.unguarded_step is None:
            return None
        before_step = 0 if selector.start else selector.best_step
        return describe_refused(
            selector.unguarded_step,
            selector.unguarded,
            selector.start or selector.best,
            before_step=before_step,
            selected_on=selector.selected_on,
            why=selector.unguarded_why,
        )
