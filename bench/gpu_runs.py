"""The measured runs of ``bench/gpu_check.py``, one function per side: asrforge's ``Trainer``
and transformers' ``Seq2SeqTrainer`` training, the three evaluation sides, and the memory model
a training run is held against. Each returns its raw figures; the check judges them."""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Callable, Iterable
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
from asrforge.data.dataset import JoinedBatches, eval_batches, worker_pieces  # noqa: E402
from asrforge.evaluation.evaluate import evaluate, prompt_length  # noqa: E402
from asrforge.model.beam import beam_decode  # noqa: E402
from asrforge.model.build import count_parameters  # noqa: E402
from asrforge.model.decoding import DecodeOptions  # noqa: E402
from asrforge.text.normalizers import forget_normalized  # noqa: E402
from asrforge.train.events import Callback  # noqa: E402
from asrforge.train.loop import Trainer  # noqa: E402
from asrforge.train.optim import build_optimizer, build_scheduler  # noqa: E402

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
"""The Tensor methods that bring a value from the device to the host."""


# ---------------------------------------------------------------------------------------------
# Training


def write_report(out: Path, text: str) -> None:
    """Write a report (making its folder) and print it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


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


def warm_shapes(w: Workload, steps: int) -> None:
    """One forward and backward of every batch shape the next ``steps`` steps meet, under the
    run's precision, then the model back on the host: cuDNN's attention builds an execution plan
    the first time it meets a shape (about 3 ms of host time a call on an H100/H200), and one
    process runs both sides, so without this the side that runs first pays for both."""
    cfg, model = w.cfg, w.bundle.model
    device, precision = cfg.train.device, cfg.train.precision
    batches = CollatedBatches(w.train_set, w.collator, w.train_batches(steps))
    model.to(device).train()
    seen = set()
    for k in range(len(batches)):
        batch = batches[k]
        shape = (tuple(batch["input_features"].shape), tuple(batch["decoder_input_ids"].shape))
        if shape in seen:
            continue
        seen.add(shape)
        with eval_autocast(device, {"no": "fp32"}.get(precision, precision)):
            out = model(**{key: v.to(device) for key, v in batch.items()})
        out.loss.backward()
    model.zero_grad(set_to_none=True)
    model.to("cpu")
    free_memory(device)


def run_asrforge_train(
    cfg: TrainConfig, warmup: int, step_hook: Callable[[], None] | None = None
) -> dict:
    """``Trainer.fit`` on ``cfg``: steady steps/s, losses, skips, loss scale, data wait, host
    reads per step, peak GPU memory; and the run's loader workers and initial weights.
    ``step_hook`` is called at every step's end (a profiler's ``step``)."""
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
            if step_hook is not None:
                step_hook()

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


def run_hf_train(
    w: Workload, out: Path, warmup: int, workers: int, step_hook: Callable[[], None] | None = None
) -> dict:
    """``Seq2SeqTrainer.train`` on asrforge's batches with asrforge's optimizer and schedule,
    the same precision and DataLoader workers (pinned memory on a GPU); ``step_hook`` as
    :func:`run_asrforge_train`'s."""
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
            if step_hook is not None:
                step_hook()

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


def silence_timestamps(model, tokenizer) -> None:
    """Zero the output rows of the timestamp tokens, so that a model with random weights never
    picks one (its other logits, the largest of 51k, are above zero). After a timestamp,
    transformers' ``generate`` decodes the rest of the 30 s window as further segments while
    ``evaluate()`` stops at the cap, so a random model that emits them makes the sides decode
    different amounts."""
    first = tokenizer.convert_tokens_to_ids("<|0.00|>")
    if first is None or first == tokenizer.unk_token_id:
        return
    with torch.no_grad():
        model.get_output_embeddings().weight[first:].zero_()


