"""The SLURM executor: one SLURM job per attempt, submitted through submitit, requeued on the
time-limit signal and resumed there.

The job runs :func:`~asrforge.matrix.executors.run_attempt` (``asrforge train``, under
``torchrun`` when it has several GPUs) with SIGUSR2 ignored. SLURM sends SIGUSR2
``signal_delay_s`` before the time limit; submitit's handler calls
:meth:`SlurmAttempt.checkpoint`, which sends the run SIGTERM (it saves a checkpoint and exits 75),
and returns the same attempt with ``--resume``, which submitit requeues. Why requeue rather than
a new job from the launcher: docs/matrix.md, "SLURM".
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from asrforge.errors import UserError
from asrforge.matrix.claims import Claims
from asrforge.matrix.executors import Attempt, AttemptResult, Device, run_attempt
from asrforge.matrix.run import has_checkpoint

log = logging.getLogger("asrforge.matrix")

SIGNAL_DELAY_S = 180
"""Seconds between the signal and the time limit: the run's last step, its save and exit."""
SAVE_GRACE_S = SIGNAL_DELAY_S - 30
"""How long the checkpoint handler waits for the run to save and exit before it requeues."""
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_minutes(text: str) -> int:
    """SLURM's ``--time`` formats (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``,
    ``D-HH:MM:SS``) as whole minutes, rounded up.

    Raises:
        UserError: any other text.
    """
    m = _TIME.match(text.strip())
    if not m:
        raise UserError(f"--time-limit: {text!r}: expected HH:MM:SS, MM, or D-HH:MM:SS")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:
        seconds = a * 3600 + b * 60 + c
    else:
        seconds = a * 60 + (b or 0)
    minutes = -(-seconds // 60)
    if minutes * 60 <= SIGNAL_DELAY_S:
        raise UserError(f"--time-limit: {text!r}: must leave more than {SIGNAL_DELAY_S} s, "
                        f"the warning before the limit")
    return minutes


def parse_slurm_args(items: list[str]) -> dict[str, str]:
    """``--slurm-arg key=value`` (sbatch's long option names: ``account=abc``,
    ``cpus-per-task=16``, ``mem=200G``) as a mapping."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--slurm-arg: {item!r}: expected key=value (an sbatch option)")
        out[key.strip().lstrip("-")] = value.strip()
    return out


def sbatch_parameters(*, partition: str | None, gpus_per_job: int, time_limit: str,
                      job_name: str = "asrforge", slurm_args: dict[str, str] | None = None
                      ) -> dict[str, Any]:
    """submitit's ``SlurmExecutor.update_parameters`` for one matrix job: one task on one node
    holding ``gpus_per_job`` GPUs (the task starts ``torchrun`` for them), the time limit, and
    the signal ``SIGNAL_DELAY_S`` before it. ``slurm_args`` go to sbatch as given, last."""
    params: dict[str, Any] = {
        "job_name": job_name, "nodes": 1, "ntasks_per_node": 1, "gpus_per_node": gpus_per_job,
        "time": time_limit_minutes(time_limit), "signal_delay_s": SIGNAL_DELAY_S,
        "stderr_to_stdout": True,
    }
    if partition:
        params["partition"] = partition
    if slurm_args:
        params["additional_parameters"] = dict(slurm_args)
    return params


class SlurmAttempt:
    """What a SLURM job runs: one attempt, and on the signal before the time limit, the
    same attempt with ``--resume`` for submitit to requeue (submitit's checkpoint protocol).

    Args:
        attempt: the job, its slot and try number.
        run_dir: the job's run directory (whether a checkpoint exists to resume from).
        root: the matrix root, where ``events.jsonl`` gets a ``requeue`` line.
    """

    def __init__(self, attempt: Attempt, run_dir: Path, root: Path):
        self.attempt, self.run_dir, self.root = attempt, run_dir, root
        self._proc: subprocess.Popen | None = None

    def __call__(self) -> AttemptResult:
        def started(proc: subprocess.Popen) -> None:
            self._proc = proc

        return run_attempt(self.attempt, on_start=started, ignore=(signal.SIGUSR2,))

    def __submitit_checkpoint__(self) -> Any:
        """Stop the run (SIGTERM: it saves and exits 75) and hand submitit the attempt to
        requeue: with ``--resume`` once a checkpoint exists."""
        # submitit is installed where this runs: this object was unpickled by it.
        from submitit.helpers import DelayedSubmission

        rc = None if self._proc is None else _stop_within_handler(self._proc, SAVE_GRACE_S)
        resume = has_checkpoint(self.run_dir)
        launcher = f"slurm:{os.environ.get('SLURM_JOB_ID', '?')}"
        Claims(self.root, launcher=launcher).event(
            "requeue", self.attempt.job.job_id, attempt=self.attempt.number, returncode=rc,
            resume=resume)
        return DelayedSubmission(SlurmAttempt(replace(self.attempt, resume=resume), self.run_dir,
                                              self.root))

    # submitit's signal handler looks for `checkpoint`, its requeue for `__submitit_checkpoint__`.
    checkpoint = __submitit_checkpoint__

    def __getstate__(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "run_dir": self.run_dir, "root": self.root,
                "_proc": None}


def _stop_within_handler(proc: subprocess.Popen, grace: float) -> int:
    """SIGTERM, then SIGKILL after ``grace`` seconds; the exit code. Runs in a signal handler
    that may interrupt ``proc.wait()``, whose lock ``Popen.wait``/``poll`` would wait on for
    ever, so the child is reaped with ``os.waitpid`` directly."""
    if proc.returncode is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        while True:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() >= deadline:
                proc.kill()
                _, status = os.waitpid(proc.pid, 0)
                break
            time.sleep(0.2)
    except ChildProcessError:
        return proc.returncode if proc.returncode is not None else -1
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode


class SlurmExecutor:
    """One SLURM job per attempt, through a submitit executor.

    Args:
        submitter: a submitit executor with its parameters set (``submitit.SlurmExecutor``; a
            ``submitit.LocalExecutor`` in tests runs the same job code on this machine).
        root: the matrix root (``events.jsonl``; the run directories are under ``runs/``).
        slots: jobs submitted at once (the queue decides when each runs).
        gpus_per_job: GPUs (processes) per job.
    """

    name = "slurm"

    def __init__(self, submitter: Any, root: Path, slots: int, gpus_per_job: int = 1):
        self._submitter, self._root = submitter, Path(root)
        self._devices = [Device(f"slurm:{i}", None, None, gpus_per_job) for i in range(slots)]
        self._jobs: dict[str, tuple[Any, Attempt]] = {}

    @classmethod
    def on_cluster(cls, root: Path, slots: int, *, partition: str | None, gpus_per_job: int,
                   time_limit: str, slurm_args: dict[str, str] | None = None,
                   max_requeues: int = 100) -> SlurmExecutor:
        """On the SLURM cluster this machine submits to; submitit's files go to
        ``<root>/slurm/``."""
        params = sbatch_parameters(partition=partition, gpus_per_job=gpus_per_job,
                                   time_limit=time_limit, slurm_args=slurm_args)
        # submitit is an optional extra, loaded only for --executor slurm.
        try:
            import submitit
        except ImportError:
            raise UserError(
                "--executor slurm needs submitit: pip install 'asrforge[slurm]'") from None
        try:
            submitter = submitit.SlurmExecutor(folder=Path(root) / "slurm" / "%j",
                                               max_num_timeout=max_requeues)
        except RuntimeError as e:
            raise UserError(f"--executor slurm: {e}") from None
        submitter.update_parameters(**params)
        return cls(submitter, root, slots, gpus_per_job)

    def devices(self) -> list[Device]:
        return list(self._devices)

    def submit(self, attempt: Attempt, *, hold_fd: int | None = None) -> None:
        run_dir = self._root / "runs" / attempt.job.job_id
        job = self._submitter.submit(SlurmAttempt(attempt, run_dir, self._root))
        log.info("%s: SLURM job %s", attempt.job.job_id, job.job_id)
        self._jobs[attempt.job.job_id] = (job, attempt)

    def poll(self, timeout: float) -> list[AttemptResult]:
        deadline = time.monotonic() + timeout
        while True:
            out = [self._result(job_id) for job_id, (job, _) in list(self._jobs.items())
                   if job.done()]
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def _result(self, job_id: str) -> AttemptResult:
        job, attempt = self._jobs.pop(job_id)
        try:
            return job.result()
        except Exception as e:  # noqa: BLE001 - a job SLURM killed or lost: a failed try
            return AttemptResult(job_id, attempt.number, attempt.device.label, None, time.time(),
                                 time.time(), "", f"SLURM job {job.job_id}: {type(e).__name__}: "
                                 f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}")

    def cancel(self, job_id: str, *, force: bool = False) -> None:
        # scancel sends SIGTERM (the run saves and exits 75), then SIGKILL after KillWait.
        if job_id in self._jobs:
            self._jobs[job_id][0].cancel(check=False)

    def close(self) -> None:
        pass
