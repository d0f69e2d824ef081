"""The run's autocast precision: what ``train.precision`` (``auto`` included) becomes on this
device and model, and accelerate's fp16 made real on a CPU."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from asrforge.config import ModelConfig


def cpu_bf16_units() -> list[str]:
    """The CPU's bf16 matrix/vector units (``amx_bf16``, ``avx512_bf16``) from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        return []
    return [u for u in ("amx_bf16", "avx512_bf16") if u in flags]


# bf16 autocast pays per op (casts, oneDNN primitives per shape): measured on this 2-core AMX
# CPU it halves a Whisper tiny.en step (d_model 384) but makes the tiny test model (d_model 32)
# 1.3x slower. Auto chooses it from this width up (every released Whisper is at least 384 wide).
BF16_MIN_WIDTH = 256


def model_width(cfg: ModelConfig) -> int | None:
    """``d_model`` of the model ``cfg`` builds (read from a pretrained directory's config.json);
    None when it cannot be read (the model build reports that properly)."""
    if cfg.pretrained is None:
        return cfg.d_model
    try:
        return int(json.loads((Path(cfg.pretrained) / "config.json").read_text())["d_model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def choose_precision(requested: str, device: str, width: int | None = None) -> tuple[str, str]:
    """(autocast precision, why). A requested precision is used as it is, on a CPU too (fp16
    there: torch's CPU autocast and ``GradScaler("cpu")``, see :func:`enable_cpu_fp16`).

    ``auto`` on a CPU: bf16 when the CPU has bf16 units and the model is at least
    ``BF16_MIN_WIDTH`` wide (``width``, its d_model), fp32 otherwise.
    """
    cuda = torch.cuda.is_available() and device != "cpu"
    if requested == "auto":
        if not cuda:
            units = cpu_bf16_units()
            if not units:
                return "no", "auto: fp32 on a CPU without bf16 units"
            if width is not None and width >= BF16_MIN_WIDTH:
                return "bf16", (
                    f"auto: this CPU has bf16 units ({', '.join(units)}) and d_model {width} >= "
                    f"{BF16_MIN_WIDTH}: bf16 autocast (~2x faster than fp32 for Whisper tiny.en)"
                )
            return "no", (
                f"auto: fp32; this CPU has bf16 units ({', '.join(units)}) but d_model {width} < "
                f"{BF16_MIN_WIDTH}: per-op bf16 overhead outweighs the faster matmuls"
            )
        if torch.cuda.is_bf16_supported():
            return "bf16", "auto: this GPU supports bf16"
        return "fp16", "auto: GPU without bf16, fp16 with dynamic loss scaling"
    if requested == "fp16" and not cuda:
        return "fp16", "set in train.precision: fp16 autocast with dynamic loss scaling on the CPU"
    return requested, "set in train.precision"


def enable_cpu_fp16(acc) -> None:
    """Make accelerate's fp16 on a CPU what it is on a GPU: fp16 autocast and a dynamic loss
    scaler. accelerate leaves both off on a CPU (it silently trains in fp32), although torch
    supports them there; with them on, a CPU run takes the GPU's code path (scaled backward,
    unscale in ``clip_grad_norm_``, ``scaler.step`` + ``update`` in ``optimizer.step``), so the
    tests cover it. Call before ``acc.prepare`` (the prepared optimizer takes the scaler)."""
    if acc.mixed_precision == "fp16" and acc.device.type == "cpu" and acc.scaler is None:
        acc.native_amp = True
        acc.scaler = torch.amp.GradScaler("cpu")
