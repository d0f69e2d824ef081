"""Recognition: recordings of any length read, their languages checked or detected (a group
of them together, the windows detection encoded reused by decoding), decoded whole or by VAD
chunks with the options :mod:`asrforge.bundle.options` makes concrete, their words timed when
asked; one :class:`Transcript` each.

:func:`recognize` takes the :class:`~asrforge.bundle.inference.Bundle` first; ``Bundle``'s
``recognize``, ``transcribe`` and ``transcribe_many`` call it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from asrforge.bundle.languages import detect, language_without_audio
from asrforge.bundle.options import (
    VAD_WITH_PREVIOUS_TEXT,
    RecognizeOptions,
    chunking_for,
    decode_options,
    no_speech_gate,
    use_vad,
    word_heads,
)
from asrforge.data.audio import SAMPLE_RATE, Audio, as_wave, audio_problem
from asrforge.errors import UserError
from asrforge.model.alignment import Word, add_word_timestamps
from asrforge.model.longform import EncodedWindows, Segment, transcribe_long
from asrforge.model.vad import Chunk, decode_chunks, speech_chunks

log = logging.getLogger(__name__)

DETECTED_TOGETHER = 4
"""Batches of recordings whose languages are detected before any of them is decoded."""


@dataclass
class Transcript:
    """One recording's transcription."""

    text: str
    language: str
    seconds: float
    """Duration of the audio."""
    segments: list[Segment] = field(default_factory=list)
    """Stretches of the audio with their text, in order, times in seconds."""
    chunking: str = "timestamps"
    """How long audio was cut into windows: ``timestamps`` or ``silence``."""
    vad: bool = False
    """Whether only the speech Silero VAD found was decoded (:mod:`asrforge.model.vad`)."""

    @property
    def words(self) -> list[Word]:
        """Every segment's words, in order (empty unless word timestamps were asked for)."""
        return [w for s in self.segments for w in s.words or []]


@functools.cache
def _say_capped(cap: int) -> None:
    """Warn, once a process for each cap, that a window stopped at it."""
    log.warning(
        "a window stopped at the cap of %d new tokens (max_new_tokens): its text is cut", cap
    )


