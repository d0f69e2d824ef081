"""Time to the first optimizer step, and peak RSS up to it, on a NeMo manifest of N lines.

How long does a launch on a large corpus take before it trains, and does its memory grow with
the corpus? A good start takes <= 30 s on 1,000,000 lines, with a start-up peak RSS that does not
grow with the corpus.

Workload (built once under ``--work-dir``):

* audio: 8 short WAV clips (tones, 0.6-1.7 s, 16 kHz), repeated: line ``i`` names clip
  ``i % 8`` by its absolute path, with its real ``duration``, and a ``text`` of 4 words that
  differs from line to line;
* data: per size, a directory as NeMo writes it, ``train_manifest.json`` (N lines) and
  ``dev_manifest.json`` (16 lines); ``data.path`` is the directory (its file names give the
  splits), as a NeMo user with a train and a dev manifest would point at it (``--layout carve``:
  ``data.path`` is the train manifest alone and ``data.eval_carve`` holds 16 rows out; the
  transformers side loads that file and calls ``train_test_split(test_size=16)``);
* model: a 2+2-layer d_model 64 Whisper on 2 s windows (``workload.quick_model``) with a
  300-token BPE, saved once as a transformers directory (weights, tokenizer, feature
  extractor): both sides load it as a pretrained model, so neither trains a tokenizer on the
  corpus and the first step itself costs milliseconds.

Sides, each launched as its own child process per size (so its memory is its own):

* ``asrforge``: ``asrforge train`` on the directory, ``data.language: en``, batch 4, fp32,
  ``--steps`` steps, no evaluation; ``--modes map,stream`` (the default): the map-style loader
  and the streaming path (``data.stream.enabled: true``; skipped with a message when the config
  has no such key);
* ``hf``: transformers' usual recipe on the same two manifests:
  ``datasets.load_dataset("json", ...)``, a lazy ``with_transform`` reading the audio and
  computing log-mels and labels of the rows a batch takes, ``Seq2SeqTrainer`` with the usual
  padding collator, the same batch size and steps (see ``startup_child.py``).

Measured per run: seconds from the parent's launch of the child to the end of the first
optimizer step (the child's wall clock at that moment: asrforge's "time to first step" log
record, transformers' ``on_step_end``; both the same ``time.time()`` clock as the parent's),
the child's start-up phases (asrforge's own breakdown, as its log prints it; the transformers
side's, timed by the child), and the child's peak RSS at that moment (``VmHWM``, with the
resident anonymous and file-backed memory then: memory-mapped Arrow pages count in RSS).

``--cache cold``: each run gets a fresh ``datasets`` cache (the JSON -> Arrow conversion happens
in the run); ``warm``: a second run reuses it (what a resumed run, another rank or the next
experiment on the same data sees). asrforge gets the cache as ``data.cache_dir`` (so its own
caches are shared too), transformers as ``load_dataset(cache_dir=...)``; both also run with
``HF_DATASETS_CACHE`` and ``HF_HOME`` under the work directory, so nothing reaches ``~/.cache``.

Run::

    .venv/bin/python bench/bench_startup.py                       # 10k, 100k, 1M; cold and warm
    .venv/bin/python bench/bench_startup.py --sizes 10000,100000 --modes map,stream

Prints one row per run, then per size and cache
``RESULT startup lines=N cache=C seconds asrforge/map=X hf=Y ratio_hf_over asrforge/map=Z
rss_mb asrforge/map=A hf=B`` (ratio above 1: asrforge reaches its first step sooner), per side
``RESULT startup rss_growth SIDE cache=C lines N0->N1 peak_mb A->B (+D)``, and writes every
figure to ``--out`` (default ``WORK/startup.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

CHILD = Path(__file__).resolve().with_name("startup_child.py")
SAMPLE_RATE = 16000
N_CLIPS = 8
DEV_LINES = 16
MB = 10**6


def words() -> list[str]:
    """The vocabulary of the synthetic transcripts: the words of ``workload.SENTENCES``."""
    from workload import SENTENCES

    seen = dict.fromkeys(w.strip(".,").lower() for s in SENTENCES for w in s.split())
    return list(seen)


def make_clips(work: Path) -> list[tuple[Path, float]]:
    """``N_CLIPS`` tone clips of 0.6-1.7 s under ``work/clips``: (absolute path, seconds)."""
    import numpy as np
    import soundfile as sf

    out = []
    for k in range(N_CLIPS):
        path = (work / "clips" / f"clip-{k}.wav").absolute()
        n = int((0.6 + 0.15 * k) * SAMPLE_RATE)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            t = np.arange(n) / SAMPLE_RATE
            tone = 0.3 * np.sin(2 * np.pi * (220 + 55 * k) * t)
            sf.write(path, tone.astype(np.float32), SAMPLE_RATE, subtype="PCM_16")
        out.append((path, n / SAMPLE_RATE))
    return out


def make_model(work: Path) -> Path:
    """The quick model with a BPE trained on ``workload.SENTENCES`` (whose words the transcripts
    use), saved as a transformers directory (weights, tokenizer, feature extractor)."""
    out = work / "model"
    if (out / "config.json").is_file():
        return out
    from workload import SENTENCES, quick_model

    from asrforge.config import ModelConfig
    from asrforge.model.build import build_model
    from asrforge.model.tokenizer import train_bpe_tokenizer

    cfg = ModelConfig(**quick_model(max_source_positions=100, max_target_positions=64))
    tokenizer = train_bpe_tokenizer(SENTENCES * 4, cfg.bpe_vocab_size)
    bundle = build_model(cfg, tokenizer, seed=0)
    tmp = work / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    bundle.model.save_pretrained(tmp)
    bundle.tokenizer.save_pretrained(tmp)
    bundle.features.save_pretrained(tmp)
    tmp.rename(out)
    return out


def transcript(i: int, vocab: list[str]) -> str:
    """Line ``i``'s text: 4 words picked by ``i`` (neighbouring lines differ)."""
    w = len(vocab)
    return " ".join(vocab[(i * p + q) % w] for p, q in ((1, 0), (7, 3), (31, 5), (127, 11)))


