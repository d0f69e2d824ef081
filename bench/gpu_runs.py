"""The measured runs of ``bench/gpu_check.py``, one function per side: asrforge's ``Trainer``
and transformers' ``Seq2SeqTrainer`` training, the three evaluation sides, and the memory model
a training run is held against. Each returns its raw figures; the check judges them."""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_memory import Shape, activation_bytes, peak_bytes  # noqa: E402
from workload import (  # noqa: E402 - the bench directory is not a package
    Clock,
    CollatedBatches,
    Workload,
    hf_optim_args,
    unwrap,
    weights_digest,
)

from asrforge.config import TrainConfig  # noqa: E402
from asrforge.evaluation.evaluate import evaluate  # noqa: E402
from asrforge.model.build import count_parameters  # noqa: E402
from asrforge.train.events import Callback  # noqa: E402
from asrforge.train.loop import Trainer  # noqa: E402
from asrforge.train.optim import build_optimizer, build_scheduler  # noqa: E402

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
"""The Tensor methods that bring a value from the device to the host."""


# ---------------------------------------------------------------------------------------------
# Training


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    """Free the last run's tensors, so that the next run's peak counts its own."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def count_host_reads(counter: Callable[[str], None]):
    """Route every Tensor read of :data:`READS` called from asrforge's own files to
    ``counter(where)`` while the block runs (``tests/test_host_reads.py``'s rule)."""
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def counted(self, *a, **kw):
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if "/asrforge/" in caller:
                counter(f"{name} in {caller.rsplit('/', 1)[-1]}")
            return original(self, *a, **kw)

        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def run_asrforge_train(cfg: TrainConfig, warmup: int) -> dict:
    """``Trainer.fit`` on ``cfg``: steady steps/s, losses, skips, loss scale, data wait, host
    reads per step, peak GPU memory; and the run's loader workers and initial weights."""
    device = cfg.train.device
    clock, info = Clock(), {"metrics": [], "reads": [], "counting": False, "peak": 0}

    def note(where: str) -> None:
        if info["counting"]:
            info["current"].append(where)

    class Probe(Callback):
        name = "gpu-check-probe"
        critical = True

        def on_train_begin(self, state, *, run):
            info.update(digest=weights_digest(run.model), workers=run.loader_workers,
                        precision=run.precision, n_params=count_parameters(run.model))  # fmt: skip
            if device == "cuda":
                sync(device)
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, state, *, step):
            info["counting"], info["current"] = True, []

        def on_step_end(self, state, *, metrics):
            info["counting"] = False
            info["reads"].append(info["current"])
            sync(device)
            clock.mark(metrics["loss"])
            info["metrics"].append(metrics)
            if device == "cuda":
                info["peak"] = max(info["peak"], torch.cuda.max_memory_allocated())

    with count_host_reads(note):
        result = Trainer(cfg, [Probe()]).fit()
    ms = info["metrics"]
    seconds, steps = clock.steady_seconds(warmup)
    step_s = sum(m["step_seconds"] for m in ms[warmup:])
    wait_s = sum(m["data_wait_seconds"] for m in ms[warmup:])
    reads = info["reads"][warmup:]
    return {
        "status": result.status,
        "steps_per_s": steps / seconds,
        "losses": [m["loss"] for m in ms],
        "finite": all(m["loss"] is not None and math.isfinite(m["loss"]) for m in ms),
        "skipped": sum(bool(m["skipped"]) for m in ms),
        "grad_scale": ms[-1].get("grad_scale"),
        "data_wait_share": wait_s / step_s,
        "reads_per_step": sum(len(r) for r in reads) / len(reads),
        "read_sites": sorted({w for r in reads for w in r}),
        "peak_bytes": info["peak"] if device == "cuda" else None,
        "workers": info["workers"],
        "precision": info["precision"],
        "digest": info["digest"],
        "n_params": info["n_params"],
    }


def run_hf_train(w: Workload, out: Path, warmup: int, workers: int) -> dict:
    """``Seq2SeqTrainer.train`` on asrforge's batches with asrforge's optimizer and schedule,
    the same precision and DataLoader workers (pinned memory on a GPU)."""
    from transformers import (
        PrinterCallback,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        TrainerCallback,
    )

    cfg, model = w.cfg, w.bundle.model
    device, precision = cfg.train.device, cfg.train.precision
    digest = weights_digest(model)
    clock, losses = Clock(), []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            sync(device)
            clock.mark()

    class LossRecorder(Seq2SeqTrainer):
        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            losses.append(float(loss))
            return loss

    args = Seq2SeqTrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=1,  # one item = one asrforge batch
        max_steps=cfg.train.max_steps,
        lr_scheduler_type="cosine",
        **hf_optim_args(cfg.optim),
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=device == "cpu",
        seed=cfg.seed,
        remove_unused_columns=False,
        train_sampling_strategy="sequential",
        dataloader_num_workers=workers,
        dataloader_prefetch_factor=4 if workers else None,
        dataloader_pin_memory=device == "cuda",
        fp16=precision == "fp16",
        bf16=precision == "bf16",
    )
    # on the device before the optimizer is built, as asrforge's loop does (fused AdamW there)
    model.to("cuda" if device == "cuda" else "cpu")
    optimizer = build_optimizer(model, cfg.optim)
    batches = w.train_batches(cfg.train.max_steps)
    trainer = LossRecorder(
        model=model,
        args=args,
        data_collator=unwrap,
        optimizers=(optimizer, build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)),
        train_dataset=CollatedBatches(w.train_set, w.collator, batches, {"use_cache": False}),
        callbacks=[Timer()],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    seconds, steps = clock.steady_seconds(warmup)
    return {"steps_per_s": steps / seconds, "losses": losses, "digest": digest}


