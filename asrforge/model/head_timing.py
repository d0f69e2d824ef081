"""How well decoder heads follow the audio, measured on two utterances joined with a pause:
where each head alone, and word timestamps with their heads together, place the second
utterance's start, against where its speech starts by the audio's energy. ``asrforge
align-heads`` (:mod:`asrforge.bundle.heads`) chooses heads and the lag word timestamps take off
with these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from asrforge.data.audio import SAMPLE_RATE
from asrforge.model.alignment import align_words, cross_attention, token_starts
from asrforge.model.encoding import encode_waves

HEAD_ERROR_LIMIT = 0.2
"""Seconds: a head qualifies when its median error of an utterance's start is within this."""
LAG_LIMIT = 0.2
"""Seconds: the most an utterance's start after a pause may come late to be taken as the heads'
lag; later (or early) is where the heads put the pause."""


def speech_onset(wave: np.ndarray, sample_rate: int = SAMPLE_RATE) -> float:
    """Seconds to the first 10 ms frame of ``wave`` whose RMS reaches a tenth of its loudest
    frame's: where an utterance's speech starts after its leading silence."""
    hop = sample_rate // 100
    n = wave.shape[0] // hop
    if n == 0:
        return 0.0
    rms = np.sqrt((wave[: n * hop].reshape(n, hop).astype(np.float64) ** 2).mean(axis=1))
    return float(np.argmax(rms >= 0.1 * rms.max())) * hop / sample_rate


@torch.no_grad()
def head_offsets(
    model,
    extractor,
    joins: Sequence[tuple[np.ndarray, list[int], int, float]],
    prompt: Sequence[int],
    *,
    eot: int,
    device: torch.device | str = "cpu",
    sample_rate: int = SAMPLE_RATE,
    encoded: Sequence[torch.Tensor] | None = None,
) -> tuple[list[tuple[int, int]], np.ndarray]:
    """How far each decoder head's own alignment places the start of a known utterance.

    Args:
        joins: ``(wave, text_tokens, k, onset)``: audio of two utterances joined (at most one
            window), the text tokens of both, the index of the second's first token, and where
            the second's speech starts in seconds.
        prompt: the decoder prompt, ending in ``<|notimestamps|>``.
        encoded: each join's encoder output (:func:`~asrforge.model.encoding.encode_waves`),
            when already computed.

    Returns:
        ``(heads, offsets)``: every ``(layer, head)`` and (len(joins), len(heads)) signed
        offsets in seconds (positive: late) of the token's start by that head alone
        (:func:`token_starts`).
    """
    cfg = model.config
    heads = [
        (layer, head)
        for layer in range(cfg.decoder_layers)
        for head in range(cfg.decoder_attention_heads)
    ]
    offsets = np.zeros((len(joins), len(heads)))
    for j, (wave, tokens, k, onset) in enumerate(joins):
        encoder_out = _encoding(model, extractor, joins, encoded, j, device, sample_rate)
        ids = torch.tensor([[*prompt, *tokens, eot]], device=device)
        _, qk = cross_attention(model, encoder_out, ids, heads, logits=False)
        for h in range(len(heads)):
            starts = token_starts(qk[h : h + 1], len(prompt), len(tokens), wave.shape[0])
            offsets[j, h] = starts[k] - onset
    return heads, offsets


@torch.no_grad()
def onset_offsets(
    model,
    extractor,
    joins: Sequence[tuple[np.ndarray, list[int], int, float]],
    prompt: Sequence[int],
    heads: Sequence[tuple[int, int]],
    *,
    eot: int,
    decode: Callable[[list[int]], str],
    specials: frozenset[int],
    unspaced: bool = False,
    device: torch.device | str = "cpu",
    sample_rate: int = SAMPLE_RATE,
    encoded: Sequence[torch.Tensor] | None = None,
) -> np.ndarray:
    """(len(joins),) signed offsets in seconds (positive: late) of the second utterance's start
    as word timestamps place it: the start of the word holding its first token among the
    join's words by ``heads`` together (:func:`align_words`, long words at sentence ends cut);
    ``joins`` and ``encoded`` as :func:`head_offsets` takes them, the rest as
    :func:`align_words`."""
    offsets = []
    for j, (wave, tokens, k, onset) in enumerate(joins):
        encoder_out = _encoding(model, extractor, joins, encoded, j, device, sample_rate)
        words, _ = align_words(
            model, encoder_out, prompt, tokens, wave.shape[0], eot=eot, decode=decode,
            specials=specials, heads=heads, unspaced=unspaced, probabilities=False,
        )  # fmt: skip
        ends = np.cumsum([len(w.tokens) for w in words])
        offsets.append(words[int(np.searchsorted(ends, k, side="right"))].start - onset)
    return np.array(offsets)


def _encoding(model, extractor, joins, encoded, j: int, device, sample_rate: int) -> torch.Tensor:
    """Join ``j``'s encoder output: ``encoded[j]``, or computed when none was given."""
    if encoded is not None:
        return encoded[j]
    return encode_waves(model, extractor, [joins[j][0]], device, sample_rate)


def qualifying_heads(
    heads: Sequence[tuple[int, int]], offsets: np.ndarray, limit: float = HEAD_ERROR_LIMIT
) -> list[tuple[int, int]]:
    """The heads whose median absolute error (over the joins, ``offsets`` as
    :func:`head_offsets` gives them) is within ``limit`` seconds, best first; empty when none
    is."""
    median = np.median(np.abs(offsets), axis=0)
    order = np.argsort(median, kind="stable")
    return [tuple(heads[h]) for h in order if median[h] <= limit]
