"""A multilingual speech corpus synthesized with espeak-ng from sentences the project generates.

How it works: docs/data.md, "How the corpus is made (`recipes/corpus.py`)".
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import soundfile as sf

from asrforge.data.audio import SAMPLE_RATE, resample
from asrforge.errors import UserError
from asrforge.recipes.corpus_languages import LANGUAGES_TABLE, REFUSED, TEXT_SOURCES
from asrforge.recipes.sentences import (
    FORTUNES,
    MAX_WORDS,
    MIN_WORDS,
    NATURAL_RULES_VERSION,
    POOL_SIZE,
    RULES_VERSION,
    fortunes_available,
    make_sentences,
    natural_sentences,
    word_pool,
)
from asrforge.text.languages import LANGUAGES, find_language_code

log = logging.getLogger(__name__)

CORPUS_FORMAT = 3
"""Bumped when the same arguments would give a different corpus (a rebuild, not a reuse)."""
SPLITS = ("train", "validation", "test")

# espeak-ng voice variants that sound like a plain voice (no whisper, croak or robot effects);
# Andy, Annie and ed were left out: Whisper tiny.en loops on them far more than on the rest.
VARIANTS = (
    "m1", "m2", "m3", "m4", "m6", "m7", "f1", "f2", "f3", "f5", "klatt", "klatt3", "john",
    "paul", "david", "robert", "steph",
)  # fmt: skip
SPEED_RANGE = (135, 185)
"""espeak-ng ``-s`` (words per minute) of a speaker, drawn uniformly."""
PITCH_RANGE = (30, 70)
"""espeak-ng ``-p`` (0-99) of a speaker, drawn uniformly."""
SPEAKERS = {"train": 8, "validation": 3, "test": 3}
"""Speaker settings per language and split (the variants of each split are its own)."""


@dataclass(frozen=True)
class Speaker:
    """One espeak-ng speaker setting."""

    voice: str
    variant: str
    speed: int
    pitch: int

    @property
    def name(self) -> str:
        return f"{self.voice}+{self.variant}/s{self.speed}/p{self.pitch}"


@dataclass(frozen=True)
class Clip:
    """One utterance to synthesize."""

    id: str
    split: str
    language: str
    text: str
    speaker: Speaker


@dataclass
class CorpusSpec:
    """What to build; two builds with equal specs give the same corpus.

    Args:
        languages: Whisper language codes (see :data:`LANGUAGES_TABLE`).
        sizes: utterances per language in each split, e.g. ``{"train": 150, "validation": 30,
            "test": 40}``.
        seed: seeds sentences and speaker settings.
        min_words, max_words: words per sentence.
        japanese_kana_only: allow ``ja``, with sentences of kana-written words only.
        text: where sentences come from: ``fortunes`` (natural sentences of the language's
            Debian fortunes package; refused when it is not installed), ``wordfreq`` (random
            draws of frequent words), or ``auto``: fortunes for each language whose package is
            installed, wordfreq for the rest (:meth:`sources` says which; the card records it).
    """

    languages: list[str]
    sizes: dict[str, int]
    seed: int = 0
    min_words: int = MIN_WORDS
    max_words: int = MAX_WORDS
    japanese_kana_only: bool = False
    text: str = "auto"
    format: int = field(default=CORPUS_FORMAT)

    def __post_init__(self) -> None:
        problems = []
        codes = []
        for lang in self.languages:
            code = find_language_code(lang)
            if code in REFUSED and not (code == "ja" and self.japanese_kana_only):
                problems.append(f"{lang}: {REFUSED[code]}")
            elif code not in LANGUAGES_TABLE:
                problems.append(
                    f"{lang}: not a language the corpus can speak (needs a wordfreq word list and "
                    f"an espeak-ng voice); choose from {', '.join(sorted(LANGUAGES_TABLE))}"
                )
            elif code in codes:
                problems.append(f"{lang}: given twice")
            else:
                codes.append(code)
        if not self.languages:
            problems.append("no languages given")
        unknown = sorted(set(self.sizes) - set(SPLITS))
        if unknown:
            problems.append(f"unknown split(s) {unknown}; the splits are {', '.join(SPLITS)}")
        for split in SPLITS:
            n = self.sizes.get(split, 0)
            if not isinstance(n, int) or n < 1:
                problems.append(f"{split}: needs at least 1 utterance per language, got {n!r}")
        if not 1 <= self.min_words <= self.max_words:
            problems.append(f"words per sentence: need 1 <= min <= max, got "
                            f"{self.min_words}..{self.max_words}")
        if self.text not in TEXT_SOURCES:
            problems.append(f"text: {self.text!r} is not one of {', '.join(TEXT_SOURCES)}")
        elif self.text == "fortunes":
            problems += [f"{c}: no natural sentences (no Debian fortunes package for it); use "
                         f"--text wordfreq or auto" for c in codes if c not in FORTUNES]
        if problems:
            raise UserError("corpus: " + "; ".join(problems))
        self.languages = codes
        self.sizes = {s: int(self.sizes[s]) for s in SPLITS}

    def to_dict(self) -> dict:
        return asdict(self)

    def sources(self) -> dict[str, str]:
        """Where each language's sentences come from: ``fortunes`` or ``wordfreq``."""
        if self.text == "auto":
            return {c: "fortunes" if fortunes_available(c) else "wordfreq" for c in self.languages}
        return dict.fromkeys(self.languages, self.text)


