"""One evaluation block: asrforge's ``evaluate()`` against ``Seq2SeqTrainer.evaluate()``.

Same model (the real Whisper tiny.en), same utterances (espeak-ng English speech), same batches
(asrforge's ``SpeechDataset`` + ``Collator`` in ``eval_batches`` order), same greedy decoding:
``predict_with_generate=True``, ``num_beams=1``, the same ``max_new_tokens``, and the same prompt
(``<|startoftranscript|><|notimestamps|>`` for tiny.en, which ``generate`` builds by itself; the
benchmark checks the generated prefix), and the same token suppression: both sides apply the
generation config's ``suppress_tokens`` / ``begin_suppress_tokens`` (asrforge's greedy decoder
reads them as ``generate`` does).
The transformers side's ``compute_metrics`` decodes predictions and labels, normalizes both with
``asrforge.text.normalize`` and scores them with ``asrforge.text.wer``, as asrforge does.

Timed: the ``evaluate`` call on each side (data loading, log-mels, forward passes, decoding,
detokenizing, metrics), after one untimed forward pass that warms the model up.

Run::

    .venv/bin/python bench/bench_eval.py            # tiny.en, 16 utterances, batch 8
    .venv/bin/python bench/bench_eval.py --quick    # a random 2+2-layer model on tones

Prints one row per side and run, whether WER, loss and hypotheses agree, then
``RESULT eval seconds asrforge=X hf=Y speedup=Z`` (speedup = hf / asrforge, medians over runs).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import (  # noqa: E402 - the bench directory is not a package
    CollatedBatches,
    ModuleTimer,
    Workload,
    add_session_args,
    bench_session,
    build_workload,
    load_average,
    make_config,
    prepare_data,
    unwrap,
)

from asrforge.data.dataset import JoinedBatches, worker_pieces  # noqa: E402
from asrforge.evaluation.evaluate import evaluate  # noqa: E402
from asrforge.text import normalize, wer  # noqa: E402


def run_asrforge(w: Workload, precision: str = "fp32") -> dict:
    """asrforge's ``evaluate`` over the batches ``RunLoaders.eval_loader`` gives (each read by
    the workers together, a piece each), under the training loop's autocast for ``precision``."""
    cfg, b = w.cfg, w.bundle
    workers = cfg.data.num_workers
    timer = ModuleTimer(b.model.model.encoder)
    t0, c0 = time.perf_counter(), time.process_time()
    pieces, counts = worker_pieces(w.eval_index_batches(), workers)
    loader = JoinedBatches(
        DataLoader(
            w.eval_set,
            batch_sampler=pieces,
            collate_fn=w.collator,
            num_workers=workers,
            persistent_workers=False,
            prefetch_factor=4 if workers else None,
        ),
        counts,
        w.collator,
    )
    with timer:
        metrics, preds = evaluate(
            b.model,
            loader,
            tokenizer=b.tokenizer,
            eot=b.specials.eot,
            max_new_tokens=cfg.eval.max_new_tokens,
            device="cpu",
            autocast=(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
            if precision == "bf16"
            else None,
        )
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    # transformers' eval_loss is the plain mean of per-batch token-mean losses: the same here
    # (predictions come batch after batch, in eval_index_batches order)
    batch_losses, start = [], 0
    for idx in w.eval_index_batches():
        ps, start = preds[start : start + len(idx)], start + len(idx)
        n = sum(p["n_label_tokens"] for p in ps)
        batch_losses.append(sum(p["loss"] * p["n_label_tokens"] for p in ps) / n)
    return {
        "seconds": seconds,
        "wer": metrics["wer"],
        "loss": metrics["loss"],
        "loss_hf_way": float(np.mean(batch_losses)),
        "hit_cap": metrics["hit_cap_count"],
        "hyps": [p["hyp"] for p in preds],
        "n": metrics["n"],
        "enc_calls": timer.calls,
        "enc_seconds": timer.seconds,
        "cpu_seconds": cpu,
        "enc_cpu_seconds": timer.cpu_seconds,
    }


def run_hf(w: Workload, out: Path) -> dict:
    """``Seq2SeqTrainer.evaluate`` with ``predict_with_generate`` on asrforge's batches."""
    from transformers import PrinterCallback, Seq2SeqTrainer, Seq2SeqTrainingArguments

    cfg, b = w.cfg, w.bundle
    model, tok, eot = b.model, b.tokenizer, b.specials.eot
    cap = cfg.eval.max_new_tokens
    prompt = w.eval_set.utts[0].prompt
    seen: dict = {}

    def compute_metrics(pred) -> dict:
        # generate() returns the new tokens only (the prompt stripped), padded with -100 / EOT
        ids = np.where(pred.predictions < 0, eot, pred.predictions)
        labels = np.where(pred.label_ids < 0, eot, pred.label_ids)
        hyps = [h.strip() for h in tok.batch_decode(ids, skip_special_tokens=True)]
        refs = [r.strip() for r in tok.batch_decode(labels, skip_special_tokens=True)]
        seen["hyps"] = hyps
        seen["hit_cap"] = sum(eot not in row[:cap] for row in ids.tolist())
        return {"wer": wer([normalize(r, "en") for r in refs], [normalize(h, "en") for h in hyps])}

    args = Seq2SeqTrainingArguments(
        output_dir=str(out),
        per_device_eval_batch_size=1,  # one item = one asrforge batch
        predict_with_generate=True,
        generation_num_beams=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_pin_memory=False,
        dataloader_num_workers=cfg.data.num_workers,
        dataloader_prefetch_factor=4 if cfg.data.num_workers else None,
    )
    gen_kwargs: dict = {"max_new_tokens": cap, "num_beams": 1}
    if b.specials.multilingual:
        gen_kwargs.update(language="en", task=cfg.data.task)
    saved = copy.deepcopy(model.generation_config)
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        data_collator=unwrap,
        compute_metrics=compute_metrics,
        eval_dataset=CollatedBatches(w.eval_set, w.collator, w.eval_index_batches()),
    )
    trainer.remove_callback(PrinterCallback)
    try:
        check_prompt(w, gen_kwargs, prompt)
        with ModuleTimer(model.model.encoder) as timer:
            t0, c0 = time.perf_counter(), time.process_time()
            metrics = trainer.evaluate(**gen_kwargs)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        model.generation_config = saved
    return {
        "seconds": seconds,
        "wer": metrics["eval_wer"],
        "loss": metrics["eval_loss"],
        "hit_cap": seen["hit_cap"],
        "hyps": seen["hyps"],
        "n": len(seen["hyps"]),
        "enc_calls": timer.calls,
        "enc_seconds": timer.seconds,
        "cpu_seconds": cpu,
        "enc_cpu_seconds": timer.cpu_seconds,
    }


