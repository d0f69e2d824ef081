"""Evaluation: teacher-forced loss and greedy (or beam search) decoding from one encoder pass per
batch.

``evaluate()`` returns corpus metrics (``loss``, ``wer``, ``cer``, ``n``, rep-trap counts and a
per-language breakdown) and one prediction record per utterance. WER and CER are computed on
``asrforge.text.normalize``-d strings (Whisper's English normalizer for English, a basic one
elsewhere); ``wer_raw`` and ``cer_raw`` are on the strings as decoded.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from asrforge.config import DataConfig, NormalizerConfig
from asrforge.data.carve import held_out_rows
from asrforge.data.dataset import IGNORE, Collator, SpeechDataset, dropped_by_reason, eval_batches
from asrforge.data.prepare import prepare_split
from asrforge.data.rules import language_filter, no_usable_clips
from asrforge.data.sources import data_config, read_split
from asrforge.model.beam import beam_decode
from asrforge.model.decoding import DecodeOptions, Suppression, decoder_states, greedy_decode
from asrforge.model.encoding import encoder_states
from asrforge.text import cer, normalize, primary_metric, repetition_flags, summarize_flags, wer

"""A run directory's folder of evaluation records (``step-NNNNNN.jsonl``, long-form, guard)."""

log = logging.getLogger(__name__)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over positions whose label is not ``IGNORE``.

    Args:
        logits: (batch, seq, vocab); labels: (batch, seq).
    """
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
        ignore_index=IGNORE, reduction=reduction,
    )


@torch.no_grad()
def evaluate(
    model,
    batches: Iterable[dict],
    *,
    tokenizer,
    eot: int,
    max_new_tokens: int = 256,
    device: torch.device | str = "cpu",
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    options: DecodeOptions = DecodeOptions(),
    normalizer: NormalizerConfig | None = None,
) -> tuple[dict, list[dict]]:
    """Evaluate ``model`` on collated batches (see ``asrforge.data.dataset.Collator``).

    Args:
        options: how tokens are picked: beam search (:func:`~asrforge.model.beam.beam_decode`)
            when :attr:`~asrforge.model.decoding.DecodeOptions.searches_beams`, else greedy
            decoding started from the teacher-forced pass's cache.
        normalizer: how transcripts are normalized before WER/CER (``eval.normalizer``);
            ``metrics["normalizer"]`` names it.

    Returns:
        (metrics, predictions). ``metrics`` has ``loss`` (token-weighted mean cross-entropy),
        ``wer``, ``cer``, ``wer_raw``, ``cer_raw``, ``n``, ``rep_trap_count``, ``rep_trap_rate``,
        ``hit_cap_count``, ``per_language`` ({lang: {wer, cer, loss, n, ...}}), and the clips
        the batches dropped (undecodable, NaN/inf or empty audio): ``n_dropped`` and
        ``dropped_utterances`` ({reason: [ids]}), also logged, so a smaller ``n`` is explained.
    """
    was_training = model.training
    model.eval()
    loss_sum, tok_sum = 0.0, 0
    preds: list[dict] = []
    dropped: dict[str, list[str]] = {}
    try:
        for batch in batches:
            for reason, uids in dropped_by_reason(batch).items():
                dropped.setdefault(reason, []).extend(uids)
            if not batch.get("size"):
                continue
            feats = batch["input_features"].to(device)
            dec_in = batch["decoder_input_ids"].to(device)
            # read on the host copy: on a GPU each position read would wait for the device
            prompt_len = prompt_length(batch["labels"])
            labels = batch["labels"].to(device)
            mask = labels != IGNORE
            with autocast() if autocast is not None else contextlib.nullcontext():
                enc = encoder_states(model, feats)
                # The teacher-forced pass fills a KV cache: cropped to the prompt, it starts the
                # greedy decoding, so the encoder's keys/values are projected once per batch.
                cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
                h = decoder_states(model, dec_in, enc, cache)
                # Only label positions are projected, giving (n_label_tokens, vocab).
                logits = model.proj_out(h[mask])
                flat = token_loss(logits, labels[mask], reduction="none")
                if options.searches_beams:  # beams start from the prompt, own caches
                    seqs, hit_cap = beam_decode(
                        model, enc, dec_in[:, :prompt_len], eot, max_new_tokens, options
                    )
                else:
                    # greedy_decode copies the prompt's keys and values into its static cache
                    cache.crop(-(dec_in.shape[1] - prompt_len))
                    # each row's first label position is its last prompt position: the first token
                    first = Suppression.of(model, device).apply(
                        logits[(mask.cumsum(1) == 1)[mask]], 0
                    ).argmax(-1)
                    seqs, hit_cap = greedy_decode(
                        model, enc, dec_in[:, :prompt_len], eot, max_new_tokens, options,
                        cache=cache, first_tokens=first,
                    )
            per_tok = torch.zeros(labels.shape, dtype=flat.dtype, device=flat.device)
            per_tok[mask] = flat
            loss_sum += float(per_tok[mask].sum())
            tok_sum += int(mask.sum())
            utt_loss = (per_tok * mask).sum(1) / mask.sum(1).clamp(min=1)
            for i, ids in enumerate(seqs):
                hyp = tokenizer.decode(ids, skip_special_tokens=True).strip()
                flags = repetition_flags(hyp, n_tokens=len(ids), max_new_tokens=max_new_tokens)
                flags["hit_cap"] = bool(flags.get("hit_cap")) or hit_cap[i]
                preds.append(
                    {
                        "uid": batch["uid"][i],
                        "language": batch["language"][i],
                        "ref": batch["text"][i],
                        "hyp": hyp,
                        "n_tokens": len(ids),
                        "loss": float(utt_loss[i]),
                        "n_label_tokens": int(mask[i].sum()),
                        **flags,
                    }
                )
    finally:
        model.train(was_training)
    metrics = summarize(preds, normalizer)
    metrics["loss"] = loss_sum / tok_sum if tok_sum else math.nan
    metrics.update(dropped_metrics(dropped, len(preds)))
    return metrics, preds


def dropped_metrics(dropped: dict[str, list[str]], n: int) -> dict:
    """``n_dropped`` and ``dropped_utterances`` of an evaluation of ``n`` clips; logs a warning
    naming them when there are any."""
    count = sum(len(ids) for ids in dropped.values())
    if count:
        ids = [u for group in dropped.values() for u in group]
        shown = ", ".join(ids[:20]) + (f" ... (+{len(ids) - 20})" if len(ids) > 20 else "")
        log.warning(
            "evaluation: dropped %d of %d clips (%s): %s",
            count, count + n, ", ".join(f"{len(v)} {k}" for k, v in dropped.items()), shown,
        )
    return {"n_dropped": count, "dropped_utterances": dropped}


def check_scored(metrics: dict, split: str, where) -> None:
    """Refuse an evaluation that scored no clip: its figures are NaN, not a measurement.

    Args:
        metrics: :func:`evaluate`'s, gathered from every process.
        where: what holds the split (a path).

    Raises:
        UserError: naming the split and the dropped clips by reason.
    """
    if not metrics["n"]:
        dropped = metrics.get("dropped_utterances") or {}
        raise no_usable_clips(split, where, dropped, how="dropped when read")


def prompt_length(labels: torch.Tensor) -> int:
    """Prompt length from the labels: the prompt's positions (all but its last) are IGNORE."""
    first = labels[0]
    n_ignored = 0
    while n_ignored < first.shape[0] and int(first[n_ignored]) == IGNORE:
        n_ignored += 1
    return n_ignored + 1


