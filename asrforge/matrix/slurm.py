"""The SLURM executor: one SLURM job per attempt, submitted through submitit, requeued on the
time-limit signal and resumed there.

The job runs :func:`~asrforge.matrix.executors.run_attempt` (``asrforge train``, under
``torchrun`` when it has several GPUs) with SIGUSR2 ignored, and records how it ended as JSON in
the launch's own directory, ``<root>/slurm/launch-*/``, which the launcher makes afresh (mode
0700) each time: submitit's files are pickles, so the launcher never reads one (not even the
job's result) and never uses a folder it did not make in this launch. SLURM sends SIGUSR2
``signal_delay_s`` before the time limit; submitit's handler calls
:meth:`SlurmAttempt.checkpoint`, which sends the run SIGTERM (it saves a checkpoint and exits 75),
and returns the same attempt with ``--resume``, which submitit requeues. Why requeue rather than
a new job from the launcher: docs/matrix.md, "SLURM".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from asrforge.errors import UserError
from asrforge.io.append import open_no_follow
from asrforge.io.atomic import atomic_write_text
from asrforge.io.directories import real_directory
from asrforge.matrix.claims import Claims
from asrforge.matrix.executors import Attempt, AttemptResult, Device, run_attempt
from asrforge.matrix.plan import SLURM_DIR
from asrforge.matrix.run import has_checkpoint

log = logging.getLogger("asrforge.matrix")

SIGNAL_DELAY_S = 180
"""Seconds between the signal and the time limit: the run's last step, its save and exit."""
SAVE_GRACE_S = SIGNAL_DELAY_S - 30
"""How long the checkpoint handler waits for the run to save and exit before it requeues."""
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_OUTCOME_BYTES = 1 << 16
_OUTCOME_TYPES: dict[str, tuple[type, ...]] = {
    "job_id": (str,), "number": (int,), "device": (str,), "returncode": (int, type(None)),
    "started": (int, float), "finished": (int, float), "host": (str,), "error": (str, type(None)),
}


def outcome_path(launch_dir: Path, attempt: Attempt) -> Path:
    """Where the job of ``attempt`` records how it ended (JSON of its :class:`AttemptResult`)."""
    return Path(launch_dir) / f"{attempt.job.job_id}.attempt-{attempt.number}.json"


def read_outcome(path: Path) -> AttemptResult | str:
    """The :class:`AttemptResult` a job recorded at ``path``, or why it cannot be read (missing,
    not a regular file, too large, not JSON, a field of the wrong type)."""
    try:
        fd = open_no_follow(path, os.O_RDONLY | os.O_NONBLOCK)
    except UserError:
        return f"{path}: a symlink, not the outcome the job recorded"
    except FileNotFoundError:
        return "no outcome recorded"
    except OSError as e:
        return f"{path}: {e.strerror}"
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > _OUTCOME_BYTES:
            return f"{path}: not a regular file of at most {_OUTCOME_BYTES} bytes"
        raw = f.read(_OUTCOME_BYTES + 1)
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return f"{path}: not JSON"
    if not isinstance(record, dict) or set(record) != set(_OUTCOME_TYPES):
        return f"{path}: not an outcome record (expected the keys {sorted(_OUTCOME_TYPES)})"
    for key, types in _OUTCOME_TYPES.items():
        if isinstance(record[key], bool) or not isinstance(record[key], types):
            return f"{path}: {key}: {record[key]!r} is not {' or '.join(t.__name__ for t in types)}"
    return AttemptResult(**record)


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


def describe_sbatch(params: dict[str, Any]) -> str:
    """``params`` (:func:`sbatch_parameters`) as the sbatch options submitit writes for them
    (``--time`` in minutes, ``--signal`` the warning before it)."""
    flags = []
    for key, value in params.items():
        if key == "signal_delay_s":
            flags.append(f"--signal=USR2@{value}")
        elif key == "additional_parameters":
            flags += [f"--{k}={v}" for k, v in value.items()]
        elif key != "stderr_to_stdout":  # one log file for both streams: no option of its own
            flags.append(f"--{key.replace('_', '-')}={value}")
    return " ".join(shlex.quote(flag) for flag in flags)


class SlurmAttempt:
    """What a SLURM job runs: one attempt, and on the signal before the time limit, the
    same attempt with ``--resume`` for submitit to requeue (submitit's checkpoint protocol).

    Args:
        attempt: the job, its slot and try number.
        run_dir: the job's run directory (whether a checkpoint exists to resume from).
        root: the matrix root, where ``events.jsonl`` gets a ``requeue`` line.
        launch_dir: this launch's directory, where the job records its outcome as JSON.
    """

    def __init__(self, attempt: Attempt, run_dir: Path, root: Path, launch_dir: Path):
        self.attempt, self.run_dir, self.root = attempt, run_dir, root
        self.launch_dir = launch_dir
        self._proc: subprocess.Popen | None = None

    def __call__(self) -> AttemptResult:
        def started(proc: subprocess.Popen) -> None:
            self._proc = proc

        result = run_attempt(self.attempt, on_start=started, ignore=(signal.SIGUSR2,))
        atomic_write_text(outcome_path(self.launch_dir, self.attempt),
                          json.dumps(dataclasses.asdict(result)))
        return result

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
                                              self.root, self.launch_dir))

    # submitit's signal handler looks for `checkpoint`, its requeue for `__submitit_checkpoint__`.
    checkpoint = __submitit_checkpoint__

    def __getstate__(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "run_dir": self.run_dir, "root": self.root,
                "launch_dir": self.launch_dir, "_proc": None}


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


