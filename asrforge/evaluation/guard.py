"""The forgetting guard's measurement: how well the model still transcribes speech it already
handled before fine-tuning (``eval.guard``).

How it measures: docs/guard.md, "The guard's measurement (`evaluation/guard.py`)".
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from asrforge.checkpoint.average import interpolate_weights
from asrforge.data.guard_set import GuardWindow
from asrforge.data.rules import not_english
from asrforge.errors import UserError
from asrforge.evaluation.batch_size import eval_batch_size
from asrforge.evaluation.guard_items import GuardItem, load_guard_items
from asrforge.evaluation.records import utterance_record
from asrforge.io.atomic import atomic_write_text
from asrforge.model.decoding import codes_of_tokens, detect_languages, greedy_decode
from asrforge.model.dtypes import is_full_precision, precision_dtype
from asrforge.model.encoding import encode_waves
from asrforge.model.longform import EncodedWindows, choose_chunking, transcribe_long
from asrforge.run_layout import TRAIN_STATE_FILE, RunLayout, recorded_selection
from asrforge.selection.groups import run_language
from asrforge.selection.guard_gate import GuardGate, largest_share_within, within
from asrforge.text import error_rates, normalize, primary_metric, wer
from asrforge.text.languages import resolve_language

"""``eval.guard.precision`` -> the autocast dtype (fp32: no autocast)."""

log = logging.getLogger("asrforge.train")


class Guard:
    """Transcribes the guard set and scores it (see the module docstring).

    Args:
        items: from :func:`load_guard_items`.
        mode: ``auto``, ``wer`` or ``drift`` (``eval.guard.mode``).
        features: the log-mel extractor of the model.
        tokenizer: decodes generated ids.
        prompt: ``prompt(language) -> ids``, the forced decoder prefix.
        eot: end-of-text id.
        batch_size: windows per decoding batch.
        max_new_tokens: cap per window.
        language_ids: a multilingual model's language tokens (code -> id), to measure language
            identification on the items whose source gave their language; None: not measured.
        sot: the ``<|startoftranscript|>`` id (with ``language_ids``).
        precision: ``fp32``, ``bf16`` or ``fp16`` (``eval.guard.precision``): every
            measurement autocasts to it, or runs in fp32.
        normalizer: how transcripts are normalized before scoring (``eval.normalizer``).
        decode: ``prompt`` or ``transcribe`` (``eval.guard.decode``).
        detect: with ``transcribe``, a multilingual model's language tokens (code -> id) to
            detect each item's language from; None: each item in its own (English-only).
        no_timestamps: the ``<|notimestamps|>`` id (with ``transcribe``).
    """

    def __init__(
        self,
        items: Sequence[GuardItem],
        *,
        mode: str,
        features,
        tokenizer,
        prompt: Callable[[str], list[int]],
        eot: int,
        batch_size: int,
        max_new_tokens: int,
        language_ids: Mapping[str, int] | None = None,
        sot: int | None = None,
        precision: str = "fp32",
        normalizer=None,
        decode: str = "prompt",
        detect: Mapping[str, int] | None = None,
        no_timestamps: int | None = None,
    ):
        if decode == "transcribe" and (no_timestamps is None or (detect and sot is None)):
            raise ValueError("decode transcribe needs no_timestamps, and sot to detect with")
        self.items = list(items)
        self.decode = decode
        self.detect = dict(detect or {})
        self.no_timestamps = no_timestamps
        self.precision = precision
        self.normalizer = normalizer
        self.language_ids = dict(language_ids or {})
        self.sot = sot
        self.lid_items = [
            k
            for k, i in enumerate(self.items)
            if sot is not None and i.language_given and i.language in self.language_ids
        ]
        """Indices of the items whose language identification is measured (none: not measured)."""
        self.last_detected: list[int | None] = []
        has_refs = all(i.reference for i in self.items)
        self.kind = "wer" if mode == "wer" or (mode == "auto" and has_refs) else "drift"
        self.metric = guard_metric([i.language for i in self.items])
        languages = sorted({i.language for i in self.items})
        self.languages = languages if len(languages) > 1 else []
        """The languages judged each on its own (none: the guard holds one language)."""
        self.features, self.tokenizer, self.prompt, self.eot = features, tokenizer, prompt, eot
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens

    def _autocast(self, device) -> contextlib.AbstractContextManager:
        """The guard's own precision, whatever the caller autocasts in (fp32: autocast off)."""
        kind = torch.device(device).type
        if is_full_precision(self.precision):
            return torch.autocast(kind, enabled=False)
        return torch.autocast(kind, dtype=precision_dtype(self.precision))

    @torch.no_grad()
    def transcribe(self, model, *, device) -> list[str]:
        """The model's greedy transcript of each item in the guard's precision (model left in
        the mode it was in)."""
        was_training = model.training
        model.eval()
        texts: list[str] = []
        detected: list[int | None] = []
        try:
            for start in range(0, len(self.items), self.batch_size):
                chunk = self.items[start : start + self.batch_size]
                with self._autocast(device):
                    enc = encode_waves(model, self.features, [i.wave for i in chunk], device)
                    found = self._detect(model, enc, self.language_ids) if self.lid_items else []
                    detected += found
                    if self.decode == "transcribe":
                        same = found and self.detect == self.language_ids
                        texts += self._transcribe(model, chunk, enc, found if same else None,
                                                  device=device)  # fmt: skip
                        continue
                    prompts = [self.prompt(i.language) for i in chunk]
                    ids = torch.tensor(prompts, device=device)
                    seqs, _ = greedy_decode(model, enc, ids, self.eot, self.max_new_tokens)
                texts += [self.tokenizer.decode(s, skip_special_tokens=True).strip() for s in seqs]
        finally:
            model.train(was_training)
        self.last_detected = detected
        return texts

    def _transcribe(
        self, model, chunk: Sequence[GuardItem], enc: torch.Tensor, found: list[int] | None, *,
        device,
    ) -> list[str]:  # fmt: skip
        """Each item's text as ``asrforge transcribe`` decodes it: the language detected (or
        the item's own, English-only), timestamps on, from the windows' encodings ``enc``;
        ``found``: the language tokens already detected among :attr:`detect`, if any."""
        languages = [i.language for i in chunk]
        if self.detect:
            code_of = codes_of_tokens(self.detect)
            found = found or self._detect(model, enc, self.detect)
            languages = [code_of[t] for t in found]
        encoded = EncodedWindows(len(chunk))
        for item, window in zip(chunk, enc, strict=True):
            encoded.add(item.wave, window)
        segments = transcribe_long(
            model, self.tokenizer, self.features, [i.wave for i in chunk],
            [self.prompt(lang) for lang in languages],
            chunking=choose_chunking(self.tokenizer, model.config, None)[0],
            no_timestamps=self.no_timestamps, eot=self.eot, max_new_tokens=self.max_new_tokens,
            batch_size=len(chunk), device=device, encoded=encoded,
        )  # fmt: skip
        return [" ".join(s.text for s in segs).strip() for segs in segments]

    def _detect(self, model, enc: torch.Tensor, language_ids: Mapping[str, int]) -> list[int]:
        """The language token each window's decoder ranks first among ``language_ids``."""
        return detect_languages(model, enc, self.sot, language_ids.values())

    def lid_accuracy(self) -> float | None:
        """The share of the measured items whose detected language token (in the last
        :meth:`transcribe`) is their language's (None: not measured)."""
        if not self.lid_items or not self.last_detected:
            return None
        right = sum(
            self.last_detected[k] == self.language_ids[self.items[k].language]
            for k in self.lid_items
        )
        return right / len(self.lid_items)

    def score(self, hyps: Sequence[str], gate: GuardGate) -> float:
        """The error rate (:attr:`metric`) of ``hyps`` against the references (``wer``) or the
        start's transcripts (``drift``), on normalized text."""
        refs = self._references(gate.start_transcripts)
        languages = [i.language for i in self.items]
        return _wer(refs, list(hyps), languages, self.metric, self.normalizer)

    def score_by_language(
        self, hyps: Sequence[str], start_transcripts: Mapping[str, str]
    ) -> dict[str, tuple[float, str]]:
        """Each of :attr:`languages`' ``(error rate, metric)`` on its own items, by the metric
        its evaluation uses (CER for unspaced scripts); {} for a guard of one language."""
        refs = self._references(start_transcripts)
        figures = {}
        for language in self.languages:
            mine = [k for k, i in enumerate(self.items) if i.language == language]
            metric = guard_metric([language])
            value = _wer(
                [refs[k] for k in mine],
                [hyps[k] for k in mine],
                [language] * len(mine),
                metric,
                self.normalizer,
            )
            figures[language] = (value, metric)
        return figures

    def _references(self, start_transcripts: Mapping[str, str]) -> list[str]:
        if self.kind == "wer":
            return [i.reference or "" for i in self.items]
        return [start_transcripts.get(i.id, "") for i in self.items]

    def measure_start(self, model, gate: GuardGate, *, device) -> dict:
        """Transcribe with the starting model and record the start in ``gate``. Returns the
        guard's metrics at step 0 (see :meth:`measure`)."""
        hyps = self.transcribe(model, device=device)
        transcripts = {i.id: h for i, h in zip(self.items, hyps, strict=True)}
        start = self.score(hyps, gate) if self.kind == "wer" else 0.0
        lid = self.lid_accuracy()
        by_language = self.score_by_language(hyps, transcripts)
        language_starts = {language: value for language, (value, _) in by_language.items()}
        gate.set_start(
            start, self.kind, transcripts, lid, language_starts, self.precision, self.decode
        )
        log.info(
            "forgetting guard: %d item(s) in %s, %s; starting model %s %.4f (tolerance %g)",
            len(self.items),
            self.precision,
            f"{self.metric.upper()} against references"
            if self.kind == "wer"
            else f"drift ({self.metric.upper()}) against the starting model's transcripts",
            self.metric if self.kind == "wer" else "drift",
            start,
            gate.tolerance,
        )
        if lid is not None:
            log.info(
                "forgetting guard: language identification on %d item(s); starting model "
                "accuracy %.4f (tolerance %s)",
                len(self.lid_items),
                lid,
                "off" if gate.lid_tolerance is None else f"{gate.lid_tolerance:g}",
            )
        if by_language:
            log.info(
                "forgetting guard: each language judged on its own: %s", _starts_text(by_language)
            )
        self.last_hyps = hyps
        return self.metrics(start, gate, lid, by_language)

    def measure(self, model, gate: GuardGate, *, device) -> dict:
        """The guard's metrics for ``model`` now: ``guard_wer`` (the value the selector judges),
        ``guard_start``, ``guard_tolerance``, ``guard_within`` (bool), ``guard_drift`` (bool: the
        value is drift, not WER against references) and ``guard_n``."""
        if gate.kind is not None and gate.kind != self.kind:
            raise UserError(
                f"eval.guard: the run started with a {gate.kind} guard, this config "
                f"measures {self.kind}; resume with the same eval.guard"
            )
        if gate.precision is not None and gate.precision != self.precision:
            raise UserError(
                f"eval.guard.precision: the guard's start was measured in {gate.precision}, "
                f"this config measures in {self.precision}; measure it as it started"
            )
        if (gate.decode or "prompt") != self.decode:
            raise UserError(
                f"eval.guard.decode: the guard's start was decoded as {gate.decode or 'prompt'}, "
                f"this config decodes as {self.decode}; decode it as it started"
            )
        hyps = self.transcribe(model, device=device)
        self.last_hyps = hyps
        by_language = self.score_by_language(hyps, gate.start_transcripts)
        return self.metrics(self.score(hyps, gate), gate, self.lid_accuracy(), by_language)

    def metrics(
        self,
        value: float,
        gate: GuardGate,
        lid: float | None = None,
        by_language: Mapping[str, tuple[float, str]] | None = None,
    ) -> dict:
        """See :meth:`measure`; with ``lid`` (the language-identification accuracy) also
        ``guard_lid``, ``guard_lid_start`` and ``guard_lid_tolerance``; with ``by_language``
        (a guard of several languages) also ``guard_languages``, each language's ``value``,
        ``start``, ``metric`` and ``within``. ``guard_within`` needs every one within its
        tolerance."""
        start = gate.start if gate.start is not None else value
        figures = {
            "guard_wer": value,
            "guard_start": start,
            "guard_tolerance": gate.tolerance,
            "guard_within": gate.within_tolerance(value, start)[0],
            "guard_drift": self.kind == "drift",
            "guard_metric": self.metric,
            "guard_n": len(self.items),
        }
        if by_language and gate.language_starts:
            figures["guard_languages"] = {
                language: {
                    "value": v,
                    "start": gate.language_starts.get(language, v),
                    "metric": metric,
                    "within": language not in gate.language_starts
                    or gate.check_language(language, v, metric)[0],
                }
                for language, (v, metric) in by_language.items()
            }
            figures["guard_within"] = figures["guard_within"] and all(
                f["within"] for f in figures["guard_languages"].values()
            )
        if lid is None or gate.lid_start is None:
            return figures
        figures.update(
            guard_lid=lid, guard_lid_start=gate.lid_start, guard_lid_tolerance=gate.lid_tolerance
        )
        if gate.judges_lid:
            figures["guard_within"] = figures["guard_within"] and gate.check_lid(lid)[0]
        return figures

    def write_records(self, out_dir: Path, step: int, gate: GuardGate) -> None:
        """``eval/guard-step-NNNNNN.jsonl``: each item's transcript now (and the start's or
        reference it is scored against)."""
        hyps = getattr(self, "last_hyps", None)
        if hyps is None:
            return
        lines = []
        code_of = {i: c for c, i in reversed(self.language_ids.items())}
        measured = set(self.lid_items) if len(self.last_detected) == len(self.items) else set()
        for k, (item, hyp) in enumerate(zip(self.items, hyps, strict=True)):
            against = item.reference if self.kind == "wer" else gate.start_transcripts.get(item.id)
            prediction = {"uid": item.id, "language": item.language, "ref": against, "hyp": hyp,
                          "kind": self.kind, "metric": self.metric}  # fmt: skip
            record = utterance_record(prediction, self.normalizer)
            # the language token the model detected (only where language-ID is measured)
            if k in measured:
                record["detected"] = code_of[self.last_detected[k]]
            lines.append(json.dumps(record, ensure_ascii=False))
        layout = RunLayout(out_dir)
        layout.eval_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(layout.guard_record(step), "\n".join(lines) + "\n")