# ---------------------------------------------------------------------------------------------
# Planning: sentences and speakers (pure functions of the spec)


def plan_speakers(language: str, seed: int) -> dict[str, list[Speaker]]:
    """Speaker settings per split for ``language``: disjoint variants, speed and pitch drawn
    per speaker. Deterministic for ``(language, seed)``."""
    rng = random.Random(f"asrforge-speakers/{language}/{seed}")
    variants = list(VARIANTS)
    rng.shuffle(variants)
    voices = LANGUAGES_TABLE[language][1]
    out: dict[str, list[Speaker]] = {}
    start = 0
    for split in SPLITS:
        chosen = variants[start : start + SPEAKERS[split]]
        start += SPEAKERS[split]
        out[split] = [
            Speaker(voices[i % len(voices)], v, rng.randint(*SPEED_RANGE), rng.randint(*PITCH_RANGE))
            for i, v in enumerate(chosen)
        ]
    return out


def plan_digest() -> str:
    """A hash of the planning constants: a corpus built under other ones is rebuilt."""
    blob = json.dumps([VARIANTS, SPEED_RANGE, PITCH_RANGE, SPEAKERS, POOL_SIZE, RULES_VERSION,
                       NATURAL_RULES_VERSION, CORPUS_FORMAT])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def plan_corpus(spec: CorpusSpec) -> list[Clip]:
    """Every clip of the corpus: distinct sentences, speakers assigned round-robin per split."""
    clips = []
    sources = spec.sources()
    for lang in spec.languages:
        total = sum(spec.sizes.values())
        if sources[lang] == "fortunes":
            sentences = draw_natural(lang, total, spec)
        else:
            pool = word_pool(LANGUAGES_TABLE[lang][0], kana_only=lang == "ja")
            sentences = make_sentences(pool, total, lang, spec.seed, spec.min_words, spec.max_words)
        speakers = plan_speakers(lang, spec.seed)
        i = 0
        # test and validation draw first: their sentences do not change with the train size
        for split in ("test", "validation", "train"):
            for j in range(spec.sizes[split]):
                clips.append(Clip(f"{lang}-{split}-{j:05d}", split, lang, sentences[i],
                                  speakers[split][j % len(speakers[split])]))
                i += 1
    return clips


def draw_natural(language: str, n: int, spec: CorpusSpec) -> list[str]:
    """``n`` distinct natural sentences of ``language``, in an order shuffled by the seed.

    Raises:
        UserError: the package is missing, or holds fewer than ``n`` speakable sentences.
    """
    pool = natural_sentences(language, spec.min_words, spec.max_words)
    if len(pool) < n:
        raise UserError(
            f"corpus: {language}: the {FORTUNES[language].package} package holds only {len(pool)} "
            f"speakable sentences of {spec.min_words}-{spec.max_words} words, {n} asked; ask "
            f"fewer, allow longer sentences, or use --text wordfreq"
        )
    rng = random.Random(f"asrforge-natural/{language}/{spec.seed}")
    rng.shuffle(pool)
    return pool[:n]


