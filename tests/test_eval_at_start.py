"""``eval.at_start``: the starting model is evaluated at step 0, seeds the selection (a run whose
fine-tuning never beats it ends with the starting weights as ``best/``, and says so), a resumed
run does not evaluate it again, and the report's change from the start fills from it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asrforge.callbacks import build_callbacks
from asrforge.cli.train import _describe_best
from asrforge.config import ConfigError, load_config
from asrforge.evaluation.guard import Guard
from asrforge.matrix.report import collect, render
from asrforge.model.build import build_model, build_tokenizer
from asrforge.selection.policies import ByWer
from asrforge.selection.selector import Selector
from asrforge.train.events import Callback
from asrforge.train.loop import NOT_IMPROVED, Trainer
from asrforge.train.run import FitResult, TrainingRun
from tests.conftest import tiny_config


class Evals(Callback):
    """The steps evaluated and the losses of the steps trained, in this process's fit."""

    name = "evals"

    def __init__(self):
        self.steps: list[int] = []
        self.losses: dict[int, float] = {}

    def on_eval_end(self, state, *, metrics, decision):
        self.steps.append(state.step)

    def on_step_end(self, state, *, metrics):
        self.losses[state.step] = metrics["loss"]


def records(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.fixture
def pretrained(tmp_path, tones_dir) -> Path:
    """A tiny model and its tokenizer saved as a transformers directory: a pretrained start."""
    cfg = tiny_config(tmp_path / "scratch", tones_dir)
    tokenizer = build_tokenizer(cfg.model, ["one two three", "uno dos tres"] * 60)
    path = tmp_path / "pretrained"
    build_model(cfg.model, tokenizer, 0).model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.mark.fast
def test_at_start_is_on_for_a_pretrained_start_and_off_from_scratch(tmp_path, tones_dir):
    assert not tiny_config(tmp_path, tones_dir).evaluates_at_start
    assert tiny_config(tmp_path, tones_dir, eval={"at_start": True}).evaluates_at_start
    model = {"pretrained": str(tmp_path / "whisper")}
    assert tiny_config(tmp_path, tones_dir, model=model).evaluates_at_start
    off = tiny_config(tmp_path, tones_dir, model=model, eval={"at_start": False})
    assert not off.evaluates_at_start


@pytest.mark.fast
def test_the_start_seeds_the_bests_and_patience_counts_from_it():
    sel = Selector(ByWer(), patience=2, max_steps=None)
    first = sel.update({"wer": 0.30, "loss": 1.0}, step=0)
    assert first.save and "the starting model (step 0)" in first.reason
    assert not sel.update({"wer": 0.35, "loss": 0.9}, step=10).save  # worse than the start
    resumed = Selector(ByWer(), patience=2, max_steps=None)
    resumed.load_state_dict(json.loads(json.dumps(sel.state_dict())))
    assert resumed.start == {"wer": 0.30, "loss": 1.0}
    third = resumed.update({"wer": 0.31, "loss": 0.8}, step=20)
    assert not third.save and third.should_stop  # two evaluations without beating the start
    assert resumed.best_step == 0 and resumed.best["wer"] == 0.30


def test_a_pretrained_start_that_fine_tuning_only_harms_stays_the_result(
    tmp_path, tones_dir, pretrained, monkeypatch
):
    transcribed = []
    original = Guard.transcribe
    monkeypatch.setattr(
        Guard, "transcribe", lambda self, *a, **k: transcribed.append(1) or original(self, *a, **k)
    )
    out = tmp_path / "run"
    cfg = tiny_config(
        out,
        tones_dir,
        model={"pretrained": str(pretrained)},  # eval.at_start left at its default: on
        optim={"lr": 1.0, "warmup_steps": 0},  # every step harms
        train={"max_steps": 8},
        eval={
            "eval_steps": 2,
            "guard": {"path": str(tones_dir), "split": "test", "mode": "drift", "max_items": 4},
        },
        selection={"patience": 2},
        checkpoint={"after_run": "best"},
    )
    result = Trainer(cfg, build_callbacks(cfg)).fit()

    start = records(out, "eval")[0]
    assert start["step"] == 0 and start["save"] and start["per_language"]
    assert start["guard_wer"] == 0.0 and start["guard_within"]  # drift 0 by definition
    assert len(transcribed) == 3  # the start once, then steps 2 and 4; step 0 reused it
    assert (out / "eval" / "step-000000.jsonl").is_file()
    # patience counted the evaluations that did not beat the start: stopped at step 4
    assert result.status == "stopped" and result.step == 4
    assert result.best_step == 0 and result.improved_on_start is False
    assert result.reason.endswith(NOT_IMPROVED)
    assert result.start["wer"] == start["wer"]
    assert records(out, "train_end")[0]["reason"].endswith(NOT_IMPROVED)
    assert NOT_IMPROVED in (out / "train.log").read_text()
    # best/ (all that after_run: best keeps) holds the starting weights
    best = load_file(out / "checkpoints" / "best" / "model.safetensors")
    start_weights = load_file(pretrained / "model.safetensors")
    shared = best.keys() & start_weights.keys()
    assert len(shared) > 20
    assert all(torch.equal(best[k], start_weights[k]) for k in shared)
    assert not list((out / "checkpoints").glob("step-*"))

    # the report: the job's change from the start fills from the step-0 evaluation
    (job,) = collect_one(out)
    assert job.start == {"wer": start["wer"], "cer": start["cer"]}
    assert job.best_step == 0 and job.delta() == 0.0
    assert "+0.0000" in render([job], "t")


def collect_one(run_dir: Path):
    """The report's rows of a directory holding just ``run_dir``."""
    runs = run_dir.parent / "only"
    runs.mkdir()
    (runs / run_dir.name).symlink_to(run_dir)
    return collect(runs)


def test_without_at_start_nothing_is_evaluated_at_step_0(tmp_path, tones_dir):
    out = tmp_path / "run"
    cfg = tiny_config(out, tones_dir, train={"max_steps": 2}, eval={"eval_steps": 2})
    seen = Evals()
    result = Trainer(cfg, [seen, *build_callbacks(cfg)]).fit()
    assert seen.steps == [2] and [r["step"] for r in records(out, "eval")] == [2]
    assert not (out / "checkpoints" / "step-000000").exists()
    assert result.start == {} and result.improved_on_start is None


class Crash(Exception):
    pass


def test_a_resume_from_the_start_checkpoint_is_exact_and_does_not_evaluate_it_again(
    tmp_path, tones_dir, monkeypatch
):
    sections = dict(
        model={"dropout": 0.1},
        train={"max_steps": 4, "ema_decay": 0.9},
        eval={"eval_steps": 2, "at_start": True},
    )
    full_cfg = tiny_config(tmp_path / "full", tones_dir, **sections)
    full = Evals()
    full_result = Trainer(full_cfg, [full, *build_callbacks(full_cfg)]).fit()
    assert full.steps == [0, 2, 4]

    cfg = tiny_config(tmp_path / "split", tones_dir, **sections)
    with monkeypatch.context() as m:  # the process dies before its first step
        m.setattr(TrainingRun, "train_step", lambda self, batches: (_ for _ in ()).throw(Crash()))
        with pytest.raises(Crash):
            Trainer(cfg, build_callbacks(cfg)).fit()
    assert [p.name for p in (tmp_path / "split" / "checkpoints").glob("step-*")] == ["step-000000"]

    resumed = Evals()
    result = Trainer(cfg, [resumed, *build_callbacks(cfg)]).fit(resume=True)
    assert resumed.steps == [2, 4]  # step 0's evaluation came with the checkpoint
    assert resumed.losses == full.losses  # exactly
    assert result.start == full_result.start and result.best_step == full_result.best_step
    a = load_file(tmp_path / "full" / "checkpoints" / "latest" / "model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoints" / "latest" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in records(tmp_path / "split", "eval")] == [0, 2, 4]


@pytest.mark.fast
def test_the_result_line_shows_the_start_and_eval_on_start_gets_its_name(tmp_path, tones_dir):
    improved = FitResult("completed", "", 4, 3, {"wer": 0.5}, tmp_path, start={"wer": 0.8})
    assert improved.improved_on_start is True
    assert _describe_best(improved) == (
        "best checkpoint at step 3: wer 0.5000 (the starting model at step 0: wer 0.8000)"
    )
    with pytest.raises(ConfigError, match=r"eval_on_start; asrforge calls this eval\.at_start"):
        load_config(
            data={
                "output_dir": str(tmp_path),
                "data": {"path": str(tones_dir)},
                "eval": {"eval_on_start": True},
            }
        )


def test_a_resume_from_the_start_checkpoint_purges_the_dead_runs_tensorboard_points(
    tmp_path, tones_dir, monkeypatch
):
    """The process that died after step 3 had logged steps 1-3 to TensorBoard; the resume from
    step-000000 logs them again, so its writer must purge the dead run's (as a resume from any
    later step does), else every curve holds two points per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        train={"max_steps": 4, "log_every": 1},
        eval={"eval_steps": 10, "at_start": True},
        callbacks=[{"name": "tensorboard"}],
    )
    original = TrainingRun.train_step

    def dies_after_step_3(self, batches):
        if self.state.step == 3:
            raise Crash()
        return original(self, batches)

    with monkeypatch.context() as m:
        m.setattr(TrainingRun, "train_step", dies_after_step_3)
        with pytest.raises(Crash):
            Trainer(cfg, build_callbacks(cfg)).fit()
    # A real resume is a new process, seconds later. TensorBoard reads event files in name
    # order, the second a writer started and then a per-process counter (".9" sorts after
    # ".10"), so in one process and one second the resumed file could be read first.
    time.sleep(1.1)
    Trainer(cfg, build_callbacks(cfg)).fit(resume=True)
    tb = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in tb.Scalars("eval/wer")] == [0, 4]
