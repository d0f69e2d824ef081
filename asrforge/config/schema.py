"""The run configuration's schema: one pydantic model per section, :class:`TrainConfig` the whole.

Every field's docstring is its documentation. Unknown fields are errors (``extra="forbid"``);
:mod:`asrforge.config.loading` reads a YAML file into it and names every problem by its YAML path.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import json
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from asrforge.config.data_section import ColumnsConfig, DataConfig
from asrforge.config.section import PathOrHubId, Section
from asrforge.config.units import parse_duration, parse_size

VAD_PACKAGES = {"silero_vad": "silero-vad", "onnxruntime": "onnxruntime"}
"""Module -> package: what voice activity detection imports (``transcribe --vad``,
``eval.longform_vad``): Silero VAD's sequence model, run by onnxruntime."""


def vad_problem(option: str) -> str | None:
    """``option: needs the package ...`` naming the VAD packages that are not installed, or
    ``option: the package ... is installed but fails to import (its error)``; None when every
    one imports."""
    missing = [p for m, p in VAD_PACKAGES.items() if importlib.util.find_spec(m) is None]
    if missing:
        noun = "package" if len(missing) == 1 else "packages"
        return f"{option}: needs the {noun} {' and '.join(missing)} (pip install 'asrforge[vad]')"
    for module, package in VAD_PACKAGES.items():
        error = _import_error(module)
        if error is not None:
            return (
                f"{option}: the package {package} is installed but fails to import "
                f"({type(error).__name__}: {error})"
            )
    return None


@functools.cache
def _import_error(module: str) -> Exception | None:
    """What importing ``module`` raises (a broken install: a missing shared library, say)."""
    # silero_vad, and torch, which it imports, are what VAD runs on anyway
    import torch

    # importing silero_vad sets torch's thread count to 1 for the whole process
    threads = torch.get_num_threads()
    try:
        importlib.import_module(module)
    except Exception as error:  # a broken native library raises OSError as often as ImportError
        return error
    finally:
        torch.set_num_threads(threads)
    return None


# The shape fields of ModelConfig: with `pretrained` set they come from the pretrained model.
SHAPE_FIELDS = (
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "num_mel_bins",
    "max_source_positions",
    "max_target_positions",
)


