"""A bundle's ``README.md``: a model card as the Hugging Face Hub reads it
(``huggingface_hub.ModelCard``): YAML metadata (``base_model``, ``language``, ``datasets``,
``license`` taken from the base model's card at the commit the run trained from,
``pipeline_tag``, a ``model-index`` with WER and CER per language on the rows evaluated) and a
body saying where the model came from (the Hub commits the run read), what was evaluated, how it
was selected, what the forgetting guard measured, and how to use it.

The figures are the ones the run recorded for the exported step (``eval/step-NNNNNN.jsonl``),
as percentages, beside the starting model's (step 0) when the run evaluated it. Averaged weights
were not evaluated as such: their card names the steps averaged and those steps' figures, and
claims no result. Nothing here asks the Hub: the base model's card is read from the cache, and
a local path is named by its last component only (a published card must not carry a home
directory).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from asrforge.checkpoint.manifest import read_manifest
from asrforge.config import TrainConfig
from asrforge.config.yaml_limits import load_front_matter, read_yaml_text
from asrforge.data.sample_rate import SAMPLE_RATE
from asrforge.hub import cached_model_dir, hub_ref
from asrforge.io.small_files import RECORDS_BYTES, parse_json, read_text
from asrforge.run_layout import RunLayout, recorded_selection

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
LOCAL_DATASET = "local"
"""``model-index``'s ``dataset.type`` of data that did not come from the Hub."""


