"""Long-form evaluation: held-out utterances joined into minute-long recordings, transcribed the
way ``asrforge transcribe`` transcribes long audio, scored as ``longform_wer``/``longform_cer``.

A model can score well clip by clip and still lose whole sentences on long audio (it learned to
stop early, or forgot timestamps). ``eval.longform_items`` recordings are built once per run
from the evaluation split: each joins utterances of one language, drawn without replacement in
an order fixed by the seed, with 0.2-0.8 s of silence between them, until it reaches a length
drawn between ``eval.longform_min_seconds`` and ``eval.longform_max_seconds``. They are decoded
with :func:`asrforge.model.longform.transcribe_long` (timestamp-driven windows when the model
has timestamp tokens, else cuts at silences) and scored on normalized text, corpus-level.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from asrforge.config import DataConfig
from asrforge.data.audio import SAMPLE_RATE, decode_audio
from asrforge.data.prepare import prepare_split
from asrforge.data.sources import data_config, read_split
from asrforge.errors import UserError
from asrforge.evaluation.batch_size import eval_batch_size
from asrforge.evaluation.evaluate import error_rate_or_nan
from asrforge.evaluation.records import utterance_record
from asrforge.io.atomic import atomic_write_text
from asrforge.model.decoding import DecodeOptions
from asrforge.model.frames import window_seconds
from asrforge.model.longform import Segment, choose_chunking, transcribe_long
from asrforge.model.vad import Chunk, decode_chunks, speech_chunks
from asrforge.run_layout import RunLayout
from asrforge.text import cer, normalize, wer

log = logging.getLogger(__name__)

GAP_SECONDS = (0.2, 0.8)
"""Silence between joined utterances: drawn uniformly in this range (seconds)."""


@dataclass
class LongItem:
    """One long recording made of held-out utterances."""

    uid: str
    language: str
    wave: np.ndarray
    """(n_samples,) float32 at 16 kHz."""
    text: str
    """The utterances' transcripts, joined by spaces."""
    parts: list[str]
    """The utterance ids, in order."""

    @property
    def seconds(self) -> float:
        return self.wave.shape[0] / SAMPLE_RATE


def build_items(
    utts: Sequence,
    load_wave: Callable[[object], np.ndarray],
    *,
    count: int,
    min_seconds: float,
    max_seconds: float,
    seed: int,
) -> list[LongItem]:
    """Join utterances into ``count`` long recordings (see the module docstring).

    Args:
        utts: utterances with ``uid``, ``language`` and ``text`` (:class:`asrforge.data.prepare.Utterance`).
        load_wave: utterance -> (n_samples,) float32 at 16 kHz.
        count: recordings to make; fewer when the split runs out (logged).
        min_seconds, max_seconds: each recording's target length is drawn between the two.
        seed: fixes the languages, utterance order, gaps and lengths.

    Returns:
        The recordings; one shorter than its target when its language ran out (logged).
    """
    rng = np.random.default_rng(seed)
    by_lang: dict[str, list] = defaultdict(list)
    for u in utts:
        by_lang[u.language].append(u)
    pools = {
        lang: [us[i] for i in rng.permutation(len(us))] for lang, us in sorted(by_lang.items())
    }
    items: list[LongItem] = []
    langs = list(pools)
    for k in range(count):
        available = [lang for lang in langs if pools[lang]]
        if not available:
            log.warning(
                "long-form evaluation: the split has audio for %d recordings, not %d", k, count
            )
            break
        lang = available[k % len(available)]  # languages take turns
        target = rng.uniform(min_seconds, max_seconds)
        pieces, texts, parts, seconds = [], [], [], 0.0
        while pools[lang] and seconds < target:
            u = pools[lang].pop()
            wave = load_wave(u)
            if pieces:
                gap = np.zeros(round(rng.uniform(*GAP_SECONDS) * SAMPLE_RATE), np.float32)
                pieces.append(gap)
                seconds += gap.shape[0] / SAMPLE_RATE
            pieces.append(wave.astype(np.float32))
            seconds += wave.shape[0] / SAMPLE_RATE
            texts.append(u.text.strip())
            parts.append(u.uid)
        if seconds < min_seconds:
            log.warning(
                "long-form evaluation: recording %d is %.1f s, short of %.0f s (the split's %s "
                "audio ran out)",
                k,
                seconds,
                min_seconds,
                lang,
            )
        items.append(
            LongItem(f"longform-{k:03d}", lang, np.concatenate(pieces), " ".join(texts), parts)
        )
    return items


