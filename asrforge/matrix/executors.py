"""Where jobs run: the job function (one attempt of one job) and the executors that call it.

:func:`run_attempt` runs ``python -m asrforge train CONFIG <overrides> [--resume]`` as a child
process with the device's environment, its output appended to the job's log, and is the same
for every executor. An executor is a plug-in with a small protocol (:class:`Executor`):
``devices()`` (the slots it can fill), ``submit(attempt)``, ``poll(timeout)``, ``cancel(job)``.

- ``local``: one thread per running job on this machine, each waiting on its child process;
  one job per device (a GPU index, or a CPU slot with its share of the cores).
- ``ray``: one Ray task per attempt (``num_gpus=1`` when the cluster has GPUs, else
  ``num_cpus`` = threads per job) on an existing cluster (``address``) or a local Ray. The matrix
  root must be on storage every node sees, and asrforge installed on every node.
"""

from __future__ import annotations

import logging
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from asrforge.errors import EXIT_DIR_ENV, UserError, reported_exit_code
from asrforge.io.append import open_append
from asrforge.matrix.plan import Job

log = logging.getLogger("asrforge.matrix")


@dataclass(frozen=True)
class Device:
    """A slot that runs one job at a time, on one device or on several (``processes``)."""

    label: str
    """``cuda:0``, ``cuda:0,1``, ``cpu:1``, ``ray:3``: names the slot in logs and claims."""
    cuda_visible: str | None = None
    """``CUDA_VISIBLE_DEVICES`` for the job (``""`` hides every GPU); None leaves it as the
    worker has it (Ray sets it for the GPU it assigned)."""
    threads: int | None = None
    """CPU threads for each process of the job (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``); None
    leaves them."""
    processes: int = 1
    """Training processes of the job, one per device: above 1 the job runs under ``torchrun``
    (NCCL on GPUs, gloo on CPU slots)."""


@dataclass(frozen=True)
class Attempt:
    """One try at one job: what :func:`run_attempt` needs, picklable."""

    job: Job
    device: Device
    number: int
    """1 for the first try; each retry adds one."""
    resume: bool
    """Pass ``--resume``: the run dir holds a checkpoint of an earlier try or launcher."""
    log_path: Path
    cwd: Path
    """The working directory (relative paths inside configs are relative to it)."""
    allow_external_callbacks: bool = False

    def command(self) -> list[str]:
        launch = [sys.executable]
        if self.device.processes > 1:
            # --standalone picks a free port, so jobs side by side do not meet.
            launch += ["-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node", str(self.device.processes)]
        cmd = [*launch, "-m", "asrforge", "train", str(self.job.config_path), *self.job.overrides]
        if self.resume:
            cmd.append("--resume")
        if self.allow_external_callbacks:
            cmd.append("--allow-external-callbacks")
        return cmd

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        if self.device.cuda_visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.device.cuda_visible
        if self.device.threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.device.threads)
        env.update(ASRFORGE_MATRIX_JOB=self.job.job_id, ASRFORGE_MATRIX_ATTEMPT=str(self.number),
                   PYTHONUNBUFFERED="1")
        return env


@dataclass
class AttemptResult:
    """How an attempt ended: ``returncode`` None when it could not be started or was lost."""

    job_id: str
    number: int
    device: str
    returncode: int | None
    started: float
    finished: float
    host: str = ""
    error: str | None = None