def model_card(
    ckpt: Path,
    cfg: TrainConfig,
    languages: list[str],
    repo_id: str | None,
    source: dict,
    *,
    name: str | None = None,
    extended_vocabulary: bool = False,
) -> str:
    """The card of a bundle exported from the training checkpoint ``ckpt`` of a run with
    ``cfg``, for ``languages``, whose ``inference_config.json`` records ``source``; ``repo_id``
    names it in the usage examples (its Hub id when it is pushed), else ``name`` (the bundle
    directory's); ``extended_vocabulary``: its new tokens come after the timestamp tokens, which
    transformers' ASR pipeline drops."""
    manifest = read_manifest(ckpt)
    commits = manifest.get("hub_commits") or {}
    averaged = "averaged_steps" in source
    run = RunLayout(ckpt.parent.parent)
    step = manifest.get("step")
    summary = {} if averaged else _eval_summary(run, step)
    start = {} if averaged or not step else _eval_summary(run, 0)
    name = (repo_id.split("/")[-1] if repo_id else name) or _default_name(cfg, languages)
    meta: dict[str, Any] = {
        "library_name": "transformers",
        "pipeline_tag": "automatic-speech-recognition",
        "tags": ["whisper", "asrforge", *(["translation"] if _translates(cfg) else [])],
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
        meta["model-index"] = [{"name": name, "results": results}]
    header = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    body = _body(cfg, ckpt, manifest, source, (summary, start), commits,
                 repo_id or name, extended_vocabulary)  # fmt: skip
    return f"---\n{header}---\n\n" + body


def _default_name(cfg: TrainConfig, languages: list[str]) -> str:
    """The base model's name and the languages (``whisper-base-es``), for a card with no
    other name."""
    base = cfg.model.pretrained
    ref = hub_ref(base)
    stem = ref.repo_id.split("/")[-1] if ref is not None else Path(str(base or "whisper")).name
    return "-".join([stem, *languages[:3]])


def _eval_summary(run: RunLayout, step: int | None) -> dict:
    """The summary line of the run's evaluation record of ``step`` ({} when there is none, or
    with a warning when the record is no regular file, too large or not a summary)."""
    if step is None:
        return {}
    record = run.eval_record(step)
    if not record.is_file():
        return {}
    try:
        lines = read_text(record, RECORDS_BYTES).strip().splitlines()
        last = parse_json(lines[-1]) if lines else {}
        if not isinstance(last, dict) or not isinstance(last.get("per_language", {}), dict):
            raise ValueError(f"its last line {lines[-1]!r:.60} is not a summary object")
    except (OSError, ValueError) as e:
        # The figures are the card's, not the model's: the bundle is written without them.
        log.warning("%s: not a readable evaluation record (%s); the model card has no figures",
                    record, e)  # fmt: skip
        return {}
    return last if last.get("summary") else {}


def _base_license(base: str | None, record: dict | None) -> str | None:
    """The ``license`` of the base model's own card: at the commit the run recorded, read from
    the Hugging Face cache (never asked of the Hub: an export works offline, and a branch that
    moved since must not lend the card another commit's license), or in a local base directory.
    None when that card is not here, or a Hub base has no recorded commit, or it cannot be read
    (no regular file, not UTF-8, a header that is not YAML or beyond
    :mod:`asrforge.config.yaml_limits`' bounds), which is warned of.
    """
    if record and record.get("commit"):
        directory = cached_model_dir(f"{record['id']}@{record['commit']}", (CARD_FILE,))
    elif base is not None and hub_ref(base) is None:
        directory = Path(base)
    else:
        directory = None
    card = directory / CARD_FILE if directory is not None else None
    if card is None or not card.is_file():
        return None
    try:
        header = load_front_matter(read_yaml_text(card))
    except (OSError, ValueError) as e:
        # someone else's card, only lending a license: the export goes on without one
        log.warning("%s: the base model's card, read for its license: %s; the model card "
                    "names no license", card, e)  # fmt: skip
        return None
    value = header.get("license") if isinstance(header, dict) else None
    return str(value) if value else None


def _translates(cfg: TrainConfig) -> bool:
    return cfg.data.task == "translate"


def _data_label(cfg: TrainConfig, data: dict) -> str:
    """The data's Hub id, else the last component of its local path."""
    return data.get("id") or Path(str(cfg.data.path)).name


def _evaluated_split(cfg: TrainConfig) -> str:
    """The split the figures are on, as ``model-index`` names it: a carve's rows are held out of
    the training split."""
    if cfg.data.eval_carve is not None:
        return f"{cfg.data.train_split} (held-out rows, eval_carve.json)"
    return cfg.data.eval_split


def _results(summary: dict, cfg: TrainConfig, data: dict) -> list[dict]:
    """``model-index`` results: WER and CER (percent) per language of the evaluation split.
    With several languages each result's ``config`` is its language (huggingface_hub merges
    results of one task, dataset, config and split into one), as for FLEURS or Common Voice,
    whose configurations are languages; the subset read is in the card's text."""
    results = []
    per_language = summary.get("per_language") or {}
    task = "Speech Translation (into English)" if _translates(cfg) else "Speech Recognition"
    for lang, m in sorted(per_language.items()):
        if m.get("wer") is None:
            continue
        dataset = {
            "name": f"{_data_label(cfg, data)} ({lang})",
            "type": data.get("id") or LOCAL_DATASET,
            "split": _evaluated_split(cfg),
        }
        config = cfg.data.subset if len(per_language) == 1 else lang
        if config is not None:
            dataset["config"] = config
        if data.get("commit"):
            dataset["revision"] = data["commit"]
        metrics = [{"type": "wer", "name": f"WER ({lang})", "value": _percent(m["wer"])}]
        if m.get("cer") is not None:
            metrics.append({"type": "cer", "name": f"CER ({lang})", "value": _percent(m["cer"])})
        results.append({
            "task": {"type": "automatic-speech-recognition", "name": task},
            "dataset": {**dataset, "args": {"language": lang}},
            "metrics": metrics,
        })  # fmt: skip
    return results


def _percent(fraction: float) -> float:
    return round(100 * float(fraction), 4)


def _body(cfg: TrainConfig, ckpt: Path, manifest: dict, source: dict, figures: tuple[dict, dict],
          commits: dict, name: str, extended: bool) -> str:  # fmt: skip
    summary, start = figures
    lines = [f"# {name}", ""]
    base = cfg.model.pretrained
    if base is None:
        lines.append("A Whisper model trained from scratch with asrforge.")
    else:
        commit = commits.get("model.pretrained", {}).get("commit")
        at = f" at commit `{commit}`" if commit else ""
        named = f"`{base}`" if hub_ref(base) is not None else f"a local model `{Path(base).name}`"
        lines.append(f"Fine-tuned with asrforge from {named}{at}.")
    if _translates(cfg):
        lines += ["", "It translates speech into English text (Whisper's `translate` task): the "
                  "figures below score its English output against English references; each "
                  "row's language is the speech's."]  # fmt: skip
    lines += ["", _data_line(cfg, commits.get("data.path"), summary), ""]
    lines += ["## Results", ""]
    if "averaged_steps" in source:
        lines.append(_averaged(source))
    else:
        lines += _results_table(summary, start)
        reason = summary.get("reason")
        lines.append(f"Step {manifest.get('step')}, selected by {_policy(ckpt, cfg)}"
                     + (f" ({reason})." if reason else "."))  # fmt: skip
    guard = manifest.get("guard") or {}
    if guard and "averaged_steps" not in source:
        lines += ["", _guard_text(guard)]
    lines += ["", "## Usage", ""]
    lines += _usage_extended(name) if extended else _usage(name)
    return "\n".join(lines)


def _data_line(cfg: TrainConfig, data: dict | None, summary: dict) -> str:
    """Which data trained the model and exactly which rows the figures are on."""
    if data:
        where = f"`{data['id']}` at commit `{data['commit']}`"
    else:
        where = f"local files (`{Path(str(cfg.data.path)).name}`)"
    subset = f", subset `{cfg.data.subset}`" if cfg.data.subset else ""
    carve = cfg.data.eval_carve
    limit = cfg.data.max_eval_samples
    at_most = f" The run scored at most {limit} of them (`data.max_eval_samples`)." if limit else ""
    if carve is None:
        return f"Data: {where}{subset}; evaluated on its `{cfg.data.eval_split}` split.{at_most}"
    n = f"{summary['n']} " if summary.get("n") is not None else ""
    return (
        f"Data: {where}{subset}. It has no evaluation split: the figures are on {n}rows held "
        f"out of its `{cfg.data.train_split}` split before training (`data.eval_carve`: size "
        f"{carve.size:g}, seed {carve.seed}), never trained on. The run directory's "
        "`eval_carve.json` lists them; `asrforge evaluate MODEL --data DATA --split "
        f"{cfg.data.train_split} --carve RUN/eval_carve.json` scores the same rows.{at_most}"
    )


def _policy(ckpt: Path, cfg: TrainConfig) -> str:
    """The selection policy that decided, as the checkpoint's selection state names it (the
    config's ``auto`` names none)."""
    try:
        decided = recorded_selection(ckpt).get("policy")
    except (OSError, ValueError):
        decided = None
    decided = decided or (cfg.selection.policy if cfg.selection.policy != "auto" else None)
    if decided is None:
        return "the selection policy"
    how = ", the one the language's group takes" if cfg.selection.policy == "auto" else ""
    return f"the `{decided}` selection policy{how}"


def _guard_text(guard: dict) -> str:
    """The forgetting guard's figures at the exported step, in sentences."""

    def pct(key: str) -> str:
        value = guard.get(key)
        return "?" if value is None else f"{_percent(value):g} %"

    drift = guard.get("guard_drift")
    what = ("drift (WER against the starting model's own transcripts)" if drift
            else "WER on the guard set")  # fmt: skip
    tolerance = guard.get("guard_tolerance")
    allowed = "" if tolerance is None else f" (allowed: up to {_percent(tolerance):g} points more)"
    text = (f"Forgetting guard: its {what} is {pct('guard_wer')}, against {pct('guard_start')} "
            f"for the starting model{allowed}")  # fmt: skip
    within = guard.get("guard_within")
    text += "." if within is None else f": {'within' if within else 'outside'} the guard."
    if guard.get("guard_lid") is not None:
        lid_tol = guard.get("guard_lid_tolerance")
        lid_allowed = (
            "" if lid_tol is None else f" (allowed: up to {_percent(lid_tol):g} points less)"
        )
        text += (f" Language identification on the guard set is right {pct('guard_lid')} of "
                 f"the time, against {pct('guard_lid_start')} for the starting model"
                 f"{lid_allowed}.")  # fmt: skip
    return text


def _usage(name: str) -> list[str]:
    return [
        "With transformers:",
        "",
        "```python",
        "from transformers import pipeline",
        "",
        f'asr = pipeline("automatic-speech-recognition", model="{name}")',
        'print(asr("audio.wav")["text"])',
        "```",
        "",
        *_usage_asrforge(name),
    ]


def _usage_extended(name: str) -> list[str]:
    """Usage for an extended vocabulary: asrforge first, and transformers without the pipeline."""
    return [
        *_usage_asrforge(name),
        "This model's vocabulary is extended: its new tokens come after Whisper's timestamp "
        "tokens, and transformers' ASR `pipeline` and its timestamp decoding "
        "(`return_timestamps`, `output_offsets`) read them as timestamps and drop them from the "
        "text. In transformers, decode clips of up to 30 s with `generate` and `batch_decode`:",
        "",
        "```python",
        "from transformers import WhisperForConditionalGeneration, WhisperProcessor",
        "",
        f'processor = WhisperProcessor.from_pretrained("{name}")',
        f'model = WhisperForConditionalGeneration.from_pretrained("{name}")',
        f"# audio: a float array of up to 30 s at {SAMPLE_RATE} Hz",
        f'features = processor(audio, sampling_rate={SAMPLE_RATE}, return_tensors="pt").input_features',
        "print(processor.batch_decode(model.generate(features), skip_special_tokens=True)[0])",
        "```",
        "",
    ]


def _usage_asrforge(name: str) -> list[str]:
    return [
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


def _results_table(summary: dict, start: dict) -> list[str]:
    """The evaluation's WER and CER per language, as percentages, beside the starting model's
    (step 0) when the run evaluated it, and a blank line."""
    before = start.get("per_language") or {}
    head = "| language | WER % | CER % | utterances |"
    if before:
        head += " WER % at start | CER % at start |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for lang, m in sorted((summary.get("per_language") or {}).items()):
        line = f"| {lang} | {_cell(m.get('wer'))} | {_cell(m.get('cer'))} | {m.get('n', '')} |"
        if before:
            b = before.get(lang) or {}
            line += f" {_cell(b.get('wer'))} | {_cell(b.get('cer'))} |"
        lines.append(line)
    if before:
        lines += ["", "The starting model (step 0, before fine-tuning) was evaluated on the same "
                  "rows in the same run."]  # fmt: skip
    return [*lines, ""]


def _cell(value) -> str:
    return "" if value is None else f"{_percent(value):g}"


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
