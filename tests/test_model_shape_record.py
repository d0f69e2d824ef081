"""Every run records its model's whole shape, pretrained runs too, and export rebuilds the model
from that record instead of guessing (issue 12 item 6: heads were assumed d_model/64)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from asrforge.bundle.export import export_bundle
from asrforge.checkpoint.manifest import read_manifest
from asrforge.checkpoint.training import (
    CheckpointContents,
    capture_rng_state,
    load_weights,
    save_training_checkpoint,
)
from asrforge.cli import main
from asrforge.config import SHAPE_FIELDS, ModelConfig, load_config
from asrforge.data.sources import load_arrow
from asrforge.errors import UserError
from asrforge.model.build import build_model, build_tokenizer
from asrforge.model.tokenizer import load_tokenizer
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config

# 4 heads of width 16: the old export's guess (d_model/64) gave 1 head
SHAPE = {"d_model": 64, "encoder_attention_heads": 4, "decoder_attention_heads": 4}


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory, tones_dir) -> tuple[Path, Path]:
    """(a tiny 4-head "pretrained" directory, a 2-step run fine-tuned from it)."""
    root = tmp_path_factory.mktemp("shape")
    scratch = tiny_config(root / "scratch", tones_dir, model=SHAPE)
    tokenizer = build_tokenizer(scratch.model, load_arrow(tones_dir)["train"]["text"])
    pretrained = root / "pretrained"
    build_model(scratch.model, tokenizer, 0).model.save_pretrained(str(pretrained))
    tokenizer.save_pretrained(str(pretrained))
    plain = tiny_config(
        root / "run", tones_dir, train={"max_steps": 2}, eval={"eval_steps": 2}
    ).to_plain()
    plain["model"] = {"pretrained": str(pretrained)}
    Trainer(load_config(data=plain)).fit()
    return pretrained, root / "run"


def _recorded_shape(config_yaml: str) -> dict:
    model = yaml.safe_load(config_yaml)["model"]
    return {name: model.get(name) for name in SHAPE_FIELDS}


def test_a_pretrained_run_records_its_whole_shape(pretrained_run):
    pretrained, run = pretrained_run
    want = json.loads((pretrained / "config.json").read_text())
    want = {name: want[name] for name in SHAPE_FIELDS}
    assert want["encoder_attention_heads"] == 4
    assert _recorded_shape((run / "config.yaml").read_text()) == want
    ckpt = run / "checkpoints" / "step-000002"
    assert _recorded_shape((ckpt / "config.yaml").read_text()) == want
    again = load_config(data=yaml.safe_load((run / "config.yaml").read_text()))
    assert again.model.pretrained == str(pretrained)  # the recorded config loads back, as written


def test_export_without_the_pretrained_directory_keeps_the_heads_and_the_loss(
    pretrained_run, tones_dir, tmp_path, capsys
):
    pretrained, run = pretrained_run
    ckpt = run / "checkpoints" / "step-000002"
    moved = pretrained.with_name("moved-away")
    os.rename(pretrained, moved)
    try:
        bundle = export_bundle(ckpt, tmp_path / "bundle")
    finally:
        os.rename(moved, pretrained)
    config = json.loads((bundle / "config.json").read_text())
    assert config["encoder_attention_heads"] == config["decoder_attention_heads"] == 4
    argv = ["evaluate", str(bundle), "--data", str(tones_dir), "--split", "validation"]
    assert main([*argv, "--batch-size", "8", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    loop = read_manifest(ckpt)["metrics"]
    assert scored["n"] == loop["n"]
    assert scored["loss"] == pytest.approx(loop["loss"], rel=1e-5)


def test_export_refuses_to_guess_a_shape_nobody_recorded(pretrained_run, tmp_path):
    """A checkpoint of a pretrained run from before shapes were recorded, its directory gone."""
    pretrained, run = pretrained_run
    ckpt = run / "checkpoints" / "step-000002"
    cfg = load_config(
        data={
            "output_dir": str(tmp_path / "old-run"),
            "model": {"pretrained": str(tmp_path / "gone")},
            "data": {"path": str(tmp_path / "no-data")},
        }
    )
    tokenizer = load_tokenizer(ckpt / "tokenizer")
    old = save_training_checkpoint(
        tmp_path / "old-run" / "checkpoints" / "step-000002",
        CheckpointContents(
            model=load_weights(ckpt / "model.safetensors"),
            optimizer={},
            scheduler={},
            rng=capture_rng_state(),
            train_state={"step": 2},
            config_yaml=cfg.to_yaml(),
            tokenizer_save=lambda d: tokenizer.save_pretrained(str(d)),
            meta={"step": 2},
        ),
    )
    with pytest.raises(UserError, match="does not record the model's shape.*heads"):
        export_bundle(old, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()


def test_shape_fields_set_with_a_pretrained_model_must_match_it(pretrained_run):
    pretrained, _run = pretrained_run
    cfg = ModelConfig(pretrained=pretrained, encoder_attention_heads=2)
    with pytest.raises(UserError, match=r"model\.encoder_attention_heads: set to 2, .* has 4"):
        build_model(cfg, build_tokenizer(cfg), 0)
    cfg = ModelConfig(pretrained=pretrained, encoder_attention_heads=4)
    build_model(cfg, build_tokenizer(cfg), 0)
    assert cfg.d_model == 64 and "d_model" in cfg.model_fields_set  # filled in
