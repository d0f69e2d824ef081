"""The new-language demo's trade-off, share by share: the fine-tuned weights of an ``asrforge demo
--language es`` run interpolated with tiny.en's (WiSE-FT, as ``export --within-guard`` does), and
at each share the test WER/CER scored as the language's text, the long-form WER and the English
guard's drift, measured as the demo measures them (``asrforge.recipes.demo.measure``).

Run after the demo, on its directory:

    .venv/bin/python bench/bench_new_language.py runs/demo-es-full --shares 1,0.8,0.6,0.4,0.2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asrforge.bundle import load_bundle
from asrforge.checkpoint.average import interpolate_weights
from asrforge.config import load_config
from asrforge.evaluation.batch_size import eval_batch_size
from asrforge.recipes.demo import Progress, guard_drift, longform_recording, measure, pct


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("demo_dir", type=Path, help="the directory of an `asrforge demo --language` run")
    p.add_argument("--shares", default="1,0.8,0.6,0.5,0.4,0.3,0.2",
                   help="shares of the fine-tuned weights, comma-separated")  # fmt: skip
    args = p.parse_args(argv)
    shares = [float(s) for s in args.shares.split(",")]

    report = json.loads((args.demo_dir / "demo-report.json").read_text())
    language = report["language"]
    cfg = load_config(args.demo_dir / "train" / "config.yaml")
    say = Progress(total_phases=len(shares))
    long_path, long_ref, _ = longform_recording(
        Path(cfg.data.path), "test", args.demo_dir / "longform-test.wav"
    )
    bundle = load_bundle(args.demo_dir / "bundle-finetuned")
    finetuned = {k: v.clone() for k, v in bundle.model.state_dict().items()}
    start = load_bundle(args.demo_dir / "bundle-start").model.state_dict()
    batch_size = eval_batch_size(cfg.data.eval_batch_size, cfg.data.batch_size)
    look = dict(data=cfg.data, batch_size=batch_size,
                max_new_tokens=cfg.eval.max_new_tokens, long_path=long_path, long_ref=long_ref,
                guard_cfg=cfg.eval.guard, say=say, score_as=language)  # fmt: skip
    rows = []
    for share in shares:
        say.phase(f"share {share:g}", "interpolated with the start, measured as the demo does")
        bundle.model.load_state_dict(interpolate_weights(start, finetuned, share), strict=False)
        bundle.model.tie_weights()
        m = measure(bundle, label=f"share {share:g}", **look).metrics
        rows.append({"share": share, "wer": m["wer"], "cer": m["cer"],
                     "longform_wer": m["longform_wer"], "guard_drift": guard_drift(report["before"], m)})  # fmt: skip
    say.end_phase()
    print(f"{'share':>5} {'WER %':>7} {'CER %':>7} {'long-form %':>12} {'drift (points)':>15}")
    for r in rows:
        print(f"{r['share']:>5g} {pct(r['wer'])} {pct(r['cer'])} {pct(r['longform_wer']):>12} "
              f"{pct(r['guard_drift']):>15}")  # fmt: skip
    print("RESULT new-language trade-off " + json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
