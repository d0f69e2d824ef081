"""Greedy decoding with a KV cache, shared by evaluation and inference bundles, and Whisper's
timestamp rules for long-form transcription (:class:`TimestampRules`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asrforge.model.frames import TIME_PRECISION


@functools.cache
def _cache_argument(decoder_class: type) -> str:
    # transformers 5 renamed the decoder's past_key_values argument to cache and warns on the old name.
    params = inspect.signature(decoder_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def decoder_states(
    model, tokens: torch.Tensor, encoder_hidden: torch.Tensor, cache
) -> torch.Tensor:
    """Run Whisper's decoder on ``tokens`` (batch, t) after what ``cache`` holds, extending it.

    Args:
        model: a ``WhisperForConditionalGeneration``.
        tokens: (batch, t) token ids that follow the cached positions.
        encoder_hidden: (batch, frames, d_model) the encoder's output.
        cache: an ``EncoderDecoderCache``, extended in place.

    Returns:
        (batch, t, d_model) the decoder's last hidden states.
    """
    decoder = model.model.decoder
    cached = {_cache_argument(type(decoder)): cache}
    return decoder(
        input_ids=tokens, encoder_hidden_states=encoder_hidden, use_cache=True, **cached
    ).last_hidden_state


def suppressed_ids(model) -> tuple[list[int], list[int]]:
    """``(always, at_begin)``: the token ids the model's generation config suppresses at every
    step (``suppress_tokens``: Whisper's non-speech symbols) and at the first generated position
    (``begin_suppress_tokens``: a leading space, EOT) — what transformers' ``generate`` applies
    to Whisper, so greedy decoding here picks the tokens it would. Empty for a from-scratch model.
    """
    gc = getattr(model, "generation_config", None)
    vocab = model.config.vocab_size

    def ids(name: str) -> list[int]:
        return sorted({int(i) for i in (getattr(gc, name, None) or []) if 0 <= int(i) < vocab})

    return ids("suppress_tokens"), ids("begin_suppress_tokens")


def suppress(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """``logits`` with the ``ids`` set to -inf on the last axis (a copy; the input is left as
    is), so no decoder picks or samples a suppressed token."""
    if not ids:
        return logits
    return logits.index_fill(-1, torch.tensor(ids, device=logits.device), float("-inf"))


def pick(logits: torch.Tensor, suppress_ids: list[int]) -> torch.Tensor:
    """Argmax over the last axis with the ``suppress_ids`` excluded (``logits`` is left as is)."""
    return suppress(logits, suppress_ids).argmax(-1)


@torch.no_grad()
def greedy_decode(
    model,
    encoder_hidden: torch.Tensor,
    prompts: torch.Tensor,
    eot: int,
    max_new_tokens: int,
    *,
    cache=None,
    first_tokens: torch.Tensor | None = None,
    rules: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[list[int]], list[bool]]:
    """Greedy decoding with a KV cache. A sequence that emitted EOT leaves the batch (its rows
    are dropped from the cache), so a batch costs what its sequences need, not batch x longest.
    The generation config's suppressed tokens are never picked (:func:`suppressed_ids`).

    Args:
        encoder_hidden: (batch, frames, d_model) encoder output.
        prompts: (batch, prompt_len) forced prefix ids (start, language, task, no-timestamps).
        max_new_tokens: cap on generated tokens per sequence (the decoder's own limit applies too).
        cache: an ``EncoderDecoderCache`` already holding the prompt's self-attention keys and
            values and the encoder's cross-attention ones (e.g. a teacher-forced pass's cache
            cropped to the prompt); then ``first_tokens`` must be given too.
        first_tokens: (batch,) the token chosen after the prompt, when ``cache`` is given
            (chosen with :func:`pick` and both suppression lists, as here).
        rules: ``rules(logits, generated)`` -> logits with forbidden tokens at ``-inf``, applied
            at every step before the pick; ``logits`` is (live, vocab), ``generated`` (live, t)
            the ids each live sequence generated so far (e.g. :class:`TimestampRules`).

    Returns:
        The generated ids of each sequence (without prompt and EOT), and whether each hit the cap.
    """
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    if (cache is None) != (first_tokens is None):
        raise ValueError("give both cache and first_tokens, or neither")
    b, p = prompts.shape
    cap = min(max_new_tokens, model.config.max_target_positions - p)
    if cache is None:
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    always, at_begin = suppressed_ids(model)
    out = torch.full((b, cap), eot, dtype=torch.long, device=prompts.device)
    rows = torch.arange(b, device=prompts.device)  # the batch row of each live sequence
    tokens, n = prompts, 0
    for t in range(cap):
        if t == 0 and first_tokens is not None:
            nxt = first_tokens
        else:
            h = decoder_states(model, tokens, encoder_hidden, cache)[:, -1]
            logits = model.proj_out(h)
            if rules is not None:
                logits = rules(logits, out[rows, :t])
            nxt = pick(logits, always + at_begin if t == 0 else always)
        out[rows, t] = nxt
        n = t + 1
        live = nxt != eot
        if not bool(live.any()):
            break
        # Later steps compute the rows still live only, so the finished ones are dropped.
        if not bool(live.all()):
            keep = live.nonzero().squeeze(1)
            rows, nxt, encoder_hidden = rows[keep], nxt[keep], encoder_hidden[keep]
            cache.batch_select_indices(keep)
        tokens = nxt[:, None]
    seqs, hit_cap = [], []
    for row in out[:, :n].tolist():
        k = row.index(eot) if eot in row else len(row)
        seqs.append(row[:k])
        hit_cap.append(eot not in row)
    return seqs, hit_cap


@dataclass(frozen=True)
class TimestampVocab:
    """Where a vocabulary keeps Whisper's timestamp tokens: ``<|0.00|>`` is ``begin``, and
    ``begin + k`` stands for ``k * 0.02`` s into the window, for ``k < count``. Ids at or past
    ``begin + count`` (an extended vocabulary's new tokens) are text again."""

    begin: int
    count: int
    eot: int
    no_timestamps: int
    specials: int | None = None
    """The first special token after the text tokens (``<|startoftranscript|>``), when it is
    not ``eot + 1`` (Whisper's layout): a BPE asrforge trains has EOT first (id 0), its text
    tokens, then the specials and timestamps."""

    @property
    def end(self) -> int:
        return self.begin + self.count

    @property
    def first_special(self) -> int:
        return self.eot + 1 if self.specials is None else self.specials

    def is_timestamp(self, token: int) -> bool:
        return self.begin <= token < self.end

    def is_text(self, token: int) -> bool:
        return token != self.eot and not self.first_special <= token < self.end

    @classmethod
    def of(cls, tokenizer, vocab_size: int, window_seconds: float) -> TimestampVocab | None:
        """The timestamp tokens of ``tokenizer``, or None when it has none or too few to cover
        ``window_seconds`` (a from-scratch BPE has no timestamps: such a model cannot drive
        long-form decoding by timestamps)."""

        def tid(token: str) -> int | None:
            i = tokenizer.convert_tokens_to_ids(token)
            # Whisper's unknown token is <|endoftext|> itself
            unknown = i == tokenizer.unk_token_id and token != "<|endoftext|>"
            return None if i is None or unknown else int(i)

        no_ts, first, eot = tid("<|notimestamps|>"), tid("<|0.00|>"), tid("<|endoftext|>")
        sot = tid("<|startoftranscript|>")
        count = round(window_seconds / TIME_PRECISION) + 1
        last = tid(f"<|{(count - 1) * TIME_PRECISION:.2f}|>")
        if None in (no_ts, first, eot, last) or last != first + count - 1:
            return None
        if first + count > vocab_size:
            return None
        specials = None if sot is None or sot == eot + 1 else sot
        return cls(begin=first, count=count, eot=eot, no_timestamps=no_ts, specials=specials)


class TimestampRules:
    """openai-whisper's ``ApplyTimestampRules`` for greedy decoding in timestamp mode (a prompt
    without ``<|notimestamps|>``), as a ``rules`` argument of :func:`greedy_decode`:

    * ``<|notimestamps|>`` and the other special tokens between EOT and the timestamps are
      never picked;
    * the first token is a timestamp, at most ``max_initial_timestamp`` seconds;
    * timestamps come in pairs (a segment's end, then the next one's start), except right
      before EOT: after a lone timestamp comes another timestamp or EOT, after a pair text;
    * timestamps never decrease, and a segment's end is later than its start;
    * when the probability mass of all timestamps exceeds that of the likeliest other token,
      a timestamp is picked.

    Args:
        vocab: the timestamp tokens.
        max_initial_timestamp: seconds; None: no limit.
    """

    def __init__(self, vocab: TimestampVocab, max_initial_timestamp: float | None = 1.0):
        self.vocab = vocab
        self.max_initial = (
            None if max_initial_timestamp is None else round(max_initial_timestamp / TIME_PRECISION)
        )

    def __call__(self, logits: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) logits, (rows, t) generated ids -> masked float logits."""
        v = self.vocab
        logits = logits.float().clone()
        logits[:, v.first_special : v.begin] = float("-inf")  # sot, languages, notimestamps...
        text = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
        text[v.eot] = False
        text[v.first_special : v.end] = False
        if generated.shape[1] == 0:
            logits[:, : v.begin] = float("-inf")
            logits[:, v.end :] = float("-inf")
            if self.max_initial is not None:
                logits[:, v.begin + self.max_initial + 1 :] = float("-inf")
        for k, seq in enumerate(generated.tolist()):
            self._pairs_and_order(logits[k], seq, text)
        logprobs = torch.log_softmax(logits, dim=-1)
        stamps = logprobs[:, v.begin : v.end].logsumexp(-1)
        others = torch.cat([logprobs[:, : v.begin], logprobs[:, v.end :]], -1).amax(-1)
        logits[stamps > others, : v.begin] = float("-inf")
        logits[stamps > others, v.end :] = float("-inf")
        return logits

    def _pairs_and_order(self, row: torch.Tensor, seq: list[int], text: torch.Tensor) -> None:
        v = self.vocab
        if not seq:
            return
        last = v.is_timestamp(seq[-1])
        penultimate = len(seq) < 2 or v.is_timestamp(seq[-2])
        # After a pair of timestamps (or the opening one) text must follow.
        if last and penultimate:
            row[v.begin : v.end] = float("-inf")
        elif last:
            # After a segment's end comes the next segment's start or EOT.
            row[text] = float("-inf")
        stamps = [t for t in seq if v.is_timestamp(t)]
        if stamps:
            # never backwards; a segment's end must be later than its start (no endless loop)
            floor = stamps[-1] if last and not penultimate else stamps[-1] + 1
            row[v.begin : floor] = float("-inf")