def recognize(
    bundle,
    audios: Sequence[Audio],
    language: str | Sequence[str | None] | None,
    options: RecognizeOptions,
    *,
    names: Sequence[str] | None = None,
) -> list[Transcript]:
    """Transcribe ``audios`` with ``bundle``: each recording's text, language, duration and
    timed segments (``Bundle.recognize``; ``Bundle.transcribe_many`` keeps the text).

    Args:
        language: one for all, or one per recording (a code, name or locale); None: the
            bundle's only language, else detected.
        options: how they are decoded (:class:`~asrforge.bundle.options.RecognizeOptions`).
        names: how warnings name each recording (its file, for arrays read from files);
            default: a path as given, else ``recording <i>``.
    """
    if isinstance(audios, str | Path | bytes) or (
        isinstance(audios, np.ndarray | torch.Tensor) and audios.ndim == 1
    ):
        # one recording would be read element by element: a path's characters, its samples
        raise UserError(
            f"recognize/transcribe_many take a list of recordings, got one "
            f"{type(audios).__name__}: pass [audio], or call transcribe(audio)"
        )
    for name, value in (
        ("batch_size", options.batch_size),
        ("max_new_tokens", options.max_new_tokens),
        ("beam_size", options.beam_size),
    ):
        if value is not None and value < 1:
            raise UserError(f"{name}: must be >= 1, got {value}")
    if options.vad and options.condition_on_previous_text:
        raise UserError(
            VAD_WITH_PREVIOUS_TEXT.format(vad="vad", previous="condition_on_previous_text")
        )
    gate = no_speech_gate(bundle, options.no_speech_threshold, options.logprob_threshold)
    mode, why = chunking_for(bundle, options.chunking)
    langs = (
        [language] * len(audios)
        if language is None or isinstance(language, str)
        else list(language)
    )
    if len(langs) != len(audios):
        raise UserError(f"{len(langs)} languages for {len(audios)} recordings")
    if names is not None and len(names) != len(audios):
        raise UserError(f"{len(names)} names for {len(audios)} recordings")
    # Languages are checked before any audio is read; None is detected from the audio.
    given = [language_without_audio(bundle, lang) for lang in langs]
    cap = options.max_new_tokens or bundle.config.eval.max_new_tokens
    window = round(bundle.window_seconds * SAMPLE_RATE)
    waves, codes = [], []
    # A None entry is decoded below, in this order.
    out: list[Transcript | None] = []
    for i, (audio, code) in enumerate(zip(audios, given, strict=True)):
        wave = as_wave(audio, options.sampling_rate, told=bundle.told)
        problem = audio_problem(wave)
        if problem is not None:  # decoding it would only make up "" or noise
            name = audio if isinstance(audio, str | Path) else f"recording {i}"
            name = names[i] if names is not None else name
            log.warning("%s: %s; not transcribed (empty text)", name, problem)
            out.append(Transcript("", code or "", wave.shape[0] / SAMPLE_RATE, [], mode))
            continue
        waves.append(wave)
        codes.append(code)
        out.append(None)
    if any(wave.shape[0] > window for wave in waves):
        log.info("long audio: chunking %s (%s)", mode, why)
    previous_text = options.condition_on_previous_text
    by_vad = [use_vad(bundle, options.vad, wave, previous_text) for wave in waves]
    chunks = [
        speech_chunks(wave, SAMPLE_RATE, bundle.window_seconds) if use else [Chunk.whole(wave)]
        for wave, use in zip(waves, by_vad, strict=True)
    ]
    decoding = decode_options(bundle, options, gate)
    segments: list[list[Segment]] = []
    # A group's languages are detected together, from windows whose encoder output its
    # decoding then reuses, and words are timed on the encodings decoding read; groups
    # bound how many such encodings are held at once.
    held = DETECTED_TOGETHER * options.batch_size
    detecting = any(code is None for code in codes)
    group = held if detecting or options.word_timestamps else max(len(waves), 1)
    for g in range(0, len(waves), group):
        part = range(g, min(g + group, len(waves)))
        encoded = EncodedWindows(limit=held)
        unknown = [j for j in part if codes[j] is None]
        # A language is heard in the first chunk (the first speech VAD found), and decoding
        # starts from that encoding when the chunk is one window.
        heard = [chunks[j][0].audio(waves[j]) if chunks[j] else waves[j] for j in unknown]
        detected = detect(
            bundle,
            heard,
            batch_size=options.batch_size,
            keep=encoded,
            reused=[
                bool(chunks[j]) and a.shape[0] <= window
                for j, a in zip(unknown, heard, strict=True)
            ],
        )
        for j, code in zip(unknown, detected, strict=True):
            codes[j] = code
        decode = functools.partial(
            _decode_pieces,
            bundle,
            prompts=[bundle.specials.prompt(codes[j], bundle.config.data.task) for j in part],
            languages=[codes[j] for j in part],
            word_timestamps=options.word_timestamps,
            chunking=mode,
            max_new_tokens=cap,
            batch_size=options.batch_size,
            condition_on_previous_text=previous_text,
            options=decoding,
            encoded=encoded,
            keep=encoded if options.word_timestamps else None,
            capped=lambda: _say_capped(cap),
        )
        segments += decode_chunks([waves[j] for j in part], [chunks[j] for j in part], decode)
        del decode, encoded  # the next group's detection does not hold this one's encodings
    decoded = iter(
        Transcript(
            " ".join(s.text for s in segs), code, wave.shape[0] / SAMPLE_RATE, segs, mode, use
        )
        for wave, code, segs, use in zip(waves, codes, segments, by_vad, strict=True)
    )
    return [t if t is not None else next(decoded) for t in out]


def _decode_pieces(
    bundle,
    audios: list[np.ndarray],
    owners: list[int],
    *,
    prompts: Sequence[list[int]],
    languages: Sequence[str],
    word_timestamps: bool,
    keep: EncodedWindows | None,
    **how,
) -> list[list[Segment]]:
    """:func:`~asrforge.model.longform.transcribe_long` of ``audios``, pieces of recordings
    (``owners[k]`` indexes ``prompts`` and ``languages``), with ``how`` (its options), then
    their words timed when asked, each on its own audio's clock, from the encodings
    decoding put in ``keep``."""
    piece_prompts = [prompts[k] for k in owners]
    decoded = transcribe_long(
        bundle.model,
        bundle.tokenizer,
        bundle.features,
        audios,
        piece_prompts,
        no_timestamps=bundle.specials.no_timestamps,
        eot=bundle.specials.eot,
        device=bundle.device,
        keep=keep,
        heads=bundle.alignment_heads,
        word_lag=bundle.word_lag,
        **how,
    )
    if word_timestamps:
        add_word_timestamps(
            bundle.model,
            bundle.features,
            audios,
            decoded,
            piece_prompts,
            [languages[k] for k in owners],
            eot=bundle.specials.eot,
            decode=lambda ids: bundle.tokenizer.decode(ids),
            non_text=non_text_ids(bundle),
            device=bundle.device,
            heads=word_heads(bundle),
            encoded=keep,
            lag=bundle.word_lag,
        )
    return decoded


def non_text_ids(bundle) -> frozenset[int]:
    """Ids that are not text: the tokenizer's special and added tokens (timestamps too)."""
    return frozenset(int(i) for i in bundle.tokenizer.added_tokens_decoder) | frozenset(
        bundle.tokenizer.all_special_ids
    )
