"""A caller's decoding options made concrete for a loaded bundle: the no-speech gate of its
tokenizer, its n-gram LM fused with tuned or given weights, the chunking its model allows,
whether a recording is decoded by VAD chunks, the heads that time words, and all of it as the
:class:`~asrforge.model.decoding.DecodeOptions` every decoder takes.

Each function takes the :class:`~asrforge.bundle.inference.Bundle` first.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from asrforge.bundle.languages import language_of_prompt
from asrforge.config import vad_problem
from asrforge.data.audio import SAMPLE_RATE
from asrforge.errors import UserError
from asrforge.lm.fusion import ShallowFusion
from asrforge.model.decoding import DecodeOptions
from asrforge.model.fallback import Fallback
from asrforge.model.longform import choose_chunking
from asrforge.model.no_speech import NoSpeech, no_speech_token
from asrforge.model.vad import vad_available

log = logging.getLogger(__name__)

GREEDY_WITHOUT_LM = (
    "the bundle's {order}-gram LM is fused in beam search only; greedy decoding runs without "
    "it ({beam} N > 1 to use it)"
)
"""What greedy decoding of a bundle with an LM says once; ``beam`` names the beam-size option."""

VAD_WITH_PREVIOUS_TEXT = (
    "{vad} and {previous}: VAD chunks are decoded apart, never prompted with the text before "
    "them; give one of the two"
)
"""Why VAD and previous-text conditioning are refused together, with the names the caller
gives them (``recognize``'s arguments, ``transcribe``'s flags)."""


def lm_alpha_beta(bundle) -> tuple[float, float]:
    """The LM weight and word bonus to decode with: tuned ones, else the recorded defaults."""
    info = bundle.config.lm
    return (
        float(bundle.lm_weights.get("alpha", info.alpha if info else 0.0)),
        float(bundle.lm_weights.get("beta", info.beta if info else 0.0)),
    )


def fusion(bundle, alpha: float | None = None, beta: float | None = None):
    """A :class:`~asrforge.lm.fusion.ShallowFusion` of the bundle's LM for beam search (None
    when it has none); ``alpha``/``beta`` default to :func:`lm_alpha_beta`."""
    if bundle.lm is None:
        return None
    tuned = lm_alpha_beta(bundle)
    return ShallowFusion(
        bundle.lm,
        bundle.tokenizer,
        bundle.specials.eot,
        tuned[0] if alpha is None else alpha,
        tuned[1] if beta is None else beta,
        language_of=functools.partial(language_of_prompt, bundle),
    )


def no_speech_gate(
    bundle, threshold: float | None, logprob_threshold: float | None = -1.0
) -> NoSpeech | None:
    """The no-speech gate of ``recognize``'s ``no_speech_threshold`` and ``logprob_threshold``;
    None when ``threshold`` is None or the vocabulary has no no-speech token.

    Raises:
        UserError: a threshold outside [0, 1], or a log-probability threshold above 0.
    """
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise UserError(f"no_speech_threshold must be in [0, 1] or None, got {threshold}")
    if logprob_threshold is not None and not logprob_threshold <= 0.0:
        raise UserError(f"logprob_threshold must be <= 0 or None, got {logprob_threshold}")
    if threshold is None:
        return None
    token = no_speech_token(bundle.tokenizer)
    if token is None:
        log.info("no no-speech gate: the vocabulary has no <|nospeech|> token")
        return None
    return NoSpeech(token, bundle.specials.sot, threshold, logprob_threshold)


def chunking_for(bundle, requested: str | None) -> tuple[str, str]:
    """``(chunking, why)`` for long audio (see :func:`asrforge.model.longform.choose_chunking`).

    Raises:
        UserError: an unknown chunking, or ``timestamps`` for a model without them.
    """
    return choose_chunking(bundle.tokenizer, bundle.model.config, requested)


def decode_options(
    bundle,
    *,
    beam_size: int,
    temperature_fallback: bool,
    use_lm: bool,
    lm_alpha: float | None,
    lm_beta: float | None,
    no_speech: NoSpeech | None,
    logprob_threshold: float | None,
) -> DecodeOptions:
    """What every window is decoded with: ``recognize``'s options (see there), the LM fused
    only in beam search; greedy decoding of a bundle with an LM says so once a bundle."""
    options = DecodeOptions(
        beam_size=beam_size,
        fallback=Fallback(logprob_threshold=logprob_threshold) if temperature_fallback else None,
        fusion=fusion(bundle, lm_alpha, lm_beta) if use_lm and beam_size > 1 else None,
        no_speech=no_speech,
    )
    if use_lm and bundle.lm is not None and beam_size == 1 and "greedy-lm" not in bundle.told:
        bundle.told.add("greedy-lm")
        log.info(GREEDY_WITHOUT_LM.format(order=bundle.lm.order, beam="beam_size"))
    return options


@functools.lru_cache(maxsize=1)
def _say_sequential_without_vad() -> None:
    """Log, once a process, that long recordings decode sequentially for want of VAD's
    packages (an install from before VAD needed onnxruntime lacks it)."""
    log.info("long recordings decode sequentially: %s", vad_problem("VAD"))


def use_vad(bundle, vad: bool | None, wave: np.ndarray, previous_text: bool) -> bool:
    """Whether to decode ``wave`` by VAD chunks (see ``recognize``); not by default when each
    window is to be conditioned on the text before it, which chunks decoded apart cannot be."""
    if vad is not None:
        return vad
    if wave.shape[0] <= bundle.window_seconds * SAMPLE_RATE or previous_text:
        return False
    if vad_available():
        return True
    _say_sequential_without_vad()
    return False


def word_heads(bundle) -> list[tuple[int, int]] | None:
    """The heads word timestamps align with; None: the model's own (said once a bundle when
    ``asrforge align-heads`` found none that qualifies)."""
    if bundle.alignment_heads == []:
        if "default-heads" not in bundle.told:
            bundle.told.add("default-heads")
            log.warning(
                "asrforge align-heads found no head that follows the audio in this model: "
                "word times come from the default heads and may be far off"
            )
        return None
    return bundle.alignment_heads
