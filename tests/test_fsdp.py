"""Sharded training (``train.distributed: fsdp``): two CPU processes on gloo train the tiny
model sharded, as DDP would, save the optimizer state in DCP shards inside the atomic
checkpoint and the whole weights as usual, resume bit-identically, stop on SIGTERM on every
rank, and export; what sharding cannot run is refused up front."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from asrforge.bundle.export import export_bundle
from asrforge.bundle.load import load_bundle
from asrforge.checkpoint import CheckpointManager, load_training_checkpoint, load_weights
from asrforge.checkpoint.manifest import PRUNED_KEY, verify
from asrforge.checkpoint.sharded import SafeReader
from asrforge.config import ConfigError, load_config
from asrforge.errors import CheckpointError, UserError
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config
from tests.test_rank_signals import (
    finish,
    rank_exit_codes,
    rank_pid,
    rank_traceback,
    torchrun,
    wait_for_steps,
)

TIMEOUT = 180
FSDP = {"max_steps": 6, "log_every": 1, "distributed": "fsdp"}


def train_2(cfg_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", "-m", "asrforge", "train", str(cfg_path), *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def write_config(tmp_path: Path, name: str, data_dir: Path, **sections) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(tiny_config(tmp_path / name, data_dir, **sections).to_yaml())
    return path


def step_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("event") == "train"}


@pytest.mark.fast
def test_config_refuses_what_sharding_cannot_run(tmp_path, tones_dir):
    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, tones_dir, train={"distributed": "fsdp", "ema_decay": 0.9,
                                                "precision": "fp16"},
                    model={"freeze_encoder": True})  # fmt: skip
    message = str(e.value)
    assert "train.distributed: fsdp cannot be combined with" in message
    for refused in ("train.ema_decay", "train.precision: fp16", "model.freeze_encoder"):
        assert refused in message
    with pytest.raises(ConfigError, match="model.lora"):
        tiny_config(tmp_path, tones_dir, train={"distributed": "fsdp"}, model={"lora": {}})
    with pytest.raises(ConfigError, match="optim.optimizer: adamw_8bit"):
        tiny_config(
            tmp_path, tones_dir, train={"distributed": "fsdp"}, optim={"optimizer": "adamw_8bit"}
        )
    # the same sections train under ddp
    tiny_config(tmp_path, tones_dir, train={"ema_decay": 0.9}, model={"freeze_encoder": True})


def test_one_process_refuses_fsdp_and_leaves_no_run_dir(tmp_path, tones_dir):
    cfg = tiny_config(tmp_path / "run", tones_dir, train={"distributed": "fsdp"})
    with pytest.raises(UserError, match="has one; launch it with torchrun"):
        Trainer(cfg).fit()
    assert not (tmp_path / "run").exists()


class _Marker:
    """Unpickled, it would create a file: a stand-in for code an altered checkpoint runs."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.fast
def test_shard_metadata_naming_other_code_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Marker(str(marker))))
    with pytest.raises(CheckpointError, match="is not part of a DCP checkpoint"):
        SafeReader(tmp_path).read_metadata()
    assert not marker.exists()


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, tones_dir) -> Path:
    """Two processes, sharded, six steps with gradient checkpointing: evaluated at 3 and 6,
    saved every 2."""
    tmp_path = tmp_path_factory.mktemp("fsdp")
    sections = dict(train=FSDP, eval={"eval_steps": 3}, model={"gradient_checkpointing": True},
                    checkpoint={"checkpoint_every": 2, "save_total_limit": 5})  # fmt: skip
    train_2(write_config(tmp_path, "full", tones_dir, **sections))
    return tmp_path / "full"


