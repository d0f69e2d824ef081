"""What a run writes beside its checkpoints (main process only): the evaluation records
``eval/step-NNNNNN.jsonl``, the training split's ``skipped-<split>.json`` and ``config.yaml``."""

from __future__ import annotations

import json
from pathlib import Path

from asrforge.config import TrainConfig
from asrforge.data.rules import SkipReport
from asrforge.io.atomic import atomic_write_text
from asrforge.run_layout import RunLayout
from asrforge.train.events import Decision


def scalars(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, int | float | bool | None)}


def write_config(out: Path, cfg: TrainConfig) -> None:
    """``config.yaml``: the resolved config of the run."""
    atomic_write_text(RunLayout(out).config, cfg.to_yaml())


def write_eval_records(
    out: Path, step: int, metrics: dict, preds: list[dict], decision: Decision, selected_on
) -> None:
    """``eval/step-NNNNNN.jsonl``: one line per utterance, then a summary line."""
    lines = [json.dumps(p, ensure_ascii=False) for p in preds]
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
