"""A run streamed from an fsspec URL (``file://``: the same code reads ``s3://``, ``gs://``,
``hf://``), its data set's configurations declared in a README.md as a Hub data set's are,
killed with SIGKILL mid-run and resumed: its final weights equal an uninterrupted run's, bit for
bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from asrforge.checkpoint.manager import CheckpointManager
from tests.conftest import tiny_config
from tests.test_hub_data import repo_files  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parents[1]
TOTAL = 12


def _config(tmp_path: Path, name: str, url: str, dev: Path) -> Path:
    cfg = tiny_config(
        tmp_path / name, "unused",
        data={"path": url, "subset": "all", "batch_size": 5,
              "stream": {"enabled": True, "shuffle_shards": 2, "eval_path": str(dev)}},
        model={"dropout": 0.1}, train={"max_steps": TOTAL},
        eval={"eval_steps": None, "at_end": False, "at_start": False},
        checkpoint={"checkpoint_every": 1, "save_total_limit": 2},
    )  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(cfg.to_yaml())
    return path


def _train(cfg: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "asrforge", "train", str(cfg), *extra],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def test_a_stream_from_a_url_killed_mid_run_resumes_bit_identically(tmp_path, repo_files):  # noqa: F811
    corpus = tmp_path / "corpus"
    for name, data in repo_files.items():
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_bytes(data.encode() if isinstance(data, str) else data)
    url, dev = f"file://{corpus}", corpus / "all" / "validation-00000-of-00001.parquet"

    full = _train(_config(tmp_path, "full", url, dev))
    assert full.wait(timeout=300) == 0, full.stderr.read()[-2000:]

    cfg = _config(tmp_path, "split", url, dev)
    ckpts = tmp_path / "split" / "checkpoints"

    def newest() -> int:
        steps = CheckpointManager(ckpts).step_dirs() if ckpts.exists() else []
        return max((step for step, _ in steps), default=0)

    proc = _train(cfg)
    deadline = time.monotonic() + 300
    while proc.poll() is None and newest() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # into the next step, mid-shard
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 3 <= newest() < TOTAL

    resumed = _train(cfg, "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()[-2000:]
    a = load_file(tmp_path / "full/checkpoints/latest/model.safetensors")
    b = load_file(tmp_path / "split/checkpoints/latest/model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
