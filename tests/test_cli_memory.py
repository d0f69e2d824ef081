"""The ``asrforge`` process keeps freed memory for its next large tensor (``cli/memory.py``)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

import asrforge.cli as cli
from asrforge.cli.memory import chosen_elsewhere, keep_freed_memory

linux_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="the thresholds are glibc's",
)

# Page faults of allocating and filling a 64 MiB tensor once more, after a few were freed (the
# heap settles on its blocks in two or three rounds, as a run's batches do).
_FAULTS = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from asrforge.cli.memory import keep_freed_memory
    kept = keep_freed_memory({}) if sys.argv[1] == "kept" else False
    def faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 << 20).fill_(1.0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    for _ in range(3):
        faults()
    print(json.dumps({"kept": kept, "faults": faults()}))
    """
)


def _reallocation(way: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, way], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux_glibc
def test_a_large_tensor_allocated_again_reuses_the_freed_pages():
    default, kept = _reallocation("default"), _reallocation("kept")
    pages = (64 << 20) // 4096
    assert not default["kept"] and default["faults"] > pages // 2  # glibc: fresh pages each time
    assert kept["kept"] and kept["faults"] < pages // 20


@pytest.mark.fast
@pytest.mark.parametrize(
    "environ, chosen",
    [
        ({}, None),
        ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_"),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES"),
        ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}, None),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "LD_PRELOAD"),
    ],
)
def test_the_allocator_a_person_chose_stands(environ, chosen):
    assert chosen_elsewhere(environ) == chosen
    if chosen:
        assert keep_freed_memory(environ) is False


@pytest.mark.fast
def test_every_command_sets_the_allocator_first(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(True))
    assert cli.main(["config", "hf"]) == 0
    assert calls == [True]
