"""The launcher: fill free devices with claimed jobs, retry failures from their checkpoint, mark
results, and show progress with an ETA.

An attempt succeeded when ``asrforge train`` exited 0 and its ``metrics.jsonl`` ends the run
``completed`` or ``stopped``. Anything else (a crash, a kill, a run stopped by SIGTERM: exit 75) is
retried on the same device with ``--resume``, up to ``retries`` times, except exit code 2: bad
input (a config, a path, a corrupt checkpoint) that no retry fixes. A run that stopped at its
``max_time`` (``out_of_time`` in its ``train_end``) is not done: it is submitted again with
``--resume``, as a continuation that does not count as a retry.

Run it as often as you like, on one machine or several sharing the matrix root: a job is run by
exactly one launcher at a time (``claims.py``), a finished one is skipped, an interrupted one
resumes from its latest checkpoint. A launcher ends when every job is done or failed (jobs that
other launchers are running count as not yet done: it waits for them, and takes one over if
its launcher dies).

With a search (:mod:`asrforge.matrix.search`) the jobs are drawn as devices free up, and a
trial that its study's pruner stops early is stopped like on a signal (it saves a checkpoint)
and marked done as ``pruned``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from asrforge.data.synth import make_tones_dataset
from asrforge.errors import ExitCode, UserError
from asrforge.hub import pinned
from asrforge.io.atomic import atomic_write_text
from asrforge.io.directories import refuse_links_under
from asrforge.matrix.claims import Claim, Claims, read_marker
from asrforge.matrix.executors import Attempt, AttemptResult, Device, Executor
from asrforge.matrix.plan import SLURM_DIR, Job, Plan
from asrforge.matrix.search import Search
from asrforge.run_layout import RunLayout, read_step_records

log = logging.getLogger("asrforge.matrix")

LOG_TAIL_LINES = 40


@dataclass
class Running:
    job: Job
    claim: Claim
    device: Device
    attempt: int
    first_started: float
    history: list[dict[str, Any]] = field(default_factory=list)
    continuations: int = 0
    """Submissions again with ``--resume`` after the run stopped at its ``max_time``."""
    stopped_early: bool = False
    """A search's pruner stopped the trial: it was sent SIGTERM."""


@dataclass
class Outcome:
    """How a launch ended: job ids by result, and whether it was interrupted."""

    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)
    interrupted: bool = False
    killed: bool = False
    """A second signal killed the running jobs, which may not have saved."""
    search: dict[str, Any] | None = None
    """A search's studies at the end (:meth:`asrforge.matrix.search.Search.summary`)."""

    @property
    def exit_code(self) -> int:
        """A run's code for the launch: 75 when one signal stopped it (its jobs saved and a launch
        again resumes them), 130 when a second one killed them."""
        if self.killed:
            return ExitCode.CANCELLED
        if self.interrupted:
            return ExitCode.INTERRUPTED
        return ExitCode.FAILED if self.failed or self.unfinished else ExitCode.OK


RUN_REWRITES = ("output_dir:", "train.grad_accum:")
"""Fields a finished job's config.yaml may hold other than its planned config and still be that
config: the run directory, the same one reached by another path (another mount of the root),
and the accumulation a resume on another process count rewrites to keep the global batch."""


def refuse_changed_done_jobs(plan: Plan) -> None:
    """Refuse a launch that gives a finished job another config than its run trained with: the
    launcher would count it done, and the report show results of a config that never ran.

    Raises:
        UserError: naming each such job and what changed.
    """
    # here, not at the top: the comparison imports torch, which a launch needs only for this
    from asrforge.checkpoint.resume import config_changes
    from asrforge.config import load_config
    from asrforge.config.yaml_limits import load_yaml, read_yaml_text

    changed = []
    # each job's pretrained model is read for its shape: one resolution per Hub repository
    with pinned():
        for job in plan.jobs:
            run_dir = plan.run_dir(job)
            marker = read_marker(run_dir)
            path = RunLayout(run_dir).config
            if not (marker and marker[0] == "done" and path.is_file()):
                continue
            try:
                ran = load_yaml(read_yaml_text(path))
            except (OSError, ValueError):
                continue  # nothing to compare: the report names the file it cannot read
            if not isinstance(ran, dict):
                continue
            planned = load_config(job.config_path, list(job.overrides))
            fixed, allowed = config_changes(planned, ran)
            lines = [x for x in (*fixed, *allowed) if not x.startswith(RUN_REWRITES)]
            if lines:
                changed.append(f"{job.job_id}: {'; '.join(lines)}")
    if changed:
        raise UserError(
            f"{len(changed)} finished job(s) ran another config than the matrix now gives them "
            f"({' | '.join(changed)}): their results are of the config they ran. Launch with "
            f"that config, or remove their run directories under {plan.root / 'runs'} to run "
            "them again"
        )


