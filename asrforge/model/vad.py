"""Voice activity detection for long audio: Silero VAD's speech regions, joined into chunks of
at most one encoder window of speech, which long-form decoding then decodes as a batch.

Silero VAD is the model the ``silero-vad`` package ships, in its sequence form
(``silero_vad_16k_sequence.onnx``, run by ``onnxruntime``): one call per 16 s of audio where
the streaming model takes one per 32 ms frame, the same probabilities; asrforge never fetches a
model. A region longer than a chunk is split by Silero itself (at its longest pause, else just
before the limit). Regions are joined in order while their speech fits a chunk, and a chunk's
audio is its regions' samples one after the other (faster-whisper's ``collect_chunks``): the
pauses between regions longer than their padding are left out, so a chunk holds a window of
speech however long the pauses were. :meth:`Chunk.placed` moves a chunk's segments, and their
words, back to the recording's clock.
"""

from __future__ import annotations

import bisect
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from asrforge.config import vad_problem
from asrforge.data.audio import SAMPLE_RATE
from asrforge.errors import UserError
from asrforge.model.longform import Segment

SPEECH_THRESHOLD = 0.5
"""Silero's speech probability above which a 32 ms frame is speech (its default)."""
MIN_SILENCE_MS = 160
"""A pause shorter than this does not end a region."""
SPEECH_PAD_MS = 200
"""Audio kept each side of a region, so that a word's soft onset or tail is not cut off."""
CHUNK_SPARE_SECONDS = 4.0
"""Seconds of a window a chunk's speech leaves empty. Whisper leaves a segment that runs into
a window's last seconds without its closing timestamp (its training windows cut such text
off), and an unclosed segment is decoded again in a window of its own: measured on
bench_vad's recording, chunks of up to 30 s took a second round for two of three chunks, of up
to 26 s none."""


def vad_available() -> bool:
    """Whether the packages voice activity detection needs can be imported."""
    return vad_problem("--vad") is None


@lru_cache(maxsize=1)
def silero_model():
    """Silero VAD's sequence model, as the ``silero-vad`` package ships it.

    Raises:
        UserError: a package it needs is not installed.
    """
    problem = vad_problem("--vad")
    if problem is not None:
        raise UserError(f"{problem}; or --no-vad for sequential long-form decoding")
    threads = torch.get_num_threads()
    try:
        # importing silero_vad sets torch's thread count to 1 for the whole process
        from silero_vad import load_silero_vad

        with warnings.catch_warnings():
            # the package's own loading (importlib.resources.path) is deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            return load_silero_vad(sequence=True)
    finally:
        torch.set_num_threads(threads)


def speech_regions(wave: np.ndarray, sample_rate: int, max_seconds: float) -> list[tuple[int, int]]:
    """Silero's speech regions of ``wave``: ``(start, end)`` sample offsets, in order, none
    longer than ``max_seconds``.

    Args:
        wave: (n_samples,) float32 audio at ``sample_rate`` (16 kHz).
    """
    model = silero_model()
    from silero_vad.sequence_vad import get_speech_timestamps_sequence

    found = get_speech_timestamps_sequence(
        np.ascontiguousarray(wave, dtype=np.float32),
        model,
        threshold=SPEECH_THRESHOLD,
        sampling_rate=sample_rate,
        max_speech_duration_s=max_seconds - 2 * SPEECH_PAD_MS / 1000,
        min_silence_duration_ms=MIN_SILENCE_MS,
        speech_pad_ms=SPEECH_PAD_MS,
    )
    return [(int(r["start"]), int(r["end"])) for r in found]