def summarize(preds: list[dict], normalizer: NormalizerConfig | None = None) -> dict:
    """Corpus metrics over prediction records, overall and per language, normalized as
    ``normalizer`` says (named as ``normalizer``)."""
    scored = [_Scored.of(p, normalizer) for p in preds]
    by_lang: dict[str, list[_Scored]] = defaultdict(list)
    for s in scored:
        by_lang[s.pred["language"]].append(s)
    metrics = _metrics_of(scored)
    metrics["per_language"] = {lang: _metrics_of(ss) for lang, ss in sorted(by_lang.items())}
    metrics["normalizer"] = (normalizer or NormalizerConfig()).name
    langs = list(by_lang)
    # No clip scored is no figure: never a reliable one.
    metrics["wer_reliable"] = bool(langs) and all(primary_metric(lang) == "wer" for lang in langs)
    return metrics


@dataclass(frozen=True)
class _Scored:
    """A prediction record with its reference and hypothesis normalized, once for the overall
    and the per-language figures."""

    pred: dict
    ref: str
    hyp: str

    @classmethod
    def of(cls, p: dict, normalizer: NormalizerConfig | None) -> _Scored:
        lang = p["language"]
        return cls(p, normalize(p["ref"], lang, normalizer), normalize(p["hyp"], lang, normalizer))