class EvalSides:
    """asrforge's ``evaluate()`` and a ``model.generate`` loop over index batches of ``w``'s
    evaluation set, under the same autocast: the model on the device with its timestamps
    silenced, the same DataLoader, the same prompt (``generate`` is told the language and task
    of a multilingual model)."""

    def __init__(self, w: Workload, workers: int, precision: str, batch_size: int | None = None):
        cfg, b = w.cfg, w.bundle
        self.w, self.workers, self.precision = w, workers, precision
        self.device, self.cap = cfg.train.device, cfg.eval.max_new_tokens
        self.model, self.tok, self.eot = b.model.to(self.device).eval(), b.tokenizer, b.specials.eot
        silence_timestamps(self.model, self.tok)
        self.batches = (
            w.eval_index_batches()
            if batch_size is None
            else eval_batches(w.eval_set.utts, batch_size)
        )
        self.gen_kwargs: dict = {"max_new_tokens": self.cap, "num_beams": 1}
        if b.specials.multilingual:
            self.gen_kwargs.update(language="en", task=cfg.data.task)

    def loader(self, batches: list) -> DataLoader:
        workers = self.workers
        return DataLoader(
            self.w.eval_set, batch_sampler=batches, collate_fn=self.w.collator,
            num_workers=workers, pin_memory=self.device == "cuda",
            prefetch_factor=4 if workers else None,
        )  # fmt: skip

    def asrforge(self, batches: list, capture: bool = False) -> list[str]:
        """``evaluate()``'s hypotheses, each batch read by the workers together as a training
        run's evaluation reads it (``RunLoaders.eval_loader``); ``capture``: its greedy step
        replayed from a graph (``eval.compile: on``)."""
        pieces, counts = worker_pieces(batches, self.workers)
        joined = JoinedBatches(self.loader(pieces), counts, self.w.collator, self.device == "cuda")
        return self.evaluate_collated(joined, capture)

    def evaluate_collated(self, collated: Iterable[dict], capture: bool = False) -> list[str]:
        """:meth:`asrforge` over batches already collated (or a loader of them)."""
        device, precision = self.device, self.precision
        with torch.no_grad():
            _, preds = evaluate(
                self.model, collated, tokenizer=self.tok, eot=self.eot,
                max_new_tokens=self.cap, device=device,
                autocast=lambda: eval_autocast(device, precision),
                options=DecodeOptions(capture=capture),
            )  # fmt: skip
        self.decoded = sum(p["n_tokens"] + 1 for p in preds)  # EOT is a decoded token too
        return [p["hyp"] for p in preds]

    def generate(self, batches: list) -> list[str]:
        return self.generate_collated(self.loader(batches))

    def generate_collated(self, collated: Iterable[dict]) -> list[str]:
        """:meth:`generate` over batches already collated (or a loader of them)."""
        hyps = []
        with torch.no_grad(), eval_autocast(self.device, self.precision):
            for batch in collated:
                ids = self.model.generate(
                    input_features=batch["input_features"].to(self.device), **self.gen_kwargs
                )
                hyps += [
                    h.strip() for h in self.tok.batch_decode(ids.tolist(), skip_special_tokens=True)
                ]
        return hyps