@dataclass(frozen=True)
class Chunk:
    """Regions of one recording decoded as one piece of audio: their samples one after the
    other, the audio between them left out."""

    regions: tuple[tuple[int, int], ...]
    """``(start, end)`` sample offsets in the recording, in order, not overlapping."""

    @classmethod
    def whole(cls, wave: np.ndarray) -> Chunk:
        """The whole of ``wave``, as one chunk (sequential long-form decoding)."""
        return cls(((0, wave.shape[0]),))

    def audio(self, wave: np.ndarray) -> np.ndarray:
        """The chunk's samples of ``wave`` (a view when it is one region)."""
        if len(self.regions) == 1:
            ((a, b),) = self.regions
            return wave[a:b]
        return np.concatenate([wave[a:b] for a, b in self.regions])

    def recording_seconds(
        self, seconds: float, *, end: bool = False, sample_rate: int = SAMPLE_RATE
    ) -> float:
        """A time in the chunk's audio as a time in its recording. Within a pad's length
        (:data:`SPEECH_PAD_MS`) either side of where two regions meet lies padding, which Silero
        did not hear as speech: a start there is the later region's start, and with ``end`` an
        end there is the earlier region's end. A time after the audio stays after the last
        region's end."""
        sample = seconds * sample_rate
        pad = SPEECH_PAD_MS * sample_rate / 1000
        lengths = [b - a for a, b in self.regions]
        joints = np.cumsum(lengths)[:-1].tolist()  # where each later region starts in the audio
        if end:
            k = bisect.bisect_left(joints, sample - pad)
            into = sample - (joints[k - 1] if k else 0)
            if k < len(lengths) - 1:
                into = min(into, lengths[k])
        else:
            k = bisect.bisect_right(joints, sample + pad)
            into = max(sample - (joints[k - 1] if k else 0), 0.0)
        return (self.regions[k][0] + into) / sample_rate

    def placed(self, segment: Segment, sample_rate: int = SAMPLE_RATE) -> Segment:
        """``segment``, decoded from this chunk's audio, on its recording's clock: its times,
        its window's and its words' (a word is timed on the chunk's audio before it is
        placed); an end never comes before its start."""

        def span(a: float, b: float) -> tuple[float, float]:
            start = self.recording_seconds(a, sample_rate=sample_rate)
            return start, max(self.recording_seconds(b, end=True, sample_rate=sample_rate), start)

        words = None
        if segment.words is not None:
            words = []
            for w in segment.words:
                a, b = span(w.start, w.end)
                words.append(dataclasses.replace(w, start=a, end=b))
        start, end = span(segment.start, segment.end)
        return dataclasses.replace(
            segment, start=start, end=end, window=span(*segment.window), words=words
        )


def join_regions(regions: Sequence[tuple[int, int]], max_samples: int) -> list[Chunk]:
    """Speech regions joined in order into chunks whose regions together hold at most
    ``max_samples`` (a region longer on its own is a chunk of its own)."""
    chunks: list[list[tuple[int, int]]] = []
    held = 0
    for start, end in regions:
        if chunks and held + end - start <= max_samples:
            chunks[-1].append((start, end))
            held += end - start
        else:
            chunks.append([(start, end)])
            held = end - start
    return [Chunk(tuple(c)) for c in chunks]


def speech_chunks(wave: np.ndarray, sample_rate: int, window_seconds: float) -> list[Chunk]:
    """The chunks of ``wave`` to decode: its speech regions joined into chunks of at most one
    window of speech less :data:`CHUNK_SPARE_SECONDS`; none when Silero finds no speech."""
    seconds = window_seconds - CHUNK_SPARE_SECONDS
    regions = speech_regions(wave, sample_rate, seconds)
    return join_regions(regions, round(seconds * sample_rate))


def decode_chunks(
    waves: Sequence[np.ndarray],
    chunks: Sequence[Sequence[Chunk]],
    decode: Callable[[list[np.ndarray], list[int]], list[list[Segment]]],
    sample_rate: int = SAMPLE_RATE,
) -> list[list[Segment]]:
    """Decode every chunk of every recording in one call and place the segments on their
    recordings' clocks.

    Args:
        chunks: each recording's chunks, in order.
        decode: ``decode(audios, owners)``: the segments of each chunk's audio, on its own
            clock; ``owners[k]`` is the index of the recording chunk ``k`` came from.

    Returns:
        Each recording's segments, in order.
    """
    pieces = [(i, c) for i, cs in enumerate(chunks) for c in cs]
    decoded = decode([c.audio(waves[i]) for i, c in pieces], [i for i, _ in pieces])
    out: list[list[Segment]] = [[] for _ in waves]
    for (i, c), segments in zip(pieces, decoded, strict=True):
        out[i] += [c.placed(s, sample_rate) for s in segments]
    return out