def measure_interpolations(
    guard: Guard,
    gate: GuardGate,
    model,
    start: Mapping[str, torch.Tensor],
    finetuned: Mapping[str, torch.Tensor],
    shares: Sequence[float],
    *,
    device,
) -> tuple[float | None, list[tuple[float, dict]]]:
    """The largest share of the fine-tuned weights, interpolated with the starting ones, whose
    guard stays within ``gate``'s tolerance, and the ``(share, guard metrics)`` pairs measured
    (:func:`asrforge.selection.guard_gate.largest_share_within`). ``model`` is loaded with each candidate
    in turn (left with the last one measured)."""

    def measure(share: float) -> float:
        model.load_state_dict(interpolate_weights(start, finetuned, share), strict=False)
        model.tie_weights()
        metrics = guard.measure(model, gate, device=device)
        log.info("forgetting guard with %g of the fine-tuned weights:%s", share, log_text(metrics))
        return metrics

    return largest_share_within(measure, shares, gate)


def recorded_gate(ckpt: Path, tolerance: float) -> GuardGate:
    """The guard's start as ``ckpt``'s selection state recorded it (:func:`recorded_selection`),
    with ``tolerance``.

    Raises:
        UserError: the checkpoint holds no guard start (trained without ``eval.guard``).
    """
    try:
        recorded = recorded_selection(ckpt).get("guard") or {}
    except (OSError, ValueError) as e:
        raise UserError(f"{ckpt}: no readable {TRAIN_STATE_FILE} ({e})") from None
    if not recorded.get("kind"):
        raise UserError(
            f"{ckpt}: holds no forgetting guard's start (trained without eval.guard): there is "
            "no guard to stay within"
        )
    gate = GuardGate(tolerance)
    gate.load_state_dict(recorded)
    return gate


