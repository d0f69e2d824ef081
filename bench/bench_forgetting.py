"""Learning without forgetting, option by option, at small scale: a tiny Whisper first trained on
the English tones (the starting model), then taught the Spanish tones at equal steps with no
option, each option of ``data.replay``, ``train.distill_weight`` and ``optim.l2sp`` alone, and
combined. Per run: the Spanish validation WER it learned, the English guard's drift (its WER
against references, minus the start's), and the seconds per optimizer step.

    PYTHONPATH=. .venv/bin/python bench/bench_forgetting.py --out /tmp/forgetting

Tones are no speech: the figures compare the options with each other, not with the demos.
``--base`` runs the same options on real Whisper base with the multilingual demo's config and
data (``configs/demo-base.yaml``; run ``asrforge demo --multilingual`` once first, which imports
base and writes the corpus, the guard and the rehearsal set): per run the Spanish and Italian
validation WER it learned (language given), each guarded language's WER on real speech at the
end minus at the start (the run's guard, language given), and the seconds per step.

    PYTHONPATH=. .venv/bin/python bench/bench_forgetting.py --base --out /tmp/forgetting-base
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from asrforge.bundle import export_bundle, load_bundle
from asrforge.config import load_config
from asrforge.data.synth import tone_splits
from asrforge.evaluation.evaluate import evaluate_split
from asrforge.train.events import Callback
from asrforge.train.loop import Trainer

ROOT = Path(__file__).resolve().parents[1]

MODEL = {
    "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    "max_source_positions": 100, "max_target_positions": 32, "bpe_vocab_size": 300,
}  # the tests' tiny model (tests/conftest.py)  # fmt: skip
OPTIONS = {
    "none": {},
    "replay": {"replay": True},
    "distill": {"distill": True},
    "l2sp": {"l2sp": True},
    "replay+distill": {"replay": True, "distill": True},
    "replay+distill+l2sp": {"replay": True, "distill": True, "l2sp": True},
}


class StepClock(Callback):
    """Seconds between consecutive optimizer steps (the first one, which warms up, left out)."""

    name = "step_clock"

    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, state, *, metrics):
        self.ends.append(time.perf_counter())
        if state.step % 25 == 0:
            print(f"step {state.step}: loss {metrics['loss']:.3f}, {self.seconds():.3f} s/step",
                  flush=True)  # fmt: skip

    def seconds(self) -> float:
        ends = self.ends[1:] if len(self.ends) > 2 else self.ends
        gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        return statistics.median(gaps) if gaps else float("nan")


def make_data(root: Path) -> None:
    """English and Spanish tones apart (``en/``, ``es/``, each with train and validation), and
    the English validation clips alone as the guard's set (``guard-en/``)."""
    from datasets import DatasetDict

    if (root / "guard-en").exists():
        return
    splits = tone_splits(seed=7, sizes={"train": 240, "validation": 36})
    for lang in ("en", "es"):
        DatasetDict(
            {s: splits[s].filter(lambda r, lang=lang: r["language"] == lang) for s in splits}
        ).save_to_disk(str(root / lang))
    splits["validation"].filter(lambda r: r["language"] == "en").save_to_disk(
        str(root / "guard-en")
    )


def english(bundle_dir: Path, root: Path) -> dict:
    """The English validation split's WER and loss (teacher-forced) of a bundle: what the start
    knew, and how much of it a run kept."""
    metrics, _, _ = evaluate_split(load_bundle(bundle_dir), root / "en", "validation",
                                   batch_size=16, max_new_tokens=12)  # fmt: skip
    return {"wer": metrics["wer"], "loss": metrics["loss"]}


def config(out: Path, data_path: Path, steps: int, lr: float, **sections):
    base = {
        "output_dir": str(out), "seed": 0, "model": dict(MODEL),
        "data": {"path": str(data_path), "batch_size": 8, "num_workers": 0},
        "optim": {"lr": lr, "warmup_steps": 5},
        "train": {"max_steps": steps, "log_every": 10, "precision": "no"},
        "eval": {"eval_steps": None, "max_new_tokens": 12},
        "checkpoint": {"after_run": "all", "save_total_limit": 1},
        "callbacks": [{"name": "tensorboard", "enabled": False}],
    }  # fmt: skip
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return load_config(data=base)


