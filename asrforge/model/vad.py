"""Voice activity detection for long audio: Silero VAD's speech regions, joined into chunks of
less than one encoder window of speech, which long-form decoding then decodes as a batch.

Silero VAD is the model the ``silero-vad`` package ships, in its sequence form
(``silero_vad_16k_sequence.onnx``, run by ``onnxruntime``): one call per 16 s of audio where
the streaming model takes one per 32 ms frame, the same probabilities; asrforge never fetches a
model. A region longer than a chunk is split by Silero itself (at its longest pause, else just
before the limit). Regions are joined in order while their speech fits a chunk, and a chunk's
audio is its regions' samples one after the other (faster-whisper's ``collect_chunks``): the
pauses between regions longer than their padding are left out, so a chunk holds most of a
window of speech however long the pauses were. :meth:`Chunk.placed` moves a chunk's segments,
and their words, back to the recording's clock.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from asrforge.config import vad_problem
from asrforge.data.audio import SAMPLE_RATE
from asrforge.errors import UserError
from asrforge.model.longform import Segment

SPEECH_THRESHOLD = 0.5
"""Silero's speech probability above which a 32 ms frame is speech (its default)."""
MIN_SILENCE_MS = 2000
"""A pause shorter than this does not end a region, so a region keeps its speaker's pauses and
chunks have few joints where audio is left out (faster-whisper's default for its VAD filter)."""
SPEECH_PAD_MS = 400
"""Audio kept each side of a region, so that a word's soft onset or tail is not cut off and the
model hears a pause where two regions meet (faster-whisper's default)."""
CHUNK_SPEECH_SHARE = 26 / 30
"""The share of a window a chunk's speech fills at most (26 s of Whisper's 30 s): Whisper
leaves a sentence that runs into a window's last seconds for the next window, and the chunk is
then decoded again from its last timestamp (measured in docs/decoding.md)."""


def vad_available() -> bool:
    """Whether the packages voice activity detection needs import."""
    return vad_problem("--vad") is None


def vad_refusal(option: str) -> str | None:
    """Why ``option`` (VAD asked for by name) cannot run, and the way round it; None when it
    can."""
    problem = vad_problem(option)
    return None if problem is None else f"{problem}; or --no-vad for sequential long-form decoding"


@functools.lru_cache(maxsize=1)
def silero_model():
    """Silero VAD's sequence model, as the ``silero-vad`` package ships it.

    Raises:
        UserError: a package it needs is not installed or fails to import.
    """
    # vad_problem imports silero_vad with torch's thread count kept, which importing it sets
    refusal = vad_refusal("--vad")
    if refusal is not None:
        raise UserError(refusal)
    from silero_vad import load_silero_vad

    with warnings.catch_warnings():
        # the package's own loading (importlib.resources.path) is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        return load_silero_vad(sequence=True)


