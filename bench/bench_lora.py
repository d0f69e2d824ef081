"""LoRA against full fine-tuning: step time and peak memory of the same training step.

    .venv/bin/python bench/bench_lora.py                 # tiny.en shape, 30 s windows, batch 4
    .venv/bin/python bench/bench_lora.py --quick         # 2+2 layers, d_model 64 (smoke test)

Each variant runs in its own process (peak RSS is per process): a Whisper of tiny.en's shape
with random weights (the speed and memory of a step do not depend on the values), random
log-mels and labels, asrforge's optimizer (``build_optimizer``: fused AdamW over the trainable
parameters) and loss; a step is forward, backward, optimizer step, zero grads. LoRA is
``model.lora``'s default (r 8, alpha 16, q_proj and v_proj) unless ``--targets`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def shape(quick: bool) -> dict:
    if quick:
        return dict(
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=256,
            decoder_ffn_dim=256,
            vocab_size=1000,
            max_source_positions=100,
            max_target_positions=64,
        )
    return dict(
        d_model=384,
        encoder_layers=4,
        decoder_layers=4,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
        vocab_size=51864,
        max_source_positions=1500,
        max_target_positions=448,
    )


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from asrforge.config import LoraConfig, OptimConfig
    from asrforge.evaluation.evaluate import token_loss
    from asrforge.model.lora import add_adapters
    from asrforge.train.optim import build_optimizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    s = shape(args.quick)
    config = WhisperConfig(
        **s, pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=1
    )
    model = WhisperForConditionalGeneration(config)
    if variant == "lora":
        add_adapters(model, LoraConfig(r=args.r, target_modules=args.targets))
    model.train()
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4))
    frames = 2 * s["max_source_positions"]
    feats = torch.randn(args.batch, 80, frames)
    ids = torch.randint(2, s["vocab_size"], (args.batch, 40))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for i in range(args.warmup + args.steps):
        t = time.perf_counter()
        logits = model(input_features=feats, decoder_input_ids=ids[:, :-1], use_cache=False).logits
        loss = token_loss(logits, ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "variant": variant,
        "trainable": trainable,
        "total": sum(p.numel() for p in model.parameters()),
        "step_s": statistics.median(times),
        "steps_s": times,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_steps_mib": rss_before / 1024,
        "optimizer_state_mib": sum(
            t.numel() * t.element_size()
            for st in optimizer.state.values()
            for t in st.values()
            if torch.is_tensor(t)
        )
        / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"])
    p.add_argument("--variant", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:  # the child: one variant, its result as JSON on the last line
        print(json.dumps(run_variant(args.variant, args)))
        return
    results = {}
    for variant in ("full", "lora"):
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--variant", variant],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    full, lora = results["full"], results["lora"]
    for r in (full, lora):
        print(
            f"{r['variant']:>4}: trainable {r['trainable']:,} of {r['total']:,} | step "
            f"{r['step_s']:.3f} s (median of {len(r['steps_s'])}) | peak RSS "
            f"{r['peak_rss_mib']:.0f} MiB (before the first step {r['rss_before_steps_mib']:.0f})"
            f" | AdamW state {r['optimizer_state_mib']:.1f} MiB"
        )
    print(
        f"LoRA/full: step time {lora['step_s'] / full['step_s']:.2f}x, peak RSS "
        f"{lora['peak_rss_mib'] / full['peak_rss_mib']:.2f}x, growth during training "
        f"{(lora['peak_rss_mib'] - lora['rss_before_steps_mib']):.0f} vs "
        f"{(full['peak_rss_mib'] - full['rss_before_steps_mib']):.0f} MiB"
    )


if __name__ == "__main__":
    main()
