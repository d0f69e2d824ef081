"""DataLoader workers of a training run: how many, and what each does when it starts."""

from __future__ import annotations

import os
import signal

from torch.utils.data import DataLoader

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run gracefully: its workers ignore them."""

AUTO_WORKERS_MAX = 4
"""``data.num_workers: auto`` starts at most this many workers per process."""


def worker_count(setting: int | str, device_type: str, processes_here: int = 1) -> int:
    """The DataLoader workers of one training process for ``data.num_workers``.

    ``auto`` keeps a GPU fed: the cores this process has (``os.sched_getaffinity`` shared by
    the ``processes_here`` processes on this machine), less one for the training process, up to
    ``AUTO_WORKERS_MAX``. On a CPU the training step itself needs the cores, so ``auto`` starts a
    worker only where a quarter of them is spare (0 on 2 or 3 cores).

    A count is capped at the cores this process may use (:func:`usable_cores`).

    Args:
        setting: ``data.num_workers``: a count, or ``"auto"``.
        device_type: the training device's type (``cuda``, ``cpu``, ...).
        processes_here: training processes on this machine (torchrun's local world size).
    """
    cores = usable_cores()
    if setting != "auto":
        # a worker per core is the most that helps; a billion would exhaust the machine
        return min(int(setting), cores)
    share = max(1, cores // max(1, processes_here))
    if device_type == "cpu":
        return min(AUTO_WORKERS_MAX, share // 4)
    return min(AUTO_WORKERS_MAX, max(1, share - 1))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: the worker ignores SIGTERM and SIGINT.

    Launchers (torchrun, SLURM, a terminal's Ctrl-C) signal a rank's whole process group, its
    workers included. A worker killed by the signal makes the rank's next batch raise
    ("DataLoader worker ... is killed by signal") before the rank can finish its step and save;
    ignoring it leaves the stop to the rank, which shuts its workers down itself. A worker of a
    :class:`StopSignalLoader` starts with the signals blocked, so one that came before this
    ignored them is dropped here. Draws no random numbers: the workers' seeds (and so the
    batches) are as without it.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class StopSignalLoader(DataLoader):
    """A DataLoader whose workers start with the stop signals blocked until
    :func:`ignore_stop_signals` ignores them: torch's worker sets its own SIGTERM handler first,
    which dies of a launcher's signal, so a signal at an epoch's start (its workers forking)
    would kill a worker. The training process receives a signal that came meanwhile once its
    workers are started."""

    def _get_iterator(self):
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