def test_sharded_checkpoint_resumes_bit_identically_and_exports(sharded_run, tmp_path):
    # every rank's optimizer shard is in the sealed manifest, with the whole weights
    ckpts = sharded_run / "checkpoints"
    files = verify(ckpts / "step-000006")["files"]
    assert {"optimizer/.metadata", "optimizer/__0_0.distcp", "optimizer/__1_0.distcp"} <= set(files)
    assert "optimizer.pt" not in files and not list(ckpts.glob(".tmp-*"))

    # the same run cut back to its step-4 checkpoint, as a run stopped after that save
    cut = tmp_path / "cut"
    shutil.copytree(sharded_run, cut, symlinks=True)
    for name in ("step-000006", "best"):
        shutil.rmtree(cut / "checkpoints" / name, ignore_errors=True)
    (cut / "checkpoints" / "latest").unlink()
    (cut / "checkpoints" / "latest").symlink_to("step-000004")
    resumed_cfg = tmp_path / "cut.yaml"
    original = (cut / "config.yaml").read_text()
    resumed_cfg.write_text(original.replace(str(sharded_run), str(cut)))
    done = train_2(resumed_cfg, "--resume")
    assert "resumed from" in done.stderr and "at step 4" in done.stderr
    a, b = ckpts / "step-000006", cut / "checkpoints" / "step-000006"
    wa, wb = load_weights(a / "model.safetensors"), load_weights(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # the optimizer shards are the same bytes (the DCP metadata names its own path)
    for shard in ("__0_0.distcp", "__1_0.distcp"):
        assert verify(a)["files"][f"optimizer/{shard}"] == verify(b)["files"][f"optimizer/{shard}"]
    assert step_losses(cut) == step_losses(sharded_run)

    # the whole weights export and load as any run's, averaged too
    bundle = load_bundle(export_bundle(sharded_run, tmp_path / "bundle"))
    assert bundle.model.model.decoder.layers[0].fc1.weight.shape == (64, 32)
    export_bundle(sharded_run, tmp_path / "avg", weights="average", average_k=2)


def test_after_run_best_prunes_the_optimizer_shards(sharded_run, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(sharded_run / "checkpoints", root, symlinks=True)
    CheckpointManager(root).prune_after_run()
    manifest = verify(root / "best")
    assert not any(f.startswith("optimizer/") for f in manifest["files"])
    assert "optimizer/__1_0.distcp" in manifest[PRUNED_KEY]
    assert not list((root / "best").rglob("*.distcp"))
    with pytest.raises(CheckpointError, match="can be exported, not resumed"):
        load_training_checkpoint(root / "best")


def test_a_sharded_checkpoint_does_not_resume_under_ddp(sharded_run, tmp_path, tones_dir):
    run = tmp_path / "run"
    shutil.copytree(sharded_run, run, symlinks=True)
    plain = yaml.safe_load((run / "config.yaml").read_text())
    plain["output_dir"] = str(run)
    plain["train"]["distributed"] = "ddp"
    with pytest.raises(UserError, match="resume it with train.distributed: fsdp"):
        Trainer(load_config(data=plain)).fit(resume=True)


def test_sharded_training_has_ddps_losses(sharded_run, tmp_path, tones_dir):
    ddp = write_config(tmp_path, "ddp", tones_dir, train={**FSDP, "distributed": "ddp"}, model={"gradient_checkpointing": True},
                       eval={"eval_steps": None, "at_end": False})  # fmt: skip
    train_2(ddp)
    sharded, plain = step_losses(sharded_run), step_losses(tmp_path / "ddp")
    assert sharded.keys() == plain.keys() == set(range(1, 7))
    # the gradients are summed in another order (reduce-scatter): close, not equal
    torch.testing.assert_close(
        torch.tensor([sharded[s] for s in sorted(sharded)]),
        torch.tensor([plain[s] for s in sorted(plain)]),
        rtol=1e-5,
        atol=1e-5,
    )


def test_sigterm_to_one_rank_saves_sharded_checkpoint_and_every_rank_exits_75(tmp_path, tones_dir):
    cfg = write_config(tmp_path, "run", tones_dir, train={**FSDP, "max_steps": 100000, "precision": "bf16"},
                       eval={"eval_steps": None, "at_end": False})  # fmt: skip
    proc = torchrun(cfg)
    wait_for_steps(tmp_path / "run", 3)
    os.kill(rank_pid(proc.pid, 1), signal.SIGTERM)
    _, stderr = finish(proc)
    codes = rank_exit_codes(stderr)
    assert codes[0] == 75 and set(codes.values()) <= {75, -15}, stderr[-3000:]
    assert not rank_traceback(stderr), stderr[-3000:]
    latest = tmp_path / "run" / "checkpoints" / "latest"
    manifest = verify(latest)
    assert "optimizer/__1_0.distcp" in manifest["files"]
    step = json.loads((latest / "train_state.json").read_text())["step"]
    done = train_2(cfg, "--resume", f"train.max_steps={step + 1}")
    assert f"at step {step} (epoch" in done.stderr