def run_attempt(
    attempt: Attempt,
    *,
    pass_fds: tuple[int, ...] = (),
    on_start: Callable[[subprocess.Popen], None] | None = None,
    ignore: tuple[signal.Signals, ...] = (),
) -> AttemptResult:
    """Run one attempt to its end: the job function every executor calls.

    Args:
        attempt: the job, device and try number.
        pass_fds: descriptors the child keeps open (the job lock: held while the child lives).
        on_start: called with the child process once it runs (for ``cancel``).
        ignore: signals the child and its own children ignore (SLURM's warning signal, which
            reaches every process of the job and is the job function's to handle).

    An exception here (Ray's cancel raises KeyboardInterrupt in the task) sends the child
    SIGTERM, so the run saves a checkpoint and exits, then propagates.
    """
    started = time.time()
    attempt.log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = attempt.command()
    try:
        log = open_append(attempt.log_path)
    except UserError as e:
        # a link where the job's log goes is for the user to remove: exit code 2 is not retried
        return AttemptResult(attempt.job.job_id, attempt.number, attempt.device.label, 2, started,
                             time.time(), socket.gethostname(), str(e))
    with log:
        log.write(
            f"==== asrforge matrix: {attempt.job.job_id} attempt {attempt.number} on "
            f"{attempt.device.label} ({socket.gethostname()}) at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}{' (resume)' if attempt.resume else ''}\n"
            f"$ {shlex.join(cmd)}\n"
        )
        log.flush()
        cwd = attempt.cwd if attempt.cwd.is_dir() else None
        env = attempt.environment(dict(os.environ))
        several = attempt.device.processes > 1
        # torchrun exits 1 whatever its processes exited with: they report theirs here
        reports = tempfile.TemporaryDirectory(prefix="asrforge-exit-") if several else nullcontext()
        with reports as exit_dir:
            if exit_dir is not None:
                env[EXIT_DIR_ENV] = exit_dir
            try:
                # A session of its own: a Ctrl-C in the terminal reaches the launcher only, which
                # then sends each job one SIGTERM (a second signal would skip the final save).
                proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, cwd=cwd, pass_fds=pass_fds, start_new_session=True,
                    preexec_fn=_ignoring(ignore) if ignore else None,
                )  # fmt: skip
            except OSError as e:
                return AttemptResult(attempt.job.job_id, attempt.number, attempt.device.label,
                                     None, started, time.time(), socket.gethostname(),
                                     f"cannot start: {e}")  # fmt: skip
            if on_start is not None:
                on_start(proc)
            try:
                rc = proc.wait()
                if exit_dir is not None:
                    rc = reported_exit_code(rc, exit_dir)
            except BaseException:
                _stop(proc)
                raise
    return AttemptResult(attempt.job.job_id, attempt.number, attempt.device.label, rc, started,
                         time.time(), socket.gethostname())


def _ignoring(signals: tuple[signal.Signals, ...]) -> Callable[[], None]:
    """A ``preexec_fn`` that sets ``signals`` to be ignored (kept across exec, by every child)."""

    def ignore() -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)

    return ignore


