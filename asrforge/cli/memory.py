"""The allocator settings of an ``asrforge`` process: freed memory kept for the next tensor.

glibc's malloc hands a block over 32 MiB to the program as fresh pages from the kernel (mmap)
and gives it back on free, so every large tensor (a batch's encoder activations, its logits)
is paid for again in page faults the next time it is allocated: a tenth of a batched CPU
evaluation's encoder time (bench/README.md). With the thresholds raised, such blocks come from
the heap and go back to it. Where the person running the command chose otherwise (glibc's
``MALLOC_*`` variables or tunables, another allocator preloaded), that choice stands.

How it was measured: docs/decisions.md, "Freed memory is kept for the next tensor".
"""

from __future__ import annotations

import ctypes
import os
import sys

BLOCK_BYTES = 1 << 30
"""Blocks up to this size come from the heap, and up to this much freed memory at its top is
kept: above a whisper-large evaluation batch's largest activation."""

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

_ALLOCATOR_CHOICES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def chosen_elsewhere(environ: os._Environ | dict[str, str] = os.environ) -> str | None:
    """The environment variable by which the person running the command chose the allocator's
    behaviour (``MALLOC_MMAP_THRESHOLD_``, a ``glibc.malloc`` tunable, a preloaded allocator),
    or None."""
    for name in _ALLOCATOR_CHOICES:
        if name in environ:
            return name
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if environ.get("LD_PRELOAD", "").strip():
        return "LD_PRELOAD"
    return None


def keep_freed_memory(environ: os._Environ | dict[str, str] = os.environ) -> bool:
    """Raise glibc's mmap and trim thresholds to :data:`BLOCK_BYTES` for this process (and the
    workers it forks); True when they were set, False where glibc is not the allocator or the
    environment chose otherwise (:func:`chosen_elsewhere`)."""
    if not sys.platform.startswith("linux") or chosen_elsewhere(environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, BLOCK_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, BLOCK_BYTES)
    )