def recorded_language(out_dir: Path) -> str | None:
    """The language most of the guard's items were transcribed in at step 0, as the run's
    ``eval/guard-step-000000.jsonl`` records it (None: no record)."""
    path = RunLayout(out_dir).guard_record(0)
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason})") from e
    counts: Counter = Counter()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: line {number} is not JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise UserError(f"{path}: line {number} is not a JSON object")
        counts[record.get("language")] += 1
    counts.pop(None, None)
    return counts.most_common(1)[0][0] if counts else None


def guard_metric(languages: Sequence[str]) -> str:
    """``"cer"`` when every guard language is judged by CER in evaluation (unspaced scripts),
    else ``"wer"``."""
    metrics = {primary_metric(lang) for lang in languages}
    return "cer" if metrics == {"cer"} else "wer"


def _wer(refs: list[str], hyps: list[str], languages: list[str], metric: str = "wer",
         normalizer=None) -> float:  # fmt: skip
    r = [normalize(x, lang, normalizer) for x, lang in zip(refs, languages, strict=True)]
    h = [normalize(x, lang, normalizer) for x, lang in zip(hyps, languages, strict=True)]
    # As the evaluation does, CER counts characters and ignores the spaces between phrases.
    if metric == "cer":
        return float(error_rates(r, h, languages[0], normalized=True)["cer"])
    # Without reference words the rate is 0.0 when nothing is said either, else inf.
    return float(wer(r, h))


