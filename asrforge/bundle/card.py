"""A bundle's ``README.md``: a model card as the Hugging Face Hub reads it
(``huggingface_hub.ModelCard``): YAML metadata (``base_model``, ``language``, ``datasets``,
``license`` taken from the base model's card at the commit the run trained from,
``pipeline_tag``, a ``model-index`` with WER and CER
per language on the evaluation split) and a body saying where the model came from (the Hub
commits the run read), how it was selected, what the forgetting guard measured, and how to use
it with transformers and asrforge.

The figures are the ones the run recorded for the exported step (``eval/step-NNNNNN.jsonl``),
as percentages. Averaged weights were not evaluated as such: their card names the steps averaged
and those steps' figures, and claims no result.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from asrforge.checkpoint.manifest import read_manifest
from asrforge.config import TrainConfig
from asrforge.hub import cached_model_dir, hub_ref
from asrforge.run_layout import RunLayout

CARD_FILE = "README.md"


def model_card(
    ckpt: Path, cfg: TrainConfig, languages: list[str], repo_id: str | None, source: dict
) -> str:
    """The card of a bundle exported from the training checkpoint ``ckpt`` of a run with
    ``cfg``, for ``languages``, whose ``inference_config.json`` records ``source``; ``repo_id``
    names it in the usage examples (its Hub id when it is pushed)."""
    manifest = read_manifest(ckpt)
    commits = manifest.get("hub_commits") or {}
    summary = {} if "averaged_steps" in source else _eval_summary(ckpt, manifest.get("step"))
    meta: dict[str, Any] = {
        "library_name": "transformers",
        "pipeline_tag": "automatic-speech-recognition",
        "tags": ["whisper", "asrforge"],
        "language": list(languages),
    }
    base = cfg.model.pretrained
    if base is not None and hub_ref(base) is not None:
        meta["base_model"] = hub_ref(base).repo_id
    if (license_ := _base_license(base, commits.get("model.pretrained"))) is not None:
        meta["license"] = license_
    data_id = commits.get("data.path", {}).get("id")
    if data_id is not None:
        meta["datasets"] = [data_id]
    results = _results(summary, cfg, commits.get("data.path", {}))
    if results:
        name = (repo_id or "model").split("/")[-1]
        meta["model-index"] = [{"name": name, "results": results}]
    header = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    return f"---\n{header}---\n\n" + _body(cfg, manifest, source, summary, commits, repo_id)


def _eval_summary(ckpt: Path, step: int | None) -> dict:
    """The summary line of the run's evaluation record of ``step`` ({} when there is none)."""
    if step is None:
        return {}
    record = RunLayout(ckpt.parent.parent).eval_record(step)
    if not record.is_file():
        return {}
    lines = record.read_text(encoding="utf-8").strip().splitlines()
    last = json.loads(lines[-1]) if lines else {}
    return last if last.get("summary") else {}


def _base_license(base: str | None, record: dict | None) -> str | None:
    """The ``license`` of the base model's own card: at the commit the run recorded, read from
    the Hugging Face cache (never asked of the Hub: an export works offline, and a branch that
    moved since must not lend the card another commit's license), or in a local base directory.
    None when that card is not here, or a Hub base has no recorded commit."""
    if record and record.get("commit"):
        directory = cached_model_dir(f"{record['id']}@{record['commit']}", (CARD_FILE,))
    elif base is not None and hub_ref(base) is None:
        directory = Path(base)
    else:
        directory = None
    card = directory / CARD_FILE if directory is not None else None
    if card is None or not card.is_file():
        return None
    match = re.match(
        r"^---\s*\n(.*?)\n---", card.read_text(encoding="utf-8", errors="replace"), re.S
    )
    try:
        header = yaml.safe_load(match.group(1)) if match else None
    except yaml.YAMLError:
        return None
    value = header.get("license") if isinstance(header, dict) else None
    return str(value) if value else None


