"""Training throughput: asrforge's ``Trainer.fit`` against transformers' ``Seq2SeqTrainer``.

Both sides train the same model (same initial weights, checked by a digest), on the same
batches (asrforge's ``SpeechDataset`` + ``Collator``, in ``epoch_batches`` order, same padding),
with the same optimizer (asrforge's AdamW groups and warmup+cosine ``LambdaLR``, handed to the
Seq2SeqTrainer through ``optimizers=``; ``--hf-optimizer native`` lets transformers build its
own with the same lr/betas/eps/weight decay), gradient clipping 1.0, fp32 or bf16 autocast
(``--precision``), no evaluation, no checkpoints, no loggers, and the same number of DataLoader
workers.

It also prints each side's fraction of this machine's matmul peak: the model FLOPs of the
measured steps (torch's ``FlopCounterMode`` on each measured batch, CPU flash attention
included, attention backward counted as twice its forward) divided by the measured time and
by the best 2048x2048 matmul rate in the same dtype, measured in this process before and
after the runs.

The figure is steady-state throughput: samples of the measured steps divided by the wall time
from the end of the last warm-up step to the end of the last step (a step's data loading,
forward, backward, clipping, optimizer and scheduler step, and the loop's own bookkeeping).
Start-up (model build, data set preparation) and asrforge's final checkpoint are outside it.

Run::

    .venv/bin/python bench/bench_train.py            # tiny.en, batch 4, 2 warm-up + 10 steps
    .venv/bin/python bench/bench_train.py --quick    # a 2+2-layer d_model 64 model on tones

Prints one row per side and run, then
``RESULT train samples/s asrforge=X hf=Y ratio=Z`` (ratio = asrforge / hf, medians over runs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import (  # noqa: E402 - the bench directory is not a package
    Clock,
    CollatedBatches,
    Workload,
    add_session_args,
    bench_session,
    build_workload,
    hf_optim_args,
    load_average,
    make_config,
    matmul_peak,
    prepare_data,
    training_flops,
    training_sizes,
    unwrap,
    weights_digest,
)

from asrforge.train.events import Callback  # noqa: E402
from asrforge.train.loop import Trainer  # noqa: E402
from asrforge.train.optim import build_optimizer, build_scheduler  # noqa: E402


def run_asrforge(cfg, warmup: int) -> dict:
    """``Trainer.fit`` on ``cfg``; returns timing, losses and the initial weights' digest."""
    clock, begins = Clock(), []
    info: dict = {}

    class Timer(Callback):
        name = "bench-timer"
        critical = True

        def on_train_begin(self, state, *, run):
            info["digest"] = weights_digest(run.model)

        def on_step_begin(self, state, *, step):
            begins.append(time.perf_counter())

        def on_step_end(self, state, *, metrics):
            clock.mark(metrics["loss"])
            info.setdefault("step_seconds", []).append(metrics["step_seconds"])

    result = Trainer(cfg, [Timer()]).fit()
    if result.status != "completed":
        raise RuntimeError(f"asrforge run ended {result.status}: {result.reason}")
    seconds, steps = clock.steady_seconds(warmup)
    in_step = sum(e - b for b, e in zip(begins[warmup:], clock.ends[warmup:], strict=True))
    return {
        "seconds": seconds,
        "steps": steps,
        "losses": clock.losses,
        "digest": info["digest"],
        "in_step_seconds": in_step,
        "step_seconds": sum(info["step_seconds"][warmup:]),
        "cpu_seconds": clock.steady_cpu_seconds(warmup),
    }


