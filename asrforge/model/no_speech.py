"""The no-speech gate, as openai-whisper's ``transcribe`` skips a window of silence or noise:
a window whose ``<|nospeech|>`` probability is above ``threshold`` yields no text, unless its
text is likely enough (average log-probability above ``logprob_threshold``).

The probability is the softmax of the decoder's logits at the ``<|startoftranscript|>``
position of the first decoder pass (no suppression, no temperature); the average
log-probability is :attr:`~asrforge.model.decoding.Hypothesis.avg_logprob`. How decoding
measures both: docs/decoding.md, "Silence and noise: the no-speech gate".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_SPEECH_TOKENS = ("<|nospeech|>", "<|nocaptions|>")
"""The no-speech token's names: the second in English-only and older vocabularies
(openai-whisper's ``tiny.en`` ... ``large-v2``)."""


@dataclass(frozen=True)
class NoSpeech:
    """When a decoded window counts as no speech (openai-whisper's defaults)."""

    token: int
    """The no-speech token's id (:func:`no_speech_token`)."""
    sot: int
    """``<|startoftranscript|>``'s id: its position in a prompt is where the token is read."""
    threshold: float = 0.6
    """A window is skipped when its no-speech probability is above this ..."""
    logprob_threshold: float | None = -1.0
    """... and its average log-probability is not above this; None: the probability alone."""

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) logits at ``<|startoftranscript|>`` -> (rows,) the no-speech
        probability of each row."""
        return logits.float().softmax(-1)[:, self.token]

    def positions(self, prompts: torch.Tensor) -> torch.Tensor:
        """(rows, p) prompts -> (rows,) where each holds ``<|startoftranscript|>`` (after a
        ``<|startofprev|>`` text, when there is one)."""
        return (prompts == self.sot).int().argmax(-1)

    def unlikely(self, avg_logprob: float) -> bool:
        """Whether text of this average log-probability does not overrule the probability."""
        return self.logprob_threshold is None or avg_logprob <= self.logprob_threshold

    def skips(self, no_speech_prob: float | None, avg_logprob: float) -> bool:
        """Whether a window decoded so yields no text (None: not measured, never skipped)."""
        if no_speech_prob is None:
            return False
        return no_speech_prob > self.threshold and self.unlikely(avg_logprob)

    def silent(self, no_speech_prob: float | None, avg_logprob: float) -> bool:
        """Whether temperature fallback stops at a decode: openai-whisper keeps a window that
        is likely silence and whose text is unlikely (below ``logprob_threshold``) rather than
        sampling text for it."""
        if no_speech_prob is None or self.logprob_threshold is None:
            return False
        return no_speech_prob > self.threshold and avg_logprob < self.logprob_threshold


def no_speech_token(tokenizer) -> int | None:
    """The id of the vocabulary's no-speech token (:data:`NO_SPEECH_TOKENS`), or None."""
    for name in NO_SPEECH_TOKENS:
        i = tokenizer.convert_tokens_to_ids(name)
        if i is not None and i != tokenizer.unk_token_id:
            return int(i)
    return None
