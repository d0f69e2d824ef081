"""Clips transcribed with their language detected: Whisper base through asrforge's bundle against
transformers' ``generate``, which detects the language of each row itself.

The same clips (real speech: the asterisk prompts of en, es, fr, it and ru, 2-15 s, in turn),
the same batch, greedy decoding, the same token cap, in one process, one after the other:

* ``recognize``: ``Bundle.recognize(clips)`` as ``asrforge transcribe`` runs it with no
  ``--language``: each clip's window encoded once, for its language and for its text;
* ``detect, then decode``: ``Bundle.detect_language`` on each clip, then ``recognize`` with those
  languages given: the path that encoded every window twice (the reference for the saving);
* ``generate``: ``WhisperForConditionalGeneration.generate`` on the bundle's weights with
  ``task="transcribe"`` and no language (transformers detects it per row), no timestamps.

Needs Whisper base imported as the multilingual demo imports it (``data/generated/models/
whisper-base``, or ``--model``) and the asterisk sound packages (``make demo-data``).

Run::

    .venv/bin/python bench/bench_detect.py --threads 2             # 40 clips
    .venv/bin/python bench/bench_detect.py --quick                 # 5 clips

Prints one row per side, then ``RESULT detect seconds recognize=X twice=Y generate=Z``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import add_session_args, bench_session, load_average  # noqa: E402

from asrforge.data.audio import SAMPLE_RATE, decode_audio  # noqa: E402
from asrforge.recipes import asterisk  # noqa: E402
from asrforge.text import normalize, wer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def clips(n: int) -> list[tuple[np.ndarray, str, str]]:
    """``n`` prompts, the five languages in turn: (16 kHz wave, transcript, language)."""
    found = {lang: asterisk.prompts(lang) for lang in asterisk.VOICES}
    out = []
    for k in range(n):
        lang = list(found)[k % len(found)]
        p = found[lang][(k // len(found)) * 7 % len(found[lang])]
        out.append((decode_audio(p.path, SAMPLE_RATE), p.text, lang))
    return out


def timed(fn):
    """``fn()``'s result, wall seconds and CPU seconds."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the rows and the RESULT line; return the wall seconds."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_session_args(p)
    p.add_argument("--clips", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--model", type=Path, default=ROOT / "data/generated/models/whisper-base")
    p.add_argument("--quick", action="store_true", help="5 clips")
    args = p.parse_args(argv)
    n = 5 if args.quick else args.clips
    asterisk.require(list(asterisk.VOICES))
    if not args.model.is_dir():
        sys.exit(
            f"{args.model}: no such model: run `asrforge demo --multilingual` once, or --model"
        )

    # imported once the inputs are checked: a missing package or model fails in a second
    import torch
    from transformers import WhisperForConditionalGeneration

    from asrforge.bundle import export_bundle, load_bundle

    with bench_session("bench-detect-", args) as (tmp, _work):
        bundle = load_bundle(export_bundle(args.model, tmp / "bundle"))
        data = clips(n)
        waves = [w for w, _, _ in data]
        refs = [normalize(t, lang) for _, t, lang in data]
        cap, batch = args.max_new_tokens, args.batch_size
        print(f"{n} clips, {sum(w.shape[0] for w in waves) / SAMPLE_RATE:.0f} s, batch {batch}, "
              f"{torch.get_num_threads()} threads, load {load_average()}")  # fmt: skip
        hf = WhisperForConditionalGeneration.from_pretrained(tmp / "bundle").eval()

        def ours():
            return bundle.recognize(waves, batch_size=batch, max_new_tokens=cap, vad=False)

        def twice():
            langs = [bundle.detect_language(w) for w in waves]
            return bundle.recognize(waves, langs, batch_size=batch, max_new_tokens=cap, vad=False)

        @torch.no_grad()
        def theirs_on(clips):
            out = []
            for k in range(0, len(clips), batch):
                feats = bundle.features(clips[k : k + batch], sampling_rate=SAMPLE_RATE,
                                        return_tensors="pt").input_features  # fmt: skip
                ids = hf.generate(feats, task="transcribe", max_new_tokens=cap,
                                  return_timestamps=False)  # fmt: skip
                out += bundle.tokenizer.batch_decode(ids, skip_special_tokens=True)
            return out

        def theirs():
            return theirs_on(waves)

        # warm-up: each side's first call pays for allocations and lazy imports
        ours(), theirs_on(waves[:1])
        rows = {}
        for name, fn in (("recognize", ours), ("detect, then decode", twice), ("generate", theirs)):
            result, wall, cpu = timed(fn)
            texts = result if name == "generate" else [t.text for t in result]
            hyps = [normalize(t, lang) for t, (_, _, lang) in zip(texts, data, strict=True)]
            rows[name] = (wall, cpu, hyps, result)
            print(
                f"{name:22s} {wall:6.2f} s wall {cpu:6.2f} CPU-s  WER {100 * wer(refs, hyps):5.1f}%"
            )
        mine, old = rows["recognize"][3], rows["detect, then decode"][3]
        same = sum(a.text == b.text for a, b in zip(mine, old, strict=True))
        hf_same = sum(
            a == b for a, b in zip(rows["recognize"][2], rows["generate"][2], strict=True)
        )
        right = sum(t.language == lang for t, (_, _, lang) in zip(mine, data, strict=True))
        print(f"same text as 'detect, then decode' {same}/{n}; as generate (normalized) {hf_same}/{n}; "
              f"language detected right {right}/{n}")  # fmt: skip
        w = {k: v[0] for k, v in rows.items()}
        print(f"recognize {w['detect, then decode'] / w['recognize']:.2f}x 'detect, then decode', "
              f"{w['generate'] / w['recognize']:.2f}x generate")  # fmt: skip
        print(f"RESULT detect seconds recognize={w['recognize']:.2f} "
              f"twice={w['detect, then decode']:.2f} generate={w['generate']:.2f}")  # fmt: skip
        return w


if __name__ == "__main__":
    main()
