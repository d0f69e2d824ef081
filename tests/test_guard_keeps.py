"""What the forgetting guard refused is kept: a run whose every trained step the guard refuses
keeps the best of them in ``checkpoints/best-unguarded/`` (through rotation, ``after_run: best``
and a resume) and says how far the target improved and the guard drifted."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config

from asrforge.callbacks import build_callbacks
from asrforge.checkpoint.average import interpolate_weights
from asrforge.errors import CheckpointNotSupportedError, UserError
from asrforge.evaluation.guard import Guard
from asrforge.selection.guard_gate import WITHIN_GUARD_SHARES, GuardGate, largest_share_within
from asrforge.selection.policies import ByWer
from asrforge.selection.selector import Selector
from asrforge.train.loop import NOT_IMPROVED, Trainer


def _guarded_selector() -> Selector:
    gate = GuardGate(0.02)
    gate.set_start(0.0, "drift", {})
    return Selector(ByWer(), patience=10, max_steps=None, guard=gate)


@pytest.mark.fast
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
    assert resumed.unguarded_why == sel.unguarded_why == "guard drift 0.1 > start 0 + tolerance 0.02"
    # a step within the guard that beats it by the policy makes best/ the better one
    assert resumed.update({"wer": 0.20, "loss": 0.6, "guard_wer": 0.01}, step=30).save
    assert resumed.unguarded_step is None and resumed.unguarded == {}


@pytest.mark.fast
def test_a_run_resumed_without_the_guard_forgets_what_the_guard_refused():
    sel = _guarded_selector()
    sel.update({"wer": 0.50, "loss": 1.0, "guard_wer": 0.0}, step=0)
    sel.update({"wer": 0.30, "loss": 0.8, "guard_wer": 0.10}, step=10)
    assert sel.unguarded_step == 10
    resumed = Selector(ByWer(), patience=10, max_steps=None)
    resumed.load_state_dict(json.loads(json.dumps(sel.state_dict())))
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
    assert "guard drift 0.5 > start 0 + tolerance 0.02" in line
    assert "checkpoints/best-unguarded/" in line and NOT_IMPROVED in out
    log = (tmp_path / "run" / "train.log").read_text()
    assert "forgetting guard refused every step the selection policy would have chosen" in log
    assert f"refused step {step}" in log
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    end = next(r for r in map(json.loads, lines) if r["event"] == "train_end")
    assert f"refused step {step}" in end["refused"]


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
    # a from-scratch start is kept for the export within the guard
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["best", "step-000000"]


@pytest.mark.fast
def test_the_largest_share_within_the_guard_is_chosen_largest_first():
    gate = GuardGate(0.02)
    gate.set_start(0.10, "wer", {})
    figures = {1.0: 0.20, 0.9: 0.13, 0.8: 0.121, 0.7: 0.119, 0.6: 0.11, 0.5: 0.10}
    measured = []

    def measure(share):
        measured.append(share)
        return {"guard_wer": figures[share]}

    share, pairs = largest_share_within(measure, [0.5, 0.6, 0.7, 0.8, 0.9, 1.0], gate)
    assert share == 0.7 and measured == [1.0, 0.9, 0.8, 0.7]  # nothing below it is measured
    assert [(a, m["guard_wer"]) for a, m in pairs] == [
        (1.0, 0.20),
        (0.9, 0.13),
        (0.8, 0.121),
        (0.7, 0.119),
    ]
    assert largest_share_within(lambda s: {"guard_wer": 0.5}, WITHIN_GUARD_SHARES, gate)[0] is None
    assert (
        largest_share_within(lambda s: {"guard_wer": 0.12}, WITHIN_GUARD_SHARES, gate)[0] == 1.0
    )  # on it


@pytest.mark.fast
def test_interpolation_mixes_floats_keeps_ties_and_refuses_another_shape():
    start = {"w": torch.zeros(2, 2), "n": torch.tensor([1]), "emb": torch.ones(3)}
    tied = torch.full((3,), 3.0)
    tuned = {
        "w": torch.full((2, 2), 10.0),
        "n": torch.tensor([7]),
        "emb": tied,
        "proj_out.weight": tied,
    }
    mixed = interpolate_weights(start, tuned, 0.3)
    assert torch.allclose(mixed["w"], torch.full((2, 2), 3.0))
    assert mixed["n"].item() == 7  # not a float: the fine-tuned one
    assert torch.allclose(mixed["emb"], torch.full((3,), 1.6))
    assert mixed["proj_out.weight"] is mixed["emb"]
    with pytest.raises(CheckpointNotSupportedError, match="'w' is \\[2, 2\\] fine-tuned"):
        interpolate_weights({**start, "w": torch.zeros(3)}, tuned, 0.5)


def test_export_within_guard_writes_the_chosen_share(tmp_path, tones_dir, monkeypatch, capsys):
    from safetensors.torch import load_file

    from asrforge.cli import main

    cfg = _refusing_run(tmp_path, tones_dir, monkeypatch)
    Trainer(cfg, build_callbacks(cfg)).fit()
    root = tmp_path / "run" / "checkpoints"
    figures = iter([0.5, 0.03, 0.015])  # shares 1.0 and 0.9 beyond 0 + 0.02, 0.8 within
    monkeypatch.setattr(
        Guard, "measure", lambda self, model, gate, **kw: self.metrics(next(figures), gate)
    )
    out = tmp_path / "bundle"
    assert main(["export", str(tmp_path / "run"), "--within-guard", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "share 0.9: outside: guard drift 0.03 > start 0 + tolerance 0.02" in printed
    assert "0.8 of the fine-tuned weights (over 0.2 of the starting model's)" in printed
    facts = json.loads((out / "inference_config.json").read_text())["source"]["within_guard"]
    assert facts["share"] == 0.8 and facts["guard"] == 0.015 and facts["guard_tolerance"] == 0.02
    assert [m["share"] for m in facts["measured"]] == [1.0, 0.9, 0.8]
    assert facts["finetuned"].endswith("best-unguarded") and facts["start"].endswith("best")
    name = "model.decoder.layers.0.fc1.weight"
    start = load_file(root / "best" / "model.safetensors")[name].double()
    tuned = load_file(root / "best-unguarded" / "model.safetensors")[name].double()
    written = load_file(out / "model.safetensors")[name].double()
    assert torch.allclose(written, 0.2 * start + 0.8 * tuned, atol=1e-6)


def test_export_within_guard_without_the_starting_weights_is_refused(tmp_path, tones_dir, capsys):
    from asrforge.cli import main

    guard = {"path": str(tones_dir), "split": "validation", "mode": "drift", "max_items": 2}
    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 3}, eval={"guard": guard})
    Trainer(cfg, build_callbacks(cfg)).fit()  # from scratch, no step-0 checkpoint
    argv = ["export", str(tmp_path / "run"), "--within-guard", "--out", str(tmp_path / "b")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the starting weights of" in err and "step-000000" in err
    assert "trained from scratch (no model.pretrained)" in err
    assert not (tmp_path / "b").exists()


@pytest.mark.fast
@pytest.mark.parametrize(
    ("model", "guarded", "kept"),
    [
        ({"pretrained": "/base", "tokenizer": "/tok-lg"}, True, True),  # an extended vocabulary
        ({}, True, True),  # from scratch
        ({"pretrained": "/base"}, True, False),  # model.pretrained is the start
        ({"pretrained": "/base", "tokenizer": "/tok-lg"}, False, False),  # no export within a guard
    ],
)
def test_step_zero_is_kept_where_only_it_holds_a_guarded_runs_start(model, guarded, kept):
    from asrforge.config import load_config

    eval_ = {"guard": {"path": "/guard"}} if guarded else {}
    data = {"output_dir": "/run", "model": model, "eval": eval_, "data": {"path": "/data"}}
    assert load_config(data=data).keeps_step_zero is kept


def test_a_guarded_run_not_started_from_pretrained_keeps_its_start(tmp_path, tones_dir, monkeypatch):
    """From scratch (as with an extended vocabulary) model.pretrained cannot stand in for the
    start, so rotation and after_run: best keep step-000000 for the export within the guard."""
    from asrforge.bundle.export import start_weights
    from asrforge.checkpoint.manifest import read_manifest

    monkeypatch.setattr(Guard, "measure", lambda self, model, gate, **kw: self.metrics(0.0, gate))
    guard = {"path": str(tones_dir), "split": "validation", "mode": "drift", "max_items": 2}
    cfg = tiny_config(
        tmp_path / "run", tones_dir, train={"max_steps": 3},
        eval={"at_start": True, "guard": guard, "eval_steps": 1}, selection={"policy": "by_loss"},
        checkpoint={"save_total_limit": 1, "after_run": "best"},
    )  # fmt: skip
    Trainer(cfg, build_callbacks(cfg)).fit()
    root = tmp_path / "run" / "checkpoints"
    assert read_manifest(root / "best")["step"] > 0
    assert [p.name for p in sorted(root.glob("step-*"))] == ["step-000000"]
    assert not (root / "step-000000" / "optimizer.pt").exists()  # pruned as best/ is
    _start, where = start_weights(root / "best")
    assert where == "run/checkpoints/step-000000"


@pytest.mark.fast
def test_shares_without_within_guard_is_refused(tmp_path, capsys):
    from asrforge.cli import main

    argv = ["export", str(tmp_path / "run"), "--shares", "0.5", "--out", str(tmp_path / "b")]
    assert main(argv) == 2
    assert "--shares: only with --within-guard" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


@pytest.mark.fast
def test_the_refused_step_names_the_guard_s_metric():
    from asrforge.selection.guard_gate import describe_refused
    for metric in ("cer", "wer"):
        gate = GuardGate(0.02)
        gate.set_start(0.1, "wer", {})
        sel = Selector(ByWer("cer"), patience=10, max_steps=None, guard=gate)
        sel.update({"cer": 0.2, "wer": 0.3, "guard_wer": 0.1, "guard_metric": metric}, step=0)
        sel.update({"cer": 0.1, "wer": 0.2, "guard_wer": 0.3, "guard_metric": metric}, step=10)
        line = describe_refused(10, sel.unguarded, sel.start, before_step=0, selected_on="cer",
                                why=sel.unguarded_why)  # fmt: skip
        assert f"cer 0.2000 -> 0.1000 since step 0; guard {metric} 0.3 > start 0.1" in line


@pytest.mark.fast
def test_export_within_guard_of_a_directory_that_is_no_run_names_it(tmp_path):
    from asrforge.bundle.within_guard import export_within_guard

    with pytest.raises(UserError, match="not a checkpoint") as refused:
        export_within_guard(
            tmp_path, "ema", (1.0,), tmp_path / "out", "hf", lm=None, ct2_quantization=None,
            max_shard_size=None, progress=print, say=print,
        )  # fmt: skip
    assert str(tmp_path) in str(refused.value) and not (tmp_path / "out").exists()


def test_export_within_guard_of_the_start_alone_says_no_fine_tuned_weights_are_there(
    tmp_path, tones_dir, monkeypatch, capsys
):
    import shutil

    from asrforge.cli import main

    cfg = _refusing_run(tmp_path, tones_dir, monkeypatch, checkpoint={"after_run": "all"})
    Trainer(cfg, build_callbacks(cfg)).fit()
    root = tmp_path / "run" / "checkpoints"
    shutil.rmtree(root / "best-unguarded")  # best/ is step 0: the start, nothing learned
    # the start is within its own guard: an export would go through, "1" of nothing learned
    monkeypatch.setattr(Guard, "measure", lambda self, model, gate, **kw: self.metrics(0.0, gate))
    for source in (tmp_path / "run", root / "step-000000"):
        out = tmp_path / f"bundle-{source.name}"
        assert main(["export", str(source), "--within-guard", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "holds the starting weights (step 0)" in err
        assert "no fine-tuned weights are there" in err and not out.exists()
