"""Peak memory of averaging and exporting sharded weights against one weights file.

A random Whisper of ``--d-model`` with ``--layers`` + ``--layers`` layers and Whisper's
vocabulary (about 170M parameters, 0.7 GB in fp32, by default) is saved ``--k`` times with
different weights, once as one ``model.safetensors`` and once as shards of ``--shard-mb`` MB (100).
In a fresh process each (peak RSS from ``VmHWM``, minus the same process's peak before the work,
which holds the imports):

* ``average``: ``average_checkpoints`` over the k checkpoints;
* ``export``: what ``asrforge export`` does with the weights of a checkpoint with EMA: the raw
  weights with the EMA tensors put over them (``ema_weights``, read lazily) written as the
  bundle's weights (``save_weights_sharded``), with the same layout as the input.

Run: ``.venv/bin/python bench/bench_shards.py [--shard-mb 100] [--dir /tmp/x]`` (writes 4.2 GB).
Prints one row per operation and layout, then
``RESULT shards average_peak one=X MB sharded=Y MB export_peak one=Z MB sharded=W MB``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 10**6

_CHILD = """
import re, sys
from pathlib import Path

def hwm():  # peak RSS of this process image
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\\s+(\\d+)", f.read()).group(1)) * 1024

from asrforge.bundle.contents import ema_weights
from asrforge.checkpoint.average import average_checkpoints
from asrforge.checkpoint.training import save_weights_sharded

base = hwm()
what, out, max_bytes, *inputs = sys.argv[1:]
if what == "average":
    average_checkpoints([Path(p) for p in inputs], Path(out))
else:
    Path(out).mkdir()
    limit = int(max_bytes) or None
    save_weights_sharded(Path(out), "model", ema_weights(Path(inputs[0])), max_shard_bytes=limit)
print(hwm(), base)
"""


def build(scratch: Path, layout: str, k: int, d_model: int, layers: int, shard: int | None):
    """k checkpoint directories (weights, EMA weights, manifest) in ``layout``."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from asrforge.checkpoint.manifest import write_manifest
    from asrforge.checkpoint.training import save_weights_sharded

    cfg = WhisperConfig(
        vocab_size=51866, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=d_model // 64, decoder_attention_heads=d_model // 64,
        encoder_ffn_dim=4 * d_model, decoder_ffn_dim=4 * d_model, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    state = WhisperForConditionalGeneration(cfg).state_dict()
    dirs = []
    for i in range(k):
        d = scratch / f"{layout}-{i}"
        d.mkdir()
        noisy = {name: t + 0.01 * i for name, t in state.items()}
        noisy["proj_out.weight"] = noisy["model.decoder.embed_tokens.weight"]
        digests = save_weights_sharded(d, "model", noisy, max_shard_bytes=shard)
        ema = {n: t for n, t in noisy.items() if n.startswith("model.encoder.layers")}
        digests |= save_weights_sharded(d, "ema", ema, max_shard_bytes=shard)
        (d / "config.yaml").write_text("seed: 0\n")
        write_manifest(d, {"step": i, "kind": "training"}, known=digests)
        dirs.append(d)
    size = sum(p.stat().st_size for p in dirs[0].glob("model*.safetensors"))
    files = len(list(dirs[0].glob("model*.safetensors")))
    return dirs, size, files


def child(what: str, out: Path, shard: int | None, inputs: list[Path]) -> tuple[int, float]:
    """Peak RSS of the work alone (bytes) and its wall time."""
    t = time.perf_counter()
    argv = [sys.executable, "-c", _CHILD, what, str(out), str(shard or 0), *map(str, inputs)]
    root = Path(__file__).resolve().parents[1]
    got = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=root)
    peak, base = map(int, got.stdout.split()[-2:])
    return peak - base, time.perf_counter() - t


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8, help="encoder and decoder layers each")
    ap.add_argument("--k", type=int, default=3, help="checkpoints averaged")
    ap.add_argument("--shard-mb", type=float, default=100.0)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp)")
    args = ap.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="asrforge-shards-", dir=args.dir))
    shard = int(args.shard_mb * MB)
    results: dict = {}
    try:
        for layout, limit in (("one", None), ("sharded", shard)):
            dirs, size, files = build(scratch, layout, args.k, args.d_model, args.layers, limit)
            avg, avg_s = child("average", scratch / f"{layout}-avg", limit, dirs)
            exp, exp_s = child("export", scratch / f"{layout}-export", limit, dirs[:1])
            results[layout] = {"size": size, "files": files, "average": avg, "export": exp}
            print(
                f"{layout:>7}: weights {size / MB:.0f} MB in {files} file(s); "
                f"average k={args.k}: +{avg / MB:.0f} MB peak RSS ({avg_s:.1f} s); "
                f"export weights: +{exp / MB:.0f} MB ({exp_s:.1f} s)"
            )
            for d in scratch.iterdir():
                shutil.rmtree(d)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    one, sharded = results["one"], results["sharded"]
    print(
        f"RESULT shards average_peak one={one['average'] / MB:.0f} MB "
        f"sharded={sharded['average'] / MB:.0f} MB export_peak one={one['export'] / MB:.0f} MB "
        f"sharded={sharded['export'] / MB:.0f} MB (weights {one['size'] / MB:.0f} MB, "
        f"{sharded['files']} shards)"
    )
    return results


if __name__ == "__main__":
    main()