def best_scores(end: dict[str, Any]) -> str:
    """The best checkpoint's WER, CER and loss of a ``train_end`` record, for a line of the
    launcher's; the numbers only, since a resumed root may have been handed."""
    best = end.get("best") if isinstance(end.get("best"), dict) else {}
    score = ", ".join(f"{k} {best[k]:.4g}" for k in ("wer", "cer", "loss")
                      if isinstance(best.get(k), (int, float)))  # fmt: skip
    return score or "–"


def last_train_end(run_dir: Path) -> dict[str, Any] | None:
    """The ``train_end`` record of the run's last start (None: it did not end normally)."""
    path = RunLayout(run_dir).metrics
    try:
        records, _ = read_step_records(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s: %s; the run is taken as not ended normally", path,
                    getattr(e, "strerror", None) or e)  # fmt: skip
        return None
    end = None
    for rec in records:
        if rec.get("event") == "train_begin":
            end = None
        elif rec.get("event") == "train_end":
            end = rec
    return end


def has_checkpoint(run_dir: Path) -> bool:
    return bool(RunLayout(run_dir).checkpoints.steps())


def log_tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64_000))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def prepare_data(plan: Plan) -> None:
    """Build the generated data sets the jobs need, once, before jobs fan out (two jobs that
    each found the path missing would otherwise write it at the same time)."""
    for path, kind in plan.data_to_generate:
        if kind == "tones" and not path.exists():
            log.info("generating the %s data set at %s", kind, path)
            make_tones_dataset(path)