def package_version(package: str) -> str | None:
    """The installed version of a Debian package (None without dpkg or the package)."""
    exe = shutil.which("dpkg-query")
    if exe is None:
        return None
    out = subprocess.run([exe, "-W", "-f=${Version}", package], capture_output=True, text=True,
                         timeout=30)
    return out.stdout.strip() or None if out.returncode == 0 else None


# ---------------------------------------------------------------------------------------------
# Synthesis


@lru_cache(maxsize=1)
def espeak_binary() -> tuple[str, str]:
    """(path, version line) of espeak-ng.

    Raises:
        UserError: espeak-ng is not installed.
    """
    path = shutil.which("espeak-ng")
    if path is None:
        raise UserError(
            "espeak-ng is not installed: `sudo apt-get install espeak-ng` (Debian/Ubuntu), "
            "or `make demo`, which installs it when it may"
        )
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    return path, out.stdout.strip()


@lru_cache(maxsize=1)
def espeak_voices() -> frozenset[str]:
    """The voice names espeak-ng knows (``espeak-ng --voices``, the Language column)."""
    path, _ = espeak_binary()
    out = subprocess.run([path, "--voices"], capture_output=True, text=True, timeout=30).stdout
    return frozenset(line.split()[1] for line in out.splitlines()[1:] if len(line.split()) > 1)


def clip_key(clip: Clip) -> str:
    """Content hash naming a clip's cached audio."""
    _, version = espeak_binary()
    s = clip.speaker
    blob = json.dumps([clip.text, s.voice, s.variant, s.speed, s.pitch, version, SAMPLE_RATE])
    return hashlib.sha256(blob.encode()).hexdigest()


def synthesize_clip(clip: Clip, cache_dir: Path) -> tuple[bytes, float, bool]:
    """16 kHz 16-bit WAV bytes of ``clip``, from the cache or espeak-ng.

    Returns:
        (wav bytes, duration in seconds, whether it came from the cache).
    """
    key = clip_key(clip)
    path = cache_dir / key[:2] / f"{key}.wav"
    if path.is_file():
        data = path.read_bytes()
        info = sf.info(io.BytesIO(data))
        return data, info.frames / info.samplerate, True
    exe, _ = espeak_binary()
    s = clip.speaker
    cmd = [exe, "-v", f"{s.voice}+{s.variant}", "-s", str(s.speed), "-p", str(s.pitch),
           "--stdout", "--stdin"]
    proc = subprocess.run(cmd, input=clip.text.encode(), capture_output=True, timeout=120)
    if proc.returncode != 0 or len(proc.stdout) < 100:
        raise RuntimeError(f"espeak-ng failed on {clip.id} ({' '.join(cmd[1:7])}): "
                           f"{proc.stderr.decode(errors='replace').strip()}")
    wave, sr = sf.read(io.BytesIO(proc.stdout), dtype="float32", always_2d=True)
    wave = resample(wave[:, 0], sr, SAMPLE_RATE)
    buf = io.BytesIO()
    sf.write(buf, np.clip(wave, -1.0, 1.0), SAMPLE_RATE, format="WAV", subtype="PCM_16")
    data = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    # Concurrent builds may race, and both write the same bytes.
    os.replace(tmp, path)
    return data, wave.shape[0] / SAMPLE_RATE, False


# ---------------------------------------------------------------------------------------------
# Building


