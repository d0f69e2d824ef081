"""What a run's checkpoints can be trusted for: sealed manifests (issue 12 item 26), top-k
members that rotation keeps (item 8)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asrforge.bundle.export import export_bundle
from asrforge.callbacks import build_callbacks
from asrforge.checkpoint.average import average_top_k
from asrforge.checkpoint.manager import CheckpointManager
from asrforge.checkpoint.manifest import read_manifest, verify, write_manifest
from asrforge.cli import main
from asrforge.errors import CheckpointCorruptError
from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tones_dir) -> Path:
    """A 6-step run evaluated at steps 2, 4 and 6, every checkpoint kept."""
    out = tmp_path_factory.mktemp("integrity") / "run"
    cfg = tiny_config(out, tones_dir, eval={"eval_steps": 2}, checkpoint={"save_total_limit": None})
    Trainer(cfg).fit()
    return out


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A private copy of the trained run, free to damage."""
    return Path(shutil.copytree(trained, tmp_path / "run", symlinks=True))


def _edit_manifest(ckpt: Path, **changes) -> None:
    path = ckpt / "manifest.json"
    manifest = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "metrics":
            manifest["metrics"].update(value)
        else:
            manifest[key] = value
    path.write_text(json.dumps(manifest, indent=2))


@pytest.mark.fast
def test_manifests_are_sealed_and_an_edited_fact_is_refused(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "weights.bin").write_bytes(b"w" * 64)
    write_manifest(d, {"step": 7, "metrics": {"wer": 0.5}})
    assert verify(d)["step"] == 7
    _edit_manifest(d, step=700)
    with pytest.raises(CheckpointCorruptError, match="does not match its own seal"):
        read_manifest(d)
    _edit_manifest(d, step=7)  # put back exactly: the seal matches again
    verify(d)
    manifest = json.loads((d / "manifest.json").read_text())
    del manifest["seal"]
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match="not sealed"):
        verify(d)


def test_export_refuses_an_edited_step(run, tmp_path):
    ckpt = run / "checkpoints" / "step-000006"
    _edit_manifest(ckpt, step=9999)
    with pytest.raises(CheckpointCorruptError, match="step-000006/manifest.json: does not match"):
        export_bundle(ckpt, tmp_path / "bundle")


def test_average_refuses_an_edited_metric(run, tmp_path):
    ckpts = run / "checkpoints"
    worst = max((read_manifest(ckpts / f"step-{s:06d}")["metrics"]["wer"], s) for s in (2, 4, 6))[1]
    _edit_manifest(ckpts / f"step-{worst:06d}", metrics={"wer": 0.0})  # "the best" now
    with pytest.raises(CheckpointCorruptError, match=f"step-{worst:06d}/manifest.json"):
        average_top_k(run, "wer", 1, tmp_path / "avg")


def test_resume_skips_a_checkpoint_whose_manifest_was_edited(run, caplog):
    ckpts = run / "checkpoints"
    _edit_manifest(ckpts / "step-000006", step=60)
    manager = CheckpointManager(ckpts)
    assert manager.latest_valid() == ckpts / "step-000004"
    assert "skipping step-000006" in caplog.text and "seal" in caplog.text


class EvalRecord(Callback):
    """Every evaluation's metrics, by step."""

    name = "eval_record"

    def __init__(self):
        self.by_step: dict[int, dict] = {}

    def on_eval_end(self, state, *, metrics, decision):
        self.by_step[state.step] = dict(metrics)


def test_averaging_members_survive_rotation_and_the_cli_names_them(tmp_path, tones_dir, capsys):
    """k=3 averaging with save_total_limit=1: rotation must keep the three best checkpoints
    (issue 12 item 8: it deleted them, and the average silently used fewer, worse steps)."""
    averaging = {"name": "average_checkpoints", "metric": "loss", "k": 3}
    cfg = tiny_config(
        tmp_path / "run", tones_dir, train={"max_steps": 6, "log_every": 2},
        eval={"eval_steps": 1}, checkpoint={"save_total_limit": 1}, callbacks=[averaging],
    )  # fmt: skip
    record = EvalRecord()
    Trainer(cfg, [record, *build_callbacks(cfg)]).fit()
    ranked = sorted(record.by_step, key=lambda s: (record.by_step[s]["loss"], s))
    best3 = ranked[:3]
    assert len(record.by_step) == 6 and len(set(record.by_step[s]["loss"] for s in ranked)) == 6
    ckpts = tmp_path / "run" / "checkpoints"
    averaged = read_manifest(ckpts / "loss.ave_3best")
    assert averaged["steps"] == best3
    for step in best3:  # the members are still there, as step directories
        verify(ckpts / f"step-{step:06d}")

    assert main(["average", str(tmp_path / "run"), "--metric", "loss", "--k", "3"]) == 0
    out = capsys.readouterr().out
    assert f"steps {', '.join(map(str, best3))}" in out
    for step in best3:
        assert f"step {step}: loss {record.by_step[step]['loss']:.6g}" in out


@pytest.mark.fast
def test_averaging_specs_use_the_callbacks_own_defaults():
    from asrforge.callbacks.averaging import AverageCheckpoints
    from asrforge.checkpoint.manager import averaging_specs
    from asrforge.config import CallbackSpec, TopKSpec

    defaults = AverageCheckpoints.Options()
    specs = averaging_specs(
        [
            CallbackSpec(name="average_checkpoints"),
            CallbackSpec(name="average_checkpoints", metric="bleu", k=2),
            CallbackSpec(name="early_stopping", monitor="wer"),
        ]
    )
    assert specs == [
        TopKSpec(metric=defaults.metric, k=defaults.k, mode="min"),
        TopKSpec(metric="bleu", k=2, mode="max"),
    ]
