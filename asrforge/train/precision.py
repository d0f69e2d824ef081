"""The run's autocast precision: what ``train.precision`` (``auto`` included) becomes on this
device and model, and accelerate's fp16 made real on a CPU."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from pathlib import Path

import torch

from asrforge.config import ModelConfig
from asrforge.errors import CheckpointSaveError, UserError
from asrforge.hub import resolve_model
from asrforge.io.atomic import atomic_write_text
from asrforge.io.locks import exclusive
from asrforge.io.small_files import read_json


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_bf16_units() -> list[str]:
    """The CPU's bf16 matrix/vector units (``amx_bf16``, ``avx512_bf16``) from /proc/cpuinfo."""
    flags = _cpuinfo().get("flags", "").split()
    return [u for u in ("amx_bf16", "avx512_bf16") if u in flags]


# bf16 autocast pays per op (casts, oneDNN primitives per shape), so below this width it never
# pays (the tiny test model, d_model 32, runs 1.3x slower in it); every released Whisper is at
# least 384 wide, and there the CPU decides: a measured probe, as bf16 without AMX runs slower.
BF16_MIN_WIDTH = 256
BF16_MIN_SPEEDUP = 1.1
"""``auto`` picks bf16 on a CPU only when the probe measures it at least this much faster than
fp32: reduced precision must buy a clear gain."""
PROBE_TOKENS = 1500
"""Rows of the probe's matmuls: the frames of a 30 s window after Whisper's encoder stem."""


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo (``unknown`` where there is none)."""
    return _cpuinfo().get("model name") or "unknown"


def measure_bf16_speedup(width: int, repeats: int = 5) -> float:
    """fp32 time over bf16-autocast time of a forward and backward pass through one Whisper
    encoder layer of ``width`` (d_model) over a 30 s window's ``PROBE_TOKENS`` frames, on this
    CPU: the matmuls, attention, norms and casts a training step is made of.

    Returns:
        The ratio; above 1, bf16 autocast is faster. Each side is its fastest of ``repeats``
        runs, the two sides alternating after a warm-up of each.
    """
    # The probe's own seed must not move the caller's random numbers.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _probe(width, repeats)


def _probe(width: int, repeats: int) -> float:
    # The probe runs once per machine, so transformers loads only then.
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer

    heads = max(1, width // 64)
    cfg = WhisperConfig(
        d_model=width, encoder_attention_heads=heads, encoder_ffn_dim=4 * width,
        attn_implementation="sdpa",
    )  # fmt: skip
    layer = WhisperEncoderLayer(cfg)
    x = torch.randn(1, PROBE_TOKENS, width)

    def seconds(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = layer(x, attention_mask=None)
        y = out[0] if isinstance(out, tuple) else out
        y.float().square().mean().backward()
        return time.perf_counter() - start

    seconds(False), seconds(True)
    # Alternating the two sides makes other load on the machine slow both alike.
    runs = [(seconds(False), seconds(True)) for _ in range(repeats)]
    return min(fp32 for fp32, _ in runs) / min(bf16 for _, bf16 in runs)


def probe_cache_file() -> Path:
    """Where measured probes are kept, one per machine and setting: ``$XDG_CACHE_HOME`` (default
    ``~/.cache``) ``/asrforge/precision-probe.json``."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "asrforge" / "precision-probe.json"


def cpu_bf16_speedup(width: int) -> float:
    """:func:`measure_bf16_speedup` at ``width``, measured once per CPU model, torch version and
    thread count and then read from :func:`probe_cache_file`, so every run on a machine (and
    every process of one run) makes the same choice, and a resume keeps its precision."""
    key = (
        f"{cpu_model_name()} | torch {torch.__version__} | threads {torch.get_num_threads()} | "
        f"d_model {width}"
    )
    path = probe_cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Processes starting together (the ranks of one run, a matrix's jobs) measure once.
        with exclusive(path.with_name(path.name + ".lock")):
            return _cached_probe(path, key, width)
    except OSError:
        # A cache that cannot be locked (read-only, no locks on NFS) costs a probe per run.
        return measure_bf16_speedup(width)


def _cached_probe(path: Path, key: str, width: int) -> float:
    try:
        known = read_json(path, error=ValueError)
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), (int, float)):
        return float(known[key])
    speedup = measure_bf16_speedup(width)
    known[key] = round(speedup, 3)
    # A cache that cannot be written costs only a probe per run.
    with contextlib.suppress(OSError, CheckpointSaveError):
        atomic_write_text(path, json.dumps(known, indent=1, sort_keys=True) + "\n")
    return speedup


def model_width(cfg: ModelConfig) -> int | None:
    """``d_model`` of the model ``cfg`` builds (read from a pretrained directory's config.json);
    None when it cannot be read (the model build reports that properly)."""
    if cfg.pretrained is None:
        return cfg.d_model
    try:
        config = resolve_model(cfg.pretrained).path / "config.json"
        return int(json.loads(config.read_text())["d_model"])
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None


def choose_precision(requested: str, device: str, width: int | None = None) -> tuple[str, str]:
    """(autocast precision, why). A requested precision is used as it is, on a CPU too (fp16
    there: torch's CPU autocast and ``GradScaler("cpu")``, see :func:`enable_cpu_fp16`).

    ``auto`` on a CPU: bf16 when the CPU has bf16 units, the model is at least
    ``BF16_MIN_WIDTH`` wide (``width``, its d_model) and the probe
    (:func:`cpu_bf16_speedup`) measures bf16 autocast at least ``BF16_MIN_SPEEDUP`` times as
    fast as fp32 at that width; fp32 otherwise. ``fp32`` is a name for ``no``.
    """
    cuda = torch.cuda.is_available() and device != "cpu"
    if requested == "fp32":
        requested = "no"
    if requested == "auto":
        if not cuda:
            units = cpu_bf16_units()
            if not units:
                return "no", "auto: fp32 on a CPU without bf16 units"
            if width is None or width < BF16_MIN_WIDTH:
                return "no", (
                    f"auto: fp32; this CPU has bf16 units ({', '.join(units)}) but d_model "
                    f"{width} < {BF16_MIN_WIDTH}: per-op bf16 overhead outweighs the faster matmuls"
                )
            speedup = cpu_bf16_speedup(width)
            measured = (
                f"bf16 autocast measured {speedup:.2f}x as fast as fp32 on this CPU "
                f"({cpu_model_name()}; {', '.join(units)}) at d_model {width}"
            )
            if speedup >= BF16_MIN_SPEEDUP:
                return "bf16", f"auto: {measured}"
            return "no", f"auto: fp32; {measured}, under the {BF16_MIN_SPEEDUP}x bf16 needs"
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
