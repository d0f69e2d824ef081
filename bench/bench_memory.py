"""Training memory: measured peak of random Whisper shapes on the CPU against a formula.

Each shape (d_model 384 to 1024, 2 encoder + 2 decoder layers, heads of 64, FFN 4 d_model,
Whisper's 51866-token vocabulary) trains for a few AdamW steps in a fresh subprocess, with and
without gradient checkpointing, the way asrforge's loop steps (``model(...).logits`` held
through ``token_loss(...).backward()``, ``zero_grad(set_to_none=True)``). Its peak RSS
(``ru_maxrss`` of that child, from ``wait4``) minus the peak of an idle child that imported the
same libraries is the measured training memory. The prediction:

    memory = weights + gradients + Adam states + activations
           = 4 P + 4 P_t + 8 P_t + A                                  (fp32, bytes)

with ``P`` parameters, ``P_t`` the trainable ones (the encoder's sinusoidal positions are
frozen), and ``A`` the tensors autograd saves for the backward pass at batch ``b``, ``T_e``
encoder frames (after the stride-2 conv; 1500 for 30 s), ``T_d`` decoder tokens, width ``d``,
FFN ``f``, vocabulary ``V``, ``L_e`` + ``L_d`` layers (elements, fp32 = 4 bytes each; derived
from transformers' WhisperEncoderLayer/WhisperDecoderLayer with SDPA, dropout 0):

    encoder layer   9 b T_e d + 2 b T_e f   LN1 in/out, q k v, SDPA out, out_proj in,
                                            LN2 in/out; fc1 out, GELU out
    decoder layer  14 b T_d d + 2 b T_d f   self-attention as above (7), cross-attention
                  + 2 b T_e d               (LN in/out, q, SDPA out, out_proj in: 5; k, v over
                                            the encoder output: 2 b T_e d), FFN LN in/out (2)
    encoder ends    5 b T_e d + 2 b T_e d   conv1/conv2 outputs and their GELUs (T = 2 T_e
                                            after conv1); final LN in and out
    decoder ends    2 b T_d d + 4 b T_d V   final LN in/out; logits and log-softmax output,
                                            and at the start of backward their two gradients

With gradient checkpointing (non-reentrant, per layer) each layer keeps only its input
(``b T d``) and one layer's activations are alive again while it is recomputed:

    A_gc = L_e b T_e d + L_d b T_d d + max(encoder layer, decoder layer) + the ends

The plain sum is not the peak: ``zero_grad(set_to_none=True)`` frees the gradients after each
step and backward frees each activation as it makes that layer's gradients, so gradients and
activations are never all alive at once, while the tied token embedding's gradient exists three
times at one moment. :func:`peak_bytes` takes the larger of the two moments that matter; both
it and the sum are printed with their error against the measurement.

Low-bit terms (``optim.optimizer: adamw_8bit``, ``model.lora.quantize_base``; bitsandbytes):

    Adam states       8 bytes per trained parameter (two fp32 moments), 8-bit AdamW
                      2 + 8/256 (two 1-byte codes and an fp32 scale per block of 256 each;
                      tensors under 4096 values keep 8, a negligible share of a Whisper)
    LoRA base         fp32 4 bytes per weight; quantized, its linear layers' weights at
                      ``BASE_BYTES`` (NF4 4 bits + an 8-bit scale per 64 + the scales' fp32
                      scale per 256 scales = 0.5 + 1/64 + 4/16384; LLM.int8 1 + 4/out row),
                      the rest (token and position embeddings, convolutions, norms,
                      biases) fp32
    LoRA adapters     r (in + out) per targeted linear layer, fp32, trained: weights,
                      gradients and Adam states as above; no autocast weight cache of the
                      frozen base (autocast caches only the casts of weights that train)

A LoRA run's activations are taken as full fine-tuning's, an upper bound: a frozen linear layer
keeps no input for a weight gradient, only what carries the gradient down to the adapters.

Run::

    .venv/bin/python bench/bench_memory.py                   # 4 shapes x {off, on}
    .venv/bin/python bench/bench_memory.py --large-v3        # also the GPU table for large-v3
    .venv/bin/python bench/bench_memory.py --large-v3 --procs 4 8   # and sharded (fsdp), per GPU

Prints one row per shape and mode (parameters, the terms, the sum and the peak predicted, the
measured peak, errors), then ``RESULT memory peak_model max_abs_error=X% mean_error=Y%
sum_formula mean_error=Z%``.

Sharded (``train.distributed: fsdp``, :func:`sharded_peak`): the weights, gradients and Adam
states divide by the number of processes, the activations do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

MB = 10**6
GB = 10**9
VOCAB = 51866  # large-v3's (51865 for the older multilingual models)


@dataclass(frozen=True)
class Shape:
    """A Whisper shape and the batch it trains on."""

    d_model: int
    encoder_layers: int = 2
    decoder_layers: int = 2
    vocab: int = VOCAB
    n_mels: int = 80
    batch: int = 2
    enc_frames: int = 500
    """``T_e``: encoder positions (mel frames / 2); the model's ``max_source_positions``."""
    dec_tokens: int = 64
    """``T_d``: decoder positions; the model's ``max_target_positions``."""

    @property
    def heads(self) -> int:
        return max(1, self.d_model // 64)

    @property
    def ffn(self) -> int:
        return 4 * self.d_model


LARGE_V3 = Shape(
    d_model=1280, encoder_layers=32, decoder_layers=32, n_mels=128, enc_frames=1500,
    dec_tokens=448,
)  # fmt: skip


def layer_parameters(s: Shape) -> tuple[int, int]:
    """Parameters of one encoder layer and of one decoder layer of shape ``s``."""
    d, f = s.d_model, s.ffn
    attn = 4 * d * d + 3 * d  # q, k, v, out; k has no bias
    ffn = 2 * d * f + f + d
    return attn + ffn + 2 * 2 * d, 2 * attn + ffn + 3 * 2 * d


def parameters(s: Shape) -> tuple[int, int]:
    """``(all, trainable)`` parameter counts of WhisperForConditionalGeneration of shape ``s``
    (proj_out tied to the token embedding; the encoder's positions frozen)."""
    d = s.d_model
    enc_layer, dec_layer = layer_parameters(s)
    conv = s.n_mels * d * 3 + d + d * d * 3 + d
    enc = conv + s.encoder_layers * enc_layer + 2 * d
    dec = s.vocab * d + s.dec_tokens * d + s.decoder_layers * dec_layer + 2 * d
    frozen = s.enc_frames * d  # encoder embed_positions: requires_grad False
    return enc + dec + frozen, enc + dec


def activation_bytes(s: Shape, checkpointing: bool, mixed: bool = False) -> dict[str, float]:
    """Bytes autograd holds for the backward pass, by part (see the module docstring).

    ``mixed``: bf16/fp16 autocast. The residual stream (each LayerNorm's input) stays fp32, as
    do LayerNorm outputs; every linear layer saves its own 2-byte cast of its input (q, k and v
    each cast the same LayerNorm output), and linear outputs, attention and GELU are 2 bytes.
    """
    b, d, f, te, td, v = s.batch, s.d_model, s.ffn, s.enc_frames, s.dec_tokens, s.vocab
    if mixed:  # bytes per element of each b*T*d (or b*T*f) unit, from the forward code
        enc_layer = 26 * b * te * d + 4 * b * te * f
        dec_layer = 38 * b * td * d + 4 * b * td * f + 8 * b * te * d
        ends = 10 * b * te * d + 8 * b * te * d + 6 * b * td * d
        logits = 14 * b * td * v  # 2-byte logits, fp32 log-softmax, fp32 gradients
    else:
        enc_layer = 4 * (9 * b * te * d + 2 * b * te * f)
        dec_layer = 4 * (14 * b * td * d + 2 * b * td * f + 2 * b * te * d)
        ends = 4 * (5 * b * te * d + 2 * b * te * d + 2 * b * td * d)
        logits = 4 * 4 * b * td * v
    if checkpointing:  # each layer keeps its fp32 input; one layer is recomputed at a time
        layers = 4 * (s.encoder_layers * b * te * d + s.decoder_layers * b * td * d)
        layers += max(enc_layer, dec_layer)
    else:
        layers = s.encoder_layers * enc_layer + s.decoder_layers * dec_layer
    return {"layers": layers, "ends": ends, "logits": logits}


def predict(s: Shape, checkpointing: bool) -> dict[str, float]:
    """Bytes (fp32) by term, their sum, and the peak: the larger of the two moments below."""
    p_all, p_train = parameters(s)
    acts = sum(activation_bytes(s, checkpointing).values())
    out = {"weights": 4 * p_all, "gradients": 4 * p_train, "adam": 8 * p_train, "activations": acts}
    out["total"] = sum(out.values())
    out["peak"] = peak_bytes(out, tied_gradient=4 * s.vocab * s.d_model)
    return out


def peak_bytes(terms: dict[str, float], tied_gradient: float, step_temporaries: float = 0) -> float:
    """The high-water mark of a step, the larger of:

    * backward: weights, Adam states and every saved activation (the peak comes early in the
      backward pass, before activations are freed), plus the tied token embedding's gradient
      three times: the output projection makes one (a transposed view, which autograd cannot
      add to in place), the embedding's backward a dense second, and their sum is a third
      (measured: +609 MB at V 51866, d 1024, against 3 x 202 MiB);
    * the optimizer step: weights, gradients and Adam states (the activations are gone), plus
      the optimizer's temporaries (none for asrforge's fused AdamW; 4 bytes per trainable
      parameter for torch's foreach AdamW, whose ``_foreach_sqrt`` copies every second moment).
    """
    backward = terms["weights"] + terms["adam"] + terms["activations"] + 3 * tied_gradient
    step = terms["weights"] + terms["gradients"] + terms["adam"] + step_temporaries
    return max(backward, step)


def sharded_peak(s: Shape, checkpointing: bool, procs: int) -> dict[str, float]:
    """Bytes per process under ``train.distributed: fsdp`` with ``procs`` processes and bf16
    (the formula, not a measurement): the fp32 weights, gradients and Adam states divided by
    ``procs``; the activations whole (each process has its own batch); and the weights FSDP
    gathers in bf16 while they run: the root unit (embeddings, convolutions, final norms: it
    stays gathered from the forward to the end of the backward) and two layers (the one
    running and the next, prefetched), which replace DDP's autocast cache of every weight. The
    tied embedding's gradient is counted whole, as for one process: the root's gradients are
    whole until their reduce-scatter at the end of the backward.
    """
    p_all, p_train = parameters(s)
    enc_layer, dec_layer = layer_parameters(s)
    root = p_all - s.encoder_layers * enc_layer - s.decoder_layers * dec_layer
    gathered = 2 * (root + 2 * max(enc_layer, dec_layer))
    acts = sum(activation_bytes(s, checkpointing, mixed=True).values())
    terms = {
        "weights": 4 * p_all / procs,
        "gradients": 4 * p_train / procs,
        "adam": 8 * p_train / procs,
        "activations": acts + gathered,
    }
    terms["static"] = terms["weights"] + terms["gradients"] + terms["adam"]
    terms["gathered"] = gathered
    terms["peak"] = peak_bytes(terms, tied_gradient=4 * s.vocab * s.d_model)
    return terms


# ---------------------------------------------------------------------------------------------
# Measurement


def child(shape: Shape, checkpointing: bool, steps: int, idle: bool) -> None:
    """Train ``shape`` for ``steps`` steps (or only import, when ``idle``); print the counts."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from asrforge.config import OptimConfig
    from asrforge.evaluation.evaluate import token_loss
    from asrforge.train.optim import build_optimizer

    torch.set_num_threads(1)
    if idle:
        print(json.dumps({"vm_hwm": _own_peak_rss()}))
        return
    cfg = WhisperConfig(
        vocab_size=shape.vocab, d_model=shape.d_model, encoder_layers=shape.encoder_layers,
        decoder_layers=shape.decoder_layers, encoder_attention_heads=shape.heads,
        decoder_attention_heads=shape.heads, encoder_ffn_dim=shape.ffn,
        decoder_ffn_dim=shape.ffn, num_mel_bins=shape.n_mels,
        max_source_positions=shape.enc_frames, max_target_positions=shape.dec_tokens,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        attn_implementation="sdpa", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, OptimConfig(lr=1e-5))  # asrforge's: fused AdamW
    feats = torch.randn(shape.batch, shape.n_mels, 2 * shape.enc_frames)
    ids = torch.randint(3, shape.vocab, (shape.batch, shape.dec_tokens))
    for _ in range(steps):
        logits = model(input_features=feats, decoder_input_ids=ids, use_cache=False).logits
        loss = token_loss(logits, ids)
        loss.backward()
        del logits, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    n_all = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in params)
    print(json.dumps({"parameters": n_all, "trainable": n_train, "vm_hwm": _own_peak_rss()}))


def _own_peak_rss() -> int:
    """This process image's peak RSS in bytes (``VmHWM``: reset by exec, unlike ``ru_maxrss``,
    which a child forked from a large parent inherits)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(shape: Shape, checkpointing: bool, steps: int, idle: bool = False) -> dict:
    """Run :func:`child` in a fresh interpreter; its output and its peak RSS in bytes (the
    child's own ``VmHWM``: ``wait4``'s ``ru_maxrss`` carries the forking parent's high-water
    mark across exec, so under a large parent such as a test run every child looked alike)."""
    argv = [sys.executable, __file__, "--child", json.dumps(asdict(shape)), "--steps", str(steps)]
    if checkpointing:
        argv.append("--checkpointing")
    if idle:
        argv.append("--idle")
    # glibc keeps freed heap memory (its mmap threshold grows up to 32 MB as big blocks are
    # freed), so the peak RSS would count tensors long dead; a fixed 64 kB threshold maps every
    # tensor buffer on its own and returns it when freed: RSS then follows the live tensors.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath()}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        _pid, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0), err.seek(0)
        if proc.returncode:
            raise RuntimeError(f"bench child failed: {err.read().decode()[-2000:]}")
        result = json.loads(out.read().decode().strip().splitlines()[-1])
    del usage  # ru_maxrss: see the docstring
    return {**result, "peak": result.pop("vm_hwm")}