def score(records: list[dict]) -> dict:
    """``longform_wer``, ``longform_cer`` (normalized text, corpus-level over recordings),
    ``longform_n`` and ``longform_seconds`` of prediction records (``ref``, ``hyp``,
    ``language``, ``seconds``)."""
    if not records:
        return {"longform_n": 0, "longform_wer": math.nan, "longform_cer": math.nan}
    refs = [normalize(r["ref"], r["language"]) for r in records]
    hyps = [normalize(r["hyp"], r["language"]) for r in records]
    return {
        "longform_wer": error_rate_or_nan(wer, refs, hyps),
        "longform_cer": error_rate_or_nan(cer, refs, hyps),
        "longform_n": len(records),
        "longform_seconds": round(sum(r["seconds"] for r in records), 2),
    }


@torch.no_grad()
def evaluate_items(
    model,
    tokenizer,
    extractor,
    specials,
    items: list[LongItem],
    *,
    task: str = "transcribe",
    chunking: str | None = None,
    max_new_tokens: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    options: DecodeOptions = DecodeOptions(),
    vad: bool = False,
) -> tuple[dict, list[dict]]:
    """Transcribe the long recordings and score them.

    ``options``: how each window is decoded, e.g. with the temperature fallback
    ``transcribe --temperature-fallback`` decodes with (:mod:`asrforge.model.fallback`). ``vad``:
    decode only the speech Silero VAD finds, as ``transcribe --vad`` does
    (:mod:`asrforge.model.vad`).

    Every module's train/eval mode is put back as it was (a frozen encoder stays in eval mode).

    Returns:
        ``(metrics, records)``: :func:`score` plus ``longform_chunking``; one record per
        recording (``uid``, ``language``, ``seconds``, ``parts``, ``ref``, ``hyp``,
        ``segments``).
    """
    mode, why = choose_chunking(tokenizer, model.config, chunking)
    seconds = window_seconds(model.config)
    waves = [it.wave for it in items]
    chunks = [speech_chunks(w, SAMPLE_RATE, seconds) if vad else [Chunk.whole(w)] for w in waves]
    prompts = [specials.prompt(it.language, task) for it in items]

    def decode(audios: list[np.ndarray], owners: list[int]) -> list[list[Segment]]:
        return transcribe_long(
            model,
            tokenizer,
            extractor,
            audios,
            [prompts[i] for i in owners],
            chunking=mode,
            no_timestamps=specials.no_timestamps,
            eot=specials.eot,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            device=device,
            autocast=autocast,
            options=options,
        )

    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        segments = decode_chunks(waves, chunks, decode)
    finally:
        for m, training in modes.items():
            m.training = training
    records = [
        {
            "uid": it.uid,
            "language": it.language,
            "seconds": round(it.seconds, 3),
            "parts": it.parts,
            "ref": it.text,
            "hyp": " ".join(s.text for s in segs),
            "segments": [s.to_dict() for s in segs],
        }
        for it, segs in zip(items, segments, strict=True)
    ]
    log.info("long-form evaluation: chunking %s (%s)", mode, why)
    return {**score(records), "longform_chunking": mode}, records


# ---------------------------------------------------------------------------------------------
# In the training loop

_ITEMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The long recordings of each run, by its evaluation set: built at the first evaluation."""


def run_longform_eval(run, model, ema, *, step: int, autocast=None) -> dict:
    """The training loop's long-form evaluation (``eval.longform_items`` > 0), with the EMA
    weights when there are some, as the short-clip evaluation: every process decodes its share
    of the recordings, the main process writes ``eval/longform-step-NNNNNN.jsonl``.

    Returns:
        The metrics to merge into the evaluation's (empty when off).
    """
    cfg = run.cfg
    if not cfg.eval.longform_items:
        return {}
    if run.eval_set not in _ITEMS:
        split = run.eval_set.split

        def load_wave(u) -> np.ndarray:
            audio = split[u.row]["audio"]
            return decode_audio(audio.get("bytes") or audio.get("path"))

        _ITEMS[run.eval_set] = build_items(
            run.eval_set.utts,
            load_wave,
            count=cfg.eval.longform_items,
            min_seconds=cfg.eval.longform_min_seconds,
            max_seconds=cfg.eval.longform_max_seconds,
            seed=cfg.seed,
        )
        log.info(
            "long-form evaluation: %d recordings, %.0f s in all",
            len(_ITEMS[run.eval_set]),
            sum(it.seconds for it in _ITEMS[run.eval_set]),
        )
    items = _ITEMS[run.eval_set]
    acc = run.accelerator
    mine = items[acc.process_index :: acc.num_processes]
    bundle = run.model_bundle
    swap = ema.swapped_in(model) if ema is not None else contextlib.nullcontext()
    with swap:
        metrics, records = evaluate_items(
            model,
            bundle.tokenizer,
            bundle.features,
            bundle.specials,
            mine,
            task=cfg.data.task,
            chunking=cfg.eval.longform_chunking,
            max_new_tokens=cfg.eval.max_new_tokens,
            batch_size=eval_batch_size(cfg.data.eval_batch_size, cfg.data.batch_size),
            device=acc.device,
            autocast=autocast,
            vad=cfg.eval.longform_vad,
        )
    if acc.num_processes > 1:
        from accelerate.utils import gather_object

        records = gather_object(records)
        metrics = {**score(records), "longform_chunking": metrics["longform_chunking"]}
    log.info(
        "eval step %d: long-form wer %.4f cer %.4f (%d recordings, %.0f s, chunking %s)",
        step,
        metrics["longform_wer"],
        metrics["longform_cer"],
        metrics["longform_n"],
        metrics.get("longform_seconds", 0.0),
        metrics["longform_chunking"],
    )
    if acc.is_main_process:
        write_records(RunLayout(run.output_dir).longform_record(step), records, metrics)
    return metrics


def write_records(path: Path, records: list[dict], metrics: dict) -> None:
    """One line per recording (:func:`~asrforge.evaluation.records.utterance_record`), then a
    summary line (as ``eval/step-NNNNNN.jsonl``)."""

    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(utterance_record(r), ensure_ascii=False) for r in records]
    lines.append(json.dumps({"summary": True, **metrics}, ensure_ascii=False))
    atomic_write_text(path, "\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------
# ``asrforge evaluate``


def evaluate_split_longform(
    bundle,
    data: Path | DataConfig,
    split: str,
    *,
    count: int,
    min_seconds: float,
    max_seconds: float,
    seed: int,
    batch_size: int,
    max_new_tokens: int,
    chunking: str | None = None,
    languages: list[str] | None = None,
    options: DecodeOptions = DecodeOptions(),
    vad: bool = False,
) -> tuple[dict, list[dict]]:
    """Long-form evaluation of a :class:`~asrforge.bundle.Bundle` on one split of a data set (a
    path or a data section, as :func:`~asrforge.evaluation.evaluate.evaluate_split` takes it),
    with the utterances the short-clip evaluation uses.

    Raises:
        UserError: the split is missing or has no usable utterance.
    """

    source = data_config(data)
    ds = read_split(source, split)
    dcfg = source.model_copy(
        update={"eval_split": split, "languages": languages, "task": bundle.config.data.task}
    )
    utts, _report = prepare_split(
        ds,
        split,
        cfg=dcfg,
        tokenizer=bundle.tokenizer,
        specials=bundle.specials,
        max_target_positions=bundle.model.config.max_target_positions,
        max_seconds=bundle.window_seconds,
        training=False,
    )
    if not utts:
        raise UserError(f"{source.path} split {split!r}: no usable utterances")

    def load_wave(u) -> np.ndarray:
        audio = ds[u.row]["audio"]
        return decode_audio(audio.get("bytes") or audio.get("path"))

    items = build_items(
        utts, load_wave, count=count, min_seconds=min_seconds, max_seconds=max_seconds, seed=seed
    )
    return evaluate_items(
        bundle.model,
        bundle.tokenizer,
        bundle.features,
        bundle.specials,
        items,
        task=bundle.config.data.task,
        chunking=chunking,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        device=bundle.device,
        options=options,
        vad=vad,
    )
