"""``asrforge demo --multilingual``: a from-scratch tiny Whisper per language (Spanish, English,
Chinese) through the matrix, each selecting its checkpoint with its language group's policy.

How it works: docs/demo.md.
"""

from __future__ import annotations

from asrforge.bundle import bundle_from_checkpoint
from asrforge.errors import UserError
from asrforge.evaluation.evaluate import evaluate_split
from asrforge.matrix.executors import LocalExecutor, parse_devices
from asrforge.matrix.plan import load_matrix
from asrforge.matrix.report import collect
from asrforge.matrix.report import write_report as write_matrix_report
from asrforge.matrix.run import Launcher
from asrforge.recipes.corpus import CorpusSpec, build_corpus
from asrforge.recipes.demo import Progress, counting, pct, resolve_demo_run
from asrforge.recipes.demo_options import MULTI_CONFIG, DemoOptions
from asrforge.selection.groups import resolve_group
from asrforge.text import primary_metric

MULTI_LANGUAGES = ("es", "en", "zh")
"""One of each policy group of configs/demo-multilingual.yaml: by_wer, combined_gate, by_loss."""
MULTI_SIZES = {"train": 200, "validation": 20, "test": 20}
MULTI_QUICK_SIZES = {"train": 12, "validation": 4, "test": 4}
MULTI_QUICK_OVERRIDES = ["train.max_steps=4", "eval.eval_steps=2", "train.log_every=1"]


def run_multilingual(options: DemoOptions) -> int:
    """One from-scratch tiny model per language, through the matrix, each selected by its
    group's policy; then the per-language table on the test split and the HTML report."""
    import yaml

    say = Progress(total_phases=4)
    config, overrides, base, root, data = resolve_demo_run(options, MULTI_CONFIG, MULTI_QUICK_OVERRIDES)
    say(f"asrforge demo --multilingual: a from-scratch tiny Whisper per language ({config})")

    sizes = MULTI_QUICK_SIZES if options.quick else MULTI_SIZES
    say.phase("corpus", f"{', '.join(MULTI_LANGUAGES)} espeak-ng speech, {sizes} per language")
    build_corpus(CorpusSpec(list(MULTI_LANGUAGES), dict(sizes), seed=base.seed), data,
                 workers=options.workers, progress=say)

    say.phase("matrix", f"{len(MULTI_LANGUAGES)} jobs (one per language), root {root}")
    root.mkdir(parents=True, exist_ok=True)
    matrix_file = root / "MATRIX.yaml"
    matrix_file.write_text(
        "# Written by `asrforge demo --multilingual`; run again with `asrforge matrix` on it.\n"
        + yaml.safe_dump({
            "out": str(root), "languages": list(MULTI_LANGUAGES),
            "configs": [{"config_id": "demo-multilingual", "path": str(config)}],
            "overrides": [*overrides, f"data.path={data}"], "retries": 0,
        }, sort_keys=False)
    )
    plan = load_matrix(matrix_file)
    outcome = Launcher(plan, LocalExecutor(parse_devices("cpu:1")), progress_every=5.0).run()
    if outcome.failed or outcome.unfinished:
        raise UserError(f"demo: matrix jobs did not finish: {outcome.failed + outcome.unfinished} "
                        f"(logs under {root / 'logs'})")

    say.phase("test", "each language's selected checkpoint on its held-out test clips")

    jobs = {r.language: r for r in collect(root)}
    rows = []
    for job in plan.jobs:
        bundle = bundle_from_checkpoint(plan.run_dir(job))
        metrics, _, _ = evaluate_split(
            bundle, data, "test", languages=[job.language], batch_size=16,
            max_new_tokens=base.eval.max_new_tokens, progress=counting(f"test {job.language}", say),
        )
        rows.append((job.language, jobs.get(job.language), metrics))

    say.phase("report", "the matrix's HTML report")
    report = root / "report.html"
    write_matrix_report(root, report, title="asrforge demo --multilingual")
    say.end_phase()
    print()
    print(multilingual_table(rows, base))
    print()
    print("A from-scratch tiny model trained for minutes on a few hundred clips: the error rates "
          "show the mechanism, not a useful model. Each language chose its checkpoint with the "
          "policy of its group in selection.groups of " + str(config) + ".")
    print(f"matrix root:  {root}  (runs/<job>/: train.log, metrics.jsonl, checkpoints/)")
    print(f"report:       {report}")
    print(f"TensorBoard:  tensorboard --logdir {root / 'runs'}")
    print(f"took {say.seconds / 60:.1f} min: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in say.phases.items()))
    return 0


def multilingual_table(rows: list, cfg) -> str:
    """Per language: its group and policy, the steps run, the selected step and why, and the
    test WER/CER (``judge by``: CER for unspaced scripts, where WER says little)."""
    groups = cfg.selection.groups
    lines = [f"{'language':<9} {'group':<6} {'policy':<14} {'steps':>5} {'best':>5}  "
             f"{'WER %':>6} {'CER %':>6} {'judge by':>8} {'n':>4}  chosen because"]
    for lang, job, m in rows:
        group = resolve_group(lang, groups) if groups else "-"
        policy = job.policy if job and job.policy else (groups[group].policy if groups else "-")
        lines.append(
            f"{lang:<9} {group:<6} {policy:<14} {job.last_step if job else '-':>5} "
            f"{job.best_step if job else '-':>5}  {pct(m.get('wer'))} {pct(m.get('cer'))} "
            f"{primary_metric(lang).upper():>8} {m.get('n', 0):>4}  "
            f"{(job.chosen_by if job else '') or ''}"
        )
    return "\n".join(lines)

