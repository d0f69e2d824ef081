"""A loaded bundle (:class:`Bundle`): the model, tokenizer, log-mel front end and inference
config it holds, and its entry points, ``transcribe``, ``transcribe_many`` and ``recognize``
(:mod:`asrforge.bundle.recognize`, with the options of :mod:`asrforge.bundle.options`), and
``detect_language`` (:mod:`asrforge.bundle.languages`); :func:`~asrforge.bundle.load.load_bundle`
builds one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asrforge.bundle.languages import detect_language, language_ids
from asrforge.bundle.options import RecognizeOptions
from asrforge.bundle.recognize import Transcript, recognize
from asrforge.data.audio import Audio, as_wave
from asrforge.model.frames import window_seconds
from asrforge.model.tokenizer import SpecialTokens

__all__ = ["Bundle", "Transcript"]


class Bundle:
    """A model ready to transcribe: weights, tokenizer, log-mel front end and inference config.

    Args:
        model: a Whisper model (put in eval mode, moved to ``device``, its weights without
            ``requires_grad``: ``bundle.model.requires_grad_(True)`` before training it).
        tokenizer: its tokenizer.
        config: the bundle's ``InferenceConfig``.
        path: where it was loaded from, if anywhere.
        device: where the model runs.
        lm: the word n-gram LM (:class:`~asrforge.lm.ngram.NGramLM`) beam search fuses, if any.
        lm_weights: ``alpha`` and ``beta`` ``asrforge lm tune`` recorded (default: the inference
            config's ``lm.alpha``/``lm.beta``).
        alignment_heads: the ``(layer, head)`` pairs ``asrforge align-heads`` found for word
            timestamps (empty: it found none that qualifies); None: the model's own
            (:func:`asrforge.model.alignment.alignment_heads`).
        word_lag: seconds those heads place words late (``asrforge align-heads`` measures it),
            taken off word timestamps.
    """

    def __init__(
        self,
        model,
        tokenizer,
        config,
        *,
        path: Path | None = None,
        device="cpu",
        lm=None,
        lm_weights: dict[str, Any] | None = None,
        alignment_heads: list[tuple[int, int]] | None = None,
        word_lag: float = 0.0,
    ):
        self.device = torch.device(device)
        if self.device.type == "cpu":
            model = model.float()
        # A bundle transcribes and is never trained: no autograd state on its weights.
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = config
        self.path = path
        self.specials = SpecialTokens.from_tokenizer(
            tokenizer, config.multilingual, config.data.language_tokens
        )
        self.features = config.features.extractor()
        self.lm = lm
        self.lm_weights = dict(lm_weights or {})
        # The notices given once a bundle, by name.
        self.told: set[str] = set()
        self.alignment_heads = alignment_heads
        self.word_lag = word_lag

    @property
    def version(self) -> str:
        return self.config.bundle_version

    @property
    def languages(self) -> list[str]:
        return list(self.config.languages)

    @property
    def window_seconds(self) -> float:
        """The encoder's window: longer audio is cut into windows (see ``model/longform.py``)."""
        return window_seconds(self.model.config)

    def __repr__(self) -> str:
        return (
            f"Bundle({self.path or '<memory>'}, version {self.version}, weights "
            f"{self.config.weights}, languages {self.languages})"
        )

    # -- audio and language -------------------------------------------------------------------
    def load_audio(self, audio: Audio, sampling_rate: int | None = None) -> np.ndarray:
        """:func:`~asrforge.data.audio.as_wave` of ``audio``, its PCM-scale warning given once
        a bundle: a path, bytes, or an array of mono samples -> (n_samples,) float32 at 16 kHz.
        """
        return as_wave(audio, sampling_rate, told=self.told)

    @property
    def language_ids(self) -> dict[str, int]:
        """The languages this bundle transcribes and detects among: code -> language token."""
        return language_ids(self)

    def detect_language(self, audio: Audio, *, sampling_rate: int | None = None) -> str:
        """The most likely of the bundle's languages for the first window of ``audio``
        (:func:`asrforge.bundle.languages.detect_language`)."""
        return detect_language(self, audio, sampling_rate=sampling_rate)

    # -- transcription ------------------------------------------------------------------------
    # The three take the same options as keywords, RecognizeOptions' fields with its defaults
    # (asrforge.bundle.options); an unknown keyword is a TypeError naming it.
    def transcribe(
        self, audio: Audio, language: str | None = None, **options: Any
    ) -> str | Transcript:
        """Transcribe one recording of any length.

        Args:
            audio: a path, encoded bytes, or a (n_samples,) array of samples (see
                :meth:`load_audio`).
            language: a code, name or locale; default: the bundle's only language, else
                detected.
            options: :class:`~asrforge.bundle.options.RecognizeOptions` by name
                (``beam_size=5``, ``temperature_fallback=True``, ...).

        Returns:
            Its text; with ``word_timestamps=True``, its whole :class:`Transcript`, the words
            of its segments timed (``transcript.words``).
        """
        chosen = RecognizeOptions.of("transcribe", options)
        [result] = recognize(self, [audio], language, chosen)
        return result if chosen.word_timestamps else result.text

    def transcribe_many(
        self,
        audios: Sequence[Audio],
        language: str | Sequence[str | None] | None = None,
        *,
        names: Sequence[str] | None = None,
        **options: Any,
    ) -> list[str] | list[Transcript]:
        """Transcribe several recordings; windows of all of them are decoded in batches.

        Args:
            language: one for all, or one per recording.
            names: how warnings name each recording; default: a path as given, else
                ``recording <i>``.
            options: :class:`~asrforge.bundle.options.RecognizeOptions` by name.

        Returns:
            Each recording's text; with ``word_timestamps=True``, each one's :class:`Transcript`.
        """
        chosen = RecognizeOptions.of("transcribe_many", options)
        transcripts = recognize(self, audios, language, chosen, names=names)
        return transcripts if chosen.word_timestamps else [t.text for t in transcripts]

    def recognize(
        self,
        audios: Sequence[Audio],
        language: str | Sequence[str | None] | None = None,
        *,
        names: Sequence[str] | None = None,
        **options: Any,
    ) -> list[Transcript]:
        """:meth:`transcribe_many` with the language, duration and timed segments of each
        (:func:`asrforge.bundle.recognize.recognize`)."""
        chosen = RecognizeOptions.of("recognize", options)
        return recognize(self, audios, language, chosen, names=names)
