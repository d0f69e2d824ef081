"""``asrforge lm tune``: choose a bundle's LM weight ``alpha`` and word bonus ``beta`` by grid
search on a development split, and record them in the bundle's manifest.

Each batch of the split is encoded once and decoded by beam search at every grid point (a line
of progress after each batch); the point with the lowest corpus error rate (WER, or CER when a
language is scored by characters) wins, ties going to the smaller ``alpha`` and ``|beta|``.
``(0, 0)`` is always on the grid: it is beam search without the LM (bit for bit), so the
recorded weights never score worse on that split than no LM. The manifest is rewritten in one
atomic rename and sealed afresh (:func:`asrforge.bundle.write.update_bundle_manifest`): the
bundle is never half-updated.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from asrforge.bundle.load import LM_WEIGHTS_KEY, load_bundle
from asrforge.bundle.options import fusion
from asrforge.bundle.write import update_bundle_manifest
from asrforge.config import DataConfig
from asrforge.data.sources import data_config
from asrforge.errors import UserError
from asrforge.evaluation.evaluate import prompt_length, split_loader
from asrforge.model.beam import beam_decode
from asrforge.model.decoding import DecodeOptions
from asrforge.model.encoding import encoder_states
from asrforge.text import normalize, primary_metric
from asrforge.text.metrics import EditCounts, corpus_error_rate, edit_counts

log = logging.getLogger(__name__)

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
BETAS = (0.0, 0.5, 1.0, 2.0)


def grid(alphas: Sequence[float], betas: Sequence[float]) -> list[tuple[float, float]]:
    """Every ``(alpha, beta)``, ``(0, 0)`` (no LM) included.

    Raises:
        UserError: an empty list, a negative or non-finite alpha, or a non-finite beta.
    """
    problems = []
    if not alphas or not betas:
        problems.append("--alphas/--betas: give at least one value each")
    problems += [
        f"--alphas: {a:g} must be a finite number >= 0"
        for a in alphas
        if not (math.isfinite(a) and a >= 0)
    ]
    problems += [f"--betas: {b:g} must be a finite number" for b in betas if not math.isfinite(b)]
    if problems:
        raise UserError("; ".join(problems))
    points = {(0.0, 0.0)} | {(float(a), float(b)) for a in alphas for b in betas}
    return sorted(points)


@torch.no_grad()
def decode_grid(
    bundle,
    loader,
    points,
    *,
    beam_size: int,
    max_new_tokens: int,
    total: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """``hyps`` (``{(alpha, beta): [hypothesis text, ...]}``), the ``refs``, each point's
    decoding ``seconds`` and its error rate (``table``: ``{(alpha, beta): (metric, value)}``),
    in one pass over the batches: each batch is read and encoded once and decoded by
    beam search at every grid point (re-reading and re-encoding the split for each point took
    longer than the points' beam searches on tiny.en). After each batch ``progress`` gets one
    line: the utterances done (of ``total``), the best point so far and its error rate
    beside no LM's, and the seconds since the start."""
    model, eot = bundle.model, bundle.specials.eot
    hyps: dict[tuple[float, float], list[str]] = {p: [] for p in points}
    seconds = dict.fromkeys(points, 0.0)
    # running edit counts by metric: a progress line and the table score each batch once
    totals = {p: dict.fromkeys(UNITS, EditCounts(0, 0, 0, 0)) for p in points}
    refs: list[tuple[str, str]] = []
    start = time.perf_counter()
    for batch in loader:
        if not batch.get("size"):
            continue
        prompts = batch["decoder_input_ids"][:, : prompt_length(batch["labels"])]
        enc = encoder_states(model, batch["input_features"].to(bundle.device))
        prompts = prompts.to(bundle.device)
        seen = list(zip(batch["language"], batch["text"], strict=True))
        refs += seen
        normalized = [normalize(text, lang) for lang, text in seen]
        for point in points:
            began = time.perf_counter()
            options = DecodeOptions(beam_size=beam_size, fusion=fusion(bundle, *point))
            seqs, _ = beam_decode(model, enc, prompts, eot, max_new_tokens, options)
            texts = [bundle.tokenizer.decode(s, skip_special_tokens=True).strip() for s in seqs]
            hyps[point] += texts
            seconds[point] += time.perf_counter() - began
            for ref, (lang, _), text in zip(normalized, seen, texts, strict=True):
                hyp = normalize(text, lang)
                for metric, unit in UNITS.items():
                    counted = totals[point][metric]
                    totals[point][metric] = EditCounts(
                        *(a + b for a, b in zip(counted, edit_counts(ref, hyp, unit), strict=True))
                    )
        if progress is not None:
            table = _table(refs, totals)
            (alpha, beta), (metric, value) = best_point(table)
            of = f"/{total}" if total else ""
            progress(
                f"asrforge: lm tune: {len(refs)}{of} utterances at {len(points)} grid points: "
                f"best so far alpha {alpha:g}, beta {beta:g}: {metric} {100 * value:.2f} % "
                f"(no LM {100 * table[(0.0, 0.0)][1]:.2f} %) ({time.perf_counter() - start:.1f} s)"
            )
    return {"hyps": hyps, "refs": refs, "seconds": seconds, "table": _table(refs, totals)}


UNITS = {"wer": "word", "cer": "char"}
"""Each error rate and the unit it counts."""


def _table(refs: list[tuple[str, str]], totals: dict) -> dict:
    """``{(alpha, beta): (metric, value)}`` from each point's running edit counts: corpus WER
    on normalized text, or CER when a language of ``refs`` is scored by characters
    (:func:`asrforge.text.primary_metric`)."""
    metric = "wer" if all(primary_metric(lang) == "wer" for lang, _ in refs) else "cer"
    return {p: (metric, corpus_error_rate([counts[metric]])) for p, counts in totals.items()}


def best_point(table: dict) -> tuple[tuple[float, float], tuple[str, float]]:
    """The grid point of ``table`` (``{(alpha, beta): (metric, value)}``) with the lowest error
    rate, ties going to the smaller ``alpha`` and ``|beta|``, and its entry."""
    point = min(table, key=lambda p: (table[p][1], p[0], abs(p[1])))
    return point, table[point]


def tune(
    bundle_dir: Path,
    data: Path | DataConfig,
    split: str = "validation",
    *,
    alphas: Sequence[float] = ALPHAS,
    betas: Sequence[float] = BETAS,
    beam_size: int = 5,
    batch_size: int = 8,
    max_samples: int | None = None,
    max_new_tokens: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Grid-search the bundle's LM weights on ``split`` and record the best in its manifest.

    Args:
        data: a path or a data section, as
            :func:`~asrforge.evaluation.evaluate.evaluate_split` takes it.
        progress: gets one line after each batch (:func:`decode_grid`).

    Returns:
        What was recorded (``alpha``, ``beta``, the metric, its value, the value without the
        LM, the split, the beam size, the utterance count) plus ``table``: every grid point's
        value, and ``seconds``: every grid point's beam-search seconds, both keyed
        ``"alpha,beta"``.

    Raises:
        UserError: the bundle has no LM, a bad grid, or a bad split; CheckpointError: the bundle
            does not verify.
    """
    points = grid(alphas, betas)
    if beam_size < 2:
        # Greedy decoding never reads the LM, so weights tuned there would mean nothing.
        raise UserError(
            f"--beam-size: must be >= 2 (the LM is fused in beam search only), got {beam_size}"
        )
    bundle = load_bundle(bundle_dir)
    if bundle.lm is None:
        raise UserError(f"{bundle_dir}: has no n-gram LM to tune (export it with --lm)")
    loader, n, _report = split_loader(
        bundle, data, split, batch_size=batch_size, max_samples=max_samples
    )
    cap = max_new_tokens or bundle.config.eval.max_new_tokens
    where = data_config(data).path
    log.info("tuning on %d utterances of %s (%s): %d grid points", n, where, split, len(points))
    decoded = decode_grid(
        bundle, loader, points, beam_size=beam_size, max_new_tokens=cap, total=n,
        progress=progress,
    )  # fmt: skip
    table = decoded["table"]
    metric = table[(0.0, 0.0)][0]
    (alpha, beta), _ = best_point(table)
    record = {
        "alpha": alpha,
        "beta": beta,
        "metric": metric,
        "value": table[(alpha, beta)][1],
        "without_lm": table[(0.0, 0.0)][1],
        "data": str(where),
        "split": split,
        "beam_size": beam_size,
        "n": len(decoded["refs"]),
    }
    update_bundle_manifest(Path(bundle_dir), {LM_WEIGHTS_KEY: record})
    return {
        **record,
        "table": {f"{a:g},{b:g}": v for (a, b), (_, v) in table.items()},
        "seconds": {f"{a:g},{b:g}": s for (a, b), s in decoded["seconds"].items()},
    }