def memory_model(cfg: TrainConfig, w: Workload, n_params: tuple[int, int]) -> float:
    """``bench_memory``'s predicted peak bytes of a step of ``cfg``'s model at its batch size and
    longest decoder length among the run's batches (fp32 weights, gradients and Adam states;
    mixed-precision activations and the autocast weight cache under fp16/bf16)."""
    c = w.bundle.model.config
    longest = max(
        max(len(w.train_set.utts[i].prompt) + len(w.train_set.utts[i].text_ids) for i in b)
        for b in w.train_batches(cfg.train.max_steps)
    )
    shape = Shape(
        d_model=c.d_model, encoder_layers=c.encoder_layers, decoder_layers=c.decoder_layers,
        vocab=c.vocab_size, n_mels=c.num_mel_bins, batch=cfg.data.batch_size,
        enc_frames=c.max_source_positions, dec_tokens=longest,
    )  # fmt: skip
    mixed = cfg.train.precision in ("fp16", "bf16")
    p_all, p_train = n_params
    acts = sum(activation_bytes(shape, checkpointing=False, mixed=mixed).values())
    terms = {
        "weights": 4 * p_all,
        "gradients": 4 * p_train,
        "adam": 8 * p_train,
        "activations": acts + (2 * p_all if mixed else 0),
    }
    return peak_bytes(terms, tied_gradient=4 * c.vocab_size * c.d_model)


# ---------------------------------------------------------------------------------------------
# Evaluation


def eval_autocast(device: str, precision: str):
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def run_eval(w: Workload, out: Path, workers: int, precision: str) -> dict:
    """asrforge's ``evaluate``, a ``model.generate`` loop and ``Seq2SeqTrainer.evaluate``, in
    that order (the last wraps the model's forward in its own autocast), on the same batches."""
    from transformers import PrinterCallback, Seq2SeqTrainer, Seq2SeqTrainingArguments

    cfg, b = w.cfg, w.bundle
    device, cap = cfg.train.device, cfg.eval.max_new_tokens
    model, tok, eot = b.model.to(device).eval(), b.tokenizer, b.specials.eot
    index_batches = w.eval_index_batches()
    pin = device == "cuda"

    def loader():
        return DataLoader(
            w.eval_set, batch_sampler=index_batches, collate_fn=w.collator, num_workers=workers,
            pin_memory=pin, prefetch_factor=4 if workers else None,
        )  # fmt: skip

    warm = w.collator([w.eval_set[i] for i in index_batches[0]])
    with torch.no_grad(), eval_autocast(device, precision):
        model(input_features=warm["input_features"].to(device),
              decoder_input_ids=warm["decoder_input_ids"].to(device))  # fmt: skip
    sync(device)
    out_rows = {}

    t0 = time.perf_counter()
    _, preds = evaluate(
        model, loader(), tokenizer=tok, eot=eot, max_new_tokens=cap, device=device,
        autocast=lambda: eval_autocast(device, precision),
    )  # fmt: skip
    sync(device)
    out_rows["asrforge"] = {"seconds": time.perf_counter() - t0, "hyps": [p["hyp"] for p in preds]}

    gen_kwargs: dict = {"max_new_tokens": cap, "num_beams": 1}
    if b.specials.multilingual:
        gen_kwargs.update(language="en", task=cfg.data.task)
    t0, hyps = time.perf_counter(), []
    with torch.no_grad(), eval_autocast(device, precision):
        for batch in loader():
            ids = model.generate(input_features=batch["input_features"].to(device), **gen_kwargs)
            hyps += [h.strip() for h in tok.batch_decode(ids.tolist(), skip_special_tokens=True)]
    sync(device)
    out_rows["generate"] = {"seconds": time.perf_counter() - t0, "hyps": hyps}

    seen: dict = {}

    def compute_metrics(pred) -> dict:
        ids = np.where(pred.predictions < 0, eot, pred.predictions)
        seen["hyps"] = [h.strip() for h in tok.batch_decode(ids, skip_special_tokens=True)]
        return {}

    args = Seq2SeqTrainingArguments(
        output_dir=str(out), per_device_eval_batch_size=1, predict_with_generate=True,
        generation_num_beams=1, report_to=[], use_cpu=device == "cpu", disable_tqdm=True,
        remove_unused_columns=False, dataloader_pin_memory=pin, dataloader_num_workers=workers,
        dataloader_prefetch_factor=4 if workers else None,
        fp16=precision == "fp16", bf16=precision == "bf16",
    )  # fmt: skip
    trainer = Seq2SeqTrainer(
        model=model, args=args, data_collator=unwrap, compute_metrics=compute_metrics,
        eval_dataset=CollatedBatches(w.eval_set, w.collator, index_batches),
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    t0 = time.perf_counter()
    trainer.evaluate(**gen_kwargs)
    sync(device)
    out_rows["hf"] = {"seconds": time.perf_counter() - t0, "hyps": seen["hyps"]}
    ref = out_rows["asrforge"]["hyps"]
    return {
        "n": len(ref),
        "asrforge_s": out_rows["asrforge"]["seconds"],
        "generate_s": out_rows["generate"]["seconds"],
        "hf_s": out_rows["hf"]["seconds"],
        "same_as_hf": sum(x == y for x, y in zip(ref, out_rows["hf"]["hyps"], strict=True)),
        "same_as_generate": sum(
            x == y for x, y in zip(ref, out_rows["generate"]["hyps"], strict=True)
        ),
    }