def run_hf(w: Workload, out: Path, warmup: int, hf_optimizer: str) -> dict:
    """``Seq2SeqTrainer.train`` on asrforge's batches; returns timing, losses, weights digest."""
    from transformers import (
        PrinterCallback,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        TrainerCallback,
    )

    cfg = w.cfg
    model = w.bundle.model
    digest = weights_digest(model)
    clock, begins = Clock(), []
    losses: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            begins.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            clock.mark()

    class LossRecorder(Seq2SeqTrainer):
        """Records each micro-batch's loss (what asrforge's loop reads with ``float(loss)``)."""

        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            losses.append(float(loss))
            return loss

    workers = cfg.data.num_workers
    args = Seq2SeqTrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=1,  # one item = one asrforge batch
        max_steps=cfg.train.max_steps,
        lr_scheduler_type="cosine",
        **hf_optim_args(cfg.optim),
        gradient_accumulation_steps=cfg.train.grad_accum,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=cfg.seed,
        remove_unused_columns=False,
        train_sampling_strategy="sequential",
        dataloader_num_workers=workers,
        dataloader_prefetch_factor=4 if workers else None,
        dataloader_pin_memory=False,
        dataloader_persistent_workers=False,
        bf16=cfg.train.precision == "bf16",  # CPU autocast to bfloat16, as asrforge's loop
    )
    if hf_optimizer == "asrforge":
        optimizer = build_optimizer(model, cfg.optim)
        optimizers = (optimizer, build_scheduler(optimizer, cfg.optim, cfg.train.max_steps))
    else:
        optimizers = (None, None)
    batches = w.train_batches(cfg.train.max_steps * cfg.train.grad_accum)
    trainer = LossRecorder(
        model=model,
        args=args,
        data_collator=unwrap,
        optimizers=optimizers,
        # asrforge's loop calls the model with use_cache=False: no KV cache while training
        train_dataset=CollatedBatches(w.train_set, w.collator, batches, {"use_cache": False}),
        callbacks=[Timer()],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    seconds, steps = clock.steady_seconds(warmup)
    in_step = sum(e - b for b, e in zip(begins[warmup:], clock.ends[warmup:], strict=True))
    ga = cfg.train.grad_accum
    step_losses = [sum(losses[i : i + ga]) for i in range(0, len(losses), ga)]
    return {
        "seconds": seconds,
        "steps": steps,
        "losses": step_losses,
        "digest": digest,
        "in_step_seconds": in_step,
        "cpu_seconds": clock.steady_cpu_seconds(warmup),
    }


def measured_batches(w: Workload, warmup: int) -> list[list[int]]:
    """The index batches of the measured steps (the same batches on both sides)."""
    ga = w.cfg.train.grad_accum
    return w.train_batches(w.cfg.train.max_steps * ga)[warmup * ga :]


def measured_flops(w: Workload, warmup: int) -> int:
    """Model FLOPs of the measured steps' forward + backward passes."""
    dtype = torch.bfloat16 if w.cfg.train.precision == "bf16" else None
    model = w.bundle.model.train()
    return sum(
        training_flops(model, w.collator([w.train_set[i] for i in b]), dtype)
        for b in measured_batches(w, warmup)
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model on tones (seconds)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps, not measured (>= 1)")
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (both sides)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32", help="autocast (both sides)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per side, alternating which goes first; medians are reported",
    )
    p.add_argument(
        "--hf-optimizer",
        choices=["asrforge", "native"],
        default="asrforge",
        help="asrforge: hand asrforge's optimizer and schedule to the Seq2SeqTrainer "
        "(identical updates); native: let transformers build AdamW + cosine",
    )
    add_session_args(p)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and the RESULT line; return the figures."""
    args = parse_args(argv)
    with bench_session("bench-train-", args) as (tmp, work):
        n_steps = args.warmup + args.steps
        sizes = training_sizes(args.quick, args.batch_size, n_steps)
        data = prepare_data(work, args.quick, sizes)
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        peaks = [matmul_peak(dtype)]
        rows: dict[str, list[dict]] = {"asrforge": [], "hf": []}
        samples = None
        for r in range(args.repeats):
            order = ["asrforge", "hf"] if r % 2 == 0 else ["hf", "asrforge"]
            for side in order:
                cfg = make_config(
                    work,
                    tmp / f"run-{side}-{r}",
                    data,
                    quick=args.quick,
                    batch_size=args.batch_size,
                    num_workers=args.num_workers,
                    max_steps=n_steps,
                    lr=args.lr,
                    precision="bf16" if args.precision == "bf16" else "no",
                )
                if side == "asrforge":
                    res = run_asrforge(cfg, args.warmup)
                else:
                    w = build_workload(cfg)
                    samples = sum(len(b) for b in measured_batches(w, args.warmup))
                    res = run_hf(w, tmp / f"hf-{r}", args.warmup, args.hf_optimizer)
                    del w
                res["load"] = load_average()
                rows[side].append(res)
        peaks.append(matmul_peak(dtype))
        # counted after the timed runs, on a fresh build (the counter's dispatch mode stays off
        # the timed code)
        flops = measured_flops(build_workload(cfg), args.warmup)
        assert samples is not None
        return report(args, rows, samples, flops, max(peaks))


def report(
    args: argparse.Namespace, rows: dict[str, list[dict]], samples: int, flops: int, peak: float
) -> dict:
    """Print the table and the RESULT line."""
    model = "quick (d_model 64, 2+2 layers, 2 s)" if args.quick else "tiny.en (37.8M, 30 s)"
    print(
        f"\nmodel {model}, batch {args.batch_size}, {args.warmup} warm-up + {args.steps} "
        f"measured steps ({samples} samples), workers {args.num_workers}, "
        f"torch threads {torch.get_num_threads()}, hf optimizer {args.hf_optimizer}, "
        f"precision {args.precision}"
    )
    print(
        f"{'side':<9} {'run':>3} {'s/step':>8} {'samples/s':>10} {'in-step s':>10} "
        f"{'cpu s/step':>10} {'GFLOP/s':>8} {'of peak':>7} {'last loss':>10}  "
        f"{'init weights':<12}  load"
    )
    for side in ("asrforge", "hf"):
        for i, r in enumerate(rows[side]):
            r["samples_per_s"] = samples / r["seconds"]
            r["gflops"] = flops / r["seconds"] / 1e9
            print(
                f"{side:<9} {i:>3} {r['seconds'] / r['steps']:>8.3f} {r['samples_per_s']:>10.3f} "
                f"{r['in_step_seconds'] / r['steps']:>10.3f} "
                f"{r['cpu_seconds'] / r['steps']:>10.3f} {r['gflops']:>8.1f} "
                f"{r['gflops'] / peak:>7.1%} {r['losses'][-1]:>10.5f}  "
                f"{r['digest']:<12}  {r['load']}"
            )
    a = statistics.median(r["samples_per_s"] for r in rows["asrforge"])
    h = statistics.median(r["samples_per_s"] for r in rows["hf"])
    same_init = all(r["digest"] == rows["asrforge"][0]["digest"] for s in rows.values() for r in s)
    la, lh = rows["asrforge"][0]["losses"], rows["hf"][0]["losses"]
    diff = max(abs(x - y) for x, y in zip(la, lh, strict=True))
    print(
        "(s/step: wall time per measured step, end to end, batch fetch included; in-step s: "
        "on_step_begin -> on_step_end, after the step's first batch was fetched; cpu s/step: "
        "the process's CPU time per step, all threads)"
    )
    sf = rows["asrforge"][0]["step_seconds"] / rows["asrforge"][0]["steps"]
    print(f"(asrforge's own clock, the step_seconds payload of on_step_end: {sf:.3f} s/step)")
    print(
        f"same initial weights: {'yes' if same_init else 'NO'}; losses per step, max |diff| "
        f"asrforge vs hf over {len(la)} steps: {diff:.2e}"
    )
    ca = statistics.median(r["cpu_seconds"] for r in rows["asrforge"])
    ch = statistics.median(r["cpu_seconds"] for r in rows["hf"])
    print(
        f"CPU time of the measured steps: asrforge {ca:.2f} s, hf {ch:.2f} s, hf/asrforge "
        f"{ch / ca:.3f} (steadier than wall time on a busy machine with --threads 1)"
    )
    fa = statistics.median(r["gflops"] for r in rows["asrforge"]) / peak
    fh = statistics.median(r["gflops"] for r in rows["hf"]) / peak
    print(
        f"model FLOPs of the measured steps: {flops / 1e9:.1f} GFLOP ({flops / samples / 1e9:.1f} "
        f"per sample); matmul peak ({args.precision}, 2048^3, best of before/after): "
        f"{peak:.0f} GFLOP/s; fraction of peak: asrforge {fa:.1%}, hf {fh:.1%}"
    )
    print(
        f"RESULT train samples/s asrforge={a:.3f} hf={h:.3f} ratio={a / h:.3f} "
        f"peak_fraction asrforge={fa:.3f} hf={fh:.3f}"
    )
    return {
        "asrforge": a,
        "hf": h,
        "ratio": a / h,
        "cpu_ratio": ch / ca,
        "peak_fraction": fa,
        "hf_peak_fraction": fh,
        "same_init": same_init,
        "loss_diff": diff,
    }


if __name__ == "__main__":
    main()
