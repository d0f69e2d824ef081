"""Averaging takes the weights a bundle exports: each checkpoint's EMA weights when the run kept
them (raw weights under the EMA tensors, in the raw dtypes), else the raw ones; ``weights`` picks
either, in ``average_checkpoints``, ``asrforge average`` and ``export --weights average``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from asrforge.bundle.contents import checkpoint_contents
from asrforge.checkpoint.average import average_checkpoints
from asrforge.checkpoint.manifest import read_manifest, write_manifest
from asrforge.checkpoint.training import load_weights, save_weights
from asrforge.cli import average as average_command
from asrforge.errors import UserError
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config


def _raw(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {
        "lin.weight": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "pos.weight": torch.randn(2, 3, generator=g),  # frozen: no EMA tensor
        "bn.num_batches_tracked": torch.tensor(i),
    }


def _ema(i: int) -> dict[str, torch.Tensor]:
    # EMA keeps float32 copies of the trainable parameters only
    return {"lin.weight": torch.full((4, 3), float(i))}


def _ckpt(root: Path, i: int, *, ema: bool = True) -> Path:
    d = root / f"step-{i:06d}"
    d.mkdir(parents=True)
    save_weights(d / "model.safetensors", _raw(i))
    if ema:
        save_weights(d / "ema.safetensors", _ema(i))
    (d / "config.yaml").write_text(f"from: {i}\n")
    write_manifest(d, {"step": i, "metrics": {"wer": 0.1 * i}, "kind": "training"})
    return d


def _exported(i: int) -> dict[str, torch.Tensor]:
    """What a bundle exports of checkpoint ``i``: its EMA tensors over its raw weights."""
    state = _raw(i)
    state["lin.weight"] = _ema(i)["lin.weight"].to(torch.bfloat16)
    return state


@pytest.mark.fast
def test_an_average_of_checkpoints_with_ema_averages_the_exported_weights(tmp_path):
    paths = [_ckpt(tmp_path, i) for i in (1, 2, 3)]
    out = average_checkpoints(paths, tmp_path / "avg")
    got = load_weights(out / "model.safetensors")
    for name in _raw(0):
        states = [_exported(i)[name] for i in (1, 2, 3)]
        if states[0].is_floating_point():
            want = (sum(s.double() for s in states) / 3).to(states[0].dtype)
        else:
            want = sum(states)
        assert got[name].dtype == states[0].dtype and torch.equal(got[name], want), name
    assert got["lin.weight"].tolist()[0] == [2.0, 2.0, 2.0]  # (1 + 2 + 3) / 3 of the EMA
    assert read_manifest(out)["weights"] == "ema"


@pytest.mark.fast
def test_raw_weights_on_request_and_without_ema(tmp_path):
    paths = [_ckpt(tmp_path, i) for i in (1, 2)]
    raw = load_weights(
        average_checkpoints(paths, tmp_path / "raw", weights="raw") / "model.safetensors"
    )
    want = ((_raw(1)["lin.weight"].double() + _raw(2)["lin.weight"].double()) / 2).to(
        torch.bfloat16
    )
    assert torch.equal(raw["lin.weight"], want)
    mixed = [paths[0], _ckpt(tmp_path / "b", 4, ema=False)]
    assert read_manifest(average_checkpoints(mixed, tmp_path / "mixed"))["weights"] == "raw"
    with pytest.raises(UserError, match="has no EMA weights"):
        average_checkpoints(mixed, tmp_path / "refused", weights="ema")


@pytest.mark.fast
def test_the_average_command_says_which_weights_and_takes_an_option(tmp_path, capsys):
    root = tmp_path / "run" / "checkpoints"
    for i in (1, 2):
        _ckpt(root, i)
    parser = argparse.ArgumentParser(prog="asrforge")
    average_command.add_parser(parser.add_subparsers(dest="command"))
    assert average_command.run(parser.parse_args(["average", str(tmp_path / "run"), "--k", "2"])) == 0
    assert "averaged the EMA weights of 2 checkpoints" in capsys.readouterr().out
    args = ["average", str(tmp_path / "run"), "--k", "2", "--weights", "raw", "--out"]
    assert average_command.run(parser.parse_args([*args, str(tmp_path / "raw")])) == 0
    assert read_manifest(tmp_path / "raw")["weights"] == "raw"


def test_export_weights_average_takes_the_ema_weights(tmp_path, tones_dir):
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        train={"max_steps": 4, "ema_decay": 0.5},
        eval={"eval_steps": 2},
        checkpoint={"save_total_limit": None},
    )
    Trainer(cfg).fit()
    root = tmp_path / "run" / "checkpoints"
    contents = checkpoint_contents(root / "latest", "average", average_k=2, scan_data=False)
    assert contents.inference.source["averaged_weights"] == "ema"
    name = "model.decoder.layers.0.fc1.weight"
    steps = [root / f"step-{s:06d}" for s in (2, 4)]
    emas = [load_weights(d / "ema.safetensors")[name] for d in steps]
    raws = [load_weights(d / "model.safetensors")[name] for d in steps]
    got = contents.state[name]
    want = ((emas[0].double() + emas[1].double()) / 2).to(raws[0].dtype)
    assert torch.equal(got, want)
    assert not torch.equal(got, ((raws[0].double() + raws[1].double()) / 2).to(raws[0].dtype))
