"""Training throughput of partial fine-tuning with and without the frozen part's cache.

Two modes on the tiny.en workload of ``workload.py`` (``--quick``: the from-scratch 2+2-layer
model on tones), each trained twice by ``Trainer.fit`` from the same initial weights on the same
batches, once recomputing the frozen part every step and once reading it from the cache
(``data.cache_encoder``):

* decoder only: ``model.freeze_encoder`` (the cache holds the encoder's output);
* top N encoder layers + decoder: ``model.train_encoder_layers: N`` (the cache holds the states
  entering layer L-N; each step runs the top N layers, the final layer norm and the decoder).

Timed: from the end of the last warm-up step to the end of the last step, as in
``bench_train.py``; the cache is built in ``prepare_run`` before the first step, so its one-time
cost is outside that span and reported on its own. A cached run must reproduce the uncached
run's per-step losses (the frozen part is a fixed function), so the table prints the largest
per-step loss difference per mode. Ends with one ``RESULT`` line.

    .venv/bin/python bench/bench_cache.py [--quick] [--threads 2] [--work-dir /tmp/bench-work]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import (  # noqa: E402 - the bench directory is not a package
    Clock,
    add_session_args,
    bench_session,
    load_average,
    make_config,
    prepare_data,
    training_sizes,
)

from asrforge.config import TrainConfig, load_config  # noqa: E402
from asrforge.data.cache.encoder import EncoderCache  # noqa: E402
from asrforge.train.events import Callback  # noqa: E402
from asrforge.train.loop import Trainer  # noqa: E402


@contextlib.contextmanager
def timed_cache_builds(seconds: list[float]):
    """Append the wall time of every ``EncoderCache.build`` call to ``seconds``."""
    original = EncoderCache.__dict__["build"]

    def build(cls, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original.__func__(cls, *args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    EncoderCache.build = classmethod(build)
    try:
        yield seconds
    finally:
        EncoderCache.build = original


def run(cfg: TrainConfig, warmup: int) -> dict:
    """``Trainer.fit`` on ``cfg``: steady-state timing, per-step losses, cache build time."""
    clock, samples = Clock(), []

    class Timer(Callback):
        name = "bench-timer"
        critical = True

        def on_step_end(self, state, *, metrics):
            clock.mark(metrics["loss"])
            samples.append(metrics["samples"])

    with timed_cache_builds([]) as builds:
        result = Trainer(cfg, [Timer()]).fit()
    if result.status != "completed":
        raise RuntimeError(f"run ended {result.status}: {result.reason}")
    seconds, steps = clock.steady_seconds(warmup)
    return {
        "seconds": seconds,
        "steps": steps,
        "cpu_seconds": clock.steady_cpu_seconds(warmup),
        "samples": sum(samples[warmup:]),
        "losses": clock.losses,
        "build_seconds": sum(builds) if builds else None,
        "load": load_average(),
    }


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time (of an even number, the faster middle one)."""
    return sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]


