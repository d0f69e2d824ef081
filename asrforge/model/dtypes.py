"""Precision names as configs write them (``train.precision``, ``eval.guard.precision``) and the
torch dtype each computes in."""

from __future__ import annotations

import torch

PRECISION_DTYPES: dict[str, torch.dtype] = {
    "no": torch.float32,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
"""``no`` (accelerate's word) and ``fp32`` both mean full precision."""


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype a resolved precision name computes in (``auto`` is resolved before this)."""
    return PRECISION_DTYPES[precision]


def is_full_precision(precision: str) -> bool:
    return precision_dtype(precision) == torch.float32
