"""The end of a multi-process command: the process group is destroyed and gloo's worker
threads joined while the interpreter lives, even when garbage in a reference cycle (as a
training run's model and accelerator) still holds the group. A worker left to the
interpreter's exit frees its last collective's tensors after finalization began, and the rank
dies by SIGABRT instead of its exit code. When the group outlives the close, the CLI leaves
without the finalization."""

from __future__ import annotations

import subprocess
import sys

# The scripts' environment: this checkout's asrforge, one thread per process.
CHILD_ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": ":".join(sys.path)}

# One rank on gloo: garbage in a reference cycle holds the group, as a training run's does, and a
# collective of Python objects has run; with "kept", a live list holds it too, as torch's DTensor
# caches hold a sharded model's device mesh. The script prints its thread counts before, during
# and after the close, and what the close returned.
SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
from asrforge.train.ranks import close_process_group

def threads():
    return set(os.listdir("/proc/self/task"))

torch.set_num_threads(1)
before = threads()
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
holder = [dist.group.WORLD]
holder.append(holder)
kept = [dist.group.WORLD] if sys.argv[2] == "kept" else []
gathered = [None]
dist.all_gather_object(gathered, {"dropped": ["a"]})
del holder
during = threads()
closed = close_process_group()
deadline = time.monotonic() + 10
while threads() - during and time.monotonic() < deadline:  # the joined closing thread's exit
    time.sleep(0.01)
print(len(before), len(during), len(threads()), dist.is_initialized(), closed)
"""


def run_script(tmp_path, holders: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "rendezvous"), holders],
        capture_output=True, text=True, timeout=120, env=CHILD_ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_closing_joins_the_groups_threads_that_a_cycle_still_holds(tmp_path):
    before, during, after, initialized, closed = run_script(tmp_path, "cycle")
    assert int(during) > int(before)  # the group's threads ran
    assert int(after) == int(before), "gloo's threads outlive the command"
    assert initialized == "False"
    assert closed == "True"


def test_a_group_something_else_keeps_is_reported_so_the_cli_skips_finalization(tmp_path):
    before, during, after, initialized, closed = run_script(tmp_path, "kept")
    assert int(after) == int(during) > int(before)  # the kept group's threads still run
    assert initialized == "False"
    assert closed == "False"


# What the CLI does when the close returns False: exit handlers run, then the exit code, with no
# finalization (an object's __del__ that only the finalization would call never runs).
LEAVE = """
import atexit, sys
from pathlib import Path
from asrforge.cli import leave_without_finalization

class Finalized:
    def __del__(self, mark=str(Path(sys.argv[1], "finalized")), open=open):
        open(mark, "w").close()

anchor = Finalized()
anchor.cycle = anchor
atexit.register(Path(sys.argv[1], "handlers").write_text, "")
print("before the exit", end="")
leave_without_finalization(3)
"""


def test_leaving_without_finalization_runs_the_exit_handlers_and_keeps_the_code(tmp_path):
    done = subprocess.run([sys.executable, "-c", LEAVE, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=CHILD_ENV)  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "before the exit"  # stdout flushed though it is a pipe
    assert (tmp_path / "handlers").exists()
    assert not (tmp_path / "finalized").exists()


# Two gloo ranks: rank 0 leaves with an all-reduce its peer never joins, and closes its group as
# the CLI does; rank 1 waits (up to a minute) for rank 0 to say it closed, so a close that waited
# for the pending collective would take that minute.
PENDING = """
import os, sys, time
from datetime import timedelta
from pathlib import Path
import torch
import torch.distributed as dist
from asrforge.train.ranks import close_process_group

rank, rendezvous, closed = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=2,
                        timeout=timedelta(seconds=120))
if rank == 0:
    dist.all_reduce(torch.ones(4), async_op=True)
    t0 = time.monotonic()
    closed_now = close_process_group(wait=1.0)
    closed.write_text(f"{time.monotonic() - t0} {closed_now}")
    if not closed_now:  # as the CLI leaves: the interpreter's finalization could abort
        os._exit(0)
else:
    deadline = time.monotonic() + 60
    while not closed.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
"""


def test_a_collective_left_pending_does_not_hold_the_close_for_the_groups_timeout(tmp_path):
    closed = tmp_path / "closed"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", PENDING, str(rank), str(tmp_path / "rendezvous"), str(closed)],
            env=CHILD_ENV,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for proc in ranks:
        assert proc.wait(timeout=150) == 0, proc.stderr.read()[-2000:]
    seconds, joined = closed.read_text().split()
    assert float(seconds) < 30  # the peer would have held it 60 s, the group 120 s
    assert joined == "False"  # so the CLI leaves by os._exit, without the finalization