def base_runs(args, names: list[str]) -> list[dict]:
    """``--base``: each option on Whisper base, the multilingual demo's config and data."""
    rows, start = [], None
    for name in names:
        on = OPTIONS[name]
        # an option on keeps the demo config's value of it; off, it is zero or null; the start's
        # validation WER is the same for every run, so only the first measures it
        overrides = [
            f"output_dir={args.out / f'run-{name}'}", f"train.max_steps={args.steps}",
            f"eval.eval_steps={args.steps}", f"eval.at_start={str(start is None).lower()}",
            *([] if on.get("distill") else ["train.distill_weight=0"]),
            *(([] if args.l2sp is None else [f"optim.l2sp={args.l2sp}"]) if on.get("l2sp")
              else ["optim.l2sp=0"]),
            *([] if on.get("replay") else ["data.replay=null"]),
        ]  # fmt: skip
        clock = StepClock()
        t0 = time.perf_counter()
        result = Trainer(load_config(ROOT / "configs" / "demo-base.yaml", overrides), [clock]).fit()
        m = result.last_metrics
        if start is None:  # the step-0 evaluation's summary, its last record
            records = args.out / f"run-{name}" / "eval" / "step-000000.jsonl"
            start = json.loads(records.read_text().splitlines()[-1])
        rows.append({
            "option": name, "steps": args.steps, "step_s": clock.seconds(),
            "run_s": time.perf_counter() - t0,
            "learned": {lang: {"start": start["per_language"][lang]["wer"], "end": x["wer"]}
                        for lang, x in m["per_language"].items()},
            "guard": {lang: {"start": g["start"], "end": g["value"]}
                      for lang, g in m["guard_languages"].items()},
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    guarded = list(rows[0]["guard"]) if rows else []
    print(f"{'option':<22} " + " ".join(f"{lang + ' WER %':>9}" for lang in rows[0]["learned"])
          + " " + " ".join(f"{lang + ' drift':>9}" for lang in guarded) + f" {'s/step':>7}")  # fmt: skip
    if rows:
        first = " ".join(f"{100 * x['start']:>9.1f}" for x in rows[0]["learned"].values())
        print(f"{'start':<22} {first}")
    for r in rows:
        learned = " ".join(f"{100 * x['end']:>9.1f}" for x in r["learned"].values())
        drift = " ".join(f"{100 * (g['end'] - g['start']):>+9.1f}" for g in r["guard"].values())
        print(f"{r['option']:<22} {learned} {drift} {r['step_s']:>7.2f}")
    print("RESULT forgetting-base " + json.dumps(rows))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="a directory for the data and runs")
    p.add_argument("--base", action="store_true",
                   help="Whisper base on the multilingual demo's data, each option at its value "
                        "in configs/demo-base.yaml (--share and --distill are ignored)")  # fmt: skip
    p.add_argument("--start-steps", type=int, default=300, help="steps teaching the start English")
    p.add_argument("--steps", type=int, default=60, help="steps teaching Spanish, every run")
    p.add_argument("--share", type=float, default=0.3, help="data.replay.share")
    p.add_argument("--distill", type=float, default=1.0, help="train.distill_weight")
    p.add_argument("--l2sp", type=float, default=None,
                   help="optim.l2sp (default 10; with --base, the demo config's)")  # fmt: skip
    p.add_argument("--only", default=None, help="comma-separated option names to run")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(OPTIONS)
    if args.base:
        return base_runs(args, names)
    root = args.out
    make_data(root)
    start = root / "start"
    if not (start / "config.json").exists():
        clock = StepClock()
        Trainer(config(root / "run-start", root / "en", args.start_steps, 3e-3), [clock]).fit()
        export_bundle(root / "run-start", start, weights="raw")
    en_start = english(start, root)
    print("start, English validation: " + json.dumps(en_start), flush=True)
    guard = {"path": str(root / "guard-en"), "mode": "wer", "tolerance": 1.0, "max_items": 24,
             "language": "en", "lid_tolerance": None}  # fmt: skip
    rows = []
    for name in names:
        on = OPTIONS[name]
        data = (
            {"replay": {"path": str(root / "en"), "share": args.share}} if on.get("replay") else {}
        )
        cfg = config(
            root / f"run-{name}", root / "es", args.steps, 1e-3,
            model={"pretrained": str(start)}, data=data,
            optim={"l2sp": (10.0 if args.l2sp is None else args.l2sp) if on.get("l2sp") else 0.0},
            train={"distill_weight": args.distill if on.get("distill") else 0.0},
            eval={"guard": guard, "at_start": True},
        )  # fmt: skip
        clock = StepClock()
        t0 = time.perf_counter()
        result = Trainer(cfg, [clock]).fit()
        run_s = time.perf_counter() - t0
        m = result.last_metrics
        # the weights at the last step, whatever the selection kept as best
        latest = root / f"run-{name}" / "checkpoints" / "latest"
        export_bundle(latest, root / f"bundle-{name}", weights="raw", overwrite=True)
        en = english(root / f"bundle-{name}", root)
        rows.append({
            "option": name, "start_wer": result.start.get("wer"), "wer": m["wer"],
            "loss": m["loss"], "guard_start": m["guard_start"], "guard_wer": m["guard_wer"],
            "drift": m["guard_wer"] - m["guard_start"], "en_loss_start": en_start["loss"],
            "en_loss": en["loss"], "step_s": clock.seconds(), "run_s": run_s,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"{'option':<22} {'es WER %':>9} {'es loss':>8} {'en WER drift':>13} "
          f"{'en loss':>8} {'s/step':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['option']:<22} {100 * r['wer']:>9.1f} {r['loss']:>8.3f} "
              f"{100 * r['drift']:>13.1f} {r['en_loss']:>8.3f} {r['step_s']:>7.3f}")  # fmt: skip
    print("RESULT forgetting " + json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
