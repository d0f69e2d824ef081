"""Packed windows against one utterance per window, in the same time budget.

The same short-clip corpus trained two ways, from the same model, for the same budget:

* asrforge: ``Trainer.fit`` with ``data.pack`` (several utterances per 30 s window, a share
  alone, a share in timestamp mode, a share with the previous text);
* transformers: ``Seq2SeqTrainer.train`` with one utterance per 30 s window, the usual Whisper
  fine-tuning recipe, on asrforge's own items and collator (same log-mels, same targets, same
  padding; transformers' own AdamW and constant-with-warmup schedule at the same numbers).

Both train one recipe (decoder + top encoder layer, ``model.train_encoder_layers: 1``),
batch ``--batch-size`` windows, autocast as ``train.precision: auto`` picks, and stop at the
first optimizer step that ends past ``--budget`` seconds (wall clock from the first step's
start; ``--clock cpu``: this process's CPU time, steadier on a shared machine). Then both
models, and the starting model, are decoded greedily by asrforge's ``evaluate`` on the held-out
split (unseen sentences and speakers).

Prints per side: steps, utterances trained, seconds, utterances/s, held-out WER; then
``RESULT packing utterances/s asrforge=X hf=Y ratio=Z wer asrforge=A hf=B start=C``.

Run::

    .venv/bin/python bench/bench_packing.py --work-dir /tmp/bench-work   # tiny.en, espeak-ng
    .venv/bin/python bench/bench_packing.py --quick                     # tiny model, tones
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import (  # noqa: E402 - the bench directory is not a package
    add_session_args,
    bench_session,
    build_workload,
    hf_optim_args,
    load_average,
    quick_model,
    tiny_en_dir,
)

from asrforge.config import TrainConfig, load_config  # noqa: E402
from asrforge.data.audio import SAMPLE_RATE  # noqa: E402
from asrforge.data.dataset import Collator, SpeechDataset, epoch_batches, eval_batches  # noqa: E402
from asrforge.data.packing import PackItems, compose_windows  # noqa: E402
from asrforge.data.prepare import prepare_split  # noqa: E402
from asrforge.data.sources import load_arrow  # noqa: E402
from asrforge.data.synth import make_tones_dataset  # noqa: E402
from asrforge.data.targets import TimestampTokens  # noqa: E402
from asrforge.evaluation.evaluate import evaluate  # noqa: E402
from asrforge.model.build import BuiltModel, build_model  # noqa: E402
from asrforge.text import edit_counts, normalize  # noqa: E402
from asrforge.text.metrics import EditCounts  # noqa: E402
from asrforge.train.events import Callback  # noqa: E402
from asrforge.train.loop import Trainer  # noqa: E402
from asrforge.train.precision import choose_precision, model_width  # noqa: E402


def build_data(work: Path, quick: bool, n_train: int, n_test: int) -> Path:
    """The corpus: tones (``quick``), else English espeak-ng speech whose test split (the
    held-out one here) has sentences and speakers the training split lacks
    (``asrforge.recipes.corpus``)."""
    if quick:
        path = work / f"tones-{n_train}-{n_test}"
        if not path.exists():
            make_tones_dataset(path, sizes={"train": n_train, "validation": n_test})
        return path
    from asrforge.recipes.corpus import CorpusSpec, build_corpus

    path = work / f"espeak-en-{n_train}-{n_test}"
    sizes = {"train": n_train, "validation": 1, "test": n_test}  # held out: test's speakers
    build_corpus(CorpusSpec(["en"], sizes, seed=0), path)
    return path


def make_config(
    work: Path, out: Path, data: Path, args: argparse.Namespace, pack: dict | None
) -> TrainConfig:
    """The run's config; ``pack``: None for one utterance per window, else the packed side's
    variant (``data.pack`` fields, and ``batch_size``/``lr``/``warmup`` overriding the shared
    settings, see :func:`parse_variant`)."""
    pack = dict(pack) if pack is not None else None
    side = {k: pack.pop(k) for k in ("batch_size", "lr", "warmup") if k in pack} if pack else {}
    if args.quick:
        model = {
            **quick_model(max_source_positions=300, max_target_positions=96),
            "train_encoder_layers": 1,
        }
    else:
        model = {"pretrained": str(tiny_en_dir(work)), "train_encoder_layers": 1}
    return load_config(
        data={
            "output_dir": str(out),
            "seed": args.seed,
            "model": model,
            "data": {
                "path": str(data),
                "batch_size": side.get("batch_size", args.batch_size),
                "languages": ["en"],
                "eval_split": "validation" if args.quick else "test",
                "pack": {"enabled": True, **pack} if pack is not None else {"enabled": False},
            },
            "optim": {
                "lr": side.get("lr", args.lr),
                "warmup_steps": side.get("warmup", args.warmup),
                "schedule": "constant",
                "weight_decay": 0.0,
                "clip_grad_norm": 1.0,
            },
            "train": {"max_steps": 1_000_000, "device": "cpu", "log_every": 10},
            "eval": {"eval_steps": None, "at_end": False, "max_new_tokens": args.max_new_tokens},
            "checkpoint": {"save_on_eval": False, "checkpoint_every": None},
        }
    )


def clock_of(kind: str):
    return time.process_time if kind == "cpu" else time.perf_counter


def run_asrforge(cfg: TrainConfig, budget: float, clock) -> dict:
    """``Trainer.fit`` with packing until the budget is spent; the trained model and counts."""
    seen: dict = {}

    class Budget(Callback):
        name = "bench-budget"
        critical = True

        def on_train_begin(self, state, *, run):
            seen["model"], seen["tokenizer"] = run.model, run.tokenizer

        def on_step_begin(self, state, *, step):
            seen.setdefault("t0", clock())

        def on_step_end(self, state, *, metrics):
            seen["seconds"] = clock() - seen["t0"]
            if seen["seconds"] >= budget:
                state.should_stop = True
                state.stop_reason = "time budget spent"

        def on_train_end(self, state, *, result):
            seen["state"] = state

    Trainer(cfg, [Budget()]).fit()
    state = seen["state"]
    bundle = build_model(cfg.model, seen["tokenizer"], cfg.seed)  # the run's specials, features
    bundle.model = seen["model"]
    return {
        "bundle": bundle,
        "steps": state.step,
        "seconds": seen["seconds"],
        "utterances": packed_utterances(cfg, bundle, state.epoch, state.batch_in_epoch),
    }


def speech_set(cfg: TrainConfig, bundle: BuiltModel, split: str) -> SpeechDataset:
    """``split`` of the corpus as the training loop filters and tokenizes it for ``bundle``."""
    ds = load_arrow(cfg.data.path)[split]
    config = bundle.model.config
    utts, _ = prepare_split(
        ds,
        split,
        cfg=cfg.data,
        tokenizer=bundle.tokenizer,
        specials=bundle.specials,
        max_target_positions=config.max_target_positions,
        max_seconds=config.max_source_positions / 50,
    )
    return SpeechDataset(ds, utts, bundle.features, bundle.specials.eot)


def packed_utterances(
    cfg: TrainConfig, bundle: BuiltModel, epoch: int, batch_in_epoch: int
) -> int:
    """Utterances in the windows of the epochs before ``epoch`` and the first
    ``batch_in_epoch`` batches of it: the layout is a pure function of (seed, epoch), so it is
    recomposed here exactly."""
    train = speech_set(cfg, bundle, cfg.data.train_split)
    stamps = TimestampTokens.from_tokenizer(bundle.tokenizer, bundle.specials.no_timestamps)
    config = bundle.model.config
    items = PackItems.of(train.utts)
    total = 0
    for e in range(epoch + 1):
        windows, _ = compose_windows(
            items,
            cfg.data.pack,
            max_samples=int(config.max_source_positions / 50 * SAMPLE_RATE),
            max_positions=config.max_target_positions,
            seed=cfg.seed,
            epoch=e,
            timestamps=stamps is not None and cfg.data.pack.timestamp_share > 0,
        )
        batches = epoch_batches(len(windows), cfg.data.batch_size, cfg.seed, e)
        if e == epoch:
            batches = batches[:batch_in_epoch]
        total += sum(len(windows[j].pieces) for b in batches for j in b)
    return total


def run_hf(cfg: TrainConfig, out: Path, budget: float, clock, precision: str) -> dict:
    """``Seq2SeqTrainer.train``, one utterance per window, until the budget is spent."""
    from transformers import (
        PrinterCallback,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        TrainerCallback,
    )

    w = build_workload(cfg)
    collate = Collator(pad_id=w.bundle.specials.eot)
    seen = {"utterances": 0}

    def data_collator(items: list[dict]) -> dict:
        batch = collate(items)
        return {k: batch[k] for k in ("input_features", "decoder_input_ids", "labels")}

    class Budget(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            seen.setdefault("t0", clock())

        def on_step_end(self, args, state, control, **kw):
            seen["seconds"] = clock() - seen["t0"]
            seen["steps"] = state.global_step
            if seen["seconds"] >= budget:
                control.should_training_stop = True

    class Counting(Seq2SeqTrainer):
        def training_step(self, model, inputs, *a, **kw):
            seen["utterances"] += int(inputs["labels"].shape[0])
            return super().training_step(model, inputs, *a, **kw)

    args = Seq2SeqTrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=cfg.data.batch_size,
        max_steps=cfg.train.max_steps,
        lr_scheduler_type="constant_with_warmup",
        **hf_optim_args(cfg.optim),
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=cfg.seed,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        bf16=precision == "bf16",
    )
    trainer = Counting(
        model=w.bundle.model,
        args=args,
        data_collator=data_collator,
        train_dataset=w.train_set,
        callbacks=[Budget()],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return {"bundle": w.bundle, **seen}


def held_out_wer(bundle: BuiltModel, cfg: TrainConfig, precision: str) -> tuple[float, list]:
    """WER of ``bundle``'s model on the held-out split, decoded by asrforge's ``evaluate`` (the
    same greedy decoding, prompt and normalizer for every model), and its per-clip records."""
    eval_set = speech_set(cfg, bundle, cfg.data.eval_split)
    eot = bundle.specials.eot
    loader = DataLoader(
        eval_set, batch_sampler=eval_batches(eval_set.utts, 8), collate_fn=Collator(pad_id=eot)
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def autocast():
        return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)

    metrics, preds = evaluate(
        bundle.model,
        loader,
        tokenizer=bundle.tokenizer,
        eot=eot,
        max_new_tokens=cfg.eval.max_new_tokens,
        autocast=autocast,
    )
    return float(metrics["wer"]), preds


def clip_errors(preds: list[dict]) -> dict[str, EditCounts]:
    """``{uid: word edits}`` under asrforge's normalizer."""
    return {
        p["uid"]: edit_counts(
            normalize(p["ref"], p["language"]), normalize(p["hyp"], p["language"])
        )
        for p in preds
    }


