"""What a run reports: the logged learning rate, one save per step, and the best checkpoint's own
evaluation at the end (the CLI line and the ``train_end`` record)."""

from __future__ import annotations

import json
import logging

import pytest

from asrforge.callbacks import build_callbacks
from asrforge.cli.train import _describe_best
from asrforge.train import evaluations as evaluations_module
from asrforge.train import run as run_module
from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config


class Record(Callback):
    name = "record"

    def __init__(self):
        self.steps: list[dict] = []
        self.saves: list[tuple[int, str]] = []

    def on_step_end(self, state, *, metrics):
        self.steps.append(dict(metrics))

    def on_save(self, state, *, path, kind):
        self.saves.append((state.step, kind))


@pytest.mark.fast
def test_lr_is_the_main_groups_and_the_others_are_named(tmp_path, tones_dir):
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        optim={"lr": 1e-3, "warmup_steps": 0, "schedule": "constant", "embedding_lr_scale": 0.1},
        train={"max_steps": 1},
        eval={"eval_steps": None, "at_end": False},
    )
    rec = Record()
    Trainer(cfg, [rec]).fit()
    m = rec.steps[0]
    assert m["lr_groups"]["embeddings"] == pytest.approx(m["lr_groups"]["decay"] * 0.1)
    assert m["lr"] == m["lr_groups"]["decay"] == pytest.approx(1e-3, rel=0.01)


# scripted evaluations: step 3 has the lowest wer (the best checkpoint under by_wer), step 4
# the lowest cer and loss
SCRIPT = {
    3: {"wer": 0.5, "cer": 0.7, "loss": 2.0},
    4: {"wer": 0.6, "cer": 0.4, "loss": 1.5},
}


class StepNow(Callback):
    """Tells the scripted evaluation which step it evaluates."""

    name = "step_now"
    step = 0

    def on_step_end(self, state, *, metrics):
        StepNow.step = state.step


def scripted_evaluate(model, batches, **kwargs):
    return {**SCRIPT[StepNow.step], "n": 12, "per_language": {}}, []


def test_a_final_step_is_saved_once_and_the_best_is_the_best_checkpoints(
    tmp_path, tones_dir, monkeypatch, caplog
):
    monkeypatch.setattr(evaluations_module, "evaluate", scripted_evaluate)
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        train={"max_steps": 4},
        eval={"eval_steps": 3, "at_end": True},
        selection={"policy": "by_wer"},
        checkpoint={"checkpoint_every": 2, "save_total_limit": 5},
    )
    rec = Record()
    caplog.set_level(logging.INFO, logger="asrforge")
    result = Trainer(cfg, [StepNow(), rec, *build_callbacks(cfg)]).fit()

    # step 4 is a checkpoint_every step and the last: one save, after the end-of-run evaluation
    assert [s for s, _ in rec.saves] == [2, 3, 4]
    saved = [r.getMessage() for r in caplog.records if "saved step-000004" in r.getMessage()]
    assert len(saved) == 1
    manifest = json.loads(
        (tmp_path / "run" / "checkpoints" / "step-000004" / "manifest.json").read_text()
    )
    assert manifest["metrics"]["wer"] == 0.6

    # the best checkpoint's own numbers, not each metric's minimum over evaluations
    assert result.best_step == 3
    assert {k: result.best[k] for k in ("wer", "cer", "loss")} == SCRIPT[3]
    assert result.tracked_bests == {"best_wer": 0.5}
    end = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ][-1]
    assert end["event"] == "train_end" and end["best_step"] == 3
    assert {k: end["best"][k] for k in ("wer", "cer", "loss")} == SCRIPT[3]
    assert (
        _describe_best(result) == "best checkpoint at step 3: wer 0.5000, cer 0.7000, loss 2.0000"
    )


def test_the_cli_names_the_policys_other_bests_as_such():
    result = run_module.FitResult(
        "completed",
        "",
        4,
        3,
        {"wer": 0.5, "cer": 0.7, "loss": 2.0},
        None,
        tracked_bests={"best_wer": 0.5, "best_loss": 1.5, "best_cer": 0.4},
    )
    assert _describe_best(result) == (
        "best checkpoint at step 3: wer 0.5000, cer 0.7000, loss 2.0000; the selection policy's "
        "bests over all evaluations: best_loss 1.5000, best_cer 0.4000"
    )