def guard_language(cfg, train_languages: Sequence[str]) -> str:
    """The language the guard is transcribed in: ``eval.guard.language``, else the run's
    (``selection.language``, the first of ``data.languages``, the training split's most
    frequent)."""
    guard = cfg.eval.guard
    language = (guard.language if guard is not None else None) or run_language(
        cfg, Counter(train_languages)
    )[0]
    return resolve_language(language, strict=False)


def log_text(metrics: dict) -> str:
    """The guard's part of the evaluation log line ("" without a guard)."""
    if "guard_wer" not in metrics:
        return ""
    metric = metrics.get("guard_metric", "wer")
    kind = f"drift ({metric})" if metrics["guard_drift"] else metric
    # The pooled figure's own verdict: a language or the language ID may refuse alone.
    pooled = within(metrics["guard_wer"], metrics["guard_start"], metrics["guard_tolerance"])
    verdict = "within" if pooled else "OUTSIDE"
    lid = ""
    if "guard_lid" in metrics:
        lid = (
            f" language-ID accuracy {metrics['guard_lid']:.4f} (start "
            f"{metrics['guard_lid_start']:.4f})"
        )
    languages = ""
    if "guard_languages" in metrics:
        languages = "; by language: " + ", ".join(
            f"{language} {f['value']:.4f} (start {f['start']:.4f}"
            + ("" if f["within"] else ", OUTSIDE")
            + ")"
            for language, f in metrics["guard_languages"].items()
        )
    refused_by = [
        language
        for language, f in (metrics.get("guard_languages") or {}).items()
        if not f["within"]
    ]
    if pooled and not metrics["guard_within"]:
        lid_outside = "language ID" if "guard_lid" in metrics and not refused_by else ""
        languages += f"; OUTSIDE by {', '.join(refused_by) or lid_outside or 'another figure'}"
    return (
        f" guard {kind} {metrics['guard_wer']:.4f} (start {metrics['guard_start']:.4f}, "
        f"{verdict} tolerance {metrics['guard_tolerance']:g}){lid}{languages}"
    )