def run_beam(
    w: Workload, workers: int, precision: str, batch_size: int | None = None, beam_size: int = 5
) -> dict:
    """asrforge's beam search (its beams sharing their utterance's encoder keys) against a
    ``model.generate(num_beams=beam_size)`` loop, on the same batches collated once beforehand
    and under the same autocast, each after one unmeasured batch: seconds, peak device memory
    on CUDA, and equal hypotheses (the two rank and stop by other conventions:
    docs/decoding.md, "Beam search, and how it differs from transformers'")."""
    sides = EvalSides(w, workers, precision, batch_size)
    device, model, tok, eot, cap = sides.device, sides.model, sides.tok, sides.eot, sides.cap
    collated = list(sides.loader(sides.batches))

    def ours(batches: list[dict]) -> list[str]:
        hyps = []
        with torch.no_grad(), eval_autocast(device, precision):
            for b in batches:
                enc = model.model.encoder(b["input_features"].to(device)).last_hidden_state
                prompts = b["decoder_input_ids"][:, : prompt_length(b["labels"])].to(device)
                seqs, _ = beam_decode(
                    model, enc, prompts, eot, cap, DecodeOptions(beam_size=beam_size)
                )
                hyps += [tok.decode(x, skip_special_tokens=True).strip() for x in seqs]
        return hyps

    def theirs(batches: list[dict]) -> list[str]:
        hyps = []
        with torch.no_grad(), eval_autocast(device, precision):
            for b in batches:
                ids = model.generate(
                    input_features=b["input_features"].to(device),
                    **{**sides.gen_kwargs, "num_beams": beam_size},
                )
                texts = tok.batch_decode(ids.tolist(), skip_special_tokens=True)
                hyps += [x.strip() for x in texts]
        return hyps

    out: dict = {"batch": len(collated[0]["uid"]), "n": sum(b["size"] for b in collated)}
    for name, run in (("asrforge", ours), ("generate", theirs)):
        run(collated[:1])
        sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out[f"{name}_hyps"] = run(collated)
        sync(device)
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_peak"] = torch.cuda.max_memory_allocated() if device == "cuda" else None
    out["same"] = sum(
        a == b for a, b in zip(out["asrforge_hyps"], out["generate_hyps"], strict=True)
    )
    return out


def run_eval(
    w: Workload, out: Path, workers: int, precision: str, batch_size: int | None = None
) -> dict:
    """asrforge's ``evaluate`` with its decoder step uncaptured and captured
    (``eval.compile`` off and on), a ``model.generate`` loop and ``Seq2SeqTrainer.evaluate``,
    in that order (the last wraps the model's forward in its own autocast), on the same batches
    (of ``batch_size``; default ``w``'s evaluation batch). Each side first decodes the first
    batch unmeasured, so that none pays for the kernels and allocations the others found
    warm."""
    from transformers import PrinterCallback, Seq2SeqTrainer, Seq2SeqTrainingArguments

    sides = EvalSides(w, workers, precision, batch_size)
    device, model, tok, eot = sides.device, sides.model, sides.tok, sides.eot
    index_batches, gen_kwargs, pin = sides.batches, sides.gen_kwargs, device == "cuda"

    def timed(run: Callable[[list], list[str]]) -> dict:
        forget_normalized()  # each side normalizes its references itself
        run(index_batches[:1])
        sync(device)
        t0 = time.perf_counter()
        hyps = run(index_batches)
        sync(device)
        return {"seconds": time.perf_counter() - t0, "hyps": hyps}

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
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)

    def hf_side(batches: list) -> list[str]:
        trainer.evaluate(CollatedBatches(w.eval_set, w.collator, batches), **gen_kwargs)
        return seen["hyps"]

    rows = {"asrforge": timed(sides.asrforge)}
    rows["captured"] = timed(lambda batches: sides.asrforge(batches, capture=True))
    rows["generate"] = timed(sides.generate)
    rows["hf"] = timed(hf_side)
    ref = rows["asrforge"]["hyps"]

    def same(a: list[str], b: list[str]) -> int:
        return sum(x == y for x, y in zip(a, b, strict=True))

    return {
        "n": len(ref),
        "batch": len(sides.batches[0]),
        "asrforge_s": rows["asrforge"]["seconds"],
        "captured_s": rows["captured"]["seconds"],
        "generate_s": rows["generate"]["seconds"],
        "hf_s": rows["hf"]["seconds"],
        # what asrforge decoded, EOT included, over each side's time: a side with the same
        # hypotheses decoded as many tokens
        "tokens": sides.decoded,
        "tokens_per_s": {k: sides.decoded / r["seconds"] for k, r in rows.items()},
        "same_captured": same(ref, rows["captured"]["hyps"]),
        "same_as_hf": same(ref, rows["hf"]["hyps"]),
        "same_as_generate": same(ref, rows["generate"]["hyps"]),
        "hf_same_as_generate": same(rows["hf"]["hyps"], rows["generate"]["hyps"]),
        "words": {k: sum(len(h.split()) for h in r["hyps"]) / len(ref) for k, r in rows.items()},
    }