def _results(summary: dict, cfg: TrainConfig, data: dict) -> list[dict]:
    """``model-index`` results: WER and CER (percent) per language of the evaluation split.
    With several languages each result's ``config`` is its language (huggingface_hub merges
    results of one task, dataset, config and split into one), as for FLEURS or Common Voice,
    whose configurations are languages; the subset read is in the card's text."""
    results = []
    per_language = summary.get("per_language") or {}
    for lang, m in sorted(per_language.items()):
        if m.get("wer") is None:
            continue
        label = data.get("id") or Path(str(cfg.data.path)).name
        dataset = {"name": f"{label} ({lang})", "type": data.get("id") or str(cfg.data.path),
                   "split": cfg.data.eval_split}  # fmt: skip
        config = cfg.data.subset if len(per_language) == 1 else lang
        if config is not None:
            dataset["config"] = config
        if data.get("commit"):
            dataset["revision"] = data["commit"]
        metrics = [{"type": "wer", "name": f"WER ({lang})", "value": _percent(m["wer"])}]
        if m.get("cer") is not None:
            metrics.append({"type": "cer", "name": f"CER ({lang})", "value": _percent(m["cer"])})
        results.append({
            "task": {"type": "automatic-speech-recognition", "name": "Speech Recognition"},
            "dataset": {**dataset, "args": {"language": lang}},
            "metrics": metrics,
        })  # fmt: skip
    return results


def _percent(fraction: float) -> float:
    return round(100 * float(fraction), 4)


def _body(
    cfg: TrainConfig, manifest: dict, source: dict, summary: dict, commits: dict, repo_id
) -> str:
    name = repo_id or "path/to/this/bundle"
    lines = ["# " + (repo_id or "asrforge bundle"), ""]
    base = cfg.model.pretrained
    if base is None:
        lines.append("A Whisper model trained from scratch with asrforge.")
    else:
        commit = commits.get("model.pretrained", {}).get("commit")
        at = f" at commit `{commit}`" if commit else ""
        lines.append(f"Fine-tuned with asrforge from `{base}`{at}.")
    data = commits.get("data.path")
    where = f"`{data['id']}` at commit `{data['commit']}`" if data else f"`{cfg.data.path}`"
    subset = f", subset `{cfg.data.subset}`" if cfg.data.subset else ""
    lines += ["", f"Data: {where}{subset}; evaluated on its `{cfg.data.eval_split}` split.", ""]
    lines += ["## Results", ""]
    if "averaged_steps" in source:
        lines.append(_averaged(source))
    else:
        lines += _results_table(summary)
        policy = cfg.selection.policy
        reason = summary.get("reason")
        lines.append(f"Step {manifest.get('step')}, selected by the `{policy}` selection policy"
                     + (f" ({reason})." if reason else "."))  # fmt: skip
    guard = manifest.get("guard") or {}
    if guard and "averaged_steps" not in source:
        facts = ", ".join(f"{k.removeprefix('guard_')} {v}" for k, v in sorted(guard.items()))
        lines += ["", f"Forgetting guard at this step: {facts}."]
    lines += [
        "",
        "## Usage",
        "",
        "With transformers:",
        "",
        "```python",
        "from transformers import pipeline",
        "",
        f'asr = pipeline("automatic-speech-recognition", model="{name}")',
        'print(asr("audio.wav")["text"])',
        "```",
        "",
        "With asrforge (every file's sha256 verified):",
        "",
        "```python",
        "import asrforge",
        "",
        f'bundle = asrforge.load_bundle("{name}")',
        'print(bundle.transcribe("audio.wav"))',
        "```",
        "",
        f"or `asrforge transcribe {name} audio.wav`.",
        "",
    ]
    return "\n".join(lines)


def _results_table(summary: dict) -> list[str]:
    """The evaluation's WER and CER per language, as percentages, and a blank line."""
    lines = ["| language | WER % | CER % | utterances |", "|---|---|---|---|"]
    for lang, m in sorted((summary.get("per_language") or {}).items()):
        cer = "" if m.get("cer") is None else f"{_percent(m['cer']):g}"
        lines.append(f"| {lang} | {_percent(m['wer']):g} | {cer} | {m.get('n', '')} |")
    return [*lines, ""]


def _averaged(source: dict) -> str:
    """What averaged weights are, with each averaged step's figure, and that the mean itself was
    not evaluated."""
    metric, steps = source.get("average_metric"), source["averaged_steps"]
    values = source.get("averaged_values") or [None] * len(steps)
    named = ", ".join(
        str(step) if value is None else f"{step} ({metric} {value:.4g})"
        for step, value in zip(steps, values, strict=True)
    )
    return (
        f"The mean of the {source.get('averaged_weights')} weights of steps {named}, the "
        f"{len(steps)} best by `{metric}`. The mean itself was not evaluated in the run: "
        "`asrforge evaluate` measures it."
    )
