"""What a run writes beside its checkpoints (main process only): the evaluation records
``eval/step-NNNNNN.jsonl``, the training split's ``skipped-<split>.json``, ``config.yaml`` and
``hub_commits.json`` (the Hub commit of each model and data set read by id)."""

from __future__ import annotations

import json
from pathlib import Path

from asrforge.config import NormalizerConfig, TrainConfig
from asrforge.data.locate import data_ref, locate
from asrforge.data.rules import SkipReport
from asrforge.evaluation.records import prediction_records
from asrforge.hub import hub_ref, resolve_model
from asrforge.io.atomic import atomic_write_text
from asrforge.run_layout import RunLayout
from asrforge.train.events import Decision


def scalars(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, int | float | bool | None)}


def write_config(out: Path, cfg: TrainConfig, commits: dict | None = None) -> None:
    """``config.yaml``: the resolved config of the run; beside it ``hub_commits.json``, the Hub
    commits of ``commits`` (:func:`hub_commits`) when the run read anything by id."""
    layout = RunLayout(out)
    atomic_write_text(layout.config, cfg.to_yaml())
    if commits:
        atomic_write_text(layout.hub_commits, json.dumps(commits, indent=1) + "\n")


def hub_commits(cfg: TrainConfig) -> dict[str, dict]:
    """The config field -> ``{id, revision, commit}`` of each model and data set the run reads
    by Hub id (``model.pretrained``, ``data.path``)."""
    commits = {}
    if hub_ref(cfg.model.pretrained) is not None:
        commits["model.pretrained"] = resolve_model(cfg.model.pretrained).record()
    if data_ref(cfg.data) is not None:
        located = locate(cfg.data, stream=cfg.data.stream.enabled)
        commits["data.path"] = located.resolved.record()
    return commits


def write_eval_records(
    out: Path,
    step: int,
    metrics: dict,
    preds: list[dict],
    decision: Decision,
    selected_on,
    specials,
    normalizer: NormalizerConfig | None,
) -> None:
    """``eval/step-NNNNNN.jsonl``: one line per utterance (its record as ``evaluate
    --predictions`` writes it, :mod:`asrforge.evaluation.records`), then a summary line."""
    records = prediction_records(preds, specials, normalizer)
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    summary = {
        "summary": True,
        "step": step,
        **scalars(metrics),
        "per_language": metrics.get("per_language", {}),
        "dropped_utterances": metrics.get("dropped_utterances", {}),
        "save": decision.save,
        "reason": decision.reason,
        "selected_on": selected_on,
        # how the error rates above were normalized (eval.normalizer)
        "normalizer": metrics.get("normalizer"),
    }
    lines.append(json.dumps(summary, ensure_ascii=False))
    layout = RunLayout(out)
    layout.eval_dir.mkdir(exist_ok=True)
    atomic_write_text(layout.eval_record(step), "\n".join(lines) + "\n")


def write_skip_report(
    out: Path, up_front: SkipReport | None, dropped: dict[str, list[str]], when: str
) -> None:
    """Rewrite ``skipped-<train split>.json``: the up-front skips and the clips dropped in the
    workers so far (``TrainState.dropped``), and log them."""
    if up_front is None or not dropped:
        return
    up_front.with_dropped(dropped).log(out, when)
