"""What a resume carries over beyond the weights: the EMA starts from the resumed weights, and
the logged loss averages the same steps as an uninterrupted run's."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from asrforge.callbacks import build_callbacks
from asrforge.checkpoint.manifest import read_manifest, write_manifest
from asrforge.train.loop import Trainer
from asrforge.train.state import TrainState
from tests.conftest import tiny_config
from tests.test_resume import PreemptAt

NO_EVAL = {"eval_steps": None, "at_end": False}


def test_ema_switched_on_at_resume_starts_from_the_resumed_weights(tmp_path, tones_dir, caplog):
    out = tmp_path / "run"
    Trainer(tiny_config(out, tones_dir, train={"max_steps": 3}, eval=NO_EVAL)).fit()
    resumed = load_file(out / "checkpoints" / "step-000003" / "model.safetensors")

    cfg = tiny_config(out, tones_dir, train={"max_steps": 4, "ema_decay": 0.9999}, eval=NO_EVAL)
    caplog.set_level(logging.INFO, logger="asrforge")
    Trainer(cfg).fit(resume=True)
    assert any(
        "EMA (decay 0.9999) starts at step 3 from the resumed weights" in r.getMessage()
        for r in caplog.records
    )
    ema = load_file(out / "checkpoints" / "step-000004" / "ema.safetensors")
    # one step of decay 0.9999 away from the step-3 weights (from the initial weights, the
    # distance would be three steps of training)
    for name, shadow in ema.items():
        torch.testing.assert_close(shadow, resumed[name].float(), atol=1e-5, rtol=0)


def _train_lines(out) -> dict[int, dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x for x in lines if x["event"] == "train"}


def test_the_logged_loss_after_a_resume_is_the_uninterrupted_runs(tmp_path, tones_dir):
    sections = dict(train={"max_steps": 8, "log_every": 4}, eval=NO_EVAL)
    full_cfg = tiny_config(tmp_path / "full", tones_dir, **sections)
    Trainer(full_cfg, build_callbacks(full_cfg)).fit()

    cfg = tiny_config(tmp_path / "split", tones_dir, **sections)
    first = Trainer(cfg, [PreemptAt(6), *build_callbacks(cfg)]).fit()  # mid-window (5..8)
    assert first.status == "interrupted" and first.step == 6
    Trainer(cfg, build_callbacks(cfg)).fit(resume=True)

    full, split = _train_lines(tmp_path / "full"), _train_lines(tmp_path / "split")
    assert sorted(full) == sorted(split) == [4, 8]
    for step in (4, 8):
        for key in ("loss", "grad_norm", "skipped_steps"):
            assert split[step][key] == full[step][key], (step, key)


OLD_SHAPES = [
    # the ids once more, flat, beside the ids by reason
    (
        {
            "step": 5,
            "dropped": {"audio file not found": ["a", "b"]},
            "dropped_utterances": ["a", "b"],
        },
        {"audio file not found": ["a", "b"]},
    ),
    # before reasons were kept: the flat ids alone, all dropped for failing to decode
    ({"step": 5, "dropped_utterances": ["a", "b", "a"]}, {"failed to decode": ["a", "b"]}),
]


@pytest.mark.fast
@pytest.mark.parametrize(("saved", "dropped"), OLD_SHAPES)
def test_an_old_state_loads_with_the_same_dropped_ids(saved, dropped):
    state = TrainState.from_dict(json.loads(json.dumps(saved)))
    assert state.step == 5 and state.dropped == dropped
    assert "dropped_utterances" not in state.to_dict()
    assert TrainState.from_dict(state.to_dict()) == state


def test_a_checkpoint_with_an_old_state_resumes(tmp_path, tones_dir, caplog):
    out = tmp_path / "run"
    Trainer(tiny_config(out, tones_dir, train={"max_steps": 3}, eval=NO_EVAL)).fit()
    ckpt = out / "checkpoints" / "step-000003"
    state = json.loads((ckpt / "train_state.json").read_text())
    recorded = state.pop("train_data")  # the old shape, resealed
    state.update(dropped={}, dropped_utterances=["ghost"])
    (ckpt / "train_state.json").write_text(json.dumps(state, indent=2) + "\n")
    manifest = read_manifest(ckpt)
    write_manifest(
        ckpt, {k: v for k, v in manifest.items() if k not in ("format_version", "files")}
    )

    with caplog.at_level(logging.INFO, logger="asrforge"):
        result = Trainer(tiny_config(out, tones_dir, train={"max_steps": 4}, eval=NO_EVAL)).fit(
            resume=True
        )
    assert result.status == "completed" and result.step == 4
    # the training data is not compared, once, and recorded from then on
    unchecked = [r for r in caplog.records if "records no fingerprint" in r.getMessage()]
    assert len(unchecked) == 1 and unchecked[0].levelno == logging.INFO
    resumed = json.loads((out / "checkpoints" / "step-000004" / "train_state.json").read_text())
    assert resumed["train_data"] == recorded
    assert resumed["dropped"] == {"failed to decode": ["ghost"]}
    assert "dropped_utterances" not in resumed
    assert json.loads((out / "skipped-train.json").read_text())["failed to decode"] == ["ghost"]
