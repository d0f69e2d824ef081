"""How soon an evaluation batch is ready: one DataLoader worker reading and featurizing it whole,
against the workers each reading a piece of it, joined again (what a run's evaluation does:
``RunLoaders.eval_loader``).

A DataLoader gives each batch to one worker. An evaluation of a few large batches
(``data.eval_batch_size: auto`` on a GPU) then waits on one worker's log-mels while the others
have nothing to do: on an H100, 128 clips at batch 128 took 3.3-3.9 s on every side while the
model decoded them in under a second (bench/README.md, "GPU figures"). Both ways here load the
same batches of the workload's espeak-ng English clips (``--quick``: tones) with the same
``--workers``; each timing starts the loader (its workers forked) and ends when every batch is
in the main process. No model runs.

Run::

    .venv/bin/python bench/bench_eval_batches.py --clips 128 --workers 2
    .venv/bin/python bench/bench_eval_batches.py --quick

Prints a row per way and run, then ``RESULT eval_batches seconds whole=X joined=Y speedup=Z``
(medians).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch.utils.data import DataLoader  # noqa: E402
from workload import (  # noqa: E402 - the bench directory is not a package
    add_session_args,
    bench_session,
    build_workload,
    load_average,
    make_config,
    prepare_data,
)

from asrforge.data.dataset import JoinedBatches, eval_batches, worker_pieces  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the rows and the RESULT line; return the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clips", type=int, default=128, help="clips, one evaluation batch")
    p.add_argument("--batch-size", type=int, default=None, help="default: --clips (one batch)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (both ways)")
    p.add_argument("--repeats", type=int, default=3, help="runs per way, alternating")
    p.add_argument("--quick", action="store_true", help="8 tone clips")
    add_session_args(p)
    args = p.parse_args(argv)
    n = 8 if args.quick else args.clips
    batch = args.batch_size or n
    with bench_session("bench-eval-batches-", args) as (tmp, work):
        sizes = {"train": 4, "validation": n}
        data = prepare_data(work, args.quick, sizes)
        cfg = make_config(work, tmp / "run", data, quick=args.quick, batch_size=batch,
                          eval_batch_size=batch, num_workers=args.workers)  # fmt: skip
        w = build_workload(cfg)
        n = len(w.eval_set.utts)  # the clips the workload keeps
        batches = eval_batches(w.eval_set.utts, batch)

        def loader(index_batches: list[list[int]]) -> DataLoader:
            return DataLoader(w.eval_set, batch_sampler=index_batches, collate_fn=w.collator,
                              num_workers=args.workers, prefetch_factor=4)  # fmt: skip

        def whole() -> list[dict]:
            return list(loader(batches))

        def joined() -> list[dict]:
            pieces, counts = worker_pieces(batches, args.workers)
            return list(JoinedBatches(loader(pieces), counts, w.collator))

        ways = {"whole": whole, "joined": joined}
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        print(f"{n} clips, batches of {batch}, {args.workers} workers; load {load_average()}")
        for r in range(args.repeats):
            for name in ways if r % 2 == 0 else reversed(ways):
                t = time.perf_counter()
                got = ways[name]()
                seconds[name].append(time.perf_counter() - t)
                assert sum(b["size"] for b in got) == n
                print(f"{name:<7} run {r}: {seconds[name][-1]:.2f} s")
    out = {name: statistics.median(s) for name, s in seconds.items()}
    out["speedup"] = out["whole"] / out["joined"]
    print(
        f"RESULT eval_batches seconds whole={out['whole']:.2f} joined={out['joined']:.2f} "
        f"speedup={out['speedup']:.2f}"
    )
    return out


if __name__ == "__main__":
    main()