def mode_config(base: TrainConfig, out: Path, model: dict, cache_dir: Path | None) -> TrainConfig:
    """``base`` with the mode's model fields and the cache on (``cache_dir``) or off (None)."""
    plain = base.to_plain()
    plain["output_dir"] = str(out)
    plain["model"].update(model)
    plain["data"].update(
        cache_encoder=cache_dir is not None, cache_dir=cache_dir and str(cache_dir)
    )
    return load_config(data=plain)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model on tones (seconds)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps, not measured (>= 1)")
    p.add_argument("--steps", type=int, default=6, help="measured steps")
    p.add_argument(
        "--train-encoder-layers", type=int, default=1, help="N of the top-N-layers mode (>= 1)"
    )
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="autocast")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each of the four, in reverse order every other time; the median is reported",
    )
    add_session_args(p, "; the caches are always built afresh in a temp dir")
    args = p.parse_args(argv)
    if min(args.warmup, args.steps, args.train_encoder_layers, args.repeats) < 1:
        p.error("--warmup, --steps, --train-encoder-layers and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the four trainings; print the table and the RESULT line; return the figures."""
    args = parse_args(argv)
    with bench_session("bench-cache-", args) as (tmp, work):
        n_steps = args.warmup + args.steps
        sizes = training_sizes(args.quick, args.batch_size, n_steps)
        data = prepare_data(work, args.quick, sizes)
        base = make_config(
            work,
            tmp / "base",
            data,
            quick=args.quick,
            batch_size=args.batch_size,
            max_steps=n_steps,
            lr=args.lr,
        )
        base.train.precision = "bf16" if args.precision == "bf16" else "no"
        n = args.train_encoder_layers
        modes = {
            "decoder only": {"freeze_encoder": True},
            f"top {n} enc + dec": {"train_encoder_layers": n},
        }
        runs = [(mode, cached) for mode in modes for cached in (False, True)]
        results: dict[tuple[str, bool], list[dict]] = {key: [] for key in runs}
        for r in range(args.repeats):
            for mode, cached in runs if r % 2 == 0 else runs[::-1]:
                # a fresh cache directory per run: each cached run pays (and reports) its build
                cfg = mode_config(
                    base,
                    tmp / f"run-{r}-{runs.index((mode, cached))}",
                    modes[mode],
                    tmp / f"cache-{r}" if cached else None,
                )
                results[mode, cached].append(run(cfg, args.warmup))
        sides = (("uncached", False), ("cached", True))
        rows = {
            mode: {side: median_run(results[mode, cached]) for side, cached in sides}
            for mode in modes
        }
        if args.repeats > 1:
            every = {
                f"{mode} {side}": [round(r["seconds"] / r["steps"], 3) for r in results[mode, c]]
                for mode in modes
                for side, c in sides
            }
            print("\ns/step of every run (medians below):", every)
        return report(args, rows)


def report(args: argparse.Namespace, rows: dict[str, dict[str, dict]]) -> dict:
    """Print the table and the RESULT line."""
    model = (
        "quick (d_model 64, 2+2 layers, 2 s)" if args.quick else "tiny.en (37.8M, 4+4 layers, 30 s)"
    )
    print(
        f"\nmodel {model}, batch {args.batch_size}, {args.warmup} warm-up + {args.steps} measured "
        f"steps, torch threads {torch.get_num_threads()}, precision {args.precision}"
    )
    print(
        f"{'mode':<17} {'cache':<8} {'s/step':>7} {'CPU s/step':>10} {'samples/s':>9} "
        f"{'speed-up':>8} {'max |dloss|':>11} {'cache build s':>13}  load"
    )
    out: dict = {}
    for mode, sides in rows.items():
        plain, cached = sides["uncached"], sides["cached"]
        for r in (plain, cached):
            r["samples_per_s"] = r["samples"] / r["seconds"]
        speedup = cached["samples_per_s"] / plain["samples_per_s"]
        diff = max(abs(a - b) for a, b in zip(plain["losses"], cached["losses"], strict=True))
        for side, r in sides.items():
            build = f"{r['build_seconds']:.1f}" if r["build_seconds"] is not None else "-"
            print(
                f"{mode:<17} {side:<8} {r['seconds'] / r['steps']:>7.3f} "
                f"{r['cpu_seconds'] / r['steps']:>10.3f} {r['samples_per_s']:>9.3f} "
                f"{speedup if side == 'cached' else 1.0:>8.2f} "
                f"{diff if side == 'cached' else 0.0:>11.2e} {build:>13}  {r['load']}"
            )
        out[mode] = {
            "speedup": speedup,
            "cpu_speedup": plain["cpu_seconds"] / cached["cpu_seconds"],
            "loss_diff": diff,
            "build_seconds": cached["build_seconds"],
            "samples_per_s": {
                "uncached": plain["samples_per_s"],
                "cached": cached["samples_per_s"],
            },
        }
    print(
        "(s/step: wall time per measured step, batch fetch included; CPU s/step: the process's "
        "CPU time, all threads; speed-up: cached / uncached samples/s; max |dloss|: largest "
        "per-step loss difference, cached vs uncached, over all steps; cache build: the one-time "
        "cost of computing the frozen part for every training utterance, outside the timed span)"
    )
    parts = " ".join(
        f"{key}={v['speedup']:.2f}x"
        for key, v in zip(("decoder_only", "top_layers"), out.values(), strict=True)
    )
    diffs = max(v["loss_diff"] for v in out.values())
    builds = " ".join(
        f"{key}={v['build_seconds']:.1f}s"
        for key, v in zip(("decoder_only", "top_layers"), out.values(), strict=True)
    )
    print(f"RESULT cache speedup {parts} max_loss_diff={diffs:.2e} build {builds}")
    return out


if __name__ == "__main__":
    main()
