"""Where a training step's and an evaluation's time goes, asrforge against transformers, under
``torch.profiler``: the companion of ``gpu_check.py`` for when a ratio there needs explaining.

For one shape and precision it trains both sides as ``gpu_check`` does (same weights, batches,
optimizer, workers) with the profiler active over the measured steps, then decodes the
evaluation batches with ``evaluate()`` and with ``model.generate``. For each it prints the wall
seconds a step (or a decode) took, the device's busy seconds in that span (the sum of its
kernels), the host-device waits (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, device to
host copies) and the operators with the most device and host time. A side whose wall time is far
above its device time is waiting on the host: launches, Python, or a wait in the wrong place.

Run (on the GPU, in the same call as gpu_check; see bench/README.md)::

    python3 bench/gpu_profile.py --out $OUT/gpu_profile.txt
    .venv/bin/python bench/gpu_profile.py --device cpu --quick --out /tmp/gp.txt   # logic
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import Progress, make_cfg, prepare  # noqa: E402
from gpu_runs import (  # noqa: E402
    EvalSides,
    free_memory,
    run_asrforge_train,
    run_hf_train,
    sync,
    warm_shapes,
    write_report,
)
from workload import build_workload, whisper_shape_model  # noqa: E402

from asrforge.data.workers import worker_count  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "Memcpy DtoH")
"""Profiler event names (substrings) where the host waits for the device."""


def summarize(prof, label: str, wall: float, units: int, unit: str, top: int) -> str:
    """The report of one profiled span: wall and device seconds per ``unit``, the waits, and
    the ``top`` operators by device time and by host time."""
    events = prof.key_averages()
    device_us = sum(
        e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    )
    waits = {
        name: (sum(e.count for e in events if name in e.key),
               sum(e.cpu_time_total for e in events if name in e.key) / 1e6)
        for name in WAITS
    }  # fmt: skip
    lines = [
        f"== {label}: {units} {unit}(s), wall {wall / units * 1e3:.1f} ms/{unit}, device busy "
        f"{device_us / 1e3 / units:.1f} ms/{unit} ({device_us / 1e6 / wall:.0%} of wall)",
        "waits: "
        + ", ".join(
            f"{k} x{c / units:.1f}/{unit} {s / units * 1e3:.1f} ms" for k, (c, s) in waits.items()
        ),  # fmt: skip
        events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60),
        events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60),
    ]
    return "\n".join(lines)


def activities(device: str) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])


def profile_training(args, tmp: Path, data: Path, model: dict) -> list[str]:
    """Both sides' training with the profiler on the steps after ``args.warmup``."""
    steps = args.warmup + args.steps
    out = []
    for side in ("asrforge", "transformers"):
        free_memory(args.device)
        cfg = make_cfg(args, tmp / f"{side}-run", data, model, args.precision, steps)
        if side == "asrforge":  # both sides meet every shape's attention plan already built
            warm_shapes(build_workload(cfg), steps)
        prof = profile(
            activities=activities(args.device),
            schedule=schedule(wait=0, warmup=args.warmup, active=args.steps, repeat=1),
        )
        marks: list[float] = []

        def step(prof=prof, marks=marks) -> None:
            prof.step()
            marks.append(time.perf_counter())

        with prof:
            if side == "asrforge":
                run_asrforge_train(cfg, args.warmup, step_hook=step)
            else:
                w = build_workload(cfg)
                workers = worker_count("auto", args.device)
                run_hf_train(w, tmp / "hf", args.warmup, workers, step_hook=step)
                del w
        wall = marks[-1] - marks[args.warmup - 1]
        out.append(summarize(prof, f"train {side}", wall, args.steps, "step", args.top))
    return out


def profile_eval(args, tmp: Path, data: Path, model: dict) -> list[str]:
    """``evaluate()`` and a ``model.generate`` loop on the same batches (``gpu_runs.EvalSides``),
    each after a warm-up decode of the first batch."""
    free_memory(args.device)
    w = build_workload(make_cfg(args, tmp / "eval", data, model, "no", 1))
    w.eval_set.utts = w.eval_set.utts[: args.eval_n]
    sides = EvalSides(w, workers=0, precision=args.eval_precision)
    device, batches = sides.device, sides.batches

    out, hyps = [], {}
    for name, run in (("evaluate()", sides.asrforge), ("generate", sides.generate)):
        run(batches[:1])
        sync(device)
        with profile(activities=activities(device)) as prof:
            t0 = time.perf_counter()
            hyps[name] = run(batches)
            sync(device)
            wall = time.perf_counter() - t0
        label = f"eval {name} {args.shape} {args.eval_precision}"
        out.append(summarize(prof, label, wall, len(batches), "batch", args.top))
    a, g = hyps["evaluate()"], hyps["generate"]
    same = sum(x == y for x, y in zip(a, g, strict=True))
    words = {k: sum(len(h.split()) for h in v) / len(v) for k, v in hyps.items()}
    first = next(((x, y) for x, y in zip(a, g, strict=True) if x != y), None)
    out.append(f"== eval hypotheses: {same}/{len(a)} equal; words per hypothesis {words}; "
               f"first difference: {first}")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="the 2+2-layer d_model 64 model")
    p.add_argument("--shape", default="base", help="base or small")
    p.add_argument("--precision", default="bf16", help="training precision: fp16, bf16, no")
    p.add_argument("--eval-precision", default=None, help="default bf16 (cpu: fp32)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=15, help="operators listed per table")
    p.add_argument("--parts", default="train,eval", help="comma-separated: train, eval")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    small = args.quick
    args.batch_size = args.eval_batch_size = 2 if small else 16
    args.eval_n = 4 if small else 32
    args.eval_n_auto = args.eval_n  # gpu_check.prepare makes this many clips; no auto batch here
    args.max_new_tokens = 4 if small else 48
    args.eval_precision = args.eval_precision or ("bf16" if args.device == "cuda" else "fp32")
    logging.getLogger("asrforge").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-profile-"))
    try:
        data, tokenizer = prepare(args, Progress(budget=float("inf")), tmp)
        model = whisper_shape_model("quick" if args.quick else args.shape, tokenizer)
        parts = []
        if "train" in args.parts.split(","):
            parts += profile_training(args, tmp, data, model)
        if "eval" in args.parts.split(","):
            parts += profile_eval(args, tmp, data, model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_report(args.out, "\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
