"""The memory allocator under a CPU training step: glibc as it comes, glibc as the ``asrforge``
command sets it (``asrforge/cli/memory.py``), glibc tuned, jemalloc and tcmalloc, each in a child process of its own running asrforge's ``Trainer.fit`` on the same
workload as ``bench_train.py`` (tiny.en, batch 4; ``--quick`` for the small model).

An allocator is chosen when a process starts (environment variables, ``LD_PRELOAD``), so each
side is a fresh process; the sides alternate over ``--repeats`` rounds so that a change in the
machine's load falls on all of them alike. Each child reports the measured steps' samples/s, CPU
time, system time and minor page faults (fresh pages the kernel had to hand over).

glibc's defaults return large freed blocks to the kernel (``mmap`` above a threshold that grows
to 32 MiB, ``trim`` of the heap's top), so a step whose activations are freed and allocated again
keeps faulting in fresh zeroed pages; the command's setting and the tuned variant keep them in
the heap. The "glibc" side sets one glibc tunable at its default value
(``glibc.malloc.arena_test=8``), which tells the command's setting to step aside and changes
nothing else (``MALLOC_TOP_PAD_`` would: it stops glibc's threshold from growing).

Run::

    .venv/bin/python bench/bench_alloc.py --repeats 2      # tiny.en, 2 warm-up + 6 steps a side
    .venv/bin/python bench/bench_alloc.py --quick          # seconds

Prints one row per side and round, then
``RESULT alloc samples/s glibc=X asrforge=A glibc-tuned=Y jemalloc=Z tcmalloc=W`` (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

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

from asrforge.cli.memory import chosen_elsewhere  # noqa: E402
from asrforge.train.events import Callback  # noqa: E402
from asrforge.train.loop import Trainer  # noqa: E402

LIBRARIES = Path("/usr/lib/x86_64-linux-gnu")

# glibc kept from handing freed blocks back: no mmap for large blocks, no trim of the heap's
# top, and 512 MiB asked of the kernel at a time.
GLIBC_TUNED = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**62),
    "MALLOC_TOP_PAD_": str(512 * 2**20),
}


# a tunable at its default, so that the command's own setting (cli/memory.py) steps aside
GLIBC_AS_IT_COMES = {"GLIBC_TUNABLES": "glibc.malloc.arena_test=8"}


def sides() -> dict[str, dict[str, str] | None]:
    """Each allocator's environment, or None where its library is not installed."""

    def preload(name: str) -> dict[str, str] | None:
        path = LIBRARIES / name
        return {"LD_PRELOAD": str(path)} if path.exists() else None

    return {
        "glibc": GLIBC_AS_IT_COMES,
        "asrforge": {},
        "glibc-tuned": GLIBC_TUNED,
        "jemalloc": preload("libjemalloc.so.2"),
        "tcmalloc": preload("libtcmalloc_minimal.so.4"),
    }


def run_child(args: argparse.Namespace) -> dict:
    """The training run of one side: the measured steps' figures, printed as JSON."""
    with bench_session("bench-alloc-", args) as (tmp, work):
        n_steps = args.warmup + args.steps
        sizes = training_sizes(args.quick, args.batch_size, n_steps)
        data = prepare_data(work, args.quick, sizes)
        cfg = make_config(work, tmp / "run", data, quick=args.quick,
                          batch_size=args.batch_size, max_steps=n_steps)  # fmt: skip
        clock, usage = Clock(), []

        class Timer(Callback):
            name = "bench-timer"
            critical = True

            def on_step_end(self, state, *, metrics):
                clock.mark(metrics["loss"])
                usage.append(resource.getrusage(resource.RUSAGE_SELF))

        Trainer(cfg, [Timer()]).fit()
        seconds, steps = clock.steady_seconds(args.warmup)
        first, last = usage[args.warmup - 1], usage[-1]
        samples = steps * args.batch_size
        return {
            "samples_per_s": samples / seconds,
            "cpu_s_per_step": clock.steady_cpu_seconds(args.warmup) / steps,
            "sys_s_per_step": (last.ru_stime - first.ru_stime) / steps,
            "minor_faults_per_step": (last.ru_minflt - first.ru_minflt) / steps,
            "max_rss_mb": last.ru_maxrss / 1024,
            "last_loss": clock.losses[-1],
            # whether bench_session's call of the command's setting took effect (cli/memory.py)
            "set_by_asrforge": platform.libc_ver()[0] == "glibc" and chosen_elsewhere() is None,
            # what the child ran under, so a report cannot name an allocator that was not used
            "environment": {
                k: os.environ[k]
                for k in (*GLIBC_TUNED, "LD_PRELOAD", "GLIBC_TUNABLES")
                if k in os.environ
            },
        }


