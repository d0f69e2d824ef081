"""A loaded bundle's languages: the ones it transcribes (code -> language token), a language a
caller names checked against them before any audio is read, the language a decoder prompt asks
for, and detection among them from the first window of each recording.

Each function takes the :class:`~asrforge.bundle.inference.Bundle` first, as
openai-whisper's ``detect_language(model, ...)`` takes its model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from asrforge.data.audio import SAMPLE_RATE, Audio, as_wave, audio_problem
from asrforge.errors import UserError
from asrforge.model.decoding import codes_of_tokens, detect_languages
from asrforge.model.encoding import encode_waves
from asrforge.model.longform import EncodedWindows
from asrforge.model.silence import segment
from asrforge.text.languages import find_language_code, resolve_language


def language_ids(bundle) -> dict[str, int]:
    """The languages ``bundle`` transcribes and detects among: code -> language token."""
    specials = bundle.specials
    langs = bundle.config.languages or list(specials.languages)
    return {c: specials.languages[c] for c in langs if c in specials.languages}


def language_without_audio(bundle, language: str | None) -> str | None:
    """The language to transcribe in, where the audio is not needed: ``language`` (a code, name
    or locale: "de", "German", "de-AT") checked, or the bundle's only language; None when it is
    to be detected.

    Raises:
        UserError: ``language`` unknown, or not the bundle's; a bundle with no language token.
    """
    multilingual = bundle.specials.multilingual
    if language is not None:
        code = resolve_language(language, strict=False).strip().lower()
        if not multilingual:
            if find_language_code(language) is None:
                raise UserError(f"unknown language {language!r}: this bundle is English-only")
            if code not in ("en", "english"):
                raise UserError(f"language {language!r}: this bundle is English-only")
            return "en"
        ids = language_ids(bundle)
        if code not in ids:
            raise UserError(
                f"unknown language {language!r}: this bundle transcribes {', '.join(sorted(ids))}"
            )
        return code
    if not multilingual:
        return "en"
    ids = language_ids(bundle)
    if not ids:
        raise UserError("this bundle's config names no language its tokenizer has a token for")
    return next(iter(ids)) if len(ids) == 1 else None


def check_language(bundle, language: str) -> None:
    """Refuse ``language`` as ``recognize`` would: unknown, or not the bundle's.

    Raises:
        UserError: naming the language and what the bundle transcribes.
    """
    language_without_audio(bundle, language)


def language_of_prompt(bundle, prompt: Sequence[int]) -> str:
    """The language a decoder prompt asks for (``en`` for an English-only model); the LM's
    language when several share the prompt's token (``data.language_tokens``)."""
    specials = bundle.specials
    if not specials.multilingual:
        return "en"
    ids = set(prompt)
    codes = [c for c, i in specials.languages.items() if i in ids]
    known = set(bundle.config.lm.languages) if bundle.config.lm else set()
    return next((c for c in codes if c in known), codes[0] if codes else "")


@torch.no_grad()
def detect_language(bundle, audio: Audio, *, sampling_rate: int | None = None) -> str:
    """The most likely of the bundle's languages for the first window of ``audio`` (the
    decoder's distribution after ``<|startoftranscript|>``, as Whisper detects).

    Args:
        audio, sampling_rate: as :func:`~asrforge.data.audio.as_wave` reads them.

    Raises:
        UserError: audio ``as_wave`` refuses, or none to hear a language in (no samples, or
            NaN/inf ones).
    """
    wave = as_wave(audio, sampling_rate, told=bundle.told)
    problem = audio_problem(wave)
    if problem is not None:
        name = audio if isinstance(audio, str | Path) else "audio"
        raise UserError(f"{name}: {problem}; no language to detect")
    return detect(bundle, [wave], batch_size=1)[0]


@torch.no_grad()
def detect(
    bundle,
    waves: Sequence[np.ndarray],
    *,
    batch_size: int,
    keep: EncodedWindows | None = None,
    reused: Sequence[bool] = (),
) -> list[str]:
    """:func:`detect_language` of each wave, ``batch_size`` first windows encoded at a time;
    with ``keep``, the encoder output of the windows ``reused`` marks (one flag a wave) goes
    into it, for decoding to start from."""
    code_of = codes_of_tokens(language_ids(bundle))
    out = []
    for k in range(0, len(waves), batch_size):
        windows = []
        for wave in waves[k : k + batch_size]:
            start, end = segment(wave, SAMPLE_RATE, bundle.window_seconds)[0]
            windows.append(wave[start:end])
        enc = encode_waves(bundle.model, bundle.features, windows, bundle.device)
        found = detect_languages(bundle.model, enc, bundle.specials.sot, code_of.keys())
        out += [code_of[token] for token in found]
        if keep is not None:
            flags = reused[k : k + batch_size]
            for window, encoded, reuse in zip(windows, enc, flags, strict=True):
                if reuse:
                    keep.add(window, encoded)
    return out