def write_manifests(work: Path, n: int, clips: list[tuple[Path, float]]) -> Path:
    """``work/manifest-N/{train,dev}_manifest.json`` (built once per size)."""
    out = work / f"manifest-{n}"
    if (out / "train_manifest.json").is_file():
        return out
    vocab = words()
    tmp = work / f"manifest-{n}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, lines, offset in (("train", n, 0), ("dev", DEV_LINES, 10**9)):
        with open(tmp / f"{name}_manifest.json", "w", encoding="utf-8") as f:
            for i in range(lines):
                path, seconds = clips[i % len(clips)]
                f.write(json.dumps({"audio_filepath": str(path), "duration": seconds,
                                    "text": transcript(offset + i, vocab)}) + "\n")  # fmt: skip
    tmp.rename(out)
    return out


def asrforge_config(run_dir: Path, data: Path, model: Path, cache: Path, args, mode: str) -> Path:
    """The run's YAML config (JSON is YAML), written beside the run directory."""
    data_section = {"path": str(data), "language": "en", "batch_size": args.batch_size,
                    "cache_dir": str(cache)}  # fmt: skip
    if args.layout == "carve":  # the train manifest alone, 16 rows held out for evaluation
        data_section.update(path=str(data / "train_manifest.json"),
                            eval_carve={"size": DEV_LINES, "seed": 0})  # fmt: skip
    if mode == "stream":
        data_section["stream"] = {"enabled": True}
    cfg = {
        "output_dir": str(run_dir),
        "seed": 0,
        "model": {"pretrained": str(model)},
        "data": data_section,
        "optim": {"lr": 1e-4, "warmup_steps": 0},
        "train": {"max_steps": args.steps, "device": "cpu", "precision": "no", "log_every": 1},
        "eval": {"eval_steps": None, "at_end": False},
        "checkpoint": {"save_on_eval": False, "checkpoint_every": None},
    }
    path = run_dir.with_suffix(".yaml")
    path.write_text(json.dumps(cfg, indent=1))
    return path


