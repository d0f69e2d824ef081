"""Benchmark checkpoint IO on a Whisper-tiny-sized model (~39M parameters, random weights).

Measures:
  (a) ``save_training_checkpoint`` (atomic directory, safety checks, sha256 manifest computed
      while the files are written, independent files written concurrently, fsyncs; the manifest
      is then verified against the bytes on disk, outside the timing) against writing the same files' bytes plainly (open, write, fsync) and against the
      libraries' own writers (safetensors ``save_file`` + ``torch.save``, then fsync);
  (b) peak extra RSS of the process during a save (sampled every 2 ms from /proc);
  (c) peak RSS of ``average_checkpoints`` over k=5 checkpoints, in a fresh process, against the
      size of one checkpoint's weights.

Run: ``.venv/bin/python bench/bench_checkpoint.py [--repeats 3] [--dir /tmp/x]`` (about a minute).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import WhisperConfig, WhisperForConditionalGeneration

from asrforge.checkpoint.manifest import verify, write_manifest
from asrforge.checkpoint.training import (
    CheckpointContents,
    capture_rng_state,
    save_training_checkpoint,
    save_weights,
)

MiB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's RSS in a thread; ``peak - start`` is the extra memory used."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak, self._stop = every, 0, threading.Event()

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.every)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def build_state() -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Whisper-tiny shape: d_model 384, 4+4 layers, vocab 51865; AdamW state after one step."""
    cfg = WhisperConfig(
        vocab_size=51865,
        d_model=384,
        encoder_layers=4,
        decoder_layers=4,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=448,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model.state_dict(), opt.state_dict(), sched.state_dict()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_bytes_write(src: Path, dst: Path) -> float:
    """Write the bytes of every file of ``src`` into ``dst`` with open/write/fsync; seconds."""
    blobs = {p.relative_to(src): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    t0 = time.perf_counter()
    for rel, data in blobs.items():
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(dst / rel, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def library_write(dst: Path, model: dict, opt: dict) -> float:
    """safetensors + torch.save of the two big objects (tie dropped by hand), then fsync."""
    t0 = time.perf_counter()
    dst.mkdir(parents=True)
    weights = {k: v for k, v in model.items() if k != "proj_out.weight"}
    save_file(weights, str(dst / "model.safetensors"))
    torch.save(opt, dst / "optimizer.pt")
    for p in dst.iterdir():
        fsync_path(p)
    return time.perf_counter() - t0


_AVERAGE_CHILD = """
import re, sys
from pathlib import Path
from asrforge.checkpoint.average import average_checkpoints

def hwm():  # peak RSS of this process image (reset by exec, unlike ru_maxrss)
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\\s+(\\d+)", f.read()).group(1)) * 1024

base = hwm()
if sys.argv[1] == "run":
    average_checkpoints([Path(p) for p in sys.argv[3:]], Path(sys.argv[2]))
print(hwm(), base)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp)")
    args = ap.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="asrforge-bench-", dir=args.dir))
    try:
        return run(scratch, args.repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(scratch: Path, repeats: int) -> int:
    t0 = time.perf_counter()
    model, opt, sched = build_state()
    n_params = sum(v.numel() for k, v in model.items() if k != "proj_out.weight")
    print(f"model: {n_params / 1e6:.1f}M parameters (built in {time.perf_counter() - t0:.1f} s)")
    payload = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "rng": capture_rng_state(),
        "train_state": {"step": 1000, "epoch": 1},
        "callbacks": {},
        "config_yaml": "seed: 0\n",
    }

    ours, plain, lib, extra = [], [], [], []
    for i in range(repeats):
        with PeakRSS() as mem:
            t = time.perf_counter()
            ck = save_training_checkpoint(
                scratch / f"ours-{i}", CheckpointContents(**payload, meta={"step": 1000})
            )
            ours.append(time.perf_counter() - t)
        extra.append(mem.peak - mem.start)
        verify(ck, check_hashes=True)  # the one-pass hashes match what is on disk
        plain.append(plain_bytes_write(ck, scratch / f"plain-{i}"))
        lib.append(library_write(scratch / f"lib-{i}", model, opt))
        size = sum(p.stat().st_size for p in ck.rglob("*") if p.is_file())
        for name in (f"ours-{i}", f"plain-{i}", f"lib-{i}"):
            shutil.rmtree(scratch / name)
    med = statistics.median

    # (c) averaging: five checkpoints with different weights, averaged in a fresh process.
    ckpts = []
    for i in range(5):
        d = scratch / f"avg-in-{i}"
        d.mkdir()
        noisy = {k: v + 0.01 * i for k, v in model.items()}
        noisy["proj_out.weight"] = noisy["model.decoder.embed_tokens.weight"]
        save_weights(d / "model.safetensors", noisy)
        (d / "config.yaml").write_text("seed: 0\n")
        write_manifest(d, {"step": i})
        ckpts.append(d)
        del noisy
    one = (ckpts[0] / "model.safetensors").stat().st_size
    del model, opt, payload

    def child(*argv: str) -> tuple[int, int, float]:
        t = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", _AVERAGE_CHILD, *argv],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        ).stdout.split()
        return int(out[0]), int(out[1]), time.perf_counter() - t

    peak, idle, avg_s = child("run", str(scratch / "avg-out"), *map(str, ckpts))

    rows = [
        ("checkpoint size on disk", f"{size / MiB:.0f} MiB", ""),
        (
            "(a) save_training_checkpoint",
            f"{med(ours):.2f} s",
            f"{size / MiB / med(ours):.0f} MiB/s",
        ),
        (
            "    same bytes, write+fsync",
            f"{med(plain):.2f} s",
            f"{size / MiB / med(plain):.0f} MiB/s",
        ),
        ("    save_file+torch.save+fsync", f"{med(lib):.2f} s", ""),
        ("    ratio ours / plain bytes", f"{med(ours) / med(plain):.2f}x", "manifest verified"),
        ("    ratio ours / library writers", f"{med(ours) / med(lib):.2f}x", ""),
        (
            "(b) peak extra RSS during save",
            f"{max(extra) / MiB:.0f} MiB",
            f"{max(extra) / size:.2f}x ckpt",
        ),
        ("(c) average k=5: one weights file", f"{one / MiB:.0f} MiB", ""),
        ("    peak RSS of the averaging process", f"{peak / MiB:.0f} MiB", f"{avg_s:.1f} s"),
        ("    same process before averaging", f"{idle / MiB:.0f} MiB", "(imports)"),
        (
            "    averaging's own peak",
            f"{(peak - idle) / MiB:.0f} MiB",
            f"{(peak - idle) / one:.2f}x one",
        ),
    ]
    print(f"\nrepeats: {repeats} (median times)   scratch: {scratch}")
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10}  {note}")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
