"""What every DataLoader worker of a training run does when it starts."""

from __future__ import annotations

import signal


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: the worker ignores SIGTERM and SIGINT.

    Launchers (torchrun, SLURM, a terminal's Ctrl-C) signal a rank's whole process group, its
    workers included. A worker killed by the signal makes the rank's next batch raise
    ("DataLoader worker ... is killed by signal") before the rank can finish its step and save;
    ignoring it leaves the stop to the rank, which shuts its workers down itself. Draws no
    random numbers: the workers' seeds (and so the batches) are as without it.
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
