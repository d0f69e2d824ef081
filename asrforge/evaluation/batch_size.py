"""``data.eval_batch_size: auto``: on a GPU the largest evaluation batch that fits, since a
greedy decode bound by kernel launches costs about the same per step whatever its batch, so a
larger batch decodes more utterances per second. Probed once per model shape and device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from asrforge.model.decoding import decoder_states

log = logging.getLogger(__name__)

CEILING = 512
"""The largest batch tried: past it a launch-bound decode has nothing left to win."""
HEADROOM = 0.8
"""The share of the GPU's memory a probed batch may peak at: the allocator's fragmentation,
the training state kept beside an evaluation and the longest real batch need the rest."""

_probed: dict[tuple, int] = {}


def largest_fitting(default: int, fits: Callable[[int], bool], ceiling: int = CEILING) -> int:
    """The largest of ``default``, ``2 * default``, ``4 * default``... up to ``ceiling`` for
    which ``fits`` holds, trying them in that order and stopping at the first that does not;
    ``default`` when none does (the configured batch is kept, whatever it costs)."""
    best, b = default, default
    while b <= ceiling and fits(b):
        best, b = b, 2 * b
    return best


def eval_batch_size(
    setting: int | str | None,
    default: int,
    model=None,
    device: torch.device | str = "cpu",
    *,
    max_new_tokens: int = 256,
    autocast: Callable[[], object] | None = None,
) -> int:
    """The evaluation batch ``data.eval_batch_size`` (``setting``) asks for: a number as it is;
    None: ``default`` (``data.batch_size``); ``auto``: on CUDA the largest that fits (probed
    with ``model`` once per shape, device and token cap, then cached), elsewhere ``default``."""
    if setting is None:
        return default
    if setting != "auto":
        return int(setting)
    if model is None or torch.device(device).type != "cuda":
        return default
    c = model.config
    key = (c.d_model, c.encoder_layers, c.decoder_layers, c.vocab_size, c.num_mel_bins,
           str(torch.device(device)), max_new_tokens, next(model.parameters()).dtype)  # fmt: skip
    if key not in _probed:
        _probed[key] = largest_fitting(
            default, lambda b: _fits(model, b, device, max_new_tokens, autocast)
        )
        log.info("data.eval_batch_size auto: %d on %s", _probed[key], device)
    return _probed[key]


@torch.no_grad()
def _fits(model, batch: int, device, max_new_tokens: int, autocast) -> bool:
    """Whether an evaluation batch of ``batch`` full windows peaks under :data:`HEADROOM` of
    the device's memory: the encoder, the teacher-forced decoder pass over the token cap with
    its logits in float32 (what ``evaluate`` holds at once), caches included."""
    # transformers loads when a probe runs, not when asrforge.evaluation is imported
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    c = model.config
    length = min(max_new_tokens + 4, c.max_target_positions)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        with autocast() if autocast is not None else torch.autocast("cuda", enabled=False):
            feats = torch.zeros(batch, c.num_mel_bins, 2 * c.max_source_positions, device=device)
            enc = model.model.encoder(feats.to(model.dtype)).last_hidden_state
            tokens = torch.zeros(batch, length, dtype=torch.long, device=device)
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            logits = model.proj_out(decoder_states(model, tokens, enc, cache)).float()
            del feats, enc, tokens, cache, logits
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    return torch.cuda.max_memory_allocated(device) <= HEADROOM * total