def make_launch_dir(root: Path) -> Path:
    """A fresh directory of this launch under ``<root>/slurm/`` (mode 0700, a name no earlier
    launch used), for submitit's files and the jobs' outcomes.

    Raises:
        UserError: ``<root>/slurm`` is a link, not a directory, or owned by another user.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    slurm = real_directory(root / SLURM_DIR, under=root)
    owner = os.lstat(slurm).st_uid
    if owner != os.geteuid():
        raise UserError(f"{slurm}: owned by user id {owner}, not by you: asrforge keeps "
                        "submitit's files only in a folder of yours")
    return Path(tempfile.mkdtemp(prefix=f"launch-{time.strftime('%Y%m%d-%H%M%S')}-",
                                 dir=slurm))


class SlurmExecutor:
    """One SLURM job per attempt, through a submitit executor.

    Args:
        submitter: a submitit executor with its parameters set (``submitit.SlurmExecutor``; a
            ``submitit.LocalExecutor`` in tests runs the same job code on this machine), whose
            folder is under ``launch_dir``.
        root: the matrix root (``events.jsonl``; the run directories are under ``runs/``).
        launch_dir: this launch's directory (:func:`make_launch_dir`): the jobs' outcomes.
        slots: jobs submitted at once (the queue decides when each runs).
        gpus_per_job: GPUs (processes) per job.
    """

    name = "slurm"

    def __init__(self, submitter: Any, root: Path, launch_dir: Path, slots: int,
                 gpus_per_job: int = 1):
        self._submitter, self._root, self._launch_dir = submitter, Path(root), Path(launch_dir)
        self._devices = [Device(f"slurm:{i}", None, None, gpus_per_job) for i in range(slots)]
        self._jobs: dict[str, tuple[Any, Attempt]] = {}

    @classmethod
    def on_cluster(cls, root: Path, slots: int, params: dict[str, Any], *,
                   max_requeues: int = 100) -> SlurmExecutor:
        """On the SLURM cluster this machine submits to, each job with ``params``
        (:func:`sbatch_parameters`); submitit's files go to a fresh ``<root>/slurm/launch-*/``,
        removed again with the folders made for it when no cluster is found.

        Raises:
            UserError: submitit is missing, or finds no SLURM here.
        """
        # submitit is an optional extra, loaded only for --executor slurm.
        try:
            import submitit
        except ImportError:
            raise UserError(
                "--executor slurm needs submitit: pip install 'asrforge[slurm]'") from None
        made, folder = [], Path(root).absolute() / SLURM_DIR
        while not folder.exists():
            made.append(folder)
            folder = folder.parent
        launch_dir = make_launch_dir(root)
        try:
            submitter = submitit.SlurmExecutor(folder=launch_dir / "%j",
                                               max_num_timeout=max_requeues)
        except RuntimeError as e:
            # Nothing was submitted, so the empty folders this launch made would only be litter.
            for directory in (launch_dir, *made):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            raise UserError(f"--executor slurm: {e}") from None
        submitter.update_parameters(**params)
        return cls(submitter, root, launch_dir, slots, params["gpus_per_node"])

    def devices(self) -> list[Device]:
        return list(self._devices)

    def submit(self, attempt: Attempt, *, hold_fd: int | None = None) -> None:
        run_dir = self._root / "runs" / attempt.job.job_id
        job = self._submitter.submit(SlurmAttempt(attempt, run_dir, self._root, self._launch_dir))
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
        """How the attempt ended, from the JSON its job recorded: never submitit's result
        pickle, which anyone who can write the folder could make run code here."""
        job, attempt = self._jobs.pop(job_id)
        outcome = read_outcome(outcome_path(self._launch_dir, attempt))
        if isinstance(outcome, AttemptResult) and (outcome.job_id, outcome.number) == (
                job_id, attempt.number):
            return outcome
        if isinstance(outcome, AttemptResult):
            outcome = "the outcome recorded names another attempt"
        try:
            state = job.state
        except Exception:  # noqa: BLE001 - sacct unreachable: the state is only for the message
            state = "unknown"
        return AttemptResult(job_id, attempt.number, attempt.device.label, None, time.time(),
                             time.time(), "", f"SLURM job {job.job_id} ({state}): {outcome}")

    def cancel(self, job_id: str, *, force: bool = False) -> None:
        # scancel sends SIGTERM (the run saves and exits 75), then SIGKILL after KillWait.
        if job_id in self._jobs:
            self._jobs[job_id][0].cancel(check=False)

    def close(self) -> None:
        pass