def speech_regions(wave: np.ndarray, sample_rate: int, max_seconds: float) -> list[tuple[int, int]]:
    """Silero's speech regions of ``wave``: ``(start, end)`` sample offsets, in order, none
    longer than ``max_seconds``.

    Args:
        wave: (n_samples,) float32 audio at ``sample_rate`` (16 kHz).
    """
    model = silero_model()
    # after silero_model, which imported silero_vad with torch's thread count kept
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

    @functools.cached_property
    def _starts(self) -> list[int]:
        """Where each region starts in the chunk's audio, in samples."""
        return [0, *np.cumsum([b - a for a, b in self.regions])[:-1].tolist()]

    def _region_at(self, sample: float) -> int:
        """The region whose audio holds ``sample`` of the chunk's (the first before it)."""
        return max(bisect.bisect_right(self._starts, sample) - 1, 0)

    def _in_region(self, k: int, sample: float, sample_rate: int) -> float:
        """Seconds in the recording of ``sample`` of the chunk's audio, taken as region ``k``'s
        and held within it (after the last region's end, a time stays after it)."""
        a, b = self.regions[k]
        at = max(a + sample - self._starts[k], a)
        return (at if k == len(self.regions) - 1 else min(at, b)) / sample_rate

    def recording_seconds(
        self, seconds: float, *, end: bool = False, sample_rate: int = SAMPLE_RATE
    ) -> float:
        """A time in the chunk's audio as a time in its recording. Regions of a chunk never
        touch (:func:`join_regions` makes one of those that do), so audio was left out where
        two meet, and a pad's length (:data:`SPEECH_PAD_MS`) each side of that joint is
        padding Silero did not hear as speech: a start in the padding before a joint starts
        the later region, and with ``end`` an end in the padding after it ends the earlier
        one."""
        sample = seconds * sample_rate
        lean = SPEECH_PAD_MS * sample_rate / 1000 * (-1 if end else 1)
        return self._in_region(self._region_at(sample + lean), sample, sample_rate)

    def _in_middle_region(
        self, a: float, b: float, sample_rate: int = SAMPLE_RATE
    ) -> tuple[float, float]:
        """Seconds ``a`` to ``b`` of the chunk's audio in the recording, both within the region
        that holds their middle (faster-whisper's way with a word)."""
        k = self._region_at((a + b) / 2 * sample_rate)
        return (
            self._in_region(k, a * sample_rate, sample_rate),
            self._in_region(k, b * sample_rate, sample_rate),
        )

    def placed(self, segment: Segment, sample_rate: int = SAMPLE_RATE) -> Segment:
        """``segment``, decoded from this chunk's audio, on its recording's clock (its words
        are timed on the chunk's audio before it is placed).

        A word lies within the region that holds its middle, so none spans left-out audio.
        A segment with words runs from its first word's start to its last word's end, as
        openai-whisper and faster-whisper time it: its words are finer than its timestamps,
        which they overrun, so consecutive segments of a window do not overlap, nor does one
        open in the region before the joint its words follow. A segment without words may
        span several regions; its start and end are placed by :meth:`recording_seconds`, a
        segment wholly in the padding around a joint as a word is."""
        words = None
        if segment.words is not None:
            words = []
            for w in segment.words:
                a, b = self._in_middle_region(w.start, w.end, sample_rate)
                words.append(dataclasses.replace(w, start=a, end=b))
        if words:
            start, end = words[0].start, words[-1].end
        else:
            start = self.recording_seconds(segment.start, sample_rate=sample_rate)
            end = self.recording_seconds(segment.end, end=True, sample_rate=sample_rate)
            if end <= start:
                start, end = self._in_middle_region(segment.start, segment.end, sample_rate)
        a, b = segment.window
        window = (
            self.recording_seconds(a, sample_rate=sample_rate),
            self.recording_seconds(b, end=True, sample_rate=sample_rate),
        )
        return dataclasses.replace(segment, start=start, end=end, window=window, words=words)


def join_regions(regions: Sequence[tuple[int, int]], max_samples: int) -> list[Chunk]:
    """Speech regions joined in order into chunks whose regions together hold at most
    ``max_samples`` (a region longer on its own is a chunk of its own). Regions that touch in
    a chunk become one: Silero shares a pause shorter than two pads between its neighbours, so
    nothing between them is left out."""
    chunks: list[list[tuple[int, int]]] = []
    held = 0
    for start, end in regions:
        if chunks and held + end - start <= max_samples:
            held += end - start
            last = chunks[-1][-1]
            if start <= last[1] + 1:  # Silero rounds a shared pause's halves down
                chunks[-1][-1] = (last[0], end)
            else:
                chunks[-1].append((start, end))
        else:
            chunks.append([(start, end)])
            held = end - start
    return [Chunk(tuple(c)) for c in chunks]


def speech_chunks(wave: np.ndarray, sample_rate: int, window_seconds: float) -> list[Chunk]:
    """The chunks of ``wave`` to decode: its speech regions joined into chunks of at most
    :data:`CHUNK_SPEECH_SHARE` of a window of speech; none when Silero finds no speech.

    Raises:
        UserError: the window is too short to hold a padded region.
    """
    seconds = window_seconds * CHUNK_SPEECH_SHARE
    if seconds <= 2 * SPEECH_PAD_MS / 1000:
        raise UserError(
            f"--vad: this model's window of {window_seconds:g} s is too short for speech "
            f"regions padded by {SPEECH_PAD_MS} ms each side; use --no-vad"
        )
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