def run_side(env: dict[str, str], args: argparse.Namespace, work: Path) -> dict:
    """One child process with ``env`` added to this one's environment."""
    command = [sys.executable, __file__, "--child", "--batch-size", str(args.batch_size),
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--work-dir", str(work)]  # fmt: skip
    if args.quick:
        command.append("--quick")
    if args.threads:
        command += ["--threads", str(args.threads)]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return {}
    unknown = set(args.sides) - set(sides())
    if unknown:
        raise SystemExit(f"--sides: unknown {sorted(unknown)}; choose from {list(sides())}")
    available = {n: env for n, env in sides().items() if env is not None and n in args.sides}
    rows: dict[str, list[dict]] = {name: [] for name in available}
    with bench_session("bench-alloc-", args) as (tmp, work):
        # the data set and tiny.en built once, before any timed child
        prepare_data(
            work, args.quick, training_sizes(args.quick, args.batch_size, args.warmup + args.steps)
        )
        for r in range(args.repeats):
            order = list(available) if r % 2 == 0 else list(reversed(available))
            for name in order:
                res = run_side(available[name], args, work)
                res["load"] = load_average()
                rows[name].append(res)
    return report(
        args, rows, missing=[n for n, e in sides().items() if e is None and n in args.sides]
    )


def report(args: argparse.Namespace, rows: dict[str, list[dict]], missing: list[str]) -> dict:
    model = "quick (d_model 64, 2+2 layers, 2 s)" if args.quick else "tiny.en (37.8M, 30 s)"
    print(f"\nmodel {model}, batch {args.batch_size}, {args.warmup} warm-up + {args.steps} "
          f"measured steps a side, fp32, {time.strftime('%Y-%m-%d')}")  # fmt: skip
    print(f"{'allocator':<12} {'run':>3} {'samples/s':>10} {'cpu s/step':>10} {'sys s/step':>10} "
          f"{'faults/step':>12} {'max RSS MB':>10} {'last loss':>10}  load")  # fmt: skip
    for name, runs in rows.items():
        for i, r in enumerate(runs):
            print(f"{name:<12} {i:>3} {r['samples_per_s']:>10.3f} {r['cpu_s_per_step']:>10.3f} "
                  f"{r['sys_s_per_step']:>10.3f} {r['minor_faults_per_step']:>12.0f} "
                  f"{r['max_rss_mb']:>10.0f} {r['last_loss']:>10.5f}  {r['load']}")  # fmt: skip
    if missing:
        print(f"(not installed here: {', '.join(missing)})")
    medians = {
        name: statistics.median(r["samples_per_s"] for r in runs) for name, runs in rows.items()
    }
    base = medians["glibc"]
    print("ratio to glibc: " + ", ".join(f"{n} {v / base:.3f}" for n, v in medians.items()))
    print("RESULT alloc samples/s " + " ".join(f"{n}={v:.3f}" for n, v in medians.items()))
    return {"medians": medians, "rows": rows}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model on tones (seconds)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps, not measured (>= 1)")
    p.add_argument("--steps", type=int, default=6, help="measured steps")
    p.add_argument("--repeats", type=int, default=1, help="rounds, alternating the sides' order")
    p.add_argument(
        "--sides", nargs="+", default=list(sides()), help="allocators to compare (glibc first)"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_session_args(p)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    return args


if __name__ == "__main__":
    main()