def check_prompt(w: Workload, gen_kwargs: dict, prompt: list[int]) -> None:
    """Untimed: ``generate`` on the first batch starts every sequence with asrforge's prompt."""
    batch = w.collator([w.eval_set[i] for i in w.eval_index_batches()[0]])
    out = w.bundle.model.generate(
        input_features=batch["input_features"],
        **{**gen_kwargs, "max_new_tokens": 1},
        return_dict_in_generate=True,
    )
    used = {tuple(row[: len(prompt)]) for row in out.sequences.tolist()}
    if used != {tuple(prompt)}:
        raise RuntimeError(f"generate() prompts {sorted(used)} differ from asrforge's {prompt}")


def warm_up(w: Workload) -> None:
    """One untimed teacher-forced forward pass on the first evaluation batch."""
    batch = w.collator([w.eval_set[i] for i in w.eval_index_batches()[0]])
    with torch.no_grad():
        w.bundle.model.eval()(
            input_features=batch["input_features"], decoder_input_ids=batch["decoder_input_ids"]
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="random small model on tones (seconds)")
    p.add_argument("--n", type=int, default=16, help="utterances (espeak-ng)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="cap on generated tokens, EOT included (default 128; --quick: 8)",
    )
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (both sides)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per side, alternating which goes first; medians are reported",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="asrforge side's autocast (bf16 is its default on CPUs with bf16 units for "
        "tiny.en); the transformers side stays at its default, fp32",
    )
    add_session_args(p)
    args = p.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 8 if args.quick else 128
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and the RESULT line; return the figures."""
    args = parse_args(argv)
    with bench_session("bench-eval-", args) as (tmp, work):
        sizes = (
            {"train": 8, "validation": args.n * 3 // 2}
            if args.quick
            else {"train": 4, "validation": args.n}
        )
        data = prepare_data(work, args.quick, sizes)
        cfg = make_config(
            work,
            tmp / "run",
            data,
            quick=args.quick,
            batch_size=args.batch_size,
            eval_batch_size=args.batch_size,
            num_workers=args.num_workers,
            max_new_tokens=args.max_new_tokens,
        )
        w = build_workload(cfg)
        w.eval_set.utts = w.eval_set.utts[: args.n]
        warm_up(w)
        rows: dict[str, list[dict]] = {"asrforge": [], "hf": []}
        for r in range(args.repeats):
            for side in ["asrforge", "hf"] if r % 2 == 0 else ["hf", "asrforge"]:
                gc.collect()
                if side == "asrforge":
                    res = run_asrforge(w, args.precision)
                else:
                    res = run_hf(w, tmp / f"hf-{r}")
                res["load"] = load_average()
                rows[side].append(res)
        return report(args, rows)


def report(args: argparse.Namespace, rows: dict[str, list[dict]]) -> dict:
    """Print the table, the agreement checks and the RESULT line."""
    model = "quick (random d_model 64, 2+2 layers)" if args.quick else "tiny.en (37.8M)"
    a0, h0 = rows["asrforge"][0], rows["hf"][0]
    print(
        f"\nmodel {model}, {a0['n']} utterances, batch {args.batch_size}, max_new_tokens "
        f"{args.max_new_tokens}, workers {args.num_workers}, torch threads "
        f"{torch.get_num_threads()}, "
        f"asrforge precision {args.precision} (hf fp32)"
    )
    print(
        f"{'side':<9} {'run':>3} {'seconds':>8} {'cpu s':>7} {'utt/s':>7} {'encoder':>12} "
        f"{'rest s':>7} {'WER':>7} {'loss':>9} {'hit cap':>7}  load"
    )
    for side in ("asrforge", "hf"):
        for i, r in enumerate(rows[side]):
            enc = f"{r['enc_calls']}x {r['enc_seconds']:.2f}s"
            print(
                f"{side:<9} {i:>3} {r['seconds']:>8.2f} {r['cpu_seconds']:>7.2f} "
                f"{r['n'] / r['seconds']:>7.2f} {enc:>12} "
                f"{r['seconds'] - r['enc_seconds']:>7.2f} {r['wer']:>7.4f} {r['loss']:>9.5f} "
                f"{r['hit_cap']:>7}  {r['load']}"
            )
    same_hyps = sum(x == y for x, y in zip(a0["hyps"], h0["hyps"], strict=True))
    wer_agree = abs(a0["wer"] - h0["wer"]) < 1e-9
    loss_agree = abs(a0["loss_hf_way"] - h0["loss"]) <= 1e-4 * max(1.0, abs(h0["loss"]))
    capped = a0["hit_cap"] or h0["hit_cap"]
    print(
        f"hypotheses identical: {same_hyps}/{a0['n']}; WER agrees: "
        f"{'yes' if wer_agree else 'NO'} ({a0['wer']:.4f} vs {h0['wer']:.4f})"
        f"{' (some hypotheses hit the cap)' if capped else ''}"
    )
    for i, (x, y) in enumerate(zip(a0["hyps"], h0["hyps"], strict=True)):
        if x != y:
            print(f"  first difference, utterance {i}: asrforge {x!r} | hf {y!r}")
            break
    print(
        f"loss agrees: {'yes' if loss_agree else 'NO'} (asrforge {a0['loss']:.5f} is "
        f"token-weighted; as transformers averages it, a mean of per-batch means: "
        f"{a0['loss_hf_way']:.5f} vs hf {h0['loss']:.5f})"
    )
    a = statistics.median(r["seconds"] for r in rows["asrforge"])
    h = statistics.median(r["seconds"] for r in rows["hf"])
    ca, ch, ea, eh = (
        statistics.median(r[k] for r in rows[side])
        for side, k in (
            ("asrforge", "cpu_seconds"),
            ("hf", "cpu_seconds"),
            ("asrforge", "enc_cpu_seconds"),
            ("hf", "enc_cpu_seconds"),
        )
    )
    print(
        "(cpu s: the process's CPU time, all threads; encoder: calls of the Whisper encoder and "
        "the wall time inside them; rest s: everything else -- data, log-mels, decoder passes, "
        "decoding, detokenizing, metrics)"
    )
    print(
        f"CPU time: asrforge {ca:.2f} s (encoder {ea:.2f}, rest {ca - ea:.2f}), hf {ch:.2f} s "
        f"(encoder {eh:.2f}, rest {ch - eh:.2f}), hf/asrforge {ch / ca:.2f} (steadier than wall "
        "time on a busy machine with --threads 1)"
    )
    print(
        f"for a 2x speedup in CPU time asrforge's rest must be <= {ch / 2 - ea:.2f} s "
        f"(hf total / 2 - asrforge encoder); it is {ca - ea:.2f} s"
    )
    print(f"RESULT eval seconds asrforge={a:.2f} hf={h:.2f} speedup={h / a:.2f}")
    return {
        "asrforge": a,
        "hf": h,
        "speedup": h / a,
        "cpu_speedup": ch / ca,
        "same_hyps": same_hyps,
        "n": a0["n"],
        "wer_agree": wer_agree,
        "loss_agree": loss_agree,
        "hit_cap": capped,
    }


if __name__ == "__main__":
    main()
