"""Cross-attention of an utterance's beams over one copy of its encoder keys and values.

Beam search decodes ``k`` rows per utterance, and every row attends to the same encoder output.
openai-whisper and transformers repeat the cross-attention keys and values per beam, so a step
reads them ``k`` times (18 MB a row a step for tiny.en, 0.5 GB a row held for large-v3). Here
the cross-attention cache keeps one row per utterance, and the ``k`` beams' queries attend to it
as ``k`` positions of one query: the same arithmetic, each key and value read once.

:func:`shared_cross_attention` switches a model to an attention implementation that does this
when a layer's queries have ``k`` times the keys' rows and otherwise is the model's own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

PREFIX = "asrforge_beams+"
"""Names of the implementations registered here: the prefix, then the model's own (``sdpa``)."""


def _grouped(base: str):
    """The attention function named ``PREFIX + base``."""
    # transformers loads when a decode runs, not when asrforge.model is imported
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.whisper.modeling_whisper import eager_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        own = ALL_ATTENTION_FUNCTIONS.get_interface(base, eager_attention_forward)
        rows, kv_rows = query.shape[0], key.shape[0]
        if rows == kv_rows or attention_mask is not None:
            return own(module, query, key, value, attention_mask, **kwargs)
        if rows % kv_rows:
            raise ValueError(f"{rows} beam rows do not share {kv_rows} utterances' keys evenly")
        k = rows // kv_rows
        _, heads, length, dim = query.shape
        # (utterance x beam, heads, q, dim) -> (utterance, heads, beam x q, dim)
        grouped = query.view(kv_rows, k, heads, length, dim).transpose(1, 2)
        out, _weights = own(
            module, grouped.reshape(kv_rows, heads, k * length, dim), key, value, None, **kwargs
        )
        # (utterance, beam x q, heads, dim) -> (utterance x beam, q, heads, dim); no weights:
        # they would come in the grouped shape, and beam search asks for none
        return out.reshape(rows, length, heads, dim), None

    return attention


_lock = threading.Lock()
_searching: dict[int, tuple[int, str | None]] = {}
"""Per model config (by ``id``) while a search runs: how many, and its own implementation."""


SHARING = ("sdpa", "eager")
"""The implementations wrapped: flash attention's kernels look themselves up by the model's
implementation name, which the wrapper changes."""


@contextmanager
def shared_cross_attention(model) -> Iterator[bool]:
    """Within it, a cross-attention layer whose cache holds one row per utterance serves the
    utterance's beams (``k`` consecutive rows of the queries) from it; every other attention is
    the model's own. Yields whether it does: not for an implementation outside
    :data:`SHARING`, whose beams then need a cross-attention row each. The model's
    implementation is restored when the last search on it ends, so searches in several threads
    on one model do not undo each other's."""
    # transformers loads when a decode runs, not when asrforge.model is imported
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = model.config
    with _lock:
        count, own = _searching.get(id(config), (0, config._attn_implementation))
        # transformers attends eagerly when no implementation is set
        base = own or "eager"
        if base not in SHARING:
            shared = False
        else:
            shared = True
            if count == 0:
                AttentionInterface.register(PREFIX + base, _grouped(base))
                AttentionMaskInterface.register(PREFIX + base, ALL_MASK_ATTENTION_FUNCTIONS[base])
                config._attn_implementation = PREFIX + base
            _searching[id(config)] = (count + 1, own)
    if not shared:
        yield False
        return
    try:
        yield True
    finally:
        with _lock:
            count, own = _searching.pop(id(config))
            if count > 1:
                _searching[id(config)] = (count - 1, own)
            else:
                config._attn_implementation = own