def stream_supported() -> bool:
    """Whether this asrforge has ``data.stream`` (the streaming path)."""
    from asrforge.config import DataConfig

    return "stream" in DataConfig.model_fields


def child_env(work: Path, threads: int) -> dict[str, str]:
    """The children's environment: this checkout first on the path, caches under ``work``,
    offline, ``threads`` intra-op threads."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    hf_home = work / "hf-home"
    env.update(HF_HOME=str(hf_home), HF_DATASETS_CACHE=str(hf_home / "datasets"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")  # fmt: skip
    return env


def run_child(argv: list[str], result: Path, env: dict, log: Path, timeout: float) -> dict:
    """Launch ``startup_child.py ARGV``, wait, and return its result with
    ``seconds``: from just before the launch to the end of its first optimizer step."""
    result.unlink(missing_ok=True)
    with open(log, "wb") as out:
        t0 = time.time()
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), *argv], stdout=out, stderr=out, env=env
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"error": f"timed out after {timeout:.0f} s (log {log})"}
    if not result.exists():
        tail = log.read_text(errors="replace")[-1500:]
        return {"error": f"exit code {code}, no first step; log {log}:\n{tail}"}
    got = json.loads(result.read_text())
    got["seconds"] = got.pop("first_step_time") - t0
    got["exit_code"] = code
    return got


def measure(side: str, size: int, cache_kind: str, data: Path, model: Path, work: Path,
            args) -> dict:  # fmt: skip
    """One launch of ``side`` (``asrforge/map``, ``asrforge/stream`` or ``hf``) on ``data``."""
    tag = side.replace("/", "-")
    cache = work / "caches" / f"{tag}-{size}"
    if cache_kind == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    run_dir = work / "runs" / f"{tag}-{size}-{cache_kind}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    result, log = run_dir.with_suffix(".result.json"), run_dir.with_suffix(".log")
    if side == "hf":
        argv = ["hf", str(result), str(data), str(model), str(cache), str(run_dir), args.layout,
                str(args.batch_size), str(args.steps)]  # fmt: skip
    else:
        config = asrforge_config(run_dir, data, model, cache, args, mode=side.split("/")[1])
        argv = ["asrforge", str(result), "train", str(config)]
    row = {"side": side, "lines": size, "cache": cache_kind, "layout": args.layout,
           "load": os.getloadavg()[0]}  # fmt: skip
    row.update(run_child(argv, result, child_env(work, args.threads), log, args.timeout))
    if "error" not in row:  # start-up the phases do not name (asrforge: set-up between its laps)
        row["unaccounted"] = row["seconds"] - sum(row["phases"].values())
    print(describe(row), flush=True)
    return row


def describe(row: dict) -> str:
    """One printed row: seconds to the first step, CPU seconds, peak RSS, load, phases."""
    head = f"{row['side']:<15} {row['lines']:>9,} lines  {row['cache']:<4}"
    if "error" in row:
        return f"{head}  FAILED: {row['error']}"
    phases = ", ".join(f"{k} {v:.2f}" for k, v in row["phases"].items())
    return (
        f"{head}  first step {row['seconds']:7.2f} s (CPU {row['cpu_seconds']:6.2f} s)  "
        f"peak RSS {row['VmHWM'] / MB:6.0f} MB (anon {row['RssAnon'] / MB:.0f}, "
        f"file {row['RssFile'] / MB:.0f})  load {row['load']:.1f}  "
        f"[{phases}, unaccounted {row['unaccounted']:.2f}]"
    )


def summarize(rows: list[dict]) -> list[str]:
    """One RESULT line per (size, cache): each side's seconds to the first step, hf / asrforge,
    peak RSS; then per side and cache, the peak RSS from the smallest to the largest size."""
    ok = [r for r in rows if "error" not in r]
    lines = []
    for size, cache in dict.fromkeys((r["lines"], r["cache"]) for r in rows):
        group = {r["side"]: r for r in ok if (r["lines"], r["cache"]) == (size, cache)}
        secs = " ".join(f"{s}={r['seconds']:.2f}" for s, r in group.items())
        ratios = " ".join(f"{s}={group['hf']['seconds'] / r['seconds']:.2f}"
                          for s, r in group.items() if s != "hf" and "hf" in group)  # fmt: skip
        rss = " ".join(f"{s}={r['VmHWM'] / MB:.0f}" for s, r in group.items())
        failed = [r["side"] for r in rows if (r["lines"], r["cache"]) == (size, cache)
                  and "error" in r]  # fmt: skip
        line = f"RESULT startup lines={size} cache={cache} seconds {secs}"
        line += f" ratio_hf_over {ratios}" if ratios else ""
        line += f" rss_mb {rss}" + (f" failed {','.join(failed)}" if failed else "")
        lines.append(line)
    for side, cache in dict.fromkeys((r["side"], r["cache"]) for r in ok):
        by_size = sorted(
            (r["lines"], r["VmHWM"]) for r in ok if (r["side"], r["cache"]) == (side, cache)
        )
        if len(by_size) > 1:
            (n0, m0), (n1, m1) = by_size[0], by_size[-1]
            lines.append(f"RESULT startup rss_growth {side} cache={cache} lines {n0}->{n1} "
                         f"peak_mb {m0 / MB:.0f}->{m1 / MB:.0f} ({(m1 - m0) / MB:+.0f})")  # fmt: skip
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes",
        default="10000,100000,1000000",
        help="manifest lines, comma-separated (default 10000,100000,1000000)",
    )
    p.add_argument(
        "--modes",
        default="map,stream",
        help="asrforge data paths: map (default loader) and/or stream "
        "(data.stream.enabled; skipped when the config has no such key)",
    )
    p.add_argument("--sides", default="asrforge,hf", help="asrforge and/or hf")
    p.add_argument(
        "--cache",
        default="cold,warm",
        help="cold (a fresh datasets cache per run) and/or warm (reuse the cold run's)",
    )
    p.add_argument("--layout", choices=("dir", "carve"), default="dir",
                   help="dir: data.path is the directory of the train and dev manifests; carve: "
                   "the train manifest alone, data.eval_carve holding 16 rows out "
                   "(transformers: train_test_split)")  # fmt: skip
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per run (default 2)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the children")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child (default 3600)")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keeps clips, model and manifests between runs (default: a temporary "
        "directory, removed at the end)",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON result (default WORK/startup.json)")
    return p.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    here = Path(__file__).resolve().parent
    # workload, and this checkout's asrforge (the one the children run, see child_env)
    sys.path[:0] = [str(here), str(here.parent)]
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if "stream" in modes and "asrforge" in args.sides and not stream_supported():
        print("asrforge/stream: skipped, this asrforge has no data.stream config key yet")
        modes.remove("stream")
    sides = [f"asrforge/{m}" for m in modes] if "asrforge" in args.sides else []
    sides += ["hf"] if "hf" in args.sides else []
    caches = [c for c in args.cache.split(",") if c]
    with work_dir(args.work_dir) as work:
        clips, model = make_clips(work), make_model(work)
        rows = []
        for size in sizes:
            t = time.perf_counter()
            data = write_manifests(work, size, clips)
            print(
                f"manifest of {size:,} lines: {data} ({time.perf_counter() - t:.1f} s)", flush=True
            )
            for side in sides:
                for cache in caches:
                    rows.append(measure(side, size, cache, data, model, work, args))
            shutil.rmtree(work / "caches", ignore_errors=True)  # a 1M-line Arrow copy each
        results = summarize(rows)
        for line in results:
            print(line)
        out = args.out or work / "startup.json"
        if args.work_dir is None and args.out is None:
            out = Path(tempfile.gettempdir()) / "bench-startup.json"
        out.write_text(json.dumps({"rows": rows, "results": results}, indent=1))
        print(f"wrote {out}")
    return {"rows": rows, "results": results}


@contextlib.contextmanager
def work_dir(path: Path | None) -> Iterator[Path]:
    """``path`` (created), or a temporary directory removed at the end when ``path`` is None."""
    if path is None:
        with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
            yield Path(tmp)
    else:
        path.mkdir(parents=True, exist_ok=True)
        yield path.absolute()


if __name__ == "__main__":
    main()