class Launcher:
    """Runs a plan's jobs on an executor's devices.

    Args:
        plan: the matrix.
        executor: where attempts run.
        retry_failed: re-run jobs that have a FAILED marker (default: skip them).
        progress_every: seconds between progress lines.
        out: where progress goes.
    """

    def __init__(self, plan: Plan, executor: Executor, *, retry_failed: bool = False,
                 progress_every: float = 5.0, out: TextIO | None = None):
        self.plan, self.executor, self.retry_failed = plan, executor, retry_failed
        self.every = progress_every
        self.out = out or sys.stdout
        # every write below goes into the root: a link there would carry it elsewhere
        refuse_links_under(plan.root, not_walked=(SLURM_DIR,))
        self.claims = Claims(plan.root)
        self.cwd = Path.cwd()
        self.running: dict[str, Running] = {}
        self.stopping = 0
        self.durations: list[float] = []
        self.outcome = Outcome()
        self.search = Search(plan) if plan.search is not None else None

    def say(self, msg: str) -> None:
        print(f"[matrix {time.strftime('%H:%M:%S')}] {msg}", file=self.out, flush=True)

    # ------------------------------------------------------------------------------------------
    def run(self) -> Outcome:
        """Launch until every job is done or failed, or a signal stops the launcher."""
        plan = self.plan
        plan.root.mkdir(parents=True, exist_ok=True)
        pending = list(plan.jobs) + (self.search.left_running() if self.search else [])
        refuse_changed_done_jobs(plan)  # before matrix.json is rewritten with the new plan
        self._write_index()
        prepare_data(plan)
        for job in plan.jobs:
            marker = read_marker(plan.run_dir(job))
            if marker and marker[0] == "done" and marker[1].get("duration_s"):
                self.durations.append(float(marker[1]["duration_s"]))
        free = self.executor.devices()
        jobs = (f"a search of {plan.search.trials} trials per language" if plan.search
                else f"{len(plan.jobs)} jobs")
        self.say(f"{jobs}, {len(free)} device(s) "
                 f"({', '.join(d.label for d in free)}) via {self.executor.name}; root {plan.root}")
        previous = self._install_signals()
        last_line = 0.0
        try:
            while True:
                if not self.stopping:
                    if self.search is not None and free and not pending:
                        pending = self.search.draw(len(free))
                        self._write_index()
                    pending = self._fill(pending, free)
                    self._stop_early()
                for result in self.executor.poll(timeout=0.5):
                    device = self._on_result(result)
                    if device is not None:
                        free.append(device)
                if self.stopping == 1:
                    for job_id in self.running:
                        self.executor.cancel(job_id)
                    self.stopping = 2
                elif self.stopping >= 3:
                    for job_id in self.running:
                        self.executor.cancel(job_id, force=True)
                now = time.monotonic()
                drawn_all = self.search is None or self.search.exhausted()
                finished = not self.running and (self.stopping or (not pending and drawn_all))
                if finished or now - last_line >= self.every:
                    self.say(self._progress_line(pending, len(free) + len(self.running)))
                    last_line = now
                if finished:
                    break
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.executor.close()
        self.outcome.interrupted, self.outcome.killed = bool(self.stopping), self.stopping >= 3
        self.outcome.unfinished += [j.job_id for j in pending]
        if self.search is not None:
            self.outcome.search = self.search.write_summary()
        return self.outcome

    def _write_index(self) -> None:
        drawn = self.search.drawn() if self.search is not None else []
        index = self.plan.index(drawn)
        atomic_write_text(self.plan.root / "matrix.json", json.dumps(index, indent=1) + "\n")

    def _stop_early(self) -> None:
        """Stop the trials their study's pruner gives up on (SIGTERM: each saves a checkpoint)."""
        if self.search is None:
            return
        for job_id, r in self.running.items():
            if not r.stopped_early and self.search.should_stop_early(r.job):
                r.stopped_early = True
                self.say(f"search: stopping {job_id} early: its {self.plan.search.metric} is behind "
                         "the other trials' at the same step")
                self.executor.cancel(job_id)

    def _fill(self, pending: list[Job], free: list[Device]) -> list[Job]:
        """Claim pending jobs for free devices; drop the ones found finished."""
        keep = []
        for job in pending:
            run_dir = self.plan.run_dir(job)
            marker = read_marker(run_dir)
            if marker and (marker[0] == "done" or not self.retry_failed):
                getattr(self.outcome, marker[0]).append(job.job_id)
                continue
            if not free:
                keep.append(job)
                continue
            got = self.claims.try_claim(job.job_id, run_dir, free[0].label,
                                        retry_failed=self.retry_failed)
            if got == "held":
                keep.append(job)
            elif got in ("done", "failed"):
                getattr(self.outcome, got).append(job.job_id)
            else:
                device = free.pop(0)
                r = Running(job, got, device, 1, time.time())
                self.running[job.job_id] = r
                self._submit(r)
        return keep

    def _submit(self, r: Running) -> None:
        run_dir = self.plan.run_dir(r.job)
        resume = has_checkpoint(run_dir)
        attempt = Attempt(r.job, r.device, r.attempt, resume, self.plan.log_path(r.job), self.cwd,
                          self.plan.allow_external_callbacks)
        self.claims.event("start", r.job.job_id, device=r.device.label, attempt=r.attempt,
                          resume=resume)
        how = " resuming from its checkpoint" if resume else ""
        self.say(f"start {r.job.job_id} on {r.device.label} (attempt {r.attempt}){how}")
        self.executor.submit(attempt, hold_fd=r.claim.lock_fd)

    def _on_result(self, res: AttemptResult) -> Device | None:
        """Judge an ended attempt: done, retry (same device), or failed. Returns the device
        when it is free again."""
        r = self.running[res.job_id]
        run_dir = self.plan.run_dir(r.job)
        end = last_train_end(run_dir)
        ok = (res.returncode == 0 and end is not None
              and end.get("status") in ("completed", "stopped"))
        why = (res.error or (f"exit code {res.returncode}" if res.returncode else None)
               or ("the run was interrupted" if end else "the run did not end normally"))
        if res.returncode == ExitCode.BAD_INPUT:
            why += " (bad input: a config, path or checkpoint to fix; not retried)"
        elif res.returncode == ExitCode.INTERRUPTED:
            why = f"interrupted by a signal after saving a checkpoint (exit code {ExitCode.INTERRUPTED:d})"
        r.history.append({"attempt": r.attempt, "device": r.device.label, "host": res.host,
                          "returncode": res.returncode,
                          "seconds": round(res.finished - res.started, 3),
                          "error": None if ok else why})
        self.claims.event("exit", r.job.job_id, attempt=r.attempt, returncode=res.returncode, ok=ok)
        # stopped early, the trial has its answer however it exited
        if r.stopped_early:
            return self._pruned(r, run_dir, end)
        if ok and end.get("out_of_time") and not self.stopping:
            r.continuations += 1
            self.say(f"{r.job.job_id} reached its max_time at step {end.get('step')}; "
                     f"continuing it (continuation {r.continuations})")
            self._submit(r)
            return None
        summary = {
            "job_id": r.job.job_id, "language": r.job.language, "config_id": r.job.config_id,
            "seed": r.job.seed, "attempts": r.attempt, "continuations": r.continuations,
            "history": r.history,
            "started": r.first_started, "finished": time.time(),
            "duration_s": round(time.time() - r.first_started, 3), "launcher": self.claims.launcher,
        }
        if ok and not end.get("out_of_time"):
            summary.update(status=end["status"], reason=end.get("reason"),
                           best_step=end.get("best_step"), best=end.get("best"),
                           step=end.get("step"))
            self.claims.finish(r.claim, run_dir, "done", summary)
            self.durations.append(summary["duration_s"])
            self.outcome.done.append(r.job.job_id)
            self.say(f"done {r.job.job_id} in {summary['duration_s']:.0f} s: "
                     f"step {end.get('step')}, best checkpoint step {end.get('best_step')}: "
                     f"{best_scores(end)}")
            if self.search is not None:
                self.say(self.search.done(r.job, end))
                self.search.write_summary()
        elif self.stopping:
            self.claims.event("release", r.job.job_id, reason="launcher stopping")
            r.claim.release()
            self.outcome.unfinished.append(r.job.job_id)
            self.say(f"stopped {r.job.job_id} ({why}); it resumes on the next launch")
        elif r.attempt <= self.plan.retries and res.returncode != 2:
            r.attempt += 1
            self.say(f"{r.job.job_id} failed ({why}); retry {r.attempt - 1}/{self.plan.retries} "
                     f"— log {self.plan.log_path(r.job)}")
            self._submit(r)
            return None
        else:
            summary.update(status="failed", reason=why,
                           log=str(self.plan.log_path(r.job)),
                           log_tail=log_tail(self.plan.log_path(r.job)))
            self.claims.finish(r.claim, run_dir, "failed", summary)
            self.outcome.failed.append(r.job.job_id)
            if self.search is not None:
                self.search.failed(r.job)
                self.search.write_summary()
            tail = summary["log_tail"].splitlines()[-5:]
            self.say(f"FAILED {r.job.job_id} after {r.attempt} attempt(s): {why}\n    "
                     + "\n    ".join(tail))
        del self.running[r.job.job_id]
        return r.device

    def _pruned(self, r: Running, run_dir: Path, end: dict[str, Any] | None) -> Device:
        """Mark a trial its pruner stopped as done (``pruned``): the search has its answer, and
        the run keeps its checkpoint (``--resume`` by hand continues it)."""
        summary = {"job_id": r.job.job_id, "language": r.job.language,
                   "config_id": r.job.config_id, "seed": r.job.seed, "status": "pruned",
                   "step": (end or {}).get("step"), "attempts": r.attempt, "history": r.history,
                   "started": r.first_started, "finished": time.time(),
                   "duration_s": round(time.time() - r.first_started, 3),
                   "launcher": self.claims.launcher}
        self.claims.finish(r.claim, run_dir, "done", summary)
        self.outcome.done.append(r.job.job_id)
        self.search.stopped_early(r.job)
        self.search.write_summary()
        self.say(f"pruned {r.job.job_id} after {summary['duration_s']:.0f} s")
        del self.running[r.job.job_id]
        return r.device

    # ------------------------------------------------------------------------------------------
    def _progress_line(self, pending: list[Job], n_devices: int) -> str:
        done, failed = len(self.outcome.done), len(self.outcome.failed)
        elsewhere = sum(self.claims.is_running(j.job_id) for j in pending)
        queued = len(pending) - elsewhere
        total = len(self.plan.jobs)
        if self.plan.search is not None:
            total = self.plan.search.trials * len(self.plan.base)
        parts = [f"{done}/{total} done", f"{len(self.running)} running"]
        if elsewhere:
            parts.append(f"{elsewhere} running elsewhere")
        parts += [f"{failed} failed", f"{queued} queued"]
        if self.outcome.unfinished:
            parts.append(f"{len(self.outcome.unfinished)} stopped")
        eta = self.eta(queued, n_devices)
        parts.append(f"ETA {_clock(eta)}" if eta is not None else "ETA --")
        return " · ".join(parts)

    def eta(self, queued: int, n_devices: int) -> float | None:
        """Seconds until this launcher is done: the mean duration of finished jobs for each
        queued job, plus what remains of each running one, spread over the devices."""
        if not self.durations:
            return None
        mean = sum(self.durations) / len(self.durations)
        now = time.time()
        left = sum(max(0.0, mean - (now - r.first_started)) for r in self.running.values())
        return (left + queued * mean) / max(1, n_devices)

    def _install_signals(self) -> dict[int, Any]:
        def handler(signum, _frame):
            self.stopping = 1 if not self.stopping else 3
            what = ("stopping: running jobs save a checkpoint and stop (again to kill them)"
                    if self.stopping == 1 else "killing running jobs")
            self.say(f"{signal.Signals(signum).name}: {what}")

        previous = {}
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
        return previous


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
