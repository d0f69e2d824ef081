"""``asrforge align-heads``: find the decoder heads whose cross-attention follows the audio, from
held-out clips, for a model whose alignment heads are unknown (built from scratch, vocabulary
extended), and record them in the bundle's manifest, which word timestamps then use.

Consecutive utterances of a split (same language) are joined with one second of silence into
recordings of at most one window. The start of the second utterance's speech is known: where
it was joined plus its own leading silence (:func:`asrforge.model.alignment.speech_onset`).
Each head aligns the joined text to the audio alone, as word timestamps do with the heads
together (:func:`asrforge.model.alignment.head_errors`); a head qualifies when its median error
of that start is within ``max_error`` (:data:`~asrforge.model.alignment.HEAD_ERROR_LIMIT`, 0.2 s,
by default). The manifest
is rewritten in one atomic rename and sealed afresh; when no head qualifies that is recorded
too, and word timestamps keep the default heads, with a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from asrforge.bundle.load import ALIGNMENT_HEADS_KEY, load_bundle
from asrforge.bundle.write import update_bundle_manifest
from asrforge.config import DataConfig
from asrforge.data.audio import SAMPLE_RATE
from asrforge.data.sources import data_config
from asrforge.errors import UserError
from asrforge.evaluation.evaluate import split_loader
from asrforge.model.alignment import HEAD_ERROR_LIMIT, head_errors, qualifying_heads, speech_onset

log = logging.getLogger(__name__)

GAP_SECONDS = 1.0
"""Silence between the two utterances of a join."""


def find_alignment_heads(
    bundle_dir: Path,
    data: Path | DataConfig,
    split: str = "validation",
    *,
    joins: int = 8,
    max_error: float = HEAD_ERROR_LIMIT,
) -> dict[str, Any]:
    """Measure every decoder head on ``joins`` joined pairs of ``split`` and record the heads
    that qualify (median error within ``max_error`` seconds) in the bundle's manifest (see the
    module docstring).

    Returns:
        What was recorded: ``heads`` (best first; empty when none qualifies), ``limit_s``,
        the data, split and join count, and ``median_error_s`` of every head (``"layer,head"``).

    Raises:
        UserError: ``joins`` < 1, a bad split, or one with no two utterances of a language that
            fit one window together; CheckpointError: the bundle does not verify.
    """
    if joins < 1:
        raise UserError(f"--joins: must be >= 1, got {joins}")
    if not max_error > 0:
        raise UserError(f"--max-error: must be > 0 seconds, got {max_error}")
    bundle = load_bundle(bundle_dir)
    loader, n, _report = split_loader(bundle, data, split, batch_size=1)
    dataset = loader.dataset
    window = round(bundle.window_seconds * SAMPLE_RATE)
    gap = np.zeros(round(GAP_SECONDS * SAMPLE_RATE), np.float32)
    pairs, by_language = [], {}
    for i in range(n):
        if len(pairs) == joins:
            break
        utt = dataset.utts[i]
        j = by_language.pop(utt.language, None)
        if j is None:
            by_language[utt.language] = i
            continue
        first, second = dataset.wave_of(j), dataset.wave_of(i)
        if first.shape[0] + gap.shape[0] + second.shape[0] > window:
            by_language[utt.language] = i
            continue
        tokens = list(dataset.utts[j].text_ids) + list(utt.text_ids)
        onset = (first.shape[0] + gap.shape[0]) / SAMPLE_RATE + speech_onset(second)
        prompt = bundle.specials.prompt(utt.language, bundle.config.data.task)
        pairs.append((np.concatenate([first, gap, second]), tokens, len(dataset.utts[j].text_ids),
                      onset, prompt))  # fmt: skip
    if not pairs:
        raise UserError(
            f"{data_config(data).path} split {split!r}: no two utterances of one language fit "
            "one window together; give a split with more (or shorter) utterances"
        )
    errors = []
    for wave, tokens, k, onset, prompt in pairs:
        heads, error = head_errors(
            bundle.model, bundle.features, [(wave, tokens, k, onset)], prompt,
            eot=bundle.specials.eot, device=bundle.device,
        )  # fmt: skip
        errors.append(error[0])
    table = np.stack(errors)
    chosen = qualifying_heads(heads, table, max_error)
    median = np.median(table, axis=0)
    record = {
        "heads": [list(h) for h in chosen],
        "limit_s": max_error,
        "data": str(data_config(data).path),
        "split": split,
        "joins": len(pairs),
        "median_error_s": {
            f"{a},{b}": round(float(e), 4) for (a, b), e in zip(heads, median, strict=True)
        },
    }
    if not chosen:
        log.warning(
            "no head's median error is within %.2f s (the best: %.3f s): word timestamps keep "
            "the default heads",
            max_error,
            float(median.min()),
        )
    update_bundle_manifest(Path(bundle_dir), {ALIGNMENT_HEADS_KEY: record})
    return record
