"""Where ``evaluate()``'s time goes on a GPU: the data (collating log-mels) against the model's
side, and within the model's side the encoder, the teacher-forced pass, the capture and the
decode, each synchronized. The companion of ``gpu_check.py``'s evaluation rows for when their
ratio needs explaining: a side that waits on its data gains nothing from a faster decode.

    python3 bench/gpu_eval_parts.py --shape base --out $OUT/parts.txt
    .venv/bin/python bench/gpu_eval_parts.py --device cpu --quick --out /tmp/parts.txt
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import Progress, make_cfg, prepare  # noqa: E402
from gpu_runs import EvalSides, sync, write_report  # noqa: E402
from workload import build_workload, whisper_shape_model  # noqa: E402

import asrforge.evaluation.evaluate as evaluate_module  # noqa: E402
import asrforge.model.decoding as decoding  # noqa: E402
from asrforge.data.workers import worker_count  # noqa: E402
from asrforge.text.normalizers import forget_normalized  # noqa: E402


class Phases:
    """Synchronized seconds per named phase, by wrapping the functions ``evaluate()`` calls."""

    def __init__(self, device: str):
        self.device, self.seconds = device, defaultdict(float)
        self.originals: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*a, **kw):
            sync(self.device)
            t0 = time.perf_counter()
            result = original(*a, **kw)
            sync(self.device)
            self.seconds[phase] += time.perf_counter() - t0
            return result

        self.originals.append((owner, name, original))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self.originals):
            setattr(owner, name, original)
        self.originals.clear()


def timed(sides: EvalSides, decode: Callable[[], list[str]]) -> tuple[float, list[str]]:
    """Seconds and hypotheses of ``decode()``, synchronized, its normalizations not cached."""
    forget_normalized()  # each run normalizes its references itself
    sync(sides.device)
    t0 = time.perf_counter()
    hyps = decode()
    sync(sides.device)
    return time.perf_counter() - t0, hyps


def model_side(sides: EvalSides, collated: list, capture: bool) -> tuple[float, list[str]]:
    """``evaluate()`` over batches already collated: the model's side alone."""
    return timed(sides, lambda: sides.evaluate_collated(collated, capture))


def generate_side(sides: EvalSides, collated: list) -> tuple[float, list[str]]:
    """A ``model.generate`` loop over the same collated batches."""
    return timed(sides, lambda: sides.generate_collated(collated))


def phases_of(sides: EvalSides, collated: list, capture: bool) -> dict[str, float]:
    """The model side's seconds per phase (each phase synchronized, so they add up to a little
    more than the unsynchronized whole)."""
    p = Phases(sides.device)
    encoder = sides.model.model.encoder
    p.wrap(encoder, "forward", "encoder")
    p.wrap(evaluate_module, "decoder_states", "teacher-forced pass")
    p.wrap(evaluate_module, "greedy_decode", "decode (capture included)")
    p.wrap(decoding, "capture_step", "capture")
    try:
        total, _ = model_side(sides, collated, capture)
    finally:
        p.restore()
        encoder.__dict__.pop("forward", None)
    out = dict(p.seconds)
    out["rest (loss, text, scoring)"] = total - sum(v for k, v in out.items() if k != "capture")
    out["whole (synchronized phases)"] = total
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="the 2+2-layer d_model 64 model")
    p.add_argument("--shape", default="base", help="base or small")
    p.add_argument("--eval-n", type=int, default=None, help="utterances (default 64, quick 4)")
    p.add_argument("--eval-batch-size", type=int, default=None, help="default 16 (quick 2)")
    p.add_argument("--eval-precision", default=None, help="default bf16 (cpu: fp32)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    quick = args.quick
    args.batch_size = 2 if quick else 16
    args.eval_batch_size = args.eval_batch_size or args.batch_size
    args.eval_n = args.eval_n or (4 if quick else 64)
    args.eval_n_auto, args.warmup, args.steps = args.eval_n, 1, 1
    args.max_new_tokens = 4 if quick else 48
    args.eval_precision = args.eval_precision or ("bf16" if args.device == "cuda" else "fp32")
    logging.getLogger("asrforge").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-eval-parts-"))
    lines = []
    try:
        data, tokenizer = prepare(args, Progress(budget=float("inf")), tmp)
        model = whisper_shape_model("quick" if quick else args.shape, tokenizer)
        w = build_workload(make_cfg(args, tmp / "eval", data, model, "no", 1))
        w.eval_set.utts = w.eval_set.utts[: args.eval_n]
        sides = EvalSides(
            w, workers=0, precision=args.eval_precision, batch_size=args.eval_batch_size
        )
        batches = sides.batches
        label = f"{args.shape if not quick else 'quick'} {args.eval_precision}, {args.eval_n} utterances, batch {args.eval_batch_size}, {args.max_new_tokens} tokens"

        t0 = time.perf_counter()
        collated = [w.collator([w.eval_set[i] for i in b]) for b in batches]
        collate_s = time.perf_counter() - t0
        workers = sides.workers = worker_count("auto", args.device)
        t0 = time.perf_counter()
        for _ in sides.loader(batches):
            pass
        loader_s = time.perf_counter() - t0
        lines.append(f"== {label}")
        lines.append(f"data: collating in this process {collate_s:.3f}s "
                     f"({collate_s / len(batches) * 1000:.1f} ms/batch); the DataLoader with "
                     f"{workers} workers, start included, {loader_s:.3f}s")  # fmt: skip

        model_side(sides, collated[:1], False)  # warm-up, unmeasured, each side
        model_side(sides, collated[:1], True)
        generate_side(sides, collated[:1])
        off_s, off = model_side(sides, collated, False)
        on_s, on = model_side(sides, collated, True)
        gen_s, gen = generate_side(sides, collated)
        same = sum(a == b for a, b in zip(off, on, strict=True))
        same_gen = sum(a == b for a, b in zip(on, gen, strict=True))
        lines.append(f"model side, batches already collated: evaluate() uncaptured {off_s:.3f}s, "
                     f"captured {on_s:.3f}s ({off_s / on_s:.2f}x); generate {gen_s:.3f}s "
                     f"(captured {gen_s / on_s:.2f}x); same hypotheses {same}/{len(on)} "
                     f"(captured), {same_gen}/{len(on)} (generate)")  # fmt: skip
        for capture in (False, True):
            parts = phases_of(sides, collated, capture)
            lines.append(f"phases, {'captured' if capture else 'uncaptured'} "
                         f"({len(batches)} batches):")  # fmt: skip
            lines += [f"  {k:<32} {v:8.3f}s  {v / len(batches) * 1000:8.1f} ms/batch"
                      for k, v in parts.items()]  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_report(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
