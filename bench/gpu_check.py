"""One GPU check in one call: precision, training and evaluation speed, memory, data wait.

For Whisper base-shaped (d_model 512, 6+6 layers, 8 heads, FFN 2048) and small-shaped (768,
12+12, 12 heads, 3072) models with random weights, vocabulary 51865 (a tokenizer of that size
made here: a BPE on the transcripts padded with unreachable tokens, Whisper's specials and
timestamps), 80 mels, 30 s windows (3000 frames), on synthetic audio (tone chords per word,
light noise, 10-20 s per clip, made here), the script measures:

1. fp16 and bf16 training with asrforge's ``Trainer``: every loss finite, the fp16 loss scale
   active (its overflow skips counted), the run completed;
2. steps/s of asrforge's ``Trainer`` against transformers' ``Seq2SeqTrainer`` on the same model
   (same initial weights), the same batches (``workload.CollatedBatches``), the same precision,
   optimizer and DataLoader workers (``bench_train``'s set-up; a ``torch.cuda.synchronize`` at
   each step's end on both sides, so the clock sees finished steps);
3. evaluation seconds and decoded tokens/s of asrforge's ``evaluate()`` with its decoder step
   captured and uncaptured (``eval.compile`` on and off), ``Seq2SeqTrainer.evaluate(
   predict_with_generate=True)`` and a plain ``model.generate`` loop, on the same batches with
   greedy decoding to the same cap, under the same autocast, at ``--eval-batch-size`` and at
   the batch ``data.eval_batch_size: auto`` picks; random weights never emit the end token, so
   every side decodes to the cap and the hypotheses are compared instead of WER;
4. the peak GPU memory of asrforge's training (``torch.cuda.max_memory_allocated``) against
   ``bench_memory``'s model (mixed-precision activations, the autocast weight cache);
5. the data-wait share of the step time (``data_wait_seconds`` / ``step_seconds`` of the
   ``on_step_end`` payload) with ``data.num_workers: auto`` (pinned memory on a GPU), and the
   host reads per step (``Tensor.item/tolist/cpu/numpy/__float__/__int__/__bool__`` called from
   asrforge's own files between ``on_step_begin`` and ``on_step_end``, as
   ``tests/test_host_reads.py`` counts them);
6. beam search (``--parts beam``): asrforge's beam 5, its beams sharing their utterance's
   encoder keys, against a ``model.generate(num_beams=5)`` loop on the same batches collated
   beforehand: seconds, peak GPU memory, equal hypotheses (no goal: a measurement).

The runs themselves are in ``gpu_runs.py``. ``--budget-seconds`` skips the parts that would not
finish in time (the table says which).

Run (on the GPU, see bench/README.md for the device call)::

    python3 bench/gpu_check.py --out $OUT/gpu_check.md
    .venv/bin/python bench/gpu_check.py --device cpu --quick --out /tmp/gc.md   # logic, seconds

Prints the table (also written to ``--out``, with the raw figures in ``<out>.json``), then
``RESULT gpu_check targets_met=X/Y``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_runs import (  # noqa: E402
    eval_autocast,
    free_memory,
    memory_model,
    run_asrforge_train,
    run_beam,
    run_eval,
    run_hf_train,
    warm_shapes,
)
from workload import (  # noqa: E402 - the bench directory is not a package
    build_workload,
    make_config,
    make_tone_clips_dataset,
    whisper_shape_model,
    whisper_sized_tokenizer,
)

from asrforge.config import TrainConfig  # noqa: E402
from asrforge.data.synth import make_tones_dataset  # noqa: E402
from asrforge.data.workers import worker_count  # noqa: E402
from asrforge.evaluation.batch_size import eval_batch_size  # noqa: E402

TARGETS = {
    "train": "asrforge >= 1.2x Seq2SeqTrainer steps/s",
    "clean": "completed, losses finite; bf16: no step skipped; fp16: loss scale on",
    "data": "data wait <= 5% of step time",
    "reads": "<= 1 host read per step",
    "memory": "within 10% of the memory model",
    "eval": ">= 3x Seq2SeqTrainer and >= 2x generate (captured), hypotheses equal",
    "beam": "measured, no goal: asrforge beam 5 vs generate(num_beams=5), time and memory",
}


class Progress:
    """Timestamped progress lines and the time budget."""

    def __init__(self, budget: float):
        self.t0, self.budget = time.perf_counter(), budget
        self.spent: dict[str, list[float]] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def say(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{self.elapsed():6.1f}s] {msg}", flush=True)

    def longest(self, prefix: str) -> float:
        """Seconds of the longest part so far whose kind starts with ``prefix`` (0: none)."""
        return max(
            (t for k, ts in self.spent.items() if k.startswith(prefix) for t in ts), default=0
        )

    def fits(self, kind: str, fallback: float) -> bool:
        """Whether another part of ``kind`` fits: the longest one so far (else ``fallback``
        seconds) before the budget runs out."""
        guess = max(self.spent.get(kind, [fallback]))
        return self.elapsed() + guess <= self.budget

    @contextmanager
    def part(self, kind: str, name: str):
        self.say(f"{name} ...")
        t0 = time.perf_counter()
        yield
        took = time.perf_counter() - t0
        self.spent.setdefault(kind, []).append(took)
        self.say(f"{name} done in {took:.1f}s")


def make_cfg(args, out: Path, data: Path, model: dict, precision: str, steps: int) -> TrainConfig:
    """asrforge's config: ``precision``, no evaluation, no checkpoints, ``num_workers: auto``."""
    return make_config(
        out, out, data, quick=False, batch_size=args.batch_size,
        eval_batch_size=args.eval_batch_size, num_workers="auto", max_steps=steps,
        max_new_tokens=args.max_new_tokens, precision=precision, model=model,
        device=args.device, log_every=10,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The checks and the table


def check_training(args, prog: Progress, tmp: Path, data: Path, model: dict, shape: str,
                   precision: str) -> list[dict]:  # fmt: skip
    """One shape and precision: asrforge's run, the Seq2SeqTrainer's run; their rows."""
    steps = args.warmup + args.steps
    free_memory(args.device)
    cfg = make_cfg(args, tmp / f"run-{shape}-{precision}", data, model, precision, steps)
    w = build_workload(make_cfg(args, tmp / f"w-{shape}-{precision}", data, model, precision,
                                steps))  # fmt: skip
    warm_shapes(w, steps)
    a = run_asrforge_train(cfg, args.warmup)
    prog.say(f"  asrforge {a['steps_per_s']:.2f} steps/s, losses {a['losses'][-1]:.3f} ...")
    predicted = memory_model(w.cfg, w, a["n_params"])
    h = run_hf_train(w, tmp / f"hf-{shape}-{precision}", args.warmup, a["workers"])
    del w
    key = f"{shape} {precision}"
    clean = a["status"] == "completed" and a["finite"]
    if precision == "fp16":  # the scaler's first steps overflow while it finds its scale
        clean = clean and a["grad_scale"] is not None and a["skipped"] < steps
    else:
        clean = clean and a["skipped"] == 0
    scale = f", loss scale {a['grad_scale']:g}" if a["grad_scale"] is not None else ""
    rows = [
        row("clean", key, f"{'yes' if clean else 'NO'}: {a['status']}, last loss "
            f"{a['losses'][-1]:.3f}, {a['skipped']}/{steps} steps skipped{scale}", clean,
            finite=a["finite"], skipped=a["skipped"], grad_scale=a["grad_scale"],
            losses=a["losses"], hf_losses=h["losses"]),
        row("train", key, f"{a['steps_per_s']:.2f} vs {h['steps_per_s']:.2f} steps/s = "
            f"{a['steps_per_s'] / h['steps_per_s']:.2f}x"
            f"{'' if a['digest'] == h['digest'] else ' (initial weights DIFFER)'}",
            a["steps_per_s"] >= 1.2 * h["steps_per_s"], asrforge=a["steps_per_s"],
            hf=h["steps_per_s"], ratio=a["steps_per_s"] / h["steps_per_s"],
            same_init=a["digest"] == h["digest"]),
        row("data", key, f"{a['data_wait_share']:.1%} of step time, {a['workers']} workers",
            a["data_wait_share"] <= 0.05, share=a["data_wait_share"], workers=a["workers"]),
        row("reads", key, f"{a['reads_per_step']:.2f} per step "
            f"({', '.join(a['read_sites']) or 'none'})", a["reads_per_step"] <= 1,
            per_step=a["reads_per_step"], sites=a["read_sites"]),
    ]  # fmt: skip
    if a["peak_bytes"] is None:
        text = f"not measured on {args.device} (model {predicted / 1e6:.0f} MB)"
        rows.append(row("memory", key, text, None, predicted=predicted, measured=None))
    else:
        err = (a["peak_bytes"] - predicted) / predicted
        rows.append(row("memory", key, f"{a['peak_bytes'] / 1e9:.2f} GB vs model "
                        f"{predicted / 1e9:.2f} GB ({err:+.1%})", abs(err) <= 0.10,
                        predicted=predicted, measured=a["peak_bytes"], error=err))  # fmt: skip
    return rows


def check_eval(args, tmp: Path, data: Path, model: dict, shape: str) -> list[dict]:
    """The evaluation sides on one shape, at ``--eval-batch-size`` and at the batch
    ``data.eval_batch_size: auto`` picks (on ``--eval-n-auto`` utterances); a row each."""
    free_memory(args.device)
    cfg = make_cfg(args, tmp / f"eval-{shape}", data, model, "no", 1)
    w = build_workload(cfg)
    utts, workers = w.eval_set.utts, worker_count("auto", args.device)
    w.eval_set.utts = utts[: args.eval_n]
    rows = [eval_row(args, shape, "batch", run_eval(
        w, tmp / f"hf-eval-{shape}", workers, args.eval_precision, args.eval_batch_size
    ))]  # fmt: skip
    whisper = w.bundle.model.to(args.device).eval()
    auto = eval_batch_size(
        "auto", args.eval_batch_size, whisper, args.device,
        max_new_tokens=args.max_new_tokens,
        autocast=lambda: eval_autocast(args.device, args.eval_precision),
    )  # fmt: skip
    w.eval_set.utts = utts[: max(args.eval_n_auto, args.eval_n)]
    rows.append(eval_row(args, shape, "auto batch", run_eval(
        w, tmp / f"hf-eval-auto-{shape}", workers, args.eval_precision, auto
    )))  # fmt: skip
    del w, whisper
    return rows


def check_beam(args, tmp: Path, data: Path, model: dict, shape: str) -> list[dict]:
    """Beam search on one shape at ``--eval-batch-size``: a row."""
    free_memory(args.device)
    cfg = make_cfg(args, tmp / f"beam-{shape}", data, model, "no", 1)
    w = build_workload(cfg)
    w.eval_set.utts = w.eval_set.utts[: args.eval_n]
    r = run_beam(w, worker_count("auto", args.device), args.eval_precision, args.eval_batch_size)
    x = r["generate_s"] / r["asrforge_s"]

    def gb(peak: int | None) -> str:
        return "" if peak is None else f", peak {peak / 1e9:.2f} GB"

    return [row(
        "beam", f"{shape} {args.eval_precision} batch {r['batch']}",
        f"asrforge {r['asrforge_s']:.2f}s{gb(r['asrforge_peak'])}; generate {r['generate_s']:.2f}s"
        f"{gb(r['generate_peak'])} ({x:.2f}x); same hypotheses {r['same']}/{r['n']}",
        None, speedup=x, **{k: v for k, v in r.items() if not k.endswith("_hyps")},
    )]  # fmt: skip


def eval_row(args, shape: str, which: str, r: dict) -> dict:
    """One evaluation row: the captured ``evaluate()`` against the peers, the uncaptured one
    beside it; decoded tokens per second; whether every side's hypotheses are the same."""
    fast = r["captured_s"]
    x_hf, x_gen, x_cap = r["hf_s"] / fast, r["generate_s"] / fast, r["asrforge_s"] / fast
    tps, n = r["tokens_per_s"], r["n"]
    same = r["same_as_hf"] == n and r["same_captured"] == n
    return row(
        "eval", f"{shape} {args.eval_precision} {which} {r['batch']}",
        f"asrforge captured {fast:.2f}s ({tps['captured']:.0f} tok/s), uncaptured "
        f"{r['asrforge_s']:.2f}s ({tps['asrforge']:.0f} tok/s, capture {x_cap:.2f}x); "
        f"Seq2SeqTrainer {r['hf_s']:.2f}s ({tps['hf']:.0f} tok/s, {x_hf:.2f}x), generate "
        f"{r['generate_s']:.2f}s ({tps['generate']:.0f} tok/s, {x_gen:.2f}x); same hypotheses "
        f"{r['same_captured']}/{n} (captured), {r['same_as_hf']}/{n} (hf), "
        f"{r['same_as_generate']}/{n} (generate), hf and generate {r['hf_same_as_generate']}/{n}",
        x_hf >= 3 and x_gen >= 2 and same, **r, speedup_hf=x_hf, speedup_generate=x_gen,
        speedup_capture=x_cap,
    )  # fmt: skip


def row(check: str, case: str, text: str, met: bool | None, /, **raw) -> dict:
    """A table row: ``met`` True/False against the check's target, None when not measured."""
    return {"check": check, "case": case, "measured": text, "target": TARGETS[check],
            "met": met, "raw": raw}  # fmt: skip


def skipped_row(check: str, case: str, why: str) -> dict:
    return row(check, case, f"skipped: {why}", None)


def table(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| check | case | measured | target | met |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        lines.append(f"| {r['check']} | {r['case']} | {r['measured']} | {r['target']} | {met} |")
    return "\n".join(lines) + "\n"


def machine(device: str) -> str:
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    import transformers

    return f"{gpu}, torch {torch.__version__}, transformers {transformers.__version__}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true",
                   help="the 2+2-layer d_model 64 model on 2 s tones: the logic, in seconds")  # fmt: skip
    p.add_argument("--shapes", default="base,small", help="comma-separated: base, small")
    p.add_argument("--precisions", default="fp16,bf16")
    p.add_argument("--batch-size", type=int, default=None, help="default 16 (--quick: 2)")
    p.add_argument("--eval-batch-size", type=int, default=None, help="default 16 (--quick: 2)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps, not measured (>= 1)")
    p.add_argument(
        "--steps",
        type=int,
        default=30,
        help="measured steps (ten moved a ratio by a tenth between runs)",
    )
    p.add_argument("--eval-n", type=int, default=None, help="utterances (default 32, --quick 4)")
    p.add_argument("--eval-n-auto", type=int, default=None,
                   help="utterances at the auto batch (default 256, --quick 4)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 48 (--quick 4)")
    p.add_argument("--eval-precision", choices=["fp32", "bf16", "fp16"], default=None,
                   help="autocast of all three evaluation sides (default bf16; cpu: fp32)")  # fmt: skip
    p.add_argument("--budget-seconds", type=float, default=450)
    p.add_argument("--parts", default="train,eval,beam", help="comma-separated: train, eval, beam")
    p.add_argument("--out", type=Path, required=True, help="the table (markdown); + .json")
    p.add_argument("--work-dir", type=Path, default=None, help="keep data and tokenizer here")
    args = p.parse_args(argv)
    args.parts = args.parts.split(",")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible (use --device cpu for a dry run)")
    small = args.quick
    args.batch_size = args.batch_size or (2 if small else 16)
    args.eval_batch_size = args.eval_batch_size or (2 if small else 16)
    args.eval_n = args.eval_n or (4 if small else 32)
    args.eval_n_auto = args.eval_n_auto or (4 if small else 256)
    args.max_new_tokens = args.max_new_tokens or (4 if small else 48)
    args.eval_precision = args.eval_precision or ("bf16" if args.device == "cuda" else "fp32")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run every check that fits the budget; print and write the table; return the figures."""
    args = parse_args(argv)
    prog = Progress(args.budget_seconds)
    logging.getLogger("asrforge").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work = args.work_dir or tmp
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    try:
        data, tokenizer = prepare(args, prog, work)
        shapes = ["quick"] if args.quick else args.shapes.split(",")
        precisions = args.precisions.split(",")
        prog.say(f"{machine(args.device)}; shapes {shapes}, precisions {precisions}")
        for shape in shapes:
            model = whisper_shape_model(shape, tokenizer)
            parts = [(f"train {shape}", precision) for precision in precisions]
            parts = [p for p in parts if "train" in args.parts] + [
                (f"{part} {shape}", args.eval_precision)
                for part in ("eval", "beam")
                if part in args.parts
            ]
            for kind, precision in parts:
                case = f"{shape} {precision}"
                cases = [
                    ("eval", f"{case} batch {args.eval_batch_size}"),
                    ("eval", f"{case} auto batch"),
                ]
                if kind.startswith("train"):
                    cases = [(c, case) for c in ("clean", "train", "data", "reads", "memory")]
                if kind.startswith("beam"):
                    cases = [("beam", f"{case} batch {args.eval_batch_size}")]
                # a larger shape's first part is guessed at 3x the longest so far (small has
                # 3.3x base's parameters)
                if not prog.fits(kind, 3 * prog.longest(kind.split()[0])):
                    rows += [skipped_row(c, k, "time budget") for c, k in cases]
                    continue
                try:
                    with prog.part(kind, f"{kind} {precision}"):
                        if kind.startswith("train"):
                            rows += check_training(args, prog, tmp, data, model, shape, precision)
                        elif kind.startswith("beam"):
                            rows += check_beam(args, tmp, data, model, shape)
                        else:
                            rows += check_eval(args, tmp, data, model, shape)
                except Exception as e:  # one broken part must not cost the others' figures
                    traceback.print_exc()
                    rows += [row(c, k, f"error: {type(e).__name__}: {e}"[:300], False)
                             for c, k in cases]  # fmt: skip
                write_outputs(args, prog, rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = write_outputs(args, prog, rows)
    print("\n" + table(rows, summary["header"]))
    print(f"RESULT gpu_check targets_met={summary['targets_met']}/{summary['targets_measured']}")
    return summary


def prepare(args, prog: Progress, work: Path) -> tuple[Path, Path | None]:
    """The data set (and, for the Whisper shapes, the 51865-token tokenizer) under ``work``."""
    steps = args.warmup + args.steps
    sizes = {"train": args.batch_size * steps, "validation": max(args.eval_n, args.eval_n_auto)}
    if args.quick:  # the tones set is a third Spanish, which the run leaves out
        sizes = {k: v * 3 // 2 + 2 for k, v in sizes.items()}
        data = work / f"tones-{sizes['train']}-{sizes['validation']}"
        if not data.exists():
            make_tones_dataset(data, sizes=sizes)
        return data, None
    from datasets import load_from_disk

    data = work / f"tone-clips-{sizes['train']}-{sizes['validation']}"
    prog.say(f"synthetic data set {sizes} ...")
    if not data.exists():
        make_tone_clips_dataset(data, sizes)
    texts = list(load_from_disk(str(data))["train"]["text"])
    return data, whisper_sized_tokenizer(texts, work / "tokenizer")


def write_outputs(args, prog: Progress, rows: list[dict]) -> dict:
    """Write the table to ``--out`` and the raw figures beside it (after every part, so that a
    run stopped from outside leaves what it measured)."""
    header = (
        f"gpu_check {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine(args.device)}; "
        f"batch {args.batch_size}, {args.warmup} warm-up + {args.steps} measured steps, eval "
        f"{args.eval_n} utterances x {args.max_new_tokens} tokens (batch {args.eval_batch_size}, "
        f"{args.eval_precision}), {prog.elapsed():.0f} s"
    )
    measured = [r for r in rows if r["met"] is not None]
    summary = {
        "header": header,
        "rows": rows,
        "targets_met": sum(bool(r["met"]) for r in measured),
        "targets_measured": len(measured),
        "seconds": prog.elapsed(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table(rows, header))
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=float))
    return summary


if __name__ == "__main__":
    main()
