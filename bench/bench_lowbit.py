"""Low-bit training against full precision: tensor bytes and step time, in one process.

    .venv/bin/python bench/bench_lowbit.py            # tiny-shaped Whisper (d 384, 4+4 layers)
    .venv/bin/python bench/bench_lowbit.py --quick    # d 64, 2+2 layers, 1000 tokens (smoke)

A Whisper with random weights (the bytes and the time of a step do not depend on the values),
random log-mels and labels, asrforge's optimizer (``build_optimizer``) and loss; a step is
forward, backward, optimizer step, zero grads, timed after a warm-up step. Two comparisons,
each side built and stepped in this same process, one after the other:

* full fine-tuning, ``optim.optimizer`` ``adamw`` (torch's fused AdamW) against ``adamw_8bit``
  (bitsandbytes): the bytes of the optimizer's state tensors after the steps;
* LoRA (``model.lora`` r 8 on q_proj and v_proj by default) on an fp32 base against a 4-bit
  and an 8-bit base (``model.lora.quantize_base``, loaded through transformers'
  ``BitsAndBytesConfig``): the bytes of the base's tensors (parameters and buffers, the
  quantization state included).

Each measured figure is printed next to what ``bench_memory``'s low-bit terms predict for the
shape (``ADAM_BYTES``, ``BASE_BYTES``), then ``RESULT lowbit ...``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_memory  # noqa: E402 - the memory model lives next to this file

from asrforge.config import LoraConfig, OptimConfig  # noqa: E402
from asrforge.evaluation.evaluate import token_loss  # noqa: E402
from asrforge.model.lora import add_adapters  # noqa: E402
from asrforge.model.lowbit import prepare_for_training, quantization_config  # noqa: E402
from asrforge.train.optim import build_optimizer  # noqa: E402

MIB = 2**20


def shape(quick: bool) -> bench_memory.Shape:
    if quick:
        return bench_memory.Shape(d_model=64, vocab=1000, enc_frames=100, dec_tokens=32)
    return bench_memory.Shape(
        d_model=384, encoder_layers=4, decoder_layers=4, vocab=51864, enc_frames=500,
        dec_tokens=64,
    )  # fmt: skip


def whisper_config(s: bench_memory.Shape):
    from transformers import WhisperConfig

    return WhisperConfig(
        vocab_size=s.vocab, d_model=s.d_model, encoder_layers=s.encoder_layers,
        decoder_layers=s.decoder_layers, encoder_attention_heads=s.heads,
        decoder_attention_heads=s.heads, encoder_ffn_dim=s.ffn, decoder_ffn_dim=s.ffn,
        num_mel_bins=s.n_mels, max_source_positions=s.enc_frames,
        max_target_positions=s.dec_tokens, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        decoder_start_token_id=1, dropout=0.0,
    )  # fmt: skip


def steps(model, optimizer, s: bench_memory.Shape, n: int) -> list[float]:
    """Seconds of each of ``n`` steps after one warm-up step."""
    torch.manual_seed(1)
    feats = torch.randn(s.batch, s.n_mels, 2 * s.enc_frames)
    ids = torch.randint(2, s.vocab, (s.batch, s.dec_tokens))
    times = []
    model.train()
    for i in range(1 + n):
        t = time.perf_counter()
        logits = model(input_features=feats, decoder_input_ids=ids[:, :-1], use_cache=False).logits
        token_loss(logits, ids[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t)
    return times


def state_bytes(optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (bitsandbytes' codes, scales and maps)."""
    total = 0
    for st in optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


