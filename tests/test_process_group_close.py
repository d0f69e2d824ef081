"""The end of a multi-process command: the process group is destroyed and gloo's worker
threads joined while the interpreter lives, even when garbage in a reference cycle (as a
training run's model and accelerator) still holds the group. A worker left to the
interpreter's exit frees its last collective's tensors after finalization began, and the rank
dies by SIGABRT instead of its exit code."""

from __future__ import annotations

import subprocess
import sys

# One rank on gloo: garbage in a reference cycle holds the group, as a training run's does, and a
# collective of Python objects has run; the script prints its thread counts before, during, after.
SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from asrforge.train.ranks import close_process_group

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(1)
before = threads()
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
holder = [dist.group.WORLD]
holder.append(holder)
gathered = [None]
dist.all_gather_object(gathered, {"dropped": ["a"]})
del holder
during = threads()
close_process_group()
print(before, during, threads(), dist.is_initialized())
"""


def run_script(tmp_path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "rendezvous")],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": ":".join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_closing_joins_the_groups_threads_that_a_cycle_still_holds(tmp_path):
    before, during, after, initialized = run_script(tmp_path)
    assert int(during) > int(before)  # the group's threads ran
    assert int(after) == int(before), "gloo's threads outlive the command"
    assert initialized == "False"