def _metrics_of(scored: list[_Scored]) -> dict:
    if not scored:
        return {"n": 0, "wer": math.nan, "cer": math.nan}
    preds = [s.pred for s in scored]
    refs, hyps = [s.ref for s in scored], [s.hyp for s in scored]
    raw_refs = [p["ref"] for p in preds]
    raw_hyps = [p["hyp"] for p in preds]
    n_tok = sum(p.get("n_label_tokens", 0) for p in preds)
    out = {
        "n": len(preds),
        "wer": error_rate_or_nan(wer, refs, hyps),
        "cer": error_rate_or_nan(cer, refs, hyps),
        "wer_raw": error_rate_or_nan(wer, raw_refs, raw_hyps),
        "cer_raw": error_rate_or_nan(cer, raw_refs, raw_hyps),
        "loss": sum(p.get("loss", 0.0) * p.get("n_label_tokens", 0) for p in preds) / n_tok
        if n_tok
        else math.nan,
    }
    out.update(summarize_flags(preds))
    return out


def error_rate_or_nan(metric, refs: list[str], hyps: list[str]) -> float:
    """``metric(refs, hyps)`` (:func:`~asrforge.text.wer` or :func:`~asrforge.text.cer`) as a
    float, NaN where it raises ValueError."""
    try:
        return float(metric(refs, hyps))
    except ValueError:
        return math.nan


def evaluate_split(
    bundle,
    data: Path | DataConfig,
    split: str,
    *,
    batch_size: int,
    max_new_tokens: int,
    languages: list[str] | None = None,
    max_samples: int | None = None,
    progress: Callable[[Iterable[dict], int], Iterable[dict]] | None = None,
    options: DecodeOptions = DecodeOptions(),
    normalizer: NormalizerConfig | None = None,
    carve: Path | None = None,
):
    """:func:`evaluate` of a :class:`~asrforge.bundle.Bundle` (or a checkpoint made into one) on
    one split of a data set, with the training loop's filtering and batch order.

    Args:
        data: a path ``data.path`` takes (a saved ``DatasetDict``, a directory of data files, a
            manifest, a CSV/TSV; see :func:`asrforge.data.sources.read_split`), or a data
            section that also names its columns, language, audio directory.
        languages: keep only these languages' utterances (default: all).
        max_samples: the first N usable utterances only.
        progress: wraps the batches (given them and the utterance count), e.g. to report.
        options, normalizer: see :func:`evaluate`.
        carve: a run's ``eval_carve.json``: only the rows it held out of ``split`` (the
            training split) are scored.

    Returns:
        ``(metrics, predictions, skip_report)``.

    Raises:
        UserError: the split is missing or has no usable utterance (none left by the up-front
            checks, or every clip dropped when read).
    """
    loader, n, report = split_loader(
        bundle, data, split, batch_size=batch_size, languages=languages, max_samples=max_samples,
        carve=carve,
    )  # fmt: skip
    batches = progress(loader, n) if progress is not None else loader
    metrics, preds = evaluate(
        bundle.model, batches, tokenizer=bundle.tokenizer, eot=bundle.specials.eot,
        max_new_tokens=max_new_tokens, device=bundle.device, options=options,
        normalizer=normalizer,
    )
    check_scored(metrics, split, data_config(data).path)
    for reason, uids in metrics["dropped_utterances"].items():  # one report of what was left out
        for uid in uids:
            report.add(reason, uid)
    return metrics, preds, report


def split_loader(
    bundle,
    data: Path | DataConfig,
    split: str,
    *,
    batch_size: int,
    languages: list[str] | None = None,
    max_samples: int | None = None,
    carve: Path | None = None,
):
    """The collated evaluation batches of one split of a data set (a path or a data section, as
    :func:`evaluate_split` takes it), filtered and ordered as the training loop's evaluation has
    them.

    Returns:
        ``(loader, utterance count, skip_report)``.

    Raises:
        UserError: the split is missing or has no usable utterance.
    """
    language_filter(languages, where="languages")  # named by this argument, not data.languages

    source = data_config(data)
    ds = read_split(source, split)
    if carve is not None:
        ds = held_out_rows(ds, carve, where=f"split {split!r} of {source.path}")
    dcfg = source.model_copy(
        update={"eval_split": split, "languages": languages, "task": bundle.config.data.task}
    )
    utts, report = prepare_split(
        ds, split, cfg=dcfg, tokenizer=bundle.tokenizer, specials=bundle.specials,
        max_target_positions=bundle.model.config.max_target_positions,
        max_seconds=bundle.window_seconds,
        training=False,
    )
    utts = utts[:max_samples] if max_samples else utts
    if not utts:
        raise report.nothing_usable(source.path, languages)
    eot = bundle.specials.eot
    loader = DataLoader(
        SpeechDataset(ds, utts, bundle.features, eot),
        batch_sampler=eval_batches(utts, batch_size), collate_fn=Collator(pad_id=eot),
    )
    return loader, len(utts), report
