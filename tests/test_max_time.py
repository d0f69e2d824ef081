"""``train.max_time``: durations parsed with an error naming the field, and a run that stops at a
step boundary early enough for its last evaluation and save, exits 0 and resumes. Time is a
fake clock that only the step, the evaluation and the save advance, so each stop is exact."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from asrforge.callbacks import build_callbacks
from asrforge.cli import main
from asrforge.cli import train as cli_train
from asrforge.config import ConfigError, load_config, parse_duration
from asrforge.train import evaluations as evaluations_module
from asrforge.train import run as run_module
from asrforge.train import time_budget
from asrforge.train.loop import Trainer
from asrforge.train.ranks import agree_to_stop
from tests.conftest import tiny_config

MINIMAL = {"output_dir": "runs/x", "data": {"path": "d"}}


@pytest.mark.fast
@pytest.mark.parametrize(
    ("written", "seconds"),
    [(3600, 3600), (1.5, 1.5), ("3600", 3600), ("90m", 5400), ("2h", 7200), ("1d2h", 93600),
     ("1h30m", 5400), ("1.5h", 5400), ("45s", 45), ("01:30:00", 5400), ("1-00:00:00", 86400)],
)  # fmt: skip
def test_durations_parse_to_seconds(written, seconds):
    assert parse_duration(written) == seconds
    cfg = load_config(data={**MINIMAL, "train": {"max_time": written}})
    assert cfg.train.max_time == written and cfg.train.max_time_seconds == seconds


@pytest.mark.fast
@pytest.mark.parametrize("written", ["", "soon", "2x", "1d2", "h", "2h 30m", "1:60:00", "inf",
                                     0, -5, "0s", True])  # fmt: skip
def test_a_bad_duration_is_refused_naming_the_field(written):
    with pytest.raises(ConfigError) as e:
        load_config(data={**MINIMAL, "train": {"max_time": written}})
    (problem,) = e.value.problems
    assert problem.startswith("train.max_time:"), problem
    assert "duration" in problem


@pytest.mark.fast
def test_no_budget_by_default():
    cfg = load_config(data=MINIMAL)
    assert cfg.train.max_time is None and cfg.train.max_time_seconds is None


@pytest.mark.fast
def test_the_stop_reason_says_what_would_not_fit_in_the_time_left(monkeypatch):
    # a tiny model's save takes a fraction of a second: the reason names the step that would
    # not fit beside it in what is left, never "leave 0 s"
    now = [0.0]
    monkeypatch.setattr(time_budget, "monotonic", lambda: now[0])
    budget = time_budget.TimeBudget(10, "10s")
    with budget.timed("step"):
        now[0] += 1.94
    with budget.timed("save"):
        now[0] += 0.2
    now[0] = 8.5
    assert budget.runs_out(evaluations=0, saves=1)
    assert budget.reason(6, evaluations=0) == (
        "reached max_time=10s (elapsed 8s, 1.5 s left: not enough for step 6, up to 1.9 s as "
        "the longest step so far, and then the last save, 0.2 s)"
    )
    # set-up alone used the budget up: none left, and an untimed save is 5% of the budget
    now[0] = 12.0
    fresh = time_budget.TimeBudget(10, "10s", already=12.0)
    assert fresh.reason(1, evaluations=1) == (
        "reached max_time=10s (elapsed 12s, none left: not enough for step 1, and then the "
        "last evaluation and save, 1.0 s)"
    )


class FakeClock:
    """The budget's clock: a step takes ``step`` seconds, an evaluation ``evaluation``, a save
    ``save``; nothing else moves it."""

    def __init__(self, monkeypatch, *, step=10.0, evaluation=5.0, save=1.0):
        self.now = 1000.0
        self.steps = 0
        monkeypatch.setattr(time_budget, "monotonic", lambda: self.now)
        monkeypatch.setattr(run_module, "finish_step", self._costs(run_module.finish_step, step))
        monkeypatch.setattr(
            evaluations_module,
            "evaluate",
            self._costs(evaluations_module.evaluate, evaluation),
        )
        monkeypatch.setattr(
            run_module, "save_run_checkpoint", self._costs(run_module.save_run_checkpoint, save)
        )

    def _costs(self, fn, seconds):
        def timed(*args, **kwargs):
            self.now += seconds
            return fn(*args, **kwargs)

        return timed


def _config(tmp_path, tones_dir, max_time=100, **sections):
    sections.setdefault("eval", {"eval_steps": None, "at_end": True})
    return tiny_config(tmp_path / "run", tones_dir,
                       train={"max_steps": 30, "log_every": 1, "max_time": max_time},
                       **sections)  # fmt: skip


def _events(run_dir, event):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def test_the_cli_stops_before_the_step_that_leaves_no_time_and_exits_zero(
    tmp_path, tones_dir, monkeypatch, capsys
):
    # Nothing timed yet: an evaluation and a save are each taken as 5% of 100 s. After step 8
    # (80 s) step 9 and the end fit (80 + 10 + 5 + 5 = 100); after step 9 step 10 does not.
    cfg = _config(tmp_path, tones_dir, checkpoint={"save_total_limit": 2, "after_run": "best"})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())))
    monkeypatch.setattr(cli_train, "_seconds_since_process_start", lambda: 0.0)
    clock = FakeClock(monkeypatch)

    assert main(["train", str(path)]) == 0
    out = capsys.readouterr().out
    reason = (
        "reached max_time=100 (elapsed 1m30s, 10 s left: not enough for step 10, up to 10 s as "
        "the longest step so far, and then the last evaluation and save, 10 s)"
    )
    assert f"asrforge: stopped at step 9: {reason}" in out
    run_dir = tmp_path / "run"
    (end,) = _events(run_dir, "train_end")
    assert (end["status"], end["step"], end["reason"]) == ("stopped", 9, reason)
    # a matrix launcher continues the run rather than finishing it
    assert end["out_of_time"] is True
    # the last evaluation and its save, at the step the run stopped at, within the budget
    assert [e["step"] for e in _events(run_dir, "eval")] == [9]
    assert [(s["step"], s["kind"]) for s in _events(run_dir, "save")] == [(9, "best")]
    assert clock.now - 1000.0 == 96 <= 100
    assert reason in (run_dir / "train.log").read_text()
    # after_run: best keeps the resume state of a run that ran out of time
    latest = json.loads((run_dir / "checkpoints" / "latest" / "train_state.json").read_text())
    assert latest["step"] == 9


@pytest.mark.parametrize(("save", "stops_at", "end"), [(1.0, 8, "6.0 s"), (6.0, 7, "11 s")])
def test_a_slower_save_stops_the_run_a_step_earlier(tmp_path, tones_dir, monkeypatch, save,
                                                    stops_at, end):  # fmt: skip
    # The starting evaluation (5 s) and its save are timed before the first step; after step k
    # the run goes on while 5 + save + 10 k + (10 + 5 + save) <= 100.
    cfg = _config(tmp_path, tones_dir, eval={"eval_steps": None, "at_end": True, "at_start": True})
    clock = FakeClock(monkeypatch, save=save)
    result = Trainer(cfg).fit()
    assert (result.status, result.step) == ("stopped", stops_at)
    assert f"not enough for step {stops_at + 1}, up to 10 s as the longest step so far, and " \
           f"then the last evaluation and save, {end})" in result.reason  # fmt: skip
    assert clock.now - 1000.0 <= 100
    assert result.last_metrics  # the last evaluation happened at the stop


def test_an_evaluation_due_at_the_stop_is_the_last_one(tmp_path, tones_dir, monkeypatch):
    # Evaluations take 20 s (5 s until one is timed, at step 3). After step 5 (81 s) step 6,
    # its due evaluation and the save fit (81 + 10 + 21 = 112); after step 6 going on would pay
    # step 6's evaluation and save, step 7 and the end (81 + 10 + 2 * 21 = 133 > 120): step 6's
    # due evaluation is the last one, not followed by another.
    cfg = _config(tmp_path, tones_dir, max_time=120, eval={"eval_steps": 3, "at_end": True})
    FakeClock(monkeypatch, evaluation=20.0)
    result = Trainer(cfg, build_callbacks(cfg)).fit()
    assert (result.status, result.step) == ("stopped", 6)
    assert "not enough for step 7, up to 10 s as the longest step so far, and then the last " \
           "evaluation and save, 21 s)" in result.reason  # fmt: skip
    run_dir = tmp_path / "run"
    assert [e["step"] for e in _events(run_dir, "eval")] == [3, 6]
    assert [s["step"] for s in _events(run_dir, "save")] == [3, 6]


def test_max_steps_first_is_not_a_time_stop(tmp_path, tones_dir, monkeypatch):
    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 3, "max_time": "1h"})
    FakeClock(monkeypatch)
    result = Trainer(cfg).fit()
    assert (result.status, result.step, result.reason) == ("completed", 3, "reached max_steps=3")
    assert not result.out_of_time


def test_a_run_out_of_time_resumes_with_a_fresh_budget(tmp_path, tones_dir, monkeypatch):
    cfg = _config(tmp_path, tones_dir, checkpoint={"save_total_limit": 2, "after_run": "best"})
    FakeClock(monkeypatch)
    first = Trainer(cfg).fit()
    assert (first.status, first.step) == ("stopped", 9)

    # a fresh budget: the same 100 s again, so steps 10..18 and the end fit once more
    resumed = Trainer(cfg).fit(resume=True)
    assert (resumed.status, resumed.step) == ("stopped", 18)
    assert "not enough for step 19" in resumed.reason
    finished = Trainer(cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"max_time": None, "max_steps": 20})})).fit(resume=True)  # fmt: skip
    assert (finished.status, finished.step) == ("completed", 20)
    assert finished.reason == "reached max_steps=20"


def _agree(rank: int, init_file: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)

    class Acc:
        num_processes, device = 2, "cpu"

    # only rank 1's clock runs out: both stop at this step
    agreed = agree_to_stop(Acc(), None, None, out_of_time=rank == 1)
    with open(f"{results}.{rank}", "w") as f:
        json.dump(agreed, f)
    dist.destroy_process_group()


def test_every_rank_stops_when_one_runs_out_of_time(tmp_path):
    results = tmp_path / "agreed"
    mp.spawn(_agree, args=(str(tmp_path / "init"), str(results)), nprocs=2)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"agreed.{rank}").read_text()) == [None, True]
