"""The disk budget: ``checkpoint.after_run`` pruning and ``checkpoint.max_disk_gb``."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState

from asrforge.checkpoint.disk import GB, RESUME_ONLY_FILES, tree_bytes
from asrforge.checkpoint.manager import CheckpointManager
from asrforge.checkpoint.manifest import PRUNED_KEY, verify
from asrforge.checkpoint.training import load_training_checkpoint
from asrforge.config import TrainConfig
from asrforge.errors import CheckpointError, CheckpointSaveError, UserError
from tests.conftest import tiny_config


def _fit(cfg):
    from asrforge.train.loop import Trainer

    AcceleratorState._reset_state()
    try:
        return Trainer(cfg, []).fit()
    finally:
        AcceleratorState._reset_state()


def _writer(nbytes: int):
    def write(d: Path) -> None:
        (d / "weights.bin").write_bytes(b"w" * nbytes)

    return write


def test_after_run_best_keeps_a_loadable_best_and_nothing_else(tmp_path, tones_dir):
    from asrforge.bundle.export import export_bundle
    from asrforge.bundle.load import load_bundle

    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        data={"max_eval_samples": 4},
        checkpoint={"save_total_limit": 2, "after_run": "best"},
    )
    assert TrainConfig.model_fields["checkpoint"].default_factory().after_run == "best"
    result = _fit(cfg)
    root = tmp_path / "run" / "checkpoints"
    assert result.status == "completed" and result.best_step is not None
    assert sorted(p.name for p in root.iterdir()) == ["best"]  # no step dirs, no latest
    best = root / "best"
    manifest = verify(best)  # the re-sealed manifest verifies, hashes included
    assert manifest["step"] == result.best_step
    assert sorted(manifest[PRUNED_KEY]) == sorted(f for f in RESUME_ONLY_FILES if f != "scaler.pt")
    assert not any((best / f).exists() for f in RESUME_ONLY_FILES)
    assert (best / "model.safetensors").is_file() and (best / "config.yaml").is_file()
    assert (tmp_path / "run" / "train.log").is_file()  # logs stay

    bundle = load_bundle(export_bundle(tmp_path / "run", tmp_path / "bundle"))
    assert bundle.model is not None

    with pytest.raises(CheckpointError, match="after_run"):
        load_training_checkpoint(best)
    # the finished run's directory is not silently trained over, nor resumed
    with pytest.raises(UserError, match="pruned"):
        _fit(cfg)
    with pytest.raises(UserError, match="pruned"):
        from asrforge.train.loop import Trainer

        AcceleratorState._reset_state()
        try:
            Trainer(cfg, []).fit(resume=True)
        finally:
            AcceleratorState._reset_state()


def test_after_run_all_keeps_every_checkpoint(tmp_path, tones_dir):
    cfg = tiny_config(
        tmp_path / "run", tones_dir, checkpoint={"save_total_limit": 2, "after_run": "all"}
    )
    _fit(cfg)
    root = tmp_path / "run" / "checkpoints"
    assert len(list(root.glob("step-*"))) >= 2 and (root / "latest").exists()
    assert (root / "best" / "optimizer.pt").is_file()


def test_a_budget_too_small_for_one_save_is_refused_before_writing(tmp_path, tones_dir):
    cfg = tiny_config(tmp_path / "run", tones_dir, checkpoint={"max_disk_gb": 1e-6})
    with pytest.raises(
        CheckpointSaveError, match=r"needs about [\d.]+ MB; .* holds 0 B of its 1\.0 kB budget"
    ):
        _fit(cfg)
    root = tmp_path / "run" / "checkpoints"
    assert list(root.iterdir()) == []  # nothing half-written, no temporary left


@pytest.mark.fast
def test_rotation_makes_room_and_refusal_deletes_nothing(tmp_path):
    size = 100_000
    # room for three checkpoints of `size`, not four (manifests are a few hundred bytes)
    m = CheckpointManager(tmp_path, save_total_limit=None, max_disk_gb=3.5 * size / GB)
    for step in range(1, 7):
        m.save(step, _writer(size), is_best=step == 1)
        assert tree_bytes(tmp_path) <= 3.5 * size
    # step 1 is best (protected), 6 the newest: the oldest others were rotated out for room
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-000001",
        "step-000005",
        "step-000006",
    ]


@pytest.mark.fast
def test_a_budget_for_one_checkpoint_refuses_the_second_and_keeps_the_first(tmp_path):
    size = 100_000
    m = CheckpointManager(tmp_path, save_total_limit=None, max_disk_gb=1.5 * size / GB)
    m.save(1, _writer(size))
    before = sorted(os.listdir(tmp_path))
    # the newest checkpoint is never rotated out for room: the one intact copy if this fails
    with pytest.raises(
        CheckpointSaveError, match=r"needs about 100\.\d kB; .* holds 100\.\d kB of its 150\.0 kB"
    ) as refused:
        m.save(2, _writer(size))
    # the advice is the budget this save needs: the kept checkpoint and the new one
    assert re.search(r"Raise checkpoint\.max_disk_gb to at least 0\.000(19\d|20\d) \(what is kept",
                     str(refused.value))  # fmt: skip
    assert sorted(os.listdir(tmp_path)) == before  # nothing deleted, nothing written
    verify(tmp_path / "step-000001")


@pytest.mark.fast
def test_max_disk_gb_must_be_positive(tmp_path):
    with pytest.raises(UserError, match="max_disk_gb"):
        CheckpointManager(tmp_path, max_disk_gb=0)


@pytest.mark.fast
def test_the_matrix_report_shows_disk_per_job_and_in_total(tmp_path):
    from asrforge.matrix.report import collect, render

    for job, size in (("en-tiny-s0", 3_000_000), ("es-tiny-s0", 1_000_000)):
        run = tmp_path / "runs" / job
        (run / "checkpoints" / "step-000002").mkdir(parents=True)
        (run / "metrics.jsonl").write_text("")
        weights = run / "checkpoints" / "step-000002" / "model.safetensors"
        weights.write_bytes(b"w" * size)
        (run / "checkpoints" / "best").mkdir()
        os.link(weights, run / "checkpoints" / "best" / "model.safetensors")  # costs nothing
    rows = {r.job_id: r for r in collect(tmp_path)}
    assert rows["en-tiny-s0"].disk_bytes == 3_000_000
    assert rows["es-tiny-s0"].disk_bytes == 1_000_000
    page = render(list(rows.values()), "t")
    assert "4.0 MB on disk" in page and ">3.0 MB</td>" in page and ">1.0 MB</td>" in page


def _training_like(step: int):
    def write(d: Path) -> None:
        (d / "model.safetensors").write_bytes(bytes([step]) * 1000)
        for name in RESUME_ONLY_FILES:
            (d / name).write_bytes(b"o" * 2000)
        (d / "config.yaml").write_text("seed: 0\n")

    return write


@pytest.mark.fast
def test_prune_keeps_everything_when_the_best_cannot_be_rebuilt(tmp_path, monkeypatch):
    from asrforge.checkpoint import manager as manager_module

    m = CheckpointManager(tmp_path, save_total_limit=None)
    m.save(1, _training_like(1), is_best=True)
    m.save(2, _training_like(2))
    before = sorted(os.listdir(tmp_path))

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manager_module, "link_files", full_disk)
    m.prune_after_run()  # logged, not raised: the run itself succeeded
    assert sorted(os.listdir(tmp_path)) == before
    assert (tmp_path / "best" / "optimizer.pt").is_file()
    monkeypatch.undo()

    m.prune_after_run()
    assert sorted(os.listdir(tmp_path)) == ["best"]
    assert verify(tmp_path / "best")["step"] == 1
    assert (tmp_path / "best" / "model.safetensors").read_bytes() == bytes([1]) * 1000