def _starts_text(by_language: Mapping[str, tuple[float, str]]) -> str:
    return ", ".join(
        f"{lang} {metric} {value:.4f}" for lang, (value, metric) in by_language.items()
    )


def build_guard(cfg, bundle, *, language: str, window_seconds: float) -> Guard | None:
    """The run's guard from ``cfg.eval.guard`` (None without one).

    Args:
        cfg: the run's ``TrainConfig``.
        bundle: the run's ``BuiltModel`` (features, tokenizer, special tokens).
        language: the language to transcribe in (:func:`guard_language`).
        window_seconds: the model's window.
    """
    gcfg = cfg.eval.guard
    if gcfg is None:
        return None
    items = load_guard_items(gcfg, language, window_seconds, cfg.data.cache_dir)
    task = cfg.data.task
    specials = bundle.specials
    check_guard_languages(items, specials.multilingual, gcfg.language)
    language_ids = specials.languages if specials.multilingual else None
    if gcfg.lid_tolerance is not None:
        _log_lid_skipped(items, language_ids)
    return Guard(
        items,
        mode=gcfg.mode,
        features=bundle.features,
        tokenizer=bundle.tokenizer,
        prompt=lambda code: bundle.specials.prompt(code, task),
        eot=bundle.specials.eot,
        batch_size=eval_batch_size(cfg.data.eval_batch_size, cfg.data.batch_size),
        max_new_tokens=gcfg.max_new_tokens,
        language_ids=language_ids if gcfg.lid_tolerance is not None else None,
        sot=specials.sot,
        precision=gcfg.precision,
        normalizer=cfg.eval.normalizer,
        decode=gcfg.decode,
        detect=language_ids,
        no_timestamps=specials.no_timestamps,
    )


