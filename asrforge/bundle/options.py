"""The options recordings are decoded with (:class:`RecognizeOptions`, the one list that
``Bundle.transcribe``, ``transcribe_many`` and ``recognize`` take as keywords), made concrete
for a loaded bundle: the no-speech gate of its tokenizer, its n-gram LM fused with tuned or
given weights, the chunking its model allows, whether a recording is decoded by VAD chunks, the
heads that time words, and all of it as the :class:`~asrforge.model.decoding.DecodeOptions`
every decoder takes.

Each function takes the :class:`~asrforge.bundle.inference.Bundle` first.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, fields
from typing import Any

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


@dataclass(frozen=True)
class RecognizeOptions:
    """How recordings are decoded: the keywords ``Bundle.transcribe``, ``transcribe_many`` and
    ``recognize`` take, with their defaults."""

    batch_size: int = 8
    """Windows (of all the recordings together) decoded in one batch."""
    max_new_tokens: int | None = None
    """Cap of new tokens per window; None: the bundle's ``eval.max_new_tokens``."""
    chunking: str | None = None
    """How audio is decoded. ``timestamps`` (default when the model has timestamp tokens):
    windows in timestamp mode, each starting at the end of the last complete segment of the
    one before, as openai-whisper and faster-whisper transcribe (audio within one window is one
    window, its segments timed by the model). ``silence`` (default otherwise): cut at the
    quietest moments, pieces decoded without timestamps, one segment per piece."""
    condition_on_previous_text: bool = False
    """``timestamps`` only: prompt each window with the text decoded before it
    (``<|startofprev|>``). Off by default: a window that went wrong (a repetition loop) then
    steers the next ones, and with greedy decoding there is no temperature fallback to
    recover; a model fine-tuned without such prompts has never seen them."""
    sampling_rate: int | None = None
    """An array's rate in Hz, resampled to 16 kHz; None: 16 kHz. Files and bytes carry their
    own."""
    beam_size: int = 1
    """Beams per window (:func:`asrforge.model.beam.beam_decode`); 1: greedy."""
    temperature_fallback: bool = False
    """Decode a window whose text looks like a loop (it compresses too well, is unlikely, or
    repeats itself) again by seeded sampling at temperatures 0.2 ... 1.0, as openai-whisper
    (:mod:`asrforge.model.fallback`)."""
    use_lm: bool = True
    """Fuse the bundle's n-gram LM, when it has one, into beam search (``beam_size`` > 1;
    greedy decoding runs without it and says so once in the log)."""
    lm_alpha: float | None = None
    """The LM's weight; None: the tuned or recorded one (:func:`lm_alpha_beta`)."""
    lm_beta: float | None = None
    """The LM's bonus per word; None: the tuned or recorded one (:func:`lm_alpha_beta`)."""
    word_timestamps: bool = False
    """Time every word of every segment (``Segment.words``): the cross-attention of the
    model's alignment heads aligned to the audio by dynamic time warping
    (:mod:`asrforge.model.alignment`). ``transcribe`` and ``transcribe_many`` then return each
    recording's whole ``Transcript`` instead of its text."""
    vad: bool | None = None
    """Decode only the speech Silero VAD finds, its regions joined into chunks (the pauses
    between them left out) of at most 26/30 of a window of speech, all decoded as one batch,
    segments and words placed back on the recording's clock (:mod:`asrforge.model.vad`);
    False: sequential windows over the whole recording. None: VAD for recordings longer than
    one window when the packages ``silero-vad`` and ``onnxruntime`` are installed and
    ``condition_on_previous_text`` is off (a chunk is decoded without the text of the chunks
    before it); True with ``condition_on_previous_text`` is refused."""
    no_speech_threshold: float | None = 0.6
    """A window (a clip, a long-form window, a VAD chunk) whose no-speech probability (of
    ``<|nospeech|>`` at ``<|startoftranscript|>``) is above this yields no text, unless its
    average log-probability is above ``logprob_threshold``, as openai-whisper's
    ``transcribe`` (:mod:`asrforge.model.no_speech`); None: every window is decoded to
    text."""
    logprob_threshold: float | None = -1.0
    """See ``no_speech_threshold``; also the average log-probability below which
    ``temperature_fallback`` decodes a window again (openai-whisper's one
    ``logprob_threshold``). None: the probability alone skips a window."""

    def __post_init__(self) -> None:
        """Refuse a value of the wrong kind by its option's name (``beam_size="5"`` would fail
        deep in decoding with a comparison error).

        Raises:
            UserError: naming each option and the kind it takes.
        """
        problems = []
        for f in fields(self):
            # the annotation names the kind: "int", "float | None", ...
            annotated, _, optional_ = f.type.partition(" | ")
            value, (kinds, what) = getattr(self, f.name), _KINDS[annotated]
            if value is None and optional_ == "None":
                continue
            # bool is an int to Python, never a count or a threshold here
            wrong = isinstance(value, bool | np.bool_) != (kinds == _FLAG[0])
            if wrong or not isinstance(value, kinds):
                problems.append(f"{f.name}: {value!r} is not {what}")
        if problems:
            raise UserError("; ".join(problems))

    @classmethod
    def of(cls, caller: str, keywords: dict[str, Any]) -> RecognizeOptions:
        """The options ``caller``'s keywords give, the others at their defaults.

        Raises:
            TypeError: a keyword that is no option, named with the options there are.
        """
        known = [f.name for f in fields(cls)]
        unknown = [k for k in keywords if k not in known]
        if unknown:
            raise TypeError(
                f"{caller}() got unexpected keyword arguments {', '.join(map(repr, unknown))}; "
                f"its options: {', '.join(known)}"
            )
        return cls(**keywords)


_FLAG = ((bool, np.bool_), "True or False")
_KINDS = {
    "int": ((int, np.integer), "a whole number"),
    "float": ((int, float, np.integer, np.floating), "a number"),
    "bool": _FLAG,
    "str": ((str,), "a text"),
}
"""What each annotation of a :class:`RecognizeOptions` field accepts, and how a message names
it."""


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


def decode_options(bundle, options: RecognizeOptions, no_speech: NoSpeech | None) -> DecodeOptions:
    """What every window is decoded with: ``options`` and the gate ``no_speech``
    (:func:`no_speech_gate`), the LM fused only in beam search; greedy decoding of a bundle
    with an LM says so once a bundle.

    Raises:
        UserError: ``lm_alpha``/``lm_beta`` given where they would change nothing: a bundle
            without an LM, or greedy decoding (the CLI refuses its flags alike).
    """
    beam, use_lm = options.beam_size, options.use_lm
    if use_lm and (options.lm_alpha is not None or options.lm_beta is not None):
        if bundle.lm is None:
            raise UserError("lm_alpha/lm_beta: this bundle has no n-gram LM (export it with --lm)")
        if beam == 1:
            raise UserError("lm_alpha/lm_beta: the n-gram LM is fused in beam search only; give "
                            "beam_size > 1 (e.g. 5)")  # fmt: skip
    decode = DecodeOptions(
        beam_size=beam,
        fallback=Fallback(logprob_threshold=options.logprob_threshold)
        if options.temperature_fallback
        else None,
        fusion=fusion(bundle, options.lm_alpha, options.lm_beta) if use_lm and beam > 1 else None,
        no_speech=no_speech,
    )
    if use_lm and bundle.lm is not None and beam == 1 and "greedy-lm" not in bundle.told:
        bundle.told.add("greedy-lm")
        log.info(GREEDY_WITHOUT_LM.format(order=bundle.lm.order, beam="beam_size"))
    return decode


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