def base_bytes(model) -> int:
    """Bytes of the model's tensors but the adapters: parameters, buffers and, for a 4-bit
    layer, its quantization state (scales, their scales, the code map); the output projection
    shares the token embedding's storage and counts once."""
    seen, total = set(), 0
    for name, t in model.state_dict().items():
        if ".lora_" in name or not torch.is_tensor(t):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def full_runs(s: bench_memory.Shape, n: int) -> list[dict]:
    from transformers import WhisperForConditionalGeneration

    rows = []
    for optimizer_name in ("adamw", "adamw_8bit"):
        torch.manual_seed(0)
        model = WhisperForConditionalGeneration(whisper_config(s))
        optimizer = build_optimizer(model, OptimConfig(lr=1e-5, optimizer=optimizer_name))
        times = steps(model, optimizer, s, n)
        trained = [p for p in model.parameters() if p.requires_grad]
        big = [p.numel() for p in trained if p.numel() >= 4096]
        small = sum(p.numel() for p in trained) - sum(big)
        per = bench_memory.ADAM_BYTES[optimizer_name]
        predicted = per * sum(big) + 8 * small
        if optimizer_name == "adamw_8bit":
            # each 8-bit tensor has two 256-entry fp32 code maps
            predicted += 2 * 256 * 4 * len(big)
        rows.append({
            "side": f"full, {optimizer_name}", "step_s": statistics.median(times),
            "measured": state_bytes(optimizer), "predicted": predicted, "what": "Adam state",
        })  # fmt: skip
        del model, optimizer
    return rows


def lora_runs(s: bench_memory.Shape, n: int, r: int, targets: list[str]) -> list[dict]:
    from transformers import WhisperForConditionalGeneration

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        WhisperForConditionalGeneration(whisper_config(s)).save_pretrained(tmp)
        for quantize in (None, "4bit", "8bit"):
            if quantize is None:
                model = WhisperForConditionalGeneration.from_pretrained(tmp)
            else:
                model = WhisperForConditionalGeneration.from_pretrained(
                    tmp,
                    quantization_config=quantization_config(quantize, "fp32"),
                    device_map={"": "cpu"},
                )
                prepare_for_training(model, gradient_checkpointing=False)
            add_adapters(model, LoraConfig(r=r, target_modules=targets))
            optimizer = build_optimizer(model, OptimConfig(lr=1e-4))
            times = steps(model, optimizer, s, n)
            p_all = bench_memory.parameters(s)[0]
            linear, rows_out = bench_memory.linear_weights(s)
            predicted = (
                4 * (p_all - linear)
                + bench_memory.BASE_BYTES[quantize] * linear
                + (4 * rows_out if quantize == "8bit" else 0)
            )
            rows.append({
                "side": f"LoRA r{r}, {quantize or 'fp32'} base", "step_s": statistics.median(times),
                "measured": base_bytes(model), "predicted": predicted, "what": "base weights",
            })  # fmt: skip
            del model, optimizer
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    s = shape(args.quick)
    print(
        f"shape: d_model {s.d_model}, {s.encoder_layers}+{s.decoder_layers} layers, vocab "
        f"{s.vocab}, {s.enc_frames} encoder frames, {s.dec_tokens} tokens, batch {s.batch}; "
        f"{bench_memory.parameters(s)[0]:,} parameters"
    )
    rows = full_runs(s, args.steps) + lora_runs(s, args.steps, args.r, args.targets)
    for row in rows:
        error = (row["predicted"] - row["measured"]) / row["measured"]
        print(
            f"{row['side']:>24}: step {row['step_s']:.3f} s | {row['what']} "
            f"{row['measured'] / MIB:.2f} MiB (model {row['predicted'] / MIB:.2f}, {error:+.1%})"
        )
    by = {row["side"]: row for row in rows}
    full, full8 = by["full, adamw"], by["full, adamw_8bit"]
    base, base4 = by[f"LoRA r{args.r}, fp32 base"], by[f"LoRA r{args.r}, 4bit base"]
    print(
        f"RESULT lowbit adam_state_8bit/fp32={full8['measured'] / full['measured']:.3f} "
        f"step_8bit/fp32={full8['step_s'] / full['step_s']:.2f} "
        f"base_4bit/fp32={base4['measured'] / base['measured']:.3f} "
        f"lora_step_4bit/fp32={base4['step_s'] / base['step_s']:.2f}"
    )
    return rows


if __name__ == "__main__":
    main()
