"""What the forgetting guard refused is kept: a run whose every trained step the guard refuses
keeps the best of them in ``checkpoints/best-unguarded/`` (through rotation, ``after_run: best``
and a resume) and says how far the target improved and the guard drifted."""

from __future__ import annotations

import json

from conftest import tiny_config

from asrforge.callbacks import build_callbacks
from asrforge.selection import ByWer, GuardGate, Selector
from asrforge.train.guard import Guard
from asrforge.train.loop import NOT_IMPROVED, Trainer


def _guarded_selector() -> Selector:
    gate = GuardGate(0.02)
    gate.set_start(0.0, "drift", {})
    return Selector(ByWer(), patience=10, max_steps=None, guard=gate)


def test_the_best_refused_evaluation_is_tracked_and_rides_in_the_state():
    sel = _guarded_selector()
    assert not sel.update({"wer": 0.50, "loss": 1.0, "guard_wer": 0.0}, step=0).unguarded
    refused = sel.update({"wer": 0.30, "loss": 0.8, "guard_wer": 0.10}, step=10)
    assert not refused.save and refused.unguarded
    worse = sel.update({"wer": 0.40, "loss": 0.7, "guard_wer": 0.10}, step=20)
    assert not worse.unguarded  # not better than the refused step 10 by the policy alone
    assert sel.best_step == 0 and sel.unguarded_step == 10
    assert sel.unguarded["wer"] == 0.30 and sel.unguarded["guard_wer"] == 0.10
    resumed = _guarded_selector()
    resumed.load_state_dict(json.loads(json.dumps(sel.state_dict())))
    assert resumed.unguarded_step == 10 and resumed.unguarded == sel.unguarded
    # a step within the guard that beats it by the policy makes best/ the better one
    assert resumed.update({"wer": 0.20, "loss": 0.6, "guard_wer": 0.01}, step=30).save
    assert resumed.unguarded_step is None and resumed.unguarded == {}


def _refusing_run(tmp_path, tones_dir, monkeypatch, **sections):
    """A run from an evaluated start whose guard is always beyond its tolerance after step 0;
    selection by loss, which a few steps surely lower."""
    monkeypatch.setattr(Guard, "measure", lambda self, model, gate, **kw: self.metrics(0.5, gate))
    guard = {"path": str(tones_dir), "split": "validation", "mode": "drift", "max_items": 2,
             "tolerance": 0.02}  # fmt: skip
    base = {
        "eval": {"at_start": True, "guard": guard},
        "selection": {"policy": "by_loss"},
        "checkpoint": {"save_total_limit": 1, "after_run": "best"},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return tiny_config(tmp_path / "run", tones_dir, **base)


def test_a_run_the_guard_refuses_keeps_its_best_trained_step(
    tmp_path, tones_dir, monkeypatch, capsys
):
    from asrforge.cli import main

    cfg = _refusing_run(tmp_path, tones_dir, monkeypatch)
    config = tmp_path / "run.yaml"
    config.write_text(cfg.to_yaml())
    assert main(["train", str(config)]) == 0
    out, root = capsys.readouterr().out, tmp_path / "run" / "checkpoints"
    # after_run: best deleted every step directory, and kept best/ and best-unguarded/
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["best", "best-unguarded"]
    assert json.loads((root / "best" / "manifest.json").read_text())["step"] == 0
    manifest = json.loads((root / "best-unguarded" / "manifest.json").read_text())
    step = manifest["step"]
    assert step in (3, 6) and manifest["is_best_unguarded"] is True
    assert manifest["guard"]["guard_wer"] == 0.5 and manifest["guard"]["guard_within"] is False
    state = json.loads((root / "best-unguarded" / "train_state.json").read_text())
    assert state["selection"]["unguarded_step"] == step
    start_loss = json.loads((root / "best" / "manifest.json").read_text())["metrics"]["loss"]
    line = next(x for x in out.splitlines() if "forgetting guard refused" in x)
    assert f"refused step {step}" in line
    assert f"loss {start_loss:.4f} -> {manifest['metrics']['loss']:.4f} since step 0" in line
    assert "guard drift 0.5000 > start 0.0000 + tolerance 0.02" in line
    assert "checkpoints/best-unguarded/" in line and NOT_IMPROVED in out
    log = (tmp_path / "run" / "train.log").read_text()
    assert "forgetting guard refused every step the selection policy would have chosen" in log
    assert f"refused step {step}" in log


def test_a_resume_keeps_the_refused_best(tmp_path, tones_dir, monkeypatch):
    first = _refusing_run(
        tmp_path, tones_dir, monkeypatch, train={"max_steps": 3}, checkpoint={"after_run": "all"}
    )
    assert Trainer(first, build_callbacks(first)).fit().refused is not None
    root = tmp_path / "run" / "checkpoints"
    assert json.loads((root / "best-unguarded" / "manifest.json").read_text())["step"] == 3
    # two more steps, none evaluated: the refused best survives in the selector and in the
    # checkpoints (save_total_limit 1 rotates out every other step)
    again = _refusing_run(
        tmp_path, tones_dir, monkeypatch, train={"max_steps": 5}, eval={"at_end": False},
        checkpoint={"checkpoint_every": 1, "after_run": "all"},
    )  # fmt: skip
    result = Trainer(again, build_callbacks(again)).fit(resume=True)
    assert result.step == 5 and result.refused is not None and "refused step 3" in result.refused
    assert json.loads((root / "best-unguarded" / "manifest.json").read_text())["step"] == 3
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    assert names == ["best", "best-unguarded", "step-000000", "step-000003", "step-000005"]


def test_a_step_within_the_guard_that_beats_it_retires_best_unguarded(
    tmp_path, tones_dir, monkeypatch
):
    cfg = _refusing_run(tmp_path, tones_dir, monkeypatch)
    calls = iter([0.5, 0.0])  # step 3 refused, step 6 within
    monkeypatch.setattr(
        Guard, "measure", lambda self, model, gate, **kw: self.metrics(next(calls), gate)
    )
    result = Trainer(cfg, build_callbacks(cfg)).fit()
    root = tmp_path / "run" / "checkpoints"
    assert result.best_step == 6 and result.refused is None
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["best"]
