"""Greedy decoding with a KV cache, shared by evaluation and inference bundles."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_decode(
    model,
    encoder_hidden: torch.Tensor,
    prompts: torch.Tensor,
    eot: int,
    max_new_tokens: int,
) -> tuple[list[list[int]], list[bool]]:
    """Greedy decoding with a KV cache; a batch stops as soon as every sequence emitted EOT.

    Args:
        encoder_hidden: (batch, frames, d_model) encoder output.
        prompts: (batch, prompt_len) forced prefix ids (start, language, task, no-timestamps).
        max_new_tokens: cap on generated tokens per sequence (the decoder's own limit applies too).

    Returns:
        The generated ids of each sequence (without prompt and EOT), and whether each hit the cap.
    """
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    decoder = model.model.decoder
    b, p = prompts.shape
    cap = min(max_new_tokens, model.config.max_target_positions - p)
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    tokens = prompts
    out = torch.empty((b, 0), dtype=torch.long, device=prompts.device)
    done = torch.zeros(b, dtype=torch.bool, device=prompts.device)
    for _ in range(cap):
        h = decoder(
            input_ids=tokens, encoder_hidden_states=encoder_hidden, past_key_values=cache, use_cache=True
        ).last_hidden_state[:, -1]
        nxt = model.proj_out(h).argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, eot), nxt)
        out = torch.cat([out, nxt[:, None]], dim=1)
        done |= nxt == eot
        if bool(done.all()):
            break
        tokens = nxt[:, None]
    seqs, hit_cap = [], []
    for row in out.tolist():
        n = row.index(eot) if eot in row else len(row)
        seqs.append(row[:n])
        hit_cap.append(eot not in row)
    return seqs, hit_cap
