"""``asrforge align-heads``: from held-out clips, find the decoder heads whose cross-attention
follows the audio (for a model whose alignment heads are unknown: built from scratch,
vocabulary extended), measure how late they place words, and record both in the bundle's
manifest, which word timestamps then use.

Consecutive utterances of a split (same language) are joined with one second of silence into
recordings of at most one window, taken from the split's languages in turn. The start of the
second utterance's speech is known: where it was joined plus its own leading silence
(:func:`asrforge.model.head_timing.speech_onset`). Each head aligns the joined text to the
audio alone, as word timestamps do with the heads together
(:func:`asrforge.model.head_timing.head_offsets`); a head qualifies when its median error of
that start is within ``max_error`` (:data:`~asrforge.model.head_timing.HEAD_ERROR_LIMIT`, 0.2
s, by default). When no head qualifies that is recorded too, and word timestamps keep the
default heads, with a warning.

The heads word timestamps will use then time the same joins' words together, and the median of
how late the second utterance's first word starts (``onset_offset_s``) is the bundle's lag
(``lag_s``), which word timestamps take off every word: cross-attention attends to a word's
sound a little after it begins, by an amount that differs from model to model and head to
head. It is taken as a lag only when it lies between 0 and
:data:`~asrforge.model.head_timing.LAG_LIMIT`: heads that give the pause before an utterance to
its first word place that start early, which says where the pause went, not how late words
come, and then the lag is 0, with a warning. ``keep_heads`` measures the lag alone and keeps
what an earlier search recorded. The manifest is rewritten in one atomic rename and sealed
afresh.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from asrforge.bundle.load import ALIGNMENT_HEADS_KEY, load_bundle
from asrforge.bundle.recognize import non_text_ids
from asrforge.bundle.write import update_bundle_manifest
from asrforge.checkpoint.manifest import read_manifest
from asrforge.config import DataConfig
from asrforge.data.audio import SAMPLE_RATE
from asrforge.data.sources import data_config
from asrforge.errors import UserError
from asrforge.evaluation.evaluate import split_loader
from asrforge.model.alignment import alignment_heads
from asrforge.model.encoding import encode_waves
from asrforge.model.head_timing import (
    HEAD_ERROR_LIMIT,
    LAG_LIMIT,
    head_offsets,
    onset_offsets,
    qualifying_heads,
    speech_onset,
)
from asrforge.text.languages import UNSPACED_LANGUAGES

log = logging.getLogger(__name__)

GAP_SECONDS = 1.0
"""Silence between the two utterances of a join."""
MIN_JOINS = 3
"""Fewest joins a record is made from. The heads and the lag are medians over the joins, and
the median of three or more is one no single join decides: a join whose transcript does not
match its audio set the whole lag of a one-join record, and two joins' median is their mean."""


