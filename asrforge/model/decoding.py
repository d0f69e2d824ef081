"""Greedy decoding with a KV cache, shared by evaluation and inference bundles."""

from __future__ import annotations

import torch


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


def pick(logits: torch.Tensor, suppress: list[int]) -> torch.Tensor:
    """Argmax over the last axis with the ``suppress`` ids excluded (``logits`` is left as is)."""
    if suppress:
        logits = logits.index_fill(-1, torch.tensor(suppress, device=logits.device), float("-inf"))
    return logits.argmax(-1)


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

    Returns:
        The generated ids of each sequence (without prompt and EOT), and whether each hit the cap.
    """
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    if (cache is None) != (first_tokens is None):
        raise ValueError("give both cache and first_tokens, or neither")
    decoder = model.model.decoder
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
            h = decoder(
                input_ids=tokens, encoder_hidden_states=encoder_hidden, past_key_values=cache,
                use_cache=True,
            ).last_hidden_state[:, -1]
            nxt = pick(model.proj_out(h), always + at_begin if t == 0 else always)
        out[rows, t] = nxt
        n = t + 1
        live = nxt != eot
        if not bool(live.any()):
            break
        if not bool(live.all()):  # drop the finished: later steps compute live rows only
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