def _pythonpath() -> str:
    root = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)


def run(shapes: list[Shape], steps: int) -> list[dict]:
    """Measure every shape without and with gradient checkpointing; rows with both figures."""
    baseline = measure(shapes[0], False, steps, idle=True)["peak"]
    print(f"idle child (torch, transformers, asrforge imported): {baseline / MB:.0f} MB peak RSS")
    header = (
        f"{'d_model':>7} {'layers':>6} {'ckpt':>4} {'params':>7} {'weights':>8} {'grads':>7} "
        f"{'adam':>7} {'acts':>7} {'sum':>7} {'error':>6} {'peak':>7} {'measured':>8} {'error':>6}"
    )
    print(header)
    rows = []
    for shape in shapes:
        for checkpointing in (False, True):
            got = measure(shape, checkpointing, steps)
            p_all, p_train = parameters(shape)
            if (got["parameters"], got["trainable"]) != (p_all, p_train):
                raise AssertionError(
                    f"parameter formula: {p_all}/{p_train}, the model has "
                    f"{got['parameters']}/{got['trainable']}"
                )
            pred = predict(shape, checkpointing)
            measured = got["peak"] - baseline
            row = {
                "d_model": shape.d_model, "layers": shape.encoder_layers + shape.decoder_layers,
                "checkpointing": checkpointing, "parameters": p_all, **pred,
                "measured": measured, "error": (pred["peak"] - measured) / measured,
                "sum_error": (pred["total"] - measured) / measured,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{shape.d_model:>7} {row['layers']:>6} {'on' if checkpointing else 'off':>4} "
                f"{p_all / 1e6:>6.1f}M {pred['weights'] / MB:>6.0f}MB {pred['gradients'] / MB:>5.0f}MB "
                f"{pred['adam'] / MB:>5.0f}MB {pred['activations'] / MB:>5.0f}MB "
                f"{pred['total'] / MB:>5.0f}MB {row['sum_error']:>+6.1%} "
                f"{pred['peak'] / MB:>5.0f}MB {measured / MB:>6.0f}MB {row['error']:>+6.1%}"
            )
    return rows