def find_alignment_heads(
    bundle_dir: Path,
    data: Path | DataConfig,
    split: str = "validation",
    *,
    joins: int = 8,
    max_error: float = HEAD_ERROR_LIMIT,
    keep_heads: bool = False,
) -> dict[str, Any]:
    """Measure every decoder head on ``joins`` joined pairs of ``split``, record the heads
    that qualify (median error within ``max_error`` seconds) in the bundle's manifest, and how
    late they place the second utterance's start together (see the module docstring).

    Args:
        keep_heads: do not search; keep the heads the bundle aligns with and only measure
            their lag.

    Returns:
        What was recorded: ``heads`` (best first; empty when none qualifies), ``lag_s`` and the
        ``onset_offset_s`` it was taken from, the data, split and join count, and unless
        ``keep_heads``, ``limit_s`` and ``median_error_s`` of every head (``"layer,head"``);
        plus ``skipped`` (not recorded): the rows of the split left out, by reason, as
        ``evaluate`` reports them. Fewer joins than ``joins`` are warned about.

    Raises:
        UserError: ``joins`` < :data:`MIN_JOINS`, a bad split, or one with fewer than
            :data:`MIN_JOINS` joins of two utterances of a language that fit one window
            together (then nothing is recorded); CheckpointError: the bundle does not verify.
    """
    if joins < MIN_JOINS:
        raise UserError(
            f"--joins: must be >= {MIN_JOINS} (a median of fewer is decided by one join), "
            f"got {joins}"
        )
    if not max_error > 0:
        raise UserError(f"--max-error: must be > 0 seconds, got {max_error}")
    bundle = load_bundle(bundle_dir)
    loader, n, report = split_loader(bundle, data, split, batch_size=1)
    skipped = {reason: len(ids) for reason, ids in report.skipped.items()}
    dataset = loader.dataset
    window = round(bundle.window_seconds * SAMPLE_RATE)
    gap = np.zeros(round(GAP_SECONDS * SAMPLE_RATE), np.float32)
    # Each language pairs its own utterances, up to ``joins`` of them; the joins measured are
    # then taken from the languages in turn, so a split sorted by language is not one language.
    paired: dict[str, list] = {}
    by_language: dict[str, int] = {}
    for i in range(n):
        utt = dataset.utts[i]
        if len(paired.get(utt.language, ())) == joins:
            continue
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
        paired.setdefault(utt.language, []).append(
            (np.concatenate([first, gap, second]), tokens, len(dataset.utts[j].text_ids), onset,
             prompt, utt.language)
        )  # fmt: skip
    pairs = in_turn(paired, joins)
    where = f"{data_config(data).path} split {split!r}"
    left_out = f" (skipped rows: {skipped})" if skipped else ""
    if len(pairs) < MIN_JOINS:
        raise UserError(
            f"{where}: {len(pairs)} join(s) of two utterances of one language that fit one "
            f"window together, and at least {MIN_JOINS} are needed{left_out}; nothing was "
            "recorded: give a split with more (or shorter) utterances"
        )
    if len(pairs) < joins:
        log.warning(
            "%s: measuring on %d joins, not the %d asked for: no more pairs of utterances of "
            "one language fit one window together%s",
            where, len(pairs), joins, left_out,
        )  # fmt: skip
    earlier = read_manifest(Path(bundle_dir)).get(ALIGNMENT_HEADS_KEY) or {}
    # Each join is encoded once, for the head search and the lag both.
    encodings = [
        encode_waves(bundle.model, bundle.features, [wave], bundle.device, SAMPLE_RATE)
        for wave, *_ in pairs
    ]
    if keep_heads:
        chosen, median = bundle.alignment_heads, None
    else:
        tables = []
        for pair, encoded in zip(pairs, encodings, strict=True):
            wave, tokens, k, onset, prompt, _language = pair
            heads, offsets = head_offsets(
                bundle.model, bundle.features, [(wave, tokens, k, onset)], prompt,
                eot=bundle.specials.eot, device=bundle.device, encoded=[encoded],
            )  # fmt: skip
            tables.append(offsets[0])
        table = np.stack(tables)
        chosen = qualifying_heads(heads, table, max_error)
        median = np.median(np.abs(table), axis=0)
    # Word timestamps fall back to the default heads when none qualifies: their lag is the one.
    timing = chosen or alignment_heads(bundle.model)
    offset = float(np.median([
        onset_offsets(
            bundle.model, bundle.features, [(wave, tokens, k, onset)], prompt, timing,
            eot=bundle.specials.eot, decode=bundle.tokenizer.decode,
            specials=non_text_ids(bundle), unspaced=language in UNSPACED_LANGUAGES,
            device=bundle.device, encoded=[encoded],
        )[0]
        for (wave, tokens, k, onset, prompt, language), encoded in zip(
            pairs, encodings, strict=True
        )
    ]))  # fmt: skip
    record = {
        "heads": [list(h) for h in (timing if chosen is None else chosen)],
        "lag_s": round(offset if 0.0 <= offset <= LAG_LIMIT else 0.0, 4),
        "onset_offset_s": round(offset, 4),
        "data": str(data_config(data).path),
        "split": split,
        "joins": len(pairs),
        "joins_by_language": dict(Counter(language for *_, language in pairs)),
    }
    if median is not None:
        record["limit_s"] = max_error
        record["median_error_s"] = {
            f"{a},{b}": round(float(e), 4) for (a, b), e in zip(heads, median, strict=True)
        }
        if not chosen:
            log.warning(
                "no head's median error is within %.2f s (the best: %.3f s): word timestamps "
                "keep the default heads",
                max_error,
                float(median.min()),
            )
    else:  # the search an earlier run recorded still stands
        record.update({k: earlier[k] for k in ("limit_s", "median_error_s") if k in earlier})
        record["kept"] = True
    if record["lag_s"] != record["onset_offset_s"]:
        log.warning("%s", lag_text(record))
    update_bundle_manifest(Path(bundle_dir), {ALIGNMENT_HEADS_KEY: record})
    return {**record, "skipped": skipped}


def in_turn(groups: dict[str, list], n: int) -> list:
    """Up to ``n`` items taken from ``groups`` in turn (the first of each, then the second of
    each, ...), in the groups' order."""
    out: list = []
    for k in range(max((len(g) for g in groups.values()), default=0)):
        out += [g[k] for g in groups.values() if k < len(g)]
    return out[:n]


def lag_text(record: dict[str, Any]) -> str:
    """What :func:`find_alignment_heads`' ``record`` means for word timestamps, in words."""
    lag, offset = record["lag_s"], record["onset_offset_s"]
    if lag == offset:
        return f"the heads place words {1000 * lag:.0f} ms late; word timestamps take that off"
    side = "early" if offset < 0 else "late"
    return (
        f"the heads place an utterance's start after a pause {abs(1000 * offset):.0f} ms {side}, "
        f"outside 0-{1000 * LAG_LIMIT:.0f} ms: that is where they put the pause, not how late "
        "words come, so word timestamps take no lag off"
    )