def build_corpus(
    spec: CorpusSpec,
    out: Path,
    *,
    cache_dir: Path | None = None,
    workers: int | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Build (or reuse) the corpus ``spec`` describes at ``out``.

    A corpus already at ``out`` with the same spec is reused as it is (unless ``force``). The
    Arrow dataset is written beside ``out`` and renamed into place, so ``out`` is a complete
    corpus or the previous one.

    Args:
        spec: languages, sizes, seed.
        out: the corpus directory.
        cache_dir: where synthesized clips are cached; default ``out/.cache``.
        workers: espeak-ng processes at once; default the number of CPUs.
        force: rebuild even when ``out`` holds this spec's corpus (clips still come from cache).
        progress: called with a line of progress every few seconds (default: the log).

    Returns:
        The card (also in ``out/card.json``).

    Raises:
        UserError: espeak-ng is missing, a voice is missing, or ``out`` is not a corpus
            directory that may be replaced.
    """
    say = progress or log.info
    out = Path(out)
    card_path = out / "card.json"
    if out.exists():
        if not out.is_dir():
            raise UserError(f"corpus --out: {out} exists and is not a directory")
        if card_path.is_file():
            card = json.loads(card_path.read_text())
            same = (card.get("spec") == spec.to_dict() and card.get("plan") == plan_digest()
                    and card.get("sources") == spec.sources())
            if not force and same:
                say(f"corpus: {out} already holds this corpus ({card_summary(card)}); reusing it")
                return card
        elif any(p.name != ".cache" for p in out.iterdir()):
            raise UserError(f"corpus --out: {out} is not empty and holds no corpus (card.json); "
                            "choose another directory")
    exe, version = espeak_binary()
    missing = sorted({v for lang in spec.languages for v in LANGUAGES_TABLE[lang][1]}
                     - espeak_voices())
    if missing:
        raise UserError(f"corpus: this espeak-ng ({version}) lacks the voice(s) {missing}")
    cache = Path(cache_dir) if cache_dir is not None else out / ".cache"
    cache.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    clips = plan_corpus(spec)
    n_workers = max(1, workers or os.cpu_count() or 1)
    say(f"corpus: {len(clips)} clips in {len(spec.languages)} language(s) "
        f"({', '.join(f'{c}: {t}' for c, t in spec.sources().items())} sentences), espeak-ng with {n_workers} worker(s), cache {cache}")
    results: dict[str, tuple[bytes, float]] = {}
    n_cached, last = 0, time.perf_counter()
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        futures = {pool.submit(synthesize_clip, c, cache): c for c in clips}
        for fut in as_completed(futures):
            data, seconds, cached = fut.result()
            results[futures[fut].id] = (data, seconds)
            n_cached += cached
            if time.perf_counter() - last > 2.0:
                last = time.perf_counter()
                say(f"corpus: {len(results)}/{len(clips)} clips ({n_cached} from cache), "
                    f"{last - t0:.1f} s")
    t_synth = time.perf_counter() - t0
    say(f"corpus: {len(clips)} clips ready ({n_cached} from cache) in {t_synth:.1f} s")

    card = _card(spec, clips, results, version, n_cached, t_synth)
    _write(out, clips, results, card, cache)
    say(f"corpus: wrote {out} ({card_summary(card)}) in {time.perf_counter() - t0:.1f} s")
    return card


def _write(out: Path, clips: list[Clip], results: dict, card: dict, cache: Path) -> None:
    import datasets
    from datasets import Audio, Dataset, DatasetDict, Features, Value

    datasets.disable_progress_bars()
    feats = Features({
        "id": Value("string"), "audio": {"bytes": Value("binary"), "path": Value("string")},
        "text": Value("string"), "language": Value("string"), "speaker": Value("string"),
        "duration": Value("float32"),
    })
    splits = {}
    for split in SPLITS:
        rows = [c for c in clips if c.split == split]
        ds = Dataset.from_dict({
            "id": [c.id for c in rows],
            "audio": [{"bytes": results[c.id][0], "path": None} for c in rows],
            "text": [c.text for c in rows],
            "language": [c.language for c in rows],
            "speaker": [c.speaker.name for c in rows],
            "duration": [results[c.id][1] for c in rows],
        }, features=feats)
        splits[split] = ds.cast_column("audio", Audio(sampling_rate=SAMPLE_RATE, decode=False))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    DatasetDict(splits).save_to_disk(str(tmp))
    (tmp / "card.json").write_text(json.dumps(card, indent=1, ensure_ascii=False) + "\n")
    (tmp / "README.md").write_text(card_markdown(card))
    if out.exists():
        if (out / ".cache").is_dir() and cache == out / ".cache":
            os.replace(out / ".cache", tmp / ".cache")  # keep the clip cache across rebuilds
        shutil.rmtree(out)
    os.replace(tmp, out)


def _card(spec: CorpusSpec, clips: list[Clip], results: dict, espeak_version: str,
          n_cached: int, seconds: float) -> dict:
    from importlib.metadata import version

    splits = {}
    for split in SPLITS:
        rows = [c for c in clips if c.split == split]
        per_lang = {}
        for lang in spec.languages:
            lr = [c for c in rows if c.language == lang]
            per_lang[lang] = {
                "utterances": len(lr),
                "hours": round(sum(results[c.id][1] for c in lr) / 3600, 4),
                "speakers": sorted({c.speaker.name for c in lr}),
            }
        splits[split] = {
            "utterances": len(rows),
            "hours": round(sum(results[c.id][1] for c in rows) / 3600, 4),
            "languages": per_lang,
        }
    sources = spec.sources()
    texts = {}
    for lang, source in sources.items():
        if source == "fortunes":
            package = FORTUNES[lang].package
            texts[lang] = f"fortunes: Debian package {package} {package_version(package) or ''}"
        else:
            texts[lang] = f"wordfreq: word list {LANGUAGES_TABLE[lang][0]!r}"
    return {
        "name": "asrforge espeak-ng corpus",
        "spec": spec.to_dict(),
        "plan": plan_digest(),
        "sources": sources,
        "languages": {
            lang: {"name": LANGUAGES[lang], "wordfreq": LANGUAGES_TABLE[lang][0],
                   "text": texts[lang].strip(), "voices": list(LANGUAGES_TABLE[lang][1])}
            for lang in spec.languages
        },
        "splits": splits,
        "sample_rate": SAMPLE_RATE,
        "espeak_ng": espeak_version,
        "wordfreq": version("wordfreq"),
        "build": {"clips_from_cache": n_cached, "synthesis_seconds": round(seconds, 2)},
        "notes": [
            "fortunes: natural sentences from the allow-listed fortune collections of the "
            "language's Debian package (never the off/ collections), cut at sentence ends and "
            "kept when short and speakable (letters and , ; ' - only, no quotes, digits, "
            "acronyms or code), shuffled by the seed.",
            "wordfreq: random draws of frequent words (wordfreq.top_n_list), weighted by "
            "1/sqrt(rank): speech material, not meaningful language.",
            "Speakers are espeak-ng settings (voice+variant, speed -s, pitch -p); train, "
            "validation and test use disjoint variants, and no sentence occurs twice.",
            "Not available: Khmer (no espeak-ng voice), Thai, Burmese, Swahili (no wordfreq "
            "list); Japanese only with kana-written words (espeak-ng does not read kanji); "
            "Chinese is spoken with the cmn-latn-pinyin voice.",
        ],
    }


def card_summary(card: dict) -> str:
    parts = [f"{s} {v['utterances']} utts / {v['hours'] * 60:.1f} min"
             for s, v in card["splits"].items()]
    return ", ".join(parts)


def card_markdown(card: dict) -> str:
    """The corpus card as Markdown (``README.md``)."""
    lines = [
        "# asrforge espeak-ng corpus", "",
        "Synthetic speech: natural sentences from Debian's fortune collections, or sentences "
        f"drawn from wordfreq word lists, spoken by espeak-ng at {card['sample_rate']} Hz. Built "
        f"by `asrforge corpus` ({card['espeak_ng']}; wordfreq {card['wordfreq']}; seed "
        f"{card['spec']['seed']}).", "",
        "| split | utterances | hours | " + " | ".join(card["languages"]) + " |",
        "|---|---|---|" + "---|" * len(card["languages"]),
    ]
    for split, v in card["splits"].items():
        cells = [str(v["languages"][lang]["utterances"]) for lang in card["languages"]]
        lines.append(f"| {split} | {v['utterances']} | {v['hours']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "## Languages and voices", ""]
    for lang, info in card["languages"].items():
        lines.append(f"- `{lang}` ({info['name']}): voices {', '.join(info['voices'])}; "
                     f"sentences: {info['text']}")
        for split, v in card["splits"].items():
            speakers = v["languages"][lang]["speakers"]
            lines.append(f"  - {split}: {', '.join(f'`{s}`' for s in speakers)}")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in card["notes"]]
    return "\n".join(lines) + "\n"