def error_kinds(errors: dict[str, EditCounts]) -> str:
    """Substitutions, deletions and insertions, in WER points."""
    words = sum(c.n_ref for c in errors.values()) or 1
    subs, dels, ins = (sum(getattr(c, k) for c in errors.values()) for k in ("subs", "dels", "ins"))
    return f"sub {100 * subs / words:.1f} del {100 * dels / words:.1f} ins {100 * ins / words:.1f}"


def wer_difference_interval(
    a: dict[str, EditCounts], b: dict[str, EditCounts], n: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95 % paired-bootstrap interval of WER(a) - WER(b) over the held-out clips: how much of a
    difference the choice of held-out clips alone makes (not the training's own noise)."""
    uids = sorted(a)
    ea = np.array([a[u].errors for u in uids])
    eb = np.array([b[u].errors for u in uids])
    words = np.array([a[u].n_ref for u in uids])
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(uids), size=(n, len(uids)))
    diff = (ea[draws].sum(1) - eb[draws].sum(1)) / words[draws].sum(1)
    lo, hi = np.quantile(diff, [0.025, 0.975])
    return float(lo), float(hi)


PACK_KEYS = {
    "batch_size": int,
    "lr": float,
    "warmup": int,
    "single_share": float,
    "timestamp_share": float,
    "prev_text_share": float,
    "max_seconds": float,
}


def parse_variant(spec: str) -> dict:
    """``--pack-variant`` ``key=value,...`` (keys: :data:`PACK_KEYS`, plus ``gap=lo:hi``) as a
    dict; the empty string is the defaults."""
    out: dict = {}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        key, sep, value = part.partition("=")
        if key == "gap" and sep:
            lo, _, hi = value.partition(":")
            out["gap_seconds"] = (float(lo), float(hi or lo))
        elif key in PACK_KEYS and sep:
            out[key] = PACK_KEYS[key](value)
        else:
            raise SystemExit(
                f"--pack-variant {spec!r}: {part!r} is not key=value with a key of "
                f"{', '.join([*PACK_KEYS, 'gap'])}"
            )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a 2+2-layer model on 6 s windows of tones")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds of training per side (default 300; --quick 6)",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="what the budget counts: wall time, or this process's CPU time",
    )
    p.add_argument(
        "--train", type=int, default=None, help="training clips (default 600; --quick 48)"
    )
    p.add_argument("--test", type=int, default=None, help="held-out clips (default 40; --quick 12)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step, both sides")
    p.add_argument("--lr", type=float, default=None, help="default 2e-4 (the demo's; --quick 3e-3)")
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps of warm-up")
    p.add_argument("--seed", type=int, default=0, help="training seed of both sides")
    p.add_argument(
        "--pack-variant",
        action="append",
        default=None,
        metavar="KEY=VALUE,...",
        help="a packed side to train (repeatable; each is one asrforge row against the same "
        "transformers run): overrides of batch_size, lr, warmup, single_share, timestamp_share, "
        "prev_text_share, max_seconds, gap=LO:HI; default one row of data.pack's defaults",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (--quick 16)")
    p.add_argument(
        "--sides",
        default="start,asrforge,hf",
        help="what to run, comma-separated: start (the start model's WER), asrforge, "
        "hf (e.g. rerun one side after a change to the other's settings)",
    )
    add_session_args(p)
    args = p.parse_args(argv)
    q = args.quick
    args.budget = args.budget or (6.0 if q else 300.0)
    args.train = args.train or (48 if q else 600)
    args.test = args.test or (12 if q else 40)
    args.lr = args.lr or (3e-3 if q else 2e-4)
    args.max_new_tokens = args.max_new_tokens or (16 if q else 64)
    args.variants = [parse_variant(v) for v in (args.pack_variant or [""])]
    return args


def variant_name(variant: dict) -> str:
    return "asrforge" + (
        "[" + ",".join(f"{k}={v}" for k, v in variant.items()) + "]" if variant else ""
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    clock = clock_of(args.clock)
    with bench_session("bench-packing-", args) as (tmp, work):
        data = build_data(work, args.quick, args.train, args.test)
        single = make_config(work, tmp / "hf", data, args, pack=None)
        precision, _ = choose_precision("auto", "cpu", model_width(single.model))
        sides = set(args.sides.split(","))
        start = None
        errors: dict[str, dict] = {}
        if "start" in sides:
            start, preds = held_out_wer(build_workload(single).bundle, single, precision)
            errors["start"] = clip_errors(preds)
            words = sum(c.n_ref for c in errors["start"].values())
            print(
                f"start: held-out WER {start:.3f} on {len(preds)} clips, {words} words: one "
                f"word is {100 / words:.2f} WER points, one clip's words "
                f"{100 / len(preds):.2f} on average (load {load_average()})"
            )
        runs = []
        if "asrforge" in sides:
            for k, variant in enumerate(args.variants):
                cfg = make_config(work, tmp / f"asrforge-{k}", data, args, pack=variant)
                runs.append(
                    (variant_name(variant), lambda c=cfg: run_asrforge(c, args.budget, clock))
                )
        if "hf" in sides:
            runs.append(
                ("hf", lambda: run_hf(single, tmp / "hf-out", args.budget, clock, precision))
            )
        rows = {}
        for side, run in runs:
            r = run()
            r["wer"], preds = held_out_wer(r.pop("bundle"), single, precision)
            errors[side] = clip_errors(preds)
            r["rate"] = r["utterances"] / r["seconds"]
            rows[side] = r
            print(
                f"{side} {r['steps']:4d} steps, {r['utterances']:5d} utterances in "
                f"{r['seconds']:6.1f} s ({args.clock}): {r['rate']:6.2f} utterances/s, held-out "
                f"WER {r['wer']:.3f} ({error_kinds(errors[side])}; load {load_average()})",
                flush=True,
            )
    if "hf" in rows:
        h = rows["hf"]
        for side, a in rows.items():
            if side == "hf":
                continue
            ratio = a["rate"] / h["rate"]
            lo, hi = wer_difference_interval(errors[side], errors["hf"])
            print(
                f"RESULT packing utterances/s asrforge={a['rate']:.2f} hf={h['rate']:.2f} "
                f"ratio={ratio:.2f} wer asrforge={a['wer']:.3f} hf={h['wer']:.3f} "
                f"start={start if start is None else round(start, 3)} precision={precision} "
                f"wer_diff_95%=[{lo:+.3f},{hi:+.3f}] side={side}"
            )
            a["ratio"] = ratio
    return {"start": start, **rows}


if __name__ == "__main__":
    main()