def _stop(proc: subprocess.Popen, grace: float = 120.0) -> None:
    """SIGTERM (the run saves and exits), SIGKILL if it is still there after ``grace``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Executor(Protocol):
    """Runs attempts somewhere; the launcher owns claims, retries and markers."""

    name: str

    def devices(self) -> list[Device]:
        """The slots: at most one running attempt per slot."""
        ...

    def submit(self, attempt: Attempt, *, hold_fd: int | None = None) -> None:
        """Start ``attempt`` on ``attempt.device``. ``hold_fd``: the job lock's descriptor, which
        a local child inherits (executors whose jobs run elsewhere ignore it)."""
        ...

    def poll(self, timeout: float) -> list[AttemptResult]:
        """Attempts that ended since the last call; waits up to ``timeout`` seconds for one."""
        ...

    def cancel(self, job_id: str, *, force: bool = False) -> None:
        """Ask a running attempt to stop (it saves a checkpoint); ``force``: kill it now."""
        ...

    def close(self) -> None: ...


def parse_devices(spec: str | None) -> list[Device]:
    """``--devices``: ``0,1,3`` (GPU indices), ``cpu:N`` (N CPU slots sharing the cores),
    ``cpu`` (one slot), or ``auto``/None (every visible GPU, else one CPU slot)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    spec = (spec or "auto").strip()
    if spec == "auto":
        gpus = visible_gpus()
        if gpus:
            return [Device(f"cuda:{i}", i) for i in gpus]
        spec = "cpu"
    if spec == "cpu" or spec.startswith("cpu:"):
        raw = spec.partition(":")[2] or "1"
        if not raw.isdigit() or int(raw) < 1:
            raise UserError(f"--devices: {spec!r}: expected cpu:N with N >= 1")
        n = int(raw)
        return [Device(f"cpu:{i}", "", max(1, cores // n)) for i in range(n)]
    ids = [s.strip() for s in spec.split(",") if s.strip()]
    if not ids or not all(s.isdigit() for s in ids) or len(set(ids)) != len(ids):
        raise UserError(f"--devices: {spec!r}: expected GPU indices like 0,1,3, cpu:N, or auto")
    return [Device(f"cuda:{i}", i) for i in ids]


def group_devices(devices: list[Device], per_job: int) -> list[Device]:
    """Slots of ``per_job`` devices each, in order (``cuda:0,1``, ``cuda:2,3``); devices left over
    stay idle and are logged.

    Raises:
        UserError: fewer devices than one job needs.
    """
    if per_job == 1:
        return list(devices)
    if len(devices) < per_job:
        raise UserError(f"--gpus-per-job {per_job}: only {len(devices)} device(s) "
                        f"({', '.join(d.label for d in devices)})")
    slots = []
    for start in range(0, len(devices) - per_job + 1, per_job):
        group = devices[start:start + per_job]
        kind = group[0].label.partition(":")[0]
        ids = ",".join(d.label.partition(":")[2] for d in group)
        # CPU slots hide every GPU (""): joining their empty strings keeps that.
        cuda = None if group[0].cuda_visible is None else ",".join(
            d.cuda_visible for d in group if d.cuda_visible)
        slots.append(Device(f"{kind}:{ids}", cuda, group[0].threads, per_job))
    idle = devices[len(slots) * per_job:]
    if idle:
        log.warning("%s: idle, fewer than --gpus-per-job %d", ", ".join(d.label for d in idle),
                    per_job)
    return slots


def visible_gpus() -> list[str]:
    """The GPUs this process may give its jobs, as ``CUDA_VISIBLE_DEVICES`` names them: its own
    value's entries when it is set, else every GPU torch sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def unseen_gpus(devices: list[Device]) -> str | None:
    """Why GPUs that ``--devices`` names are not among :func:`visible_gpus`, or None: a job
    given one would train on the CPU without a word."""
    named = [d.cuda_visible for d in devices if d.label.startswith("cuda:")]
    if not named:
        return None
    gpus = visible_gpus()
    unseen = [i for i in named if i not in gpus]
    if not unseen:
        return None
    have = f"sees GPU(s) {', '.join(gpus)}" if gpus else "sees no GPU (use cpu or cpu:N)"
    return f"--devices: GPU {', '.join(unseen)}: not visible here; this machine {have}"


class LocalExecutor:
    """Child processes on this machine, one per device, each waited on by a thread."""

    name = "local"

    def __init__(self, devices: list[Device]):
        self._devices = list(devices)
        self._done: queue.Queue[AttemptResult] = queue.Queue()
        self._procs: dict[str, subprocess.Popen] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stop_asked: set[str] = set()

    def devices(self) -> list[Device]:
        return list(self._devices)

    def submit(self, attempt: Attempt, *, hold_fd: int | None = None) -> None:
        job_id = attempt.job.job_id

        def started(proc: subprocess.Popen) -> None:
            with self._lock:
                self._procs[job_id] = proc
                if job_id in self._stop_asked:  # cancelled while it was starting
                    proc.send_signal(signal.SIGTERM)

        def work() -> None:
            try:
                result = run_attempt(
                    attempt, pass_fds=(hold_fd,) if hold_fd is not None else (), on_start=started
                )
            except Exception as e:  # noqa: BLE001 - reported as a failed attempt
                result = AttemptResult(job_id, attempt.number, attempt.device.label, None,
                                       time.time(), time.time(), socket.gethostname(), repr(e))
            with self._lock:
                self._procs.pop(job_id, None)
                self._stop_asked.discard(job_id)
            self._done.put(result)

        t = threading.Thread(target=work, name=f"job-{job_id}", daemon=True)
        self._threads[job_id] = t
        t.start()

    def poll(self, timeout: float) -> list[AttemptResult]:
        out = []
        try:
            out.append(self._done.get(timeout=timeout))
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        for r in out:
            self._threads.pop(r.job_id, None)
        return out

    def cancel(self, job_id: str, *, force: bool = False) -> None:
        with self._lock:
            self._stop_asked.add(job_id)
            proc = self._procs.get(job_id)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL if force else signal.SIGTERM)

    def close(self) -> None:
        for t in list(self._threads.values()):
            t.join(timeout=1.0)


class RayExecutor:
    """Ray tasks: ``gpus_per_job`` GPUs each on a cluster with GPUs, else ``threads`` CPUs per
    process.

    Args:
        address: a running cluster (``ray.init(address=...)``); None: ``RAY_ADDRESS`` if set,
            else a local Ray started here and shut down by :meth:`close`.
        threads: CPU threads per process on a cluster without GPUs (default 1).
        init_kwargs: more ``ray.init`` arguments (``num_cpus`` for a local Ray, ...).
        gpus_per_job: devices (GPUs, or CPU processes) each job runs on.
    """

    name = "ray"

    def __init__(self, address: str | None = None, threads: int | None = None,
                 init_kwargs: dict[str, Any] | None = None, gpus_per_job: int = 1):
        try:
            import ray
        except ImportError:
            raise UserError("--executor ray needs Ray: pip install 'asrforge[ray]'") from None
        self._ray = ray
        self._owns = not ray.is_initialized()
        if self._owns:
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     **(init_kwargs or {}))
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        n_per = gpus_per_job
        if gpus:
            if gpus < n_per:
                if self._owns:
                    ray.shutdown()
                raise UserError(f"--gpus-per-job {n_per}: the Ray cluster has {gpus} GPU(s)")
            options: dict[str, Any] = {"num_gpus": n_per, "num_cpus": n_per}
            self._devices = [Device(f"ray:{i}", None, None, n_per) for i in range(gpus // n_per)]
        else:
            t = threads or 1
            options = {"num_cpus": t * n_per}
            n = max(1, int(resources.get("CPU", 1)) // (t * n_per))
            self._devices = [Device(f"ray:{i}", "", t, n_per) for i in range(n)]
        # max_retries=0: the launcher retries, resuming from the checkpoint, and says so.
        self._task = ray.remote(max_retries=0, **options)(run_attempt)
        self._refs: dict[Any, Attempt] = {}

    def devices(self) -> list[Device]:
        return list(self._devices)

    def submit(self, attempt: Attempt, *, hold_fd: int | None = None) -> None:
        self._refs[self._task.remote(attempt)] = attempt

    def poll(self, timeout: float) -> list[AttemptResult]:
        if not self._refs:
            time.sleep(timeout)
            return []
        ready, _ = self._ray.wait(list(self._refs), num_returns=1, timeout=timeout)
        if ready:
            ready, _ = self._ray.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
        out = []
        for ref in ready:
            attempt = self._refs.pop(ref)
            try:
                out.append(self._ray.get(ref))
            except Exception as e:  # noqa: BLE001 - a lost worker, a cancelled task: a failed try
                out.append(AttemptResult(attempt.job.job_id, attempt.number, attempt.device.label,
                                         None, time.time(), time.time(), "",
                                         f"{type(e).__name__}: {e}"))
        return out

    def cancel(self, job_id: str, *, force: bool = False) -> None:
        for ref, attempt in self._refs.items():
            if attempt.job.job_id == job_id:
                self._ray.cancel(ref, force=force)

    def close(self) -> None:
        if self._owns:
            self._ray.shutdown()