ADAM_BYTES = {"adamw": 8.0, "adamw_8bit": 2.0 + 2 * 4 / 256}
"""Bytes of Adam state per trained parameter for each ``optim.optimizer``."""

BASE_BYTES = {None: 4.0, "8bit": 1.0, "4bit": 0.5 + 1 / 64 + 4 / (64 * 256)}
"""Bytes per weight of a LoRA base's linear layers for each ``model.lora.quantize_base`` (the
8-bit row scales, 4 bytes per output row, are added in :func:`lora_terms`)."""

LORA_TARGETS = {
    "q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "out_proj": "attn",
    "fc1": "fc1", "fc2": "fc2",
}  # fmt: skip


def linear_weights(s: Shape) -> tuple[int, int]:
    """(weights of every attention/FFN linear layer, their output rows): what bitsandbytes
    quantizes (the output projection is tied to the embedding and stays fp32)."""
    d, f = s.d_model, s.ffn
    enc = s.encoder_layers * (4 * d * d + 2 * d * f)
    dec = s.decoder_layers * (8 * d * d + 2 * d * f)
    rows = s.encoder_layers * (4 * d + f + d) + s.decoder_layers * (8 * d + f + d)
    return enc + dec, rows


def lora_parameters(s: Shape, r: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters: ``r (in + out)`` per targeted linear layer (the decoder's self- and
    cross-attention both have each attention projection)."""
    d, f = s.d_model, s.ffn
    size = {"attn": d + d, "fc1": d + f, "fc2": f + d}
    per_enc = sum(r * size[LORA_TARGETS[t]] for t in targets)
    per_dec = per_enc + sum(r * size["attn"] for t in targets if LORA_TARGETS[t] == "attn")
    return s.encoder_layers * per_enc + s.decoder_layers * per_dec


def lora_terms(
    s: Shape,
    quantize: str | None,
    optimizer: str,
    r: int = 32,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    checkpointing: bool = True,
    mixed: bool = True,
) -> dict[str, float]:
    """Bytes by term of a LoRA step on shape ``s`` (see the module docstring), and its peak."""
    p_all, _ = parameters(s)
    linear, rows = linear_weights(s)
    base = (
        4 * (p_all - linear)
        + BASE_BYTES[quantize] * linear
        + (4 * rows if quantize == "8bit" else 0)
    )
    p_lora = lora_parameters(s, r, targets)
    acts = sum(activation_bytes(s, checkpointing, mixed=mixed).values())
    terms = {
        "weights": base + 4 * p_lora,
        "gradients": 4 * p_lora,
        "adam": ADAM_BYTES[optimizer] * p_lora,
        "activations": acts + (2 * p_lora if mixed else 0),
    }
    return {**terms, "lora_parameters": p_lora, "peak": peak_bytes(terms, tied_gradient=0)}


def full_terms(s: Shape, optimizer: str, checkpointing: bool = True) -> dict[str, float]:
    """Bytes by term of a full fine-tuning step on a GPU with mixed precision (fp32 weights,
    gradients and ``optimizer``'s states; autocast's weight cache), and its peak."""
    p_all, p_train = parameters(s)
    acts = sum(activation_bytes(s, checkpointing, mixed=True).values())
    terms = {
        "weights": 4 * p_all,
        "gradients": 4 * p_train,
        "adam": ADAM_BYTES[optimizer] * p_train,
        "activations": acts + 2 * p_all,
    }
    return {**terms, "peak": peak_bytes(terms, tied_gradient=4 * s.vocab * s.d_model)}


def large_v3_lowbit_table(batch: int = 4) -> list[dict]:
    """large-v3 at ``batch`` (30 s windows, 448 decoder tokens, checkpointing on, bf16/fp16
    autocast): the peak of full fine-tuning with either AdamW, and of LoRA (r 32 on every
    attention and FFN linear layer) on an fp32, 8-bit or 4-bit base."""
    shape = Shape(**{**asdict(LARGE_V3), "batch": batch})
    rows = []
    for optimizer in ("adamw", "adamw_8bit"):
        rows.append({"run": "full", "base": "fp32", "optimizer": optimizer,
                     **full_terms(shape, optimizer)})  # fmt: skip
    for quantize in (None, "8bit", "4bit"):
        for optimizer in ("adamw", "adamw_8bit"):
            rows.append({"run": "lora r32", "base": quantize or "fp32", "optimizer": optimizer,
                         **lora_terms(shape, quantize, optimizer)})  # fmt: skip
    return rows


def large_v3_table() -> list[dict]:
    """The peak the formula predicts for large-v3 at the pipeline's batch sizes, on a GPU.

    Weights, gradients and Adam states are fp32 in every row (16 bytes per parameter: mixed
    precision as accelerate and the HF Trainer run it keeps fp32 master weights). ``fp32``: no
    autocast. ``mixed``: bf16 or fp16 autocast (the same bytes for both), activations as
    :func:`activation_bytes` with ``mixed``, plus the autocast cache, a 2-byte copy of every
    weight alive from the forward to the backward. ``foreach``: what torch's foreach AdamW
    (the usual ``adamw_torch``) adds at the step over asrforge's fused one. None of it counts
    the CUDA context (~0.5 GB) or the caching allocator's reserve above what is allocated.
    """
    rows = []
    p_all, p_train = parameters(LARGE_V3)
    tied = 4 * LARGE_V3.vocab * LARGE_V3.d_model
    for batch in (1, 2, 4, 8):
        for checkpointing in (True, False):
            shape = Shape(**{**asdict(LARGE_V3), "batch": batch})
            terms = {"weights": 4 * p_all, "gradients": 4 * p_train, "adam": 8 * p_train}
            fp32 = {**terms, "activations": sum(activation_bytes(shape, checkpointing).values())}
            acts = sum(activation_bytes(shape, checkpointing, mixed=True).values())
            mixed = {**terms, "activations": acts + 2 * p_all}
            rows.append({
                "batch": batch, "checkpointing": checkpointing,
                "fp32": peak_bytes(fp32, tied), "mixed": peak_bytes(mixed, tied),
                "mixed_foreach": peak_bytes(mixed, tied, step_temporaries=4 * p_train),
                "mixed_activations": mixed["activations"], "static": sum(terms.values()),
            })  # fmt: skip
    return rows


def sharded_table(procs: list[int], batch: int = 2) -> list[dict]:
    """:func:`sharded_peak` of large-v3 at ``batch`` for each number of processes, gradient
    checkpointing on and off."""
    rows = []
    for n in procs:
        for checkpointing in (True, False):
            shape = Shape(**{**asdict(LARGE_V3), "batch": batch})
            peak = sharded_peak(shape, checkpointing, n)
            rows.append({"procs": n, "batch": batch, "checkpointing": checkpointing, **peak})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-models", type=int, nargs="+", default=[384, 512, 768, 1024])
    ap.add_argument("--layers", type=int, default=2, help="encoder and decoder layers each")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--enc-frames", type=int, default=500, help="T_e (30 s: 1500)")
    ap.add_argument("--dec-tokens", type=int, default=64, help="T_d")
    ap.add_argument("--steps", type=int, default=2, help="AdamW steps (the 2nd has Adam states)")
    ap.add_argument("--large-v3", action="store_true", help="print the large-v3 GPU table")
    ap.add_argument(
        "--procs",
        type=int,
        nargs="+",
        default=[4, 8],
        help="with --large-v3: the sharded (train.distributed: fsdp) table for these numbers "
        "of processes",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--idle", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        child(Shape(**json.loads(args.child)), args.checkpointing, args.steps, args.idle)
        return {}
    shapes = [
        Shape(d_model=d, encoder_layers=args.layers, decoder_layers=args.layers,
              vocab=args.vocab, batch=args.batch, enc_frames=args.enc_frames,
              dec_tokens=args.dec_tokens)
        for d in args.d_models
    ]  # fmt: skip
    rows = run(shapes, args.steps)
    errors = [r["error"] for r in rows]
    worst = max(errors, key=abs)
    sums = [r["sum_error"] for r in rows]
    print(
        f"RESULT memory peak_model max_abs_error={abs(worst):.1%} "
        f"mean_error={sum(errors) / len(errors):+.1%} sum_formula "
        f"mean_error={sum(sums) / len(sums):+.1%}"
    )
    out: dict = {"rows": rows, "max_abs_error": abs(worst)}
    if args.large_v3:
        p_all = parameters(LARGE_V3)[0]
        print(f"large-v3 on a GPU: {p_all / 1e9:.3f} B parameters, 16 bytes each = "
              f"{16 * p_all / GB:.1f} GB before activations")  # fmt: skip
        print(f"{'batch':>5} {'ckpt':>4} {'fp32':>8} {'mixed':>8} {'mixed+foreach':>13}")
        for r in large_v3_table():
            print(
                f"{r['batch']:>5} {'on' if r['checkpointing'] else 'off':>4} "
                f"{r['fp32'] / GB:>6.1f}GB {r['mixed'] / GB:>6.1f}GB {r['mixed_foreach'] / GB:>11.1f}GB"
            )
        out["large_v3"] = large_v3_table()
        print("large-v3 sharded (train.distributed: fsdp, bf16), per process, batch 2:")
        print(f"{'procs':>5} {'ckpt':>4} {'static':>8} {'gathered':>8} {'activ.':>8} {'peak':>8}")
        for r in sharded_table(args.procs):
            acts = r["activations"] - r["gathered"]
            print(
                f"{r['procs']:>5} {'on' if r['checkpointing'] else 'off':>4} "
                f"{r['static'] / GB:>6.1f}GB {r['gathered'] / GB:>6.1f}GB {acts / GB:>6.1f}GB "
                f"{r['peak'] / GB:>6.1f}GB"
            )
        out["large_v3_sharded"] = sharded_table(args.procs)
        print("large-v3 low-bit (formula; batch 4, 30 s, checkpointing on, bf16 autocast):")
        print(f"{'run':>8} {'base':>5} {'optimizer':>10} {'weights':>8} {'adam':>7} {'peak':>7}")
        out["large_v3_lowbit"] = large_v3_lowbit_table()
        for r in out["large_v3_lowbit"]:
            print(
                f"{r['run']:>8} {r['base']:>5} {r['optimizer']:>10} {r['weights'] / GB:>6.2f}GB "
                f"{r['adam'] / GB:>5.2f}GB {r['peak'] / GB:>5.1f}GB"
            )
    return out


if __name__ == "__main__":
    main()