def check_guard_languages(
    items: Sequence[GuardItem], multilingual: bool, stated: str | None = None
) -> None:
    """Refuse guard items in a language other than English under an English-only model, the
    language given by their source or by ``stated`` (``eval.guard.language``), as
    its training data in one is refused (:func:`asrforge.data.rules.check_english_only`): its
    prompt has no language slot, so the guard would score English transcripts of that speech.

    Raises:
        UserError: naming each language, its item count and the ways out.
    """
    # an item that took the run's language for want of its own is English to such a model, as a
    # row without a language is (data/rules.py: row_language)
    given = Counter(i.language for i in items if i.language_given or stated)
    if multilingual or not (found := not_english(given, unit="item")):
        return
    raise UserError(
        f"eval.guard: English-only model: its prompt has no language slot, so it cannot be "
        f"guarded on {found}. Give the guard English speech (eval.guard.language: en labels "
        "clips without a language), or start from a multilingual Whisper (model.pretrained)"
    )


def _log_lid_skipped(items: Sequence[GuardItem], language_ids: Mapping[str, int] | None) -> None:
    """Say once why the guard does not measure language identification, where it does not."""
    if not language_ids:
        log.info("forgetting guard: the model is English-only: language identification is "
                 "not measured")  # fmt: skip
        return
    skipped = [i for i in items if not i.language_given or i.language not in language_ids]
    if skipped:
        log.info(
            "forgetting guard: %d of %d item(s) have no language of their own (audio files, "
            "rows without one) or one the model has no token for: their language "
            "identification is not measured",
            len(skipped),
            len(items),
        )


def guard_transcripts(
    bundle, guard_cfg, window_seconds: float, batch_size: int, max_new_tokens: int
) -> tuple[list[str], list[str]]:
    """``(item ids, transcripts)`` of the guard set by ``bundle``, windows as the training
    run's guard cuts them."""
    items = load_guard_items(guard_cfg, "en", window_seconds)
    texts = bundle_transcripts(bundle, items, batch_size, max_new_tokens, decode=guard_cfg.decode)
    return [i.id for i in items], texts


def attach_model_references(bundle, windows: Sequence[GuardWindow], batch_size: int,
                            max_new_tokens: int) -> None:  # fmt: skip
    """Give each recording of a guard set without a reference the starting model's transcript
    as its reference (``asrforge guard build --model``; those ``--references`` gave keep theirs).

    Raises:
        UserError: a recording the model cannot give a reference (longer than its window, or
            an empty transcript), naming them: with references on only some recordings the
            guard would measure drift under ``mode: auto`` and be refused under ``mode: wer``.
    """
    windows = [w for w in windows if w.text is None]
    if bundle.specials.multilingual and any(w.language is None for w in windows):
        raise UserError("--model is multilingual: give the clips' --language to "
                        "transcribe them in")  # fmt: skip
    # a clip longer than the model's window would be cut by the guard, and has no one reference
    fit = [w for w in windows if w.seconds <= bundle.window_seconds]
    items = [GuardItem(w.id, w.wave, None, w.language or "en") for w in fit]
    texts = bundle_transcripts(bundle, items, batch_size, max_new_tokens)
    for w, text in zip(fit, texts, strict=True):
        w.text = text.strip() or None
    missing = [w for w in windows if w.text is None]
    if missing:
        named = "; ".join(
            f"{w.id} ({w.seconds:.1f} s: {', '.join(c.path.name for c in w.clips)})"
            for w in missing[:10]
        ) + (f"; and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise UserError(
            f"--model gave no reference to {len(missing)} of {len(windows)} recordings (longer "
            f"than the model's {bundle.window_seconds:g} s window, or an empty transcript): "
            f"{named}; split or remove those clips, or build without --model for a guard "
            "that measures drift"
        )


def bundle_transcripts(bundle, items: Sequence[GuardItem], batch_size: int,
                       max_new_tokens: int, *, decode: str = "prompt") -> list[str]:  # fmt: skip
    """The greedy transcript of each item by ``bundle`` (an :class:`asrforge.bundle.Bundle`),
    decoded as the training run's guard decodes (``decode``: ``eval.guard.decode``)."""
    specials = bundle.specials
    guard = Guard(
        items,
        mode="drift",
        features=bundle.features,
        tokenizer=bundle.tokenizer,
        prompt=lambda code: specials.prompt(code, bundle.config.data.task),
        eot=specials.eot,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        decode=decode,
        detect=bundle.language_ids if specials.multilingual else None,
        sot=specials.sot,
        no_timestamps=specials.no_timestamps,
    )
    return guard.transcribe(bundle.model, device=bundle.device)