class LoraConfig(Section):
    """LoRA adapters (peft): low-rank updates ``W + (alpha/r) * B @ A`` on the named linear
    layers; only the adapters train, the base weights stay fixed."""

    r: int = Field(default=8, gt=0)
    """Rank of each adapter's update (A: r x in, B: out x r)."""
    alpha: float = Field(default=16.0, gt=0)
    """Scale of the update: it is multiplied by ``alpha / r``."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input (in training only)."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)
    """Names (last part of the module path, as in peft) of the linear layers that get an adapter:
    ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (attention), ``fc1``, ``fc2`` (MLP), in the
    encoder and decoder; a longer path suffix (``decoder.layers.3.fc1``) picks single layers.
    The default, the queries and values, is the common Whisper LoRA."""
    quantize_base: Literal["4bit", "8bit"] | None = None
    """Hold the frozen base quantized (QLoRA; bitsandbytes through transformers'
    ``BitsAndBytesConfig``, the ``lowbit`` extra), its linear layers only: ``4bit``: NF4 with
    double quantization (about 0.5 byte per weight), matmuls in the run's precision
    (``train.precision``: fp32, bf16 or fp16); ``8bit``: LLM.int8 (1 byte per weight), matmuls
    in fp16 whatever the precision. Needs ``model.pretrained`` and its own vocabulary. The
    adapters train in fp32 on top. Checkpoints hold the adapters and the sha256 of the
    full-precision base; ``asrforge export`` merges the adapters into that full-precision base
    (read again from ``model.pretrained``), not into the quantized one. null: the base in full
    precision."""


class ModelConfig(Section):
    """The one place that defines the model's shape (or points at a pretrained model)."""

    pretrained: PathOrHubId | None = None
    """A transformers Whisper model: a local directory (config.json + safetensors weights) or a
    Hugging Face Hub id, ``openai/whisper-small`` or ``org/name@revision`` (downloaded once into
    the Hugging Face cache; offline with ``HF_HUB_OFFLINE=1``; the run records the commit). An
    existing local path wins; ``./name`` is always local. Its shape is used: the shape fields
    below are filled in from it when the model is built (so the run's config.yaml records the
    whole shape), and any set must equal it."""
    tokenizer: Path | None = None
    """A directory with tokenizer files. Default: the pretrained model's; for a model built from
    scratch, a byte-level BPE trained on the transcripts of the training rows ``data.languages``
    keeps (see ``bpe_vocab_size``)."""
    bpe_vocab_size: int = Field(default=512, ge=300)
    """Vocabulary size (before special tokens) of the BPE trained for a from-scratch model."""
    d_model: int = Field(default=64, gt=0)
    """Width of encoder and decoder."""
    encoder_layers: int = Field(default=2, gt=0)
    """Transformer layers in the encoder."""
    decoder_layers: int = Field(default=2, gt=0)
    """Transformer layers in the decoder."""
    encoder_attention_heads: int = Field(default=4, gt=0)
    """Attention heads per encoder layer; must divide ``d_model``."""
    decoder_attention_heads: int = Field(default=4, gt=0)
    """Attention heads per decoder layer; must divide ``d_model``."""
    encoder_ffn_dim: int = Field(default=256, gt=0)
    """Hidden width of each encoder layer's feed-forward block."""
    decoder_ffn_dim: int = Field(default=256, gt=0)
    """Hidden width of each decoder layer's feed-forward block."""
    num_mel_bins: int = Field(default=80, gt=0)
    """Log-mel channels of the input features."""
    max_source_positions: int = Field(default=1500, gt=0)
    """Encoder positions after the stride-2 conv: 50 per second of audio (1500 = 30 s)."""
    max_target_positions: int = Field(default=448, gt=4)
    """Longest label sequence, special prefix tokens included; longer utterances are skipped."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout probability in the encoder and decoder (transformers' ``WhisperConfig.dropout``),
    in training only; a pretrained model gets it too."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel: ``sdpa`` (torch's fused scaled_dot_product_attention) or ``eager``
    (plain matmuls)."""
    freeze_encoder: bool = False
    """Train the decoder only (the encoder's weights stay fixed)."""
    train_encoder_layers: int | None = Field(default=None, ge=0)
    """Train only the top N encoder layers (and the encoder's final layer norm) with the decoder;
    the convolutions, positions and lower layers stay fixed and run in eval mode (no dropout).
    0 freezes the whole encoder, like ``freeze_encoder``; null: the whole encoder trains (unless
    ``freeze_encoder``). At most the model's number of encoder layers."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of the model's weights (needs ``peft``). Checkpoints hold
    the adapters only; ``asrforge export`` merges them into plain Whisper weights."""
    vocab_size: int | None = Field(default=None, gt=0)
    """Rows of the token embedding (the tokenizer's length). Filled in when the model is built,
    so the run's config.yaml records it; when set, the built model must have exactly this."""
    base_vocab_size: int | None = Field(default=None, gt=0)
    """The pretrained model's vocabulary size before an extended tokenizer (one with
    ``vocab_extension.json``, see ``asrforge vocab build``) grew it; equals ``vocab_size`` when
    nothing was extended. Filled in and checked like ``vocab_size``."""

    @model_validator(mode="after")
    def _shape_is_consistent(self) -> ModelConfig:
        problems = []
        # With `pretrained`, shape fields that are set are checked against it when the model is
        # built (asrforge.model.build), which also fills them in.
        if self.pretrained is None:
            if self.max_source_positions % 50:
                problems.append(
                    "max_source_positions: must be a multiple of 50 (50 positions = 1 s of audio), "
                    f"got {self.max_source_positions}"
                )
            for side in ("encoder", "decoder"):
                heads = getattr(self, f"{side}_attention_heads")
                if self.d_model % heads:
                    problems.append(
                        f"{side}_attention_heads: must divide d_model={self.d_model}, got {heads}"
                    )
        if self.lora is not None and self.lora.quantize_base and self.pretrained is None:
            problems.append(
                f"lora.quantize_base: {self.lora.quantize_base} needs model.pretrained (the base "
                "is loaded quantized from its weights; a model built from scratch has none)"
            )
        if self.lora is not None and (self.freeze_encoder or self.train_encoder_layers is not None):
            problems.append(
                "lora: cannot be combined with model.freeze_encoder or model.train_encoder_layers "
                "(with LoRA only the adapters train)"
            )
        top = self.train_encoder_layers
        if top is not None:
            if self.freeze_encoder:
                problems.append(
                    "train_encoder_layers: cannot be set together with model.freeze_encoder: true "
                    "(train_encoder_layers: 0 freezes the whole encoder)"
                )
            if self.pretrained is None and top > self.encoder_layers:
                problems.append(
                    f"train_encoder_layers: must be <= model.encoder_layers ({self.encoder_layers}), "
                    f"got {top}"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def trained_top_encoder_layers(self) -> int | None:
        """How many top encoder layers train while the rest of the encoder is frozen:
        ``train_encoder_layers``, or 0 with ``freeze_encoder``; None when the whole encoder
        trains. Derived from those two fields, not a field itself."""
        if self.freeze_encoder:
            return 0
        return self.train_encoder_layers

    @property
    def chunk_seconds(self) -> float:
        """Length of the audio window the encoder sees, in seconds (1500 positions = 30 s)."""
        return self.max_source_positions / 50.0


_Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimConfig(Section):
    """AdamW and the learning-rate schedule."""

    # No optimizer setting means anything at inf or nan (clip_grad_norm: null disables clipping).
    model_config = ConfigDict(allow_inf_nan=False)

    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"
    """``adamw``: torch's AdamW, its two moment estimates in fp32 (8 bytes per trained
    parameter). ``adamw_8bit``: bitsandbytes' AdamW8bit (Hugging Face's ``optim: adamw_8bit``),
    the moments kept as 8-bit codes with a scale per block of 256 values (about 2 bytes per
    parameter; tensors under 4096 values keep fp32 moments); needs the ``lowbit`` extra
    (``pip install 'asrforge[lowbit]'``). Both resume exactly."""
    lr: float = Field(default=1e-3, gt=0)
    """Peak learning rate."""
    embedding_lr_scale: float = Field(default=1.0, gt=0)
    """Multiplier on ``lr`` for the token and position embeddings."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW's decoupled weight decay on the weight matrices (never on embeddings, biases or
    norms); 0: none."""
    betas: tuple[_Beta, _Beta] = (0.9, 0.98)
    """AdamW's decay rates of the gradient's running mean and of its square, each in [0, 1)."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW's epsilon, added to the denominator for numerical stability."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning rate after warmup: cosine or linear decay to ``lr * min_lr_ratio`` at
    ``train.max_steps``, or constant ``lr``."""
    warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps of linear warmup from 0 to ``lr``."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate as a fraction of ``lr`` (cosine and linear)."""
    clip_grad_norm: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value; null disables clipping."""
    l2sp: float = Field(default=0.0, ge=0)
    """L2-SP: a decoupled pull of the trained weights toward the starting model's, applied
    after each optimizer step as AdamW applies its decay (``w -= lr * l2sp * (w - w_start)``,
    the parameter group's learning rate), on the parameters that train only (LoRA's adapters,
    the unfrozen layers); 0: none. Holds a copy of the trained weights. See docs/training.md,
    "Learning without forgetting"."""


class TrainLoopConfig(Section):
    """How long and how the loop steps."""

    max_steps: int = Field(default=100, gt=0)
    """Optimizer steps to train (the run may stop earlier: early stopping, step caps)."""
    max_epochs: int | None = Field(default=None, gt=0)
    """Stop after this many passes over the training split (``max_steps`` still caps the run);
    null: no epoch limit."""
    grad_accum: int = Field(default=1, gt=0)
    """Micro-batches per optimizer step, on each process."""
    keep_global_batch: bool = True
    """On ``--resume``: keep the checkpoint's global batch (micro-batches a step on all
    processes together, times ``data.batch_size``) on another number of processes, or after a
    change of ``grad_accum``, by setting ``grad_accum`` to what keeps it (said at start); a
    resume where none does is refused. ``false``: this config's ``grad_accum`` as it is,
    whatever global batch that makes (said at start)."""
    precision: Literal["auto", "no", "fp32", "fp16", "bf16"] = "auto"
    """Autocast dtype; ``no`` and ``fp32``: none, full precision. ``auto``: bf16 on GPUs that
    support it, fp16 with dynamic loss scaling on other GPUs; on a CPU, bf16 only when it has
    bf16 units (AMX, AVX512-BF16), the model's d_model is at least 256 and a short probe,
    measured once per machine and cached, finds bf16 autocast at least 1.1x as fast as fp32
    there (CPUs with AMX usually do, CPUs with only AVX512-BF16 usually do not); fp32
    otherwise. The log says which and why."""
    log_every: int = Field(default=10, gt=0)
    """Optimizer steps between ``on_step_end`` payloads carrying averaged metrics to loggers."""
    max_consecutive_nonfinite: int = Field(default=5, gt=0)
    """Stop the run after this many optimizer steps in a row with a non-finite loss or gradient
    (under fp16 a gradient overflow while the loss scale is above 1 does not count: that is the
    scaler finding its scale)."""
    ema_decay: float | None = Field(default=None, gt=0, lt=1)
    """Keep an exponential moving average of the weights with this decay (e.g. 0.999)."""
    distill_weight: float = Field(default=0.0, ge=0)
    """Distillation toward the start (learning without forgetting): adds this weight times the
    KL divergence from the frozen starting model's token distributions to the model's, at the
    labelled positions of the replay rows (``data.replay``; a packed window that holds a replay
    clip, whole; every row without it); 0: off. Holds a frozen copy of the starting model and
    runs its forward on those rows every micro-batch (a forward of them, no backward, and the
    model's memory again)."""
    distributed: Literal["ddp", "fsdp"] = "ddp"
    """How several processes (``torchrun``, ``accelerate launch``) share the training. ``ddp``:
    each holds all the weights, gradients and optimizer states. ``fsdp``: they are sharded
    across the processes (PyTorch FSDP2, one unit per encoder and decoder layer), so each holds
    about 1/N of them; evaluation gathers the whole weights on every process. Needs at least
    two processes, and refuses ``model.lora``, ``train.ema_decay``, ``precision: fp16`` (use
    bf16), ``data.asr_ratio`` below 1 and a frozen encoder part. See docs/distributed.md."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: the GPU when one is visible, else the CPU; ``cpu`` even when a GPU is visible."""
    max_time: int | float | str | None = None
    """Wall-clock budget of one process's run: seconds (``3600``) or a duration such as
    ``90m``, ``2h``, ``1d2h``, ``01:30:00``; null: none. The run stops at an optimizer step
    boundary, as at ``max_steps`` (the last evaluation and save, exit 0, status ``stopped``),
    before the step that would leave too little time for them: the longest step so far plus
    the last evaluation's and save's durations (each taken as 5% of ``max_time`` until one is
    timed). The clock counts the process from its start (set-up included), and a resume gets
    the whole budget again, since a scheduler's limit (SLURM's ``--time``) is per job; the run
    keeps its resume state (``checkpoint.after_run`` waits) so ``--resume`` continues it
    (``asrforge matrix`` does so by itself). At least one step is taken."""

    @field_validator("max_time", mode="before")
    @classmethod
    def _a_duration(cls, v: Any) -> Any:
        # Checked before pydantic's own coercion (which takes a YAML true for 1 s); the
        # ValueError lets pydantic name the field.
        if v is not None:
            parse_duration(v)
        return v

    @property
    def max_time_seconds(self) -> float | None:
        """``max_time`` in seconds (None: no budget)."""
        return None if self.max_time is None else parse_duration(self.max_time)

    @field_validator("precision", mode="before")
    @classmethod
    def _yaml_no_is_a_word(cls, v: Any) -> Any:
        # YAML 1.1 reads `precision: no` as the boolean False.
        return "no" if v is False else v


class GuardConfig(Section):
    """The forgetting guard: speech the starting model already transcribes well, measured at
    step 0 and at every evaluation. A checkpoint becomes best only while the guard's WER stays
    within ``tolerance`` of the starting model's, whatever the selection policy.

    Pick general-domain speech in the run's language, unlike the fine-tuning data (read speech,
    conversation, broadcast), that the starting model handles well: what fine-tuning must not
    forget. Without references the guard measures drift (the WER of the model's transcript
    against the starting model's own transcript of the same audio), so any real recording
    serves."""

    path: Path
    """Data in any form ``data.path`` takes (a saved data set, a directory of data files, a NeMo
    manifest, a CSV/TSV; columns ``audio``, optional ``text`` and ``language``), a directory of
    audio files (the files directly in it, in name order), or one audio file. Audio longer than
    the model's window is cut into windows at pauses. ``asrforge guard build`` writes one from
    short clips."""
    split: str = "validation"
    """The split of data with splits (a single file is read whole)."""
    columns: ColumnsConfig = Field(default_factory=ColumnsConfig)
    """The data's column names, as ``data.columns`` gives them (the text is optional here)."""
    audio_dir: Path | None = None
    """Where the data's relative audio paths are read from; default the manifest's directory."""
    tolerance: float = Field(default=0.02, ge=0)
    """How much worse than at step 0 the guard's WER may be on a save (absolute: 0.02 is two
    WER points)."""
    max_items: int | None = Field(default=50, gt=0)
    """Evaluate the first N items (windows) only; null: all."""
    mode: Literal["auto", "wer", "drift"] = "auto"
    """``wer``: against the references (every item needs one); ``drift``: against the starting
    model's transcripts; ``auto``: ``wer`` when every item has a reference, else ``drift``."""
    language: str | None = None
    """The language to transcribe the guard in; default the run's language."""
    lid_tolerance: float | None = Field(default=0.05, ge=0)
    """For a multilingual model, how much lower than at step 0 the guard's
    language-identification accuracy (the language token the model detects for each item
    against the item's language) may be on a save (absolute: 0.05 is five points); null: not judged.
    English-only models and guard items without a language (audio files) are not measured."""
    max_new_tokens: int = Field(default=160, gt=0)
    """Cap on generated tokens per guard window (the model's own limit applies too). Keep it
    above the longest transcript: a transcript cut at the cap ends at a different word whenever
    a spelling earlier in it changes, which would count as drift."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The precision the guard is measured in, the same at step 0, at every evaluation and in
    ``export --within-guard``: the one the bundle ships in (its weights are fp32), whatever
    ``train.precision`` autocasts the training in. Drift between precisions is not forgetting."""
    decode: Literal["prompt", "transcribe"] = "prompt"
    """How the guard decodes each item, the same at step 0, at every evaluation and in
    ``export --within-guard``. ``prompt``: greedy in the item's own language, without
    timestamps. ``transcribe``: as ``asrforge transcribe`` runs the bundle, the language detected
    (a multilingual model) and with timestamps: the model judged as users run it, where the
    item's language is not given (a window's first language token chosen right, and what the
    model writes once it has chosen, both count); ``max_new_tokens`` then caps each decoding
    window, timestamps counted, as in long-form decoding."""


class NormalizerConfig(Section):
    """How references and hypotheses are normalized before WER and CER (each evaluation, the
    selection that judges by them, ``asrforge evaluate``): Whisper's normalizers (English's, a
    basic one for every other language), with two of their options. The metrics name the
    options in force (``normalizer``)."""

    remove_diacritics: bool = False
    """Strip accents and other combining marks, and write ``œ ø æ ß ð þ ł`` as ASCII, in every
    language (Whisper's basic normalizer with ``remove_diacritics``), so references written
    without accents are not scored as errors. English's normalizer strips them already."""
    numbers: Literal["standard", "as_written"] = "standard"
    """``standard``: English spoken numbers are rewritten as digits ("twenty five" -> "25", as
    Whisper's English normalizer does), other languages' numbers stay as written;
    ``as_written``: numbers stay as written in every language, English too, so the model is
    scored on writing them as the references do."""

    @property
    def name(self) -> str:
        """``whisper``, or ``whisper`` and the options changed (``whisper, no diacritics``)."""
        parts = ["whisper"]
        if self.remove_diacritics:
            parts.append("no diacritics")
        if self.numbers == "as_written":
            parts.append("numbers as written")
        return ", ".join(parts)


class EvalConfig(Section):
    """When and how the validation split is evaluated."""

    eval_steps: int | None = Field(default=None, gt=0)
    """Evaluate every N optimizer steps (and at the end); null: only at the end."""
    max_new_tokens: int = Field(default=256, gt=0)
    """Cap on generated tokens per utterance during greedy decoding."""
    beam_size: int = Field(default=1, ge=1)
    """Beams per utterance when decoding the evaluation split; 1: greedy decoding (fast, the
    in-training default); 5 is openai-whisper's and faster-whisper's inference default."""
    compile: Literal["auto", "on", "off"] = "auto"
    """Greedy decoding replays each decoder step from one captured CUDA graph instead of
    launching its kernels one by one (a step of a small batch on a GPU is bound by launches);
    the hypotheses are the same. auto: on for CUDA, off on the CPU (where a step's kernels cost
    more than their launches). Beam search, sampling and timestamp rules are not captured."""
    at_end: bool = True
    """Evaluate once more after the last step (unless that step was just evaluated)."""
    at_start: bool | None = None
    """Evaluate the starting model before the first optimizer step (step 0), like any
    evaluation: metrics.jsonl, eval/step-000000.jsonl, the guard (drift 0 by definition). Its
    result seeds the selection: a later step becomes best only by beating the starting model,
    patience counts from it, and when none does the run says so and ``best/`` holds the
    starting weights (a step-0 checkpoint is saved). A resumed run never evaluates step 0
    again. null: on for a pretrained start (``model.pretrained``), off for a model built from
    scratch (a random model's evaluation says nothing and costs as much as any other)."""
    longform_items: int = Field(default=0, ge=0)
    """Long-form evaluation: join held-out utterances of the evaluation split into this many
    long recordings (one language each, fixed by the seed), decode them as ``asrforge
    transcribe`` decodes long audio and report ``longform_wer``/``longform_cer``; 0: off. Each
    evaluation transcribes them again (tiny.en: ~0.1 CPU-s per second of audio)."""
    longform_min_seconds: float = Field(default=60.0, gt=0)
    """Shortest long-form recording, in seconds (shorter only when the split runs out)."""
    longform_max_seconds: float = Field(default=120.0, gt=0)
    """Longest long-form recording, in seconds; each one's length is drawn between the two."""
    longform_chunking: Literal["timestamps", "silence"] | None = None
    """How the long recordings are decoded; null: as ``asrforge transcribe`` would (timestamps
    when the model's vocabulary has them, else cuts at silences)."""
    longform_vad: bool = False
    """Decode the long recordings as ``asrforge transcribe --vad`` does: only the speech Silero
    VAD finds, joined into chunks decoded as a batch (needs the packages ``silero-vad`` and
    ``onnxruntime``); false: sequential windows over each whole recording."""

    @model_validator(mode="after")
    def _longform_range(self) -> EvalConfig:
        if self.longform_min_seconds > self.longform_max_seconds:
            raise ValueError(
                f"longform_min_seconds: must be <= longform_max_seconds "
                f"({self.longform_max_seconds:g}), got {self.longform_min_seconds:g}"
            )
        problem = vad_problem("longform_vad") if self.longform_vad else None
        if problem is not None:
            raise ValueError(problem)
        return self

    guard: GuardConfig | None = None
    """The forgetting guard (see GuardConfig); null: none."""
    normalizer: NormalizerConfig = Field(default_factory=NormalizerConfig)
    """How transcripts are normalized before WER and CER (see NormalizerConfig)."""


class PolicyGroup(Section):
    """A language group of the selection table."""

    languages: list[str] = Field(default_factory=list)
    """ISO codes or English names; an empty list matches every language not in another group."""
    policy: Literal["by_wer", "by_loss", "combined_gate"]
    """How runs of this group select: ``by_wer``, ``by_loss``, or ``combined_gate`` (WER and loss
    both within ``selection.wer_tol``/``loss_eps`` of their bests)."""
    max_steps: int | None = Field(default=None, gt=0)
    """Cap on optimizer steps for runs of this group; null: no cap."""


class SelectionConfig(Section):
    """How an evaluation decides: is this the new best checkpoint, and has patience run out."""

    policy: Literal["auto", "by_wer", "by_loss", "combined_gate"] = "auto"
    """``auto``: the policy of the run language's group in ``groups``."""
    language: str | None = None
    """The language whose group decides; default the first of ``data.languages``, else the
    training split's most frequent language."""
    wer_tol: float = Field(default=0.05, ge=0)
    """combined_gate: a save needs ``wer < best_wer + wer_tol``."""
    loss_eps: float = Field(default=0.05, ge=0)
    """combined_gate: a save needs ``loss < best_loss + loss_eps``."""
    unspaced_error_rate: Literal["cer", "wer"] = "cer"
    """What ``by_wer`` and ``combined_gate`` judge a language written without spaces by
    (Chinese, Cantonese, Japanese, Thai, Lao, Khmer, Burmese): ``cer``, the character error
    rate, as the forgetting guard does; ``wer`` keeps the word error rate, which for such text
    counts a sentence with one wrong character as wholly wrong."""
    patience: int | None = Field(default=None, gt=0)
    """Evaluations in a row without a save before the run stops; default 5 when every weight
    trains, 3 when part of the model is frozen (``model.freeze_encoder``,
    ``model.train_encoder_layers``, or ``model.lora``: only its adapters train)."""
    max_steps: int | None = Field(default=None, gt=0)
    """Cap on optimizer steps; default the group's cap."""
    groups: dict[str, PolicyGroup] | None = None
    """Replace the shipped language-group table (asrforge/selection_groups.yaml)."""


class TopKSpec(Section):
    """Keep the k best checkpoints by one metric (ESPnet's ``keep_nbest_models``)."""

    metric: str
    """A key of the evaluation metrics: ``wer``, ``cer``, ``loss``, ..."""
    k: int = Field(default=1, gt=0)
    """How many checkpoints to keep by ``metric``."""
    mode: Literal["min", "max"] = "min"
    """``min``: lower is better (WER, loss); ``max``: higher is better."""


class CheckpointConfig(Section):
    """What is saved under ``output_dir/checkpoints`` and what rotation keeps."""

    checkpoint_every: int | None = Field(default=None, gt=0)
    """Save ``step-NNNNNN/`` every N optimizer steps; null: at evaluations and at the end only."""
    save_on_eval: bool = True
    """Save a checkpoint after every evaluation (needed for ``best/`` and top-k)."""
    save_total_limit: int | None = Field(default=3, gt=0)
    """Keep at most this many ``step-*`` checkpoints; the best and top-k members never count
    against it and are never deleted by it."""
    keep_best: list[TopKSpec] = Field(default_factory=list)
    """Top-k per metric, each kept as ``best-<metric>-<rank>/``."""
    after_run: Literal["best", "all"] = "best"
    """What stays under ``checkpoints/`` when a run ends (completed or stopped early). ``best``:
    ``best/`` (and the ``keep_best`` and averaged directories) with their weights, config,
    tokenizer and manifest; the optimizer, scheduler, scaler and RNG state and every
    ``step-*`` checkpoint are deleted, so the run can be exported but not resumed. A run with
    ``eval.guard`` whose start is not ``model.pretrained`` as stored (an extended vocabulary, a
    model built from scratch) keeps ``step-000000/`` too, as rotation does, for ``export
    --within-guard``. ``all``: keep everything (needed to extend the run later with
    ``--resume``). Logs are always kept."""
    max_disk_gb: float | None = Field(default=None, gt=0)
    """Most bytes (in GB, 10^9) the run's ``checkpoints/`` may hold. Before each save, rotation
    deletes the oldest step checkpoints it may delete until the new one fits; a save that cannot
    fit even then is refused before anything is written. null: no limit."""
    max_shard_size: int | str | None = "5GB"
    """Weights (and EMA weights) larger than this are saved as safetensors shards with a
    ``model.safetensors.index.json``, as transformers' ``save_pretrained(max_shard_size=...)``
    writes them: a number of bytes or a size such as ``5GB``, ``500MB``, ``2GiB``. Averaging
    and export then hold one shard in memory at a time. null: always one file."""

    @field_validator("max_shard_size")
    @classmethod
    def _a_size(cls, v: int | str | None) -> int | str | None:
        if v is not None:
            # A ValueError lets pydantic name the field.
            parse_size(v)
        return v

    @property
    def max_shard_bytes(self) -> int | None:
        """``max_shard_size`` in bytes (None: never shard)."""
        return None if self.max_shard_size is None else parse_size(self.max_shard_size)

    def unknown_metrics(self, produced: Collection[str]) -> list[str]:
        """One problem line per ``keep_best`` metric that evaluation never produces (a top-k
        by it would stay empty forever). ``produced``: the evaluation's metric names, which
        only the training code knows (``asrforge.train.events.eval_metric_names``)."""
        return [
            f"checkpoint.keep_best.{i}.metric: {metric_problem(spec.metric, produced)}"
            for i, spec in enumerate(self.keep_best)
            if spec.metric not in produced
        ]


def metric_problem(metric: str, produced: Collection[str]) -> str:
    """Why ``metric`` cannot be selected by: evaluation does not produce it. Names the close
    match, if any, and every valid name."""
    close = difflib.get_close_matches(metric, list(produced), n=1)
    hint = f", did you mean {close[0]!r}?" if close else ""
    return (
        f"{metric!r} is not a metric evaluation produces{hint} "
        f"(it produces: {', '.join(sorted(produced))})"
    )


class CallbackSpec(BaseModel):
    """One callback: a registered ``name`` (or ``_target_``, a dotted class path, which needs
    ``--allow-external-callbacks``) plus the callback's own options."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, use_attribute_docstrings=True)

    name: str | None = None
    """A registered callback (``early_stopping``, ``average_checkpoints``, ``wandb``, ...;
    ``asrforge.callbacks.REGISTRY``); its options sit beside it."""
    target: str | None = Field(default=None, alias="_target_")
    """A dotted class path (``package.module.Class``) to import instead of a registered ``name``;
    needs ``--allow-external-callbacks``."""
    id: str | None = Field(default=None, min_length=1)
    """The key of this callback's state in a checkpoint's ``callbacks.json``. Default: the name,
    numbered from the second callback of that name on (``early_stopping#2``), so set an id when
    callbacks of one name may be reordered or removed between a run and its resume."""
    critical: bool | None = None
    """A critical callback's failure stops the run (exit 1); an optional one's is logged with its
    traceback and the run goes on. Default: the callback's own choice; every built-in callback
    is optional, because each only observes the run and what it writes is a log or can be rebuilt
    offline (``asrforge average``). Saving checkpoints is the loop's own work, not a callback's:
    a failed save always stops the run."""

    @model_validator(mode="after")
    def _one_of_name_or_target(self) -> CallbackSpec:
        if (self.name is None) == (self.target is None):
            raise ValueError("give exactly one of `name` or `_target_`")
        return self

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class TrainConfig(Section):
    """A whole run."""

    output_dir: Path
    """The run directory: config.yaml, metrics.jsonl, train.log, tensorboard/, checkpoints/.
    Apart from the data: ``asrforge train`` refuses one that is, holds or lies in ``data.path``,
    ``data.replay.path`` or ``eval.guard.path``."""
    seed: int = Field(default=0, ge=0)
    """Seeds the weights of a model built here, the data order, dropout, packing and every other
    random draw of the run (numpy's seed sequences take no negative numbers). Fixed for the run:
    ``--resume`` refuses another."""
    config_id: str | None = None
    """A name for this configuration in reports and manifests; default the YAML file's stem."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model's shape (or a pretrained model) and which part of it trains."""
    data: DataConfig
    """Where the speech comes from and how it is batched."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    train: TrainLoopConfig = Field(default_factory=TrainLoopConfig)
    """How long the run trains and how each step runs."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """When and how the validation split is evaluated; the forgetting guard."""
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    """Which evaluation makes the best checkpoint, and when patience stops the run."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """What is saved under ``output_dir/checkpoints`` and what rotation keeps."""
    callbacks: list[CallbackSpec] = Field(default_factory=list)
    """Callbacks that observe the run, called in list order. ``metrics_jsonl``, ``tensorboard``,
    ``lr_monitor``, ``system_monitor`` and ``progress`` are on by default (``enabled: false``
    turns one off)."""

    @field_validator("output_dir", mode="before")
    @classmethod
    def _names_a_directory(cls, value: Any) -> Any:
        # an empty value would be the current directory, where the run would write among its files
        if isinstance(value, str) and not value.strip():
            raise ValueError("must name a directory, got an empty value (an unset variable?)")
        return value

    @model_validator(mode="after")
    def _cross_section_rules(self) -> TrainConfig:
        if self.data.cache_encoder and self.model.trained_top_encoder_layers is None:
            raise ValueError(
                "data.cache_encoder: needs model.freeze_encoder: true or model.train_encoder_layers "
                "(a training encoder's output changes every step)"
            )
        if self.data.filter_wer is not None and self.model.pretrained is None:
            raise ValueError(
                "data.filter_wer: needs model.pretrained (the rows are scored by the starting "
                "model; a model built here transcribes nothing yet)"
            )
        if self.train.distributed == "fsdp":
            refused = self._fsdp_refusals()
            if refused:
                raise ValueError(
                    "train.distributed: fsdp cannot be combined with " + "; ".join(refused)
                )
        return self

    def _fsdp_refusals(self) -> list[str]:
        # Each needs every process to run the same sharded layers in the same order, or the
        # whole weights on one process; docs/distributed.md says why for each.
        refused = []
        if self.model.lora is not None:
            refused.append("model.lora (the adapters are small: use ddp)")
        if self.train.ema_decay is not None:
            refused.append("train.ema_decay (the EMA would need the whole weights per process)")
        if self.train.precision == "fp16":
            refused.append("train.precision: fp16 (the loss scaler is not shard-aware: use bf16)")
        if self.data.asr_ratio < 1.0:
            refused.append("data.asr_ratio below 1 (text-only batches skip the encoder's shards)")
        if self.model.trained_top_encoder_layers is not None:
            refused.append("a frozen encoder part (model.freeze_encoder, train_encoder_layers)")
        if self.optim.l2sp or self.train.distill_weight:
            refused.append("optim.l2sp or train.distill_weight (the starting weights are whole)")
        if self.optim.optimizer == "adamw_8bit":
            refused.append(
                "optim.optimizer: adamw_8bit (its 8-bit states are not sharded: use adamw)"
            )
        return refused

    @property
    def evaluates_at_start(self) -> bool:
        """Whether the run evaluates its starting model at step 0 (``eval.at_start``; by
        default only a pretrained start)."""
        if self.eval.at_start is not None:
            return self.eval.at_start
        return self.model.pretrained is not None

    @property
    def keeps_step_zero(self) -> bool:
        """Whether the run's step-0 checkpoint is kept through rotation and ``checkpoint.after_run:
        best``: an export within its guard (``eval.guard``) interpolates with the starting
        weights, and only step 0 holds them when they are not ``model.pretrained``'s as stored
        (a model built from scratch, or a vocabulary ``model.tokenizer`` extends)."""
        starts_as_pretrained = self.model.pretrained is not None and self.model.tokenizer is None
        return self.eval.guard is not None and not starts_as_pretrained

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_plain(), sort_keys=False)

    def to_plain(self) -> dict[str, Any]:
        plain = self.model_dump(mode="json", by_alias=True, exclude_none=False)
        if self.model.pretrained is not None:
            # The shape comes from the pretrained model: defaults are not its shape. Building
            # the model fills every shape field in (asrforge.model.build), so a built run's
            # config.yaml records the whole shape.
            for name in set(SHAPE_FIELDS) - self.model.model_fields_set:
                plain["model"].pop(name, None)
        return plain

    def fingerprint(self) -> str:
        """sha256 of the resolved config (stable across key order)."""
        blob = json.dumps(self.to_plain(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()
