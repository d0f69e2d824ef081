"""Filtering poor transcripts (``data.filter_wer``): each training row scored once by the
starting model (greedy decoding, its WER against the row's transcript, both normalized as
evaluation normalizes them), and the rows above the threshold dropped before training, reported
in ``skipped-<split>.json`` under :data:`REASON`.

The scores are cached by fingerprint (``<cache>/filter/<key>.json``): the prepared split's key
(:func:`~asrforge.data.prepare.prepared_split_key`), the starting weights' sha256, the decoding
cap and the normalizer; a resume, the other ranks and the next run read them instead of
decoding again. Changing the threshold re-filters from the same scores.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from asrforge.config import TrainConfig
from asrforge.data.dataset import Collator, SpeechDataset, eval_batches
from asrforge.data.prepare import UtteranceTable, prepared_split_key
from asrforge.data.rules import SkipReport, UtteranceRules
from asrforge.evaluation.batch_size import eval_batch_size
from asrforge.evaluation.evaluate import evaluate
from asrforge.io.atomic import atomic_write_text
from asrforge.io.small_files import RECORDS_BYTES, read_json
from asrforge.text.metrics import wer
from asrforge.text.normalizers import normalize

log = logging.getLogger("asrforge.train")

REASON = "transcript far from the starting model's (data.filter_wer)"
"""The skip report's reason for a filtered row."""


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 of a model's weights, by name in order."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def score_key(cfg: TrainConfig, split, rules: UtteranceRules, model) -> str | None:
    """The scores' cache key, or None when the split has no fingerprint."""
    prepared = prepared_split_key(split, cfg.data, rules)
    if prepared is None:
        return None
    parts = {
        "prepared": prepared,
        "weights": weights_sha256(model),
        "max_new_tokens": cfg.eval.max_new_tokens,
        "normalizer": cfg.eval.normalizer.model_dump(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def score_rows(
    model, dataset: SpeechDataset, *, cfg: TrainConfig, tokenizer, eot: int, device
) -> dict[str, float]:
    """Each utterance's WER (the starting model's greedy transcript against its own), by id;
    clips that fail to decode are left out (training drops them as it meets them)."""
    batch_size = eval_batch_size(
        cfg.data.eval_batch_size, cfg.data.batch_size, model, device,
        max_new_tokens=cfg.eval.max_new_tokens,
    )  # fmt: skip
    loader = DataLoader(
        dataset,
        batch_sampler=eval_batches(dataset.utts, batch_size),
        collate_fn=Collator(pad_id=eot),
        num_workers=0,
    )
    _, preds = evaluate(model, loader, tokenizer=tokenizer, eot=eot,
                        max_new_tokens=cfg.eval.max_new_tokens, device=device)  # fmt: skip
    norm = cfg.eval.normalizer
    return {
        p["uid"]: wer(normalize(p["ref"], p["language"], norm), normalize(p["hyp"], p["language"], norm))
        for p in preds
    }  # fmt: skip


def filter_transcripts(
    cfg: TrainConfig,
    cache_root: Path,
    dataset: SpeechDataset,
    report: SkipReport,
    *,
    model,
    tokenizer,
    eot: int,
    device,
) -> UtteranceTable:
    """The training utterances whose starting-model WER is at most ``data.filter_wer``; the
    others are added to ``report`` under :data:`REASON`."""
    utts: UtteranceTable = dataset.utts
    key = score_key(cfg, dataset.split, utts.rules, model)
    path = Path(cache_root) / "filter" / f"{key}.json" if key is not None else None
    scores = None
    if path is not None and path.is_file():
        try:
            scores = read_json(path, RECORDS_BYTES, error=ValueError)
            log.info("data.filter_wer: the starting model's scores read from %s", path)
        except (OSError, ValueError) as e:
            log.warning("data.filter_wer: %s unusable (%s): scoring again", path, e)
    if scores is None:
        log.info(
            "data.filter_wer: scoring %d training utterances with the starting model", len(utts)
        )
        scores = score_rows(model, dataset, cfg=cfg, tokenizer=tokenizer, eot=eot, device=device)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(scores))
    threshold = cfg.data.filter_wer
    uids = utts.uids()
    keep = np.array([scores.get(uid, 0.0) <= threshold for uid in uids], dtype=bool)
    for uid in (u for u, k in zip(uids, keep.tolist(), strict=True) if not k):
        report.add(REASON, uid)
    log.info(
        "data.filter_wer: %d of %d training utterances kept (WER against the starting model's "
        "transcript at most %g)",
        int(keep.sum()),
        len(uids),
        threshold,
    )
    return utts.subset(keep)
