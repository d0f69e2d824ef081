"""Exact resume: a run stopped and resumed gives the same per-step losses and final weights as
an uninterrupted run (bit-identical on CPU), with data order, selection state and patience."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from asrforge.callbacks import build_callbacks
from asrforge.checkpoint import CheckpointManager
from asrforge.checkpoint.manifest import verify
from asrforge.errors import ExitCode
from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]


class Losses(Callback):
    name = "losses"

    def __init__(self):
        self.by_step: dict[int, float] = {}

    def on_step_end(self, state, *, metrics):
        self.by_step[state.step] = metrics["loss"]


class PreemptAt(Callback):
    """Sends this process SIGTERM at a step, as a cluster's preemption would."""

    name = "preempt_at"

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, state, *, metrics):
        if state.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def run(cfg, extra, resume=False):
    rec = Losses()
    result = Trainer(cfg, [rec, *extra, *build_callbacks(cfg)]).fit(resume=resume)
    return rec.by_step, result


def assert_resume_is_bit_identical(
    tmp_path: Path,
    data_path: Path,
    sections: dict,
    stop_at: int = 2,
    weights: tuple[str, ...] = ("model.safetensors",),
) -> dict:
    """Run ``sections`` on ``data_path`` whole (``tmp_path/full``), and stopped after step
    ``stop_at`` then resumed (``tmp_path/split``): the same per-step losses and final
    ``weights`` files (e.g. ``ema.safetensors`` too), exactly. Returns the stopped run's
    ``train_state.json``."""
    full, full_result = run(tiny_config(tmp_path / "full", data_path, **sections), [])
    assert full_result.status == "completed", full_result.reason  # e.g. a stray SIGTERM
    cfg = tiny_config(tmp_path / "split", data_path, **sections)
    first, interrupted = run(cfg, [PreemptAt(stop_at)])
    assert interrupted.status == "interrupted" and sorted(first) == list(range(1, stop_at + 1))
    state = json.loads((tmp_path / "split/checkpoints/latest/train_state.json").read_text())
    second, _ = run(cfg, [], resume=True)
    assert {**first, **second} == full  # per-step losses, exactly
    for name in weights:
        a = load_file(tmp_path / "full/checkpoints/latest" / name)
        b = load_file(tmp_path / "split/checkpoints/latest" / name)
        assert a.keys() == b.keys(), name
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    return state


def test_resume_is_bit_identical(tmp_path, tones_dir):
    # dropout on, EMA on, grad accumulation across an epoch boundary (48 utterances / 8 = 6
    # micro-batches per epoch, 4 per step), evaluation with the selection policy in between.
    sections = dict(
        model={"dropout": 0.1}, train={"max_steps": 8, "grad_accum": 4, "ema_decay": 0.9},
        eval={"eval_steps": 3}, checkpoint={"save_total_limit": 5},
    )
    full_cfg = tiny_config(tmp_path / "full", tones_dir, **sections)
    full, full_result = run(full_cfg, [])

    cfg = tiny_config(tmp_path / "split", tones_dir, **sections)
    first, interrupted = run(cfg, [PreemptAt(4)])
    assert interrupted.status == "interrupted"
    assert sorted(first) == [1, 2, 3, 4]
    second, result = run(cfg, [], resume=True)
    assert sorted(second) == [5, 6, 7, 8]
    assert {**first, **second} == full  # per-step losses, exactly
    a = load_file(tmp_path / "full" / "checkpoints" / "latest" / "model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoints" / "latest" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ea = load_file(tmp_path / "full" / "checkpoints" / "latest" / "ema.safetensors")
    eb = load_file(tmp_path / "split" / "checkpoints" / "latest" / "ema.safetensors")
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
    # selection state and bests carried over
    sa = json.loads((tmp_path / "full" / "checkpoints" / "latest" / "train_state.json").read_text())
    sb = json.loads((tmp_path / "split" / "checkpoints" / "latest" / "train_state.json").read_text())
    for key in ("step", "epoch", "batch_in_epoch", "best", "best_step", "selection", "samples_seen"):
        assert sa[key] == sb[key], key
    assert result.best_step == full_result.best_step


def test_resume_without_flag_refuses_to_overwrite(tmp_path, tones_dir):
    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 2}, eval={"eval_steps": None})
    run(cfg, [])
    from asrforge.errors import UserError

    with pytest.raises(UserError, match="--resume"):
        run(cfg, [])


def _write_config(tmp_path: Path, tones_dir: Path, **sections) -> Path:
    cfg = tiny_config(tmp_path / "run", tones_dir, **sections)
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    return path


def _train_cmd(cfg_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "asrforge", "train", str(cfg_path), *extra]


def test_sigterm_finishes_the_step_saves_and_exits_interrupted(tmp_path, tones_dir):
    cfg_path = _write_config(tmp_path, tones_dir, train={"max_steps": 100000, "log_every": 1},
                             eval={"eval_steps": None, "at_end": False})
    proc = subprocess.Popen(_train_cmd(cfg_path), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics.exists() and metrics.read_text().count('"event": "train"') >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.INTERRUPTED == 75, out  # not 0: the run did not finish
    assert "SIGTERM received" in out and "interrupted" in out
    latest = tmp_path / "run" / "checkpoints" / "latest"
    manifest = verify(latest)
    state = json.loads((latest / "train_state.json").read_text())
    assert manifest["step"] == state["step"] >= 3


def test_sigkill_at_random_moments_never_leaves_a_torn_checkpoint(tmp_path, tones_dir):
    """Kill -9 a training process many times while it saves every step; every checkpoint on disk
    verifies, and the run still finishes by resuming."""
    import random

    total = 30
    cfg_path = _write_config(
        tmp_path, tones_dir, train={"max_steps": total}, eval={"eval_steps": None, "at_end": False},
        checkpoint={"checkpoint_every": 1, "save_total_limit": 2},
    )
    ckpts = tmp_path / "run" / "checkpoints"

    def newest_step() -> int:
        if not ckpts.exists():
            return 0
        return max((step for step, _ in CheckpointManager(ckpts).step_dirs()), default=0)

    rng = random.Random(0)
    kills = 0
    for _attempt in range(4):
        extra = ["--resume"] if ckpts.exists() else []
        before = newest_step()
        proc = subprocess.Popen(_train_cmd(cfg_path, *extra), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Kill on progress, not on a clock: once this process has saved a new step, it is in the
        # saving loop; kill it at a random moment of the next save or two. (A fixed sleep let a
        # fast machine finish all steps before the second kill.)
        deadline = time.monotonic() + 120
        while proc.poll() is None and newest_step() <= before and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.25))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
        for _step, path in CheckpointManager(ckpts).step_dirs():
            verify(path)  # raises on a torn checkpoint
        assert newest_step() < total, "the run finished before it could be killed again"
    assert kills == 4
    done = subprocess.run(_train_cmd(cfg_path, "--resume"), cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    latest = CheckpointManager(tmp_path / "run" / "checkpoints").latest_valid()
    assert verify(latest)["step"] == total
    cfg = yaml.safe_load(cfg_path.read_text())
    assert cfg["train"]["max_steps"] == total
