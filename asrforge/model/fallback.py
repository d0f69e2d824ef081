"""Temperature fallback, as openai-whisper's ``transcribe`` guards against repetition loops: a
window is decoded at temperature 0 (greedy or beam search); when its text compresses too well
(a loop: ``compression_ratio`` above 2.4), its average log-probability is too low (below -1),
or it is a rep trap by :mod:`asrforge.text.repetition` (hit the cap, or half its token 4-grams
repeat), it is decoded again by sampling at the next temperature (0.2, 0.4, ... 1.0) until one
passes; the last is kept when none does. Sampling draws from a ``torch.Generator`` seeded per
call, so a transcription is reproducible. openai-whisper samples ``best_of=5`` candidates per
temperature and keeps the likeliest; here ``best_of`` is that number too.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asrforge.model.beam import beam_search
from asrforge.model.decoding import (
    DecodeOptions,
    Hypothesis,
    Suppression,
    decoder_states,
    new_cache,
)
from asrforge.model.projection import vocab_logits
from asrforge.text.repetition import repetition_score


@dataclass(frozen=True)
class Fallback:
    """When and how a window is decoded again (openai-whisper's ``transcribe`` defaults)."""

    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    """The first (0: greedy or beam search) and each next one tried."""
    compression_ratio_threshold: float | None = 2.4
    """Fall back when the text's ``compression_ratio`` is above this; None: never."""
    logprob_threshold: float | None = -1.0
    """Fall back when the average log-probability per token is below this; None: never."""
    repetition_threshold: float | None = 0.5
    """Fall back when this fraction of the token 4-grams repeat, or the cap was hit."""
    best_of: int = 5
    """Samples per temperature above 0; the likeliest (summed log-probability) is kept."""
    seed: int = 0


def compression_ratio(text: str) -> float:
    """UTF-8 bytes of ``text`` over its zlib-compressed bytes (openai-whisper's)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def fallback_reason(hyp: Hypothesis, text: str, fallback: Fallback) -> str | None:
    """Why ``hyp`` (decoded as ``text``) should be decoded again, or None."""
    if fallback.compression_ratio_threshold is not None:
        ratio = compression_ratio(text)
        if ratio > fallback.compression_ratio_threshold:
            return f"compression ratio {ratio:.2f}"
    if fallback.logprob_threshold is not None and hyp.avg_logprob < fallback.logprob_threshold:
        return f"average log-probability {hyp.avg_logprob:.2f}"
    if fallback.repetition_threshold is not None:
        if hyp.hit_cap:
            return "hit the token cap"
        if repetition_score(hyp.tokens) >= fallback.repetition_threshold:
            return "repeats itself"
    return None


@torch.no_grad()
def sample(
    model,
    encoder_hidden: torch.Tensor,
    prompts: torch.Tensor,
    eot: int,
    max_new_tokens: int,
    options: DecodeOptions = DecodeOptions(),
    *,
    temperature: float,
    generator: torch.Generator,
) -> list[Hypothesis]:
    """One sampled sequence per row at ``temperature`` (> 0), with a KV cache; the
    log-probabilities summed are the model's (before the temperature), as openai-whisper's.
    ``options``: its ``rules`` are read."""
    rules = options.rules
    device = prompts.device
    b, p = prompts.shape
    cap = min(max_new_tokens, model.config.max_target_positions - p)
    suppression = Suppression.of(model, device)
    cache = new_cache(model, p + max(cap, 0))
    generated = torch.zeros((b, 0), dtype=torch.long, device=device)
    sums = torch.zeros(b, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    tokens = prompts
    for t in range(max(cap, 0)):
        h = decoder_states(model, tokens, encoder_hidden, cache)[:, -1]
        logits = suppression.apply(vocab_logits(model, h).float(), t)
        if rules is not None:  # after the suppression, as in greedy decoding
            logits = rules(logits, generated)
        probs = torch.softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(device)
        nxt = torch.where(done, eot, nxt)
        picked = torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None]).squeeze(1)
        sums = sums + torch.where(done, 0.0, picked)
        generated = torch.cat([generated, nxt[:, None]], dim=1)
        done = done | (nxt == eot)
        if bool(done.all()):
            break
        tokens = nxt[:, None]
    out = []
    for row, s in zip(generated.tolist(), sums.tolist(), strict=True):
        ended = eot in row
        out.append(Hypothesis(row[: row.index(eot)] if ended else row, s, not ended))
    return out


def decode_with_fallback(
    model,
    encoder_hidden: torch.Tensor,
    prompts: torch.Tensor,
    eot: int,
    max_new_tokens: int,
    options: DecodeOptions,
    *,
    decode_text: Callable[[list[int]], str],
) -> tuple[list[Hypothesis], list[float]]:
    """Decode each row at the first temperature, then again at the next ones the rows that
    :func:`fallback_reason` rejects, by ``options.fallback`` (which must be set); with
    ``options.no_speech``, a row the gate calls silent (:meth:`NoSpeech.silent
    <asrforge.model.no_speech.NoSpeech.silent>`) is not decoded again, and every hypothesis
    keeps the first decode's no-speech probability. Its
    ``fusion`` (an n-gram LM, :class:`~asrforge.lm.fusion.ShallowFusion`) joins the beam search
    at temperature 0 only: the samples are the model's.

    Returns:
        The kept hypothesis of each row and the temperature it was decoded at.
    """
    fallback = options.fallback
    if fallback is None:
        raise ValueError("decode_with_fallback needs options.fallback")
    gate = options.no_speech
    generator = torch.Generator().manual_seed(fallback.seed)
    hyps: list[Hypothesis | None] = [None] * prompts.shape[0]
    temps = [fallback.temperatures[0]] * prompts.shape[0]
    todo = list(range(prompts.shape[0]))
    for temperature in fallback.temperatures:
        if not todo:
            break
        idx = torch.tensor(todo, device=prompts.device)
        enc, ps = encoder_hidden[idx], prompts[idx]
        if temperature == 0:
            found = beam_search(model, enc, ps, eot, max_new_tokens, options)
        else:
            found = _best_of(model, enc, ps, eot, max_new_tokens, options, temperature, generator)
        still = []
        for row, hyp in zip(todo, found, strict=True):
            if hyps[row] is not None:  # the no-speech probability is the first decode's
                hyp = dataclasses.replace(hyp, no_speech_prob=hyps[row].no_speech_prob)
            hyps[row], temps[row] = hyp, temperature
            if fallback_reason(hyp, decode_text(hyp.tokens), fallback) is None:
                continue
            # openai-whisper's order: a likely silence with unlikely text is not sampled again
            if gate is None or not gate.silent(hyp.no_speech_prob, hyp.avg_logprob):
                still.append(row)
        todo = still
    return [h for h in hyps if h is not None], temps


def _best_of(model, enc, prompts, eot, cap, options, temperature, generator) -> list[Hypothesis]:
    """The likeliest of ``options.fallback.best_of`` samples per row."""
    n = options.fallback.best_of
    rep = enc.repeat_interleave(n, dim=0), prompts.repeat_interleave(n, dim=0)
    found = sample(model, *rep, eot, cap, options, temperature=temperature, generator=generator)
    return [
        max(found[i * n : (i + 1) * n], key=lambda h: h.sum_logprob) for i in range(len(prompts))
    ]
