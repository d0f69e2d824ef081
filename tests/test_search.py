"""A matrix whose config values are drawn (``search:``): the plan checks the space before
anything runs, trials are drawn as devices free up, a trial behind the others is stopped early
and marked ``pruned``, a relaunch carries on the same studies, and trials are ordinary runs."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import threading
import time
import warnings

import pytest
import yaml

from asrforge.cli import main
from asrforge.config import ConfigError
from asrforge.errors import ExitCode, UserError
from asrforge.matrix.executors import AttemptResult, Device, LocalExecutor, parse_devices
from asrforge.matrix.plan import load_matrix
from asrforge.matrix.run import Launcher
from asrforge.matrix.search import Search
from tests.conftest import tiny_config

pytest.importorskip("optuna")


def write_yaml(path, data):
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def config(tmp_path, tones_dir):
    path = tmp_path / "tiny.yaml"
    path.write_text(tiny_config(tmp_path / "unused", tones_dir, train={"max_steps": 4, "precision": "no"},
                                eval={"eval_steps": 2}).to_yaml())  # fmt: skip
    return path


def search_file(tmp_path, config, **search):
    spec = {"trials": 6, "metric": "loss", "sampler_seed": 3,
            "space": {"optim.lr": {"low": 1e-6, "high": 1e-2, "log": True}},
            "pruner": {"kind": "median", "startup_trials": 2}, **search}  # fmt: skip
    return write_yaml(tmp_path / "search.yaml", {
        "out": str(tmp_path / "root"), "languages": ["en"],
        "configs": [{"config_id": "tiny", "path": str(config)}], "search": spec})  # fmt: skip


def lr_of(job) -> float:
    return float(next(o for o in job.overrides if o.startswith("optim.lr=")).split("=", 1)[1])


def loss_curve(lr: float) -> list[float]:
    """A made-up run's loss at steps 2 and 4: best at lr 1e-4."""
    far = abs(math.log10(lr) + 4)
    return [2.0 + far, 1.0 + far]


class TrialExecutor:
    """Runs each trial instantly, writing the evaluations and end its drawn lr would give."""

    name = "scripted"

    def __init__(self, plan, n_devices=2):
        self.plan, self.n, self.attempts, self.results, self.cancelled = plan, n_devices, [], [], []

    def devices(self):
        return [Device(f"cpu:{i}", "", 1) for i in range(self.n)]

    def submit(self, attempt, *, hold_fd=None):
        self.attempts.append(attempt)
        run_dir = self.plan.run_dir(attempt.job)
        run_dir.mkdir(parents=True, exist_ok=True)
        curve = loss_curve(lr_of(attempt.job))
        lines = [{"event": "train_begin", "step": 0}]
        lines += [
            {"event": "eval", "step": s, "loss": v} for s, v in zip((2, 4), curve, strict=True)
        ]
        lines.append({"event": "train_end", "step": 4, "status": "completed", "best_step": 4,
                      "best": {"loss": curve[-1]}})  # fmt: skip
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        self.results.append(AttemptResult(attempt.job.job_id, attempt.number, attempt.device.label,
                                          0, time.time(), time.time(), "here"))  # fmt: skip

    def poll(self, timeout):
        out, self.results = self.results, []
        return out

    def cancel(self, job_id, *, force=False):
        self.cancelled.append(job_id)
        # the run stopped by SIGTERM saves and exits 75
        self.results = [AttemptResult(r.job_id, r.number, r.device, ExitCode.INTERRUPTED, r.started,
                                      r.finished, r.host) if r.job_id == job_id else r
                        for r in self.results]  # fmt: skip

    def close(self):
        pass


@pytest.mark.fast
def test_a_search_is_checked_whole_before_anything_runs(tmp_path, config, capsys):
    bad = write_yaml(tmp_path / "bad.yaml", {
        "out": str(tmp_path / "root"), "languages": ["en"], "seeds": [0, 1],
        "configs": [{"config_id": "tiny", "path": str(config)}, {"config_id": "b", "path": str(config)}],
        "search": {"trials": 2, "metric": "bleu", "space": {
            "optim.lr": {"low": 0.0, "high": 1e-3, "log": True},
            "optim.weight_decay": {"low": 0.1, "high": 0.01},
            "train.max_steps": {"choices": []},
            "model.dropout": {"low": 0.1, "choices": [0.0]},
            "optim.nope": {"choices": [1, 2]}}}})  # fmt: skip
    with pytest.raises(ConfigError) as e:
        load_matrix(bad)
    text = "\n".join(e.value.problems)
    for expected in ("draws the values of one config; configs lists 2",
                     "seeds lists 2 (give one)",
                     "search.space.optim.lr: a log scale needs low > 0",
                     "search.space.optim.weight_decay: low 0.1 must be below high 0.01",
                     "search.space.train.max_steps: choices is empty",
                     "search.space.model.dropout: give choices, or low and high, not both"):  # fmt: skip
        assert expected in text, text
    # the metric is checked against evaluation's; the space's values as configs of the trials
    with pytest.raises(
        ConfigError, match="search.metric: 'bleu' is not a metric evaluation produces"
    ):
        load_matrix(search_file(tmp_path, config, metric="bleu"))
    one = search_file(tmp_path, config, space={"optim.nope": {"choices": [1, 2]}})
    with pytest.raises(ConfigError, match=r"search.space draws optim.nope=1: optim.nope: unknown "
                                          r"field \(job en-tiny-s0\)"):
        load_matrix(one)
    assert main(["matrix", str(one), "--dry-run"]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.fast
def test_the_dry_run_shows_each_languages_first_trial_as_it_will_run(tmp_path, config, capsys):
    path = search_file(tmp_path, config)
    assert main(["matrix", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    job_id, _, command = next(x for x in out.splitlines() if x.startswith("en-")).partition(": ")
    assert "a search: 6 trials per language (t000 to t005), each the command above with its own "\
           "number and drawn optim.lr" in out
    # the trial the search then runs: the same job, config_id and run dir, its value drawn
    trial = Search(load_matrix(path)).draw(1)[0]
    drawn = next(o for o in trial.overrides if o.startswith("optim.lr="))
    assert job_id == trial.job_id == "en-tiny-t000"
    assert shlex.split(command) == ["asrforge", "train", str(trial.config_path), *(
        "optim.lr=<drawn>" if o == drawn else o for o in trial.overrides)]


@pytest.mark.fast
def test_trials_behind_the_others_stop_early_and_the_best_is_the_lowest(tmp_path, config, capsys):
    plan = load_matrix(search_file(tmp_path, config))
    executor = TrialExecutor(plan)
    outcome = Launcher(plan, executor, progress_every=0.0).run()
    assert outcome.exit_code == 0 and len(outcome.done) == 6
    trials = outcome.search["en"]["trials"]
    assert [t["number"] for t in trials] == list(range(6))
    pruned = [t for t in trials if t["state"] == "pruned"]
    complete = [t for t in trials if t["state"] == "complete"]
    assert pruned and len(pruned) + len(complete) == 6
    # each pruned trial was stopped (SIGTERM) and marked done as pruned; its run dir stays
    for t in pruned:
        job_id = f"en-tiny-t{t['number']:03d}"
        assert job_id in executor.cancelled
        assert json.loads((plan.root / "runs" / job_id / "DONE").read_text())["status"] == "pruned"
    # a complete trial's value is its best checkpoint's loss, and the study's best the lowest
    for t in complete:
        assert t["value"] == loss_curve(t["params"]["optim.lr"])[-1]
    best = min(complete, key=lambda t: t["value"])
    assert outcome.search["en"]["best"] == best["number"]
    assert json.loads((plan.root / "search.json").read_text()) == outcome.search
    # every trial is in the matrix's index, under a config id of its own
    index = json.loads((plan.root / "matrix.json").read_text())
    assert [j["config_id"] for j in index["jobs"]] == [f"tiny-t{n:03d}" for n in range(6)]
    text = capsys.readouterr().out
    assert re.search(r"search en: trial \d+ loss [\d.]+; best so far trial \d+", text)
    assert "6/6 done" in text


@pytest.mark.fast
def test_a_relaunch_resumes_the_trials_left_running_with_their_values(tmp_path, config):
    plan = load_matrix(search_file(tmp_path, config))
    first = Search(plan)
    drawn = first.draw(2)  # then the launcher dies: the trials stay running in the study
    (plan.run_dir(drawn[1]) / "checkpoints" / "step-000002").mkdir(parents=True)
    again = Search(plan)
    left = again.left_running()
    assert [(j.job_id, j.overrides) for j in left] == [(j.job_id, j.overrides) for j in drawn]
    # run to the end: the two are resumed (one from its checkpoint), four more are drawn
    executor = TrialExecutor(plan)
    outcome = Launcher(plan, executor, progress_every=0.0).run()
    runs = [(a.job.job_id, a.resume) for a in executor.attempts]
    assert runs[:2] == [(drawn[0].job_id, False), (drawn[1].job_id, True)]
    assert len(runs) == 6 and len(outcome.search["en"]["trials"]) == 6
    # a later launch finds every trial finished and runs nothing
    executor = TrialExecutor(plan)
    assert Launcher(plan, executor, progress_every=0.0).run().exit_code == 0
    assert executor.attempts == []


@pytest.mark.fast
def test_the_same_file_draws_the_same_first_trials(tmp_path, config):
    draws = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        draws.append(
            [lr_of(j) for j in Search(load_matrix(search_file(tmp_path / name, config))).draw(3)]
        )
    assert draws[0] == draws[1] and len(set(draws[0])) == 3


@pytest.mark.slow
def test_trials_are_ordinary_training_runs(tmp_path, config):
    spec = search_file(tmp_path, config, trials=2, pruner={"kind": "none"},
                       space={"optim.lr": {"choices": [1e-3, 3e-4]}})  # fmt: skip
    plan = load_matrix(spec)
    outcome = Launcher(plan, LocalExecutor(parse_devices("cpu:1")), progress_every=60).run()
    assert outcome.exit_code == 0, outcome
    trials = outcome.search["en"]["trials"]
    assert [t["state"] for t in trials] == ["complete", "complete"]
    for t in trials:
        run_dir = plan.root / "runs" / f"en-tiny-t{t['number']:03d}"
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert saved["optim"]["lr"] == t["params"]["optim.lr"] and saved["seed"] == 0
        end = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
        assert end["event"] == "train_end" and t["value"] == end["best"]["loss"]


def plant_running_trial(plan, suggest) -> int:
    """A trial left running in the study's journal, its values written by ``suggest(trial)``
    (as a journal someone edited would hold them, each with a distribution of its own)."""
    import optuna

    path = str(plan.root / "search" / "en.journal")
    journal = optuna.storages.journal
    storage = journal.JournalStorage(
        journal.JournalFileBackend(path, lock_obj=journal.JournalFileOpenLock(path))
    )
    trial = optuna.load_study(study_name="en", storage=storage).ask()
    suggest(trial)
    return trial.number


@pytest.mark.parametrize(
    "suggest, refused",
    [
        (lambda t: t.suggest_float("optim.lr", 1e300, 1.000001e300, log=True),
         "optim.lr: 1.0"),
        (lambda t: t.suggest_float("optim.lr", 0.5, 0.6, log=True), "optim.lr: 0.5"),
        (lambda t: (t.suggest_float("optim.lr", 9e-5, 1e-4, log=True),
                    t.suggest_categorical("data.cache_dir", ["/elsewhere"])),
         "data.cache_dir: not in search.space"),
        (lambda t: None, "optim.lr: no value drawn"),
    ],
    ids=["huge", "above-range", "extra-name", "no-value"],
)
def test_a_trial_the_journal_holds_outside_the_space_is_refused_by_name(
    tmp_path, config, caplog, suggest, refused
):
    plan = load_matrix(search_file(tmp_path, config))
    good = Search(plan).draw(1)[0]
    number = plant_running_trial(plan, suggest)
    again = Search(plan)
    with caplog.at_level("WARNING", logger="asrforge.matrix"):
        left = again.left_running()
    assert [j.job_id for j in left] == [good.job_id]  # the trial drawn from the space resumes
    assert f"search en: trial {number} refused, not run: {refused}" in caplog.text
    (refused_trial,) = [t for t in again.studies["en"].trials if t.number == number]
    assert refused_trial.state.name == "FAIL"
    assert Search(plan).left_running() == [good]  # a later launch does not see it again


def test_a_journal_trial_of_another_kind_is_refused_and_drawing_beside_it_is_one_line(
    tmp_path, config, caplog, capsys
):
    """A first trial whose lr is the string '0.001': refused; optuna then cannot draw beside
    it, and says so as bad input naming the journal, not a traceback."""
    plan = load_matrix(search_file(tmp_path, config))
    Search(plan)  # the study exists
    number = plant_running_trial(plan, lambda t: t.suggest_categorical("optim.lr", ["0.001"]))
    search = Search(plan)
    with caplog.at_level("WARNING", logger="asrforge.matrix"):
        assert search.left_running() == []
    assert f"trial {number} refused, not run: optim.lr: '0.001' is outside" in caplog.text
    with pytest.raises(UserError, match=r"en.journal: .*move it aside to start afresh"):
        search.draw(1)


def test_a_choice_or_step_outside_the_space_is_refused(tmp_path, config):
    space = {"optim.lr": {"choices": [1e-3, 3e-4]},
             "train.max_steps": {"low": 2, "high": 8, "step": 2}}  # fmt: skip
    plan = load_matrix(search_file(tmp_path, config, space=space))
    search = Search(plan)
    assert search.outside_space({"optim.lr": 3e-4, "train.max_steps": 6}) is None
    for params, why in [
        ({"optim.lr": 5e-4, "train.max_steps": 6}, "optim.lr: 0.0005 is not one of"),
        ({"optim.lr": True, "train.max_steps": 6}, "optim.lr: True is not one of"),
        ({"optim.lr": 3e-4, "train.max_steps": 5}, "train.max_steps: 5 is not on"),
        ({"optim.lr": 3e-4, "train.max_steps": 6.0}, "train.max_steps: 6.0 is not an integer"),
        ({"optim.lr": 3e-4, "train.max_steps": float("nan")}, "train.max_steps: nan is outside"),
    ]:
        assert search.outside_space(params).startswith(why), params


@pytest.mark.parametrize(
    "space, drawn",
    [
        ({"model.d_model": {"low": 32, "high": 34}}, "model.d_model=33"),
        ({"model.d_model": {"low": 32, "high": 1024}}, "model.d_model=33"),
        ({"model.d_model": {"low": 32, "high": 64, "step": 8},
          "model.encoder_attention_heads": {"choices": [2, 3]}},
         "model.encoder_attention_heads=3"),
    ],
    ids=["odd-inside", "sampled-wide-range", "a-choice-against-the-range"],
)
def test_a_space_whose_inside_holds_invalid_configs_is_refused_before_anything_runs(
    tmp_path, config, space, drawn
):
    """The ends of each range are valid configs; values between them (or a choice beside
    another parameter's end) are not: found by the plan, not when a trial fails."""
    with pytest.raises(ConfigError) as e:
        load_matrix(search_file(tmp_path, config, space=space))
    assert f"search.space draws {drawn}" in str(e.value) or (
        "search.space draws" in str(e.value) and drawn in str(e.value))
    assert "must divide d_model" in str(e.value)


@pytest.mark.fast
def test_every_draw_that_breaks_a_config_is_told_with_the_jobs_problems_at_once(tmp_path, config):
    """The plan stopped at a job's first invalid config: a problem of the job hid the space's,
    and one broken draw the next. Each YAML path a draw breaks is one line, whatever number of
    draws break it."""
    space = {"model.d_model": {"low": 32, "high": 40}, "train.max_steps": {"choices": [5, -1]}}
    m = yaml.safe_load(search_file(tmp_path, config, space=space).read_text())
    m["languages"], m["overrides"] = ["en", "es"], {"optim.weight_decay": -1}
    with pytest.raises(ConfigError) as e:
        load_matrix(write_yaml(tmp_path / "search.yaml", m))
    assert e.value.problems == [
        "overrides: optim.weight_decay: must be >= 0, got -1 (all 2 jobs)",
        "search.space draws model.d_model=33, train.max_steps=5 (or 3 other draws): "
        "model.encoder_attention_heads: must divide d_model=33, got 2 (all 2 jobs)",
        "search.space draws model.d_model=33, train.max_steps=5 (or 3 other draws): "
        "model.decoder_attention_heads: must divide d_model=33, got 2 (all 2 jobs)",
        "search.space draws model.d_model=32, train.max_steps=-1 (or 1 other draw): "
        "train.max_steps: must be > 0, got -1 (all 2 jobs)",
    ]


def test_space_values_cover_small_ranges_and_sample_large_ones():
    from asrforge.matrix.plan import SPACE_SAMPLES, SearchParameter, space_values

    assert space_values(SearchParameter(low=2, high=8, step=2)) == [2, 4, 6, 8]
    wide = space_values(SearchParameter(low=0, high=10**6))
    assert len(wide) == SPACE_SAMPLES and wide[:2] == [0, 1] and wide[-2:] == [10**6 - 1, 10**6]
    logs = space_values(SearchParameter(low=1e-6, high=1e-2, log=True))
    assert logs[0] == 1e-6 and logs[-1] == 1e-2 and logs == sorted(set(logs))
    stepped = space_values(SearchParameter(low=0.0, high=1.0, step=0.25))
    assert stepped == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_two_launchers_on_one_root_never_leave_an_older_search_json_last(tmp_path, config):
    import threading

    plan = load_matrix(search_file(tmp_path, config))
    first, second = Search(plan), Search(plan)  # two launchers sharing the root
    mine, theirs = first.draw(1)[0], second.draw(1)[0]
    first.done(mine, {"best": {"loss": 1.0}})
    read, others = first.summary, []

    def read_then_the_other_finishes():
        summary = read()  # the other launcher's trial still runs in this reading
        other = threading.Thread(
            target=lambda: (second.done(theirs, {"best": {"loss": 0.5}}), second.write_summary())
        )
        other.start()
        other.join(0.5)  # it may write now, between this reading and this write
        others.append(other)
        return summary

    first.summary = read_then_the_other_finishes
    first.write_summary()
    others[0].join()
    written = json.loads((plan.root / "search.json").read_text())["en"]
    assert [t["state"] for t in written["trials"]] == ["complete", "complete"]
    assert written["best"] == 1  # the other launcher's trial, told last


@pytest.mark.fast
def test_the_pruner_reads_a_resumed_trials_metrics_again_once_they_are_cut(tmp_path, config):
    search = Search(load_matrix(search_file(tmp_path, config)))
    job = search.draw(1)[0]
    metrics = search.plan.run_dir(job) / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    evals = [{"event": "eval", "step": s, "loss": v} for s, v in ((2, 3.0), (4, 2.0))]
    metrics.write_text("".join(json.dumps(x) + "\n" for x in
                               [{"event": "train_begin", "step": 0}, *evals]))  # fmt: skip
    search.should_stop_early(job)
    # killed after step 4, resumed from step 2: its start replaces the file, cut back to step 2
    resumed = [{"event": "train_begin", "step": 0}, evals[0],
               {"event": "train_begin", "step": 2, "resumed": True, "device": "cpu" * 20},
               {"event": "eval", "step": 4, "loss": 2.5}, {"event": "eval", "step": 6, "loss": 1.0}]
    replacement = tmp_path / "cut.jsonl"
    replacement.write_text("".join(json.dumps(x) + "\n" for x in resumed))
    replacement.replace(metrics)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # optuna warns of a step reported twice
        search.should_stop_early(job)
    trial = search.studies["en"].trials[0]
    assert trial.intermediate_values == {2: 3.0, 4: 2.0, 6: 1.0}


@pytest.mark.fast
@pytest.mark.parametrize("attack", ["a FIFO", "larger than the limit"])
def test_the_pruner_reads_a_trials_metrics_within_bounds(tmp_path, config, monkeypatch, attack):
    search = Search(load_matrix(search_file(tmp_path, config)))
    job = search.draw(1)[0]
    metrics = search.plan.run_dir(job) / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    evals = [{"event": "eval", "step": s, "loss": 4.0 - s / 2} for s in (2, 4, 6)]
    if attack == "a FIFO":
        os.mkfifo(metrics)
    else:
        lines = [json.dumps(x) + "\n" for x in evals]
        metrics.write_text("".join(lines))
        monkeypatch.setattr("asrforge.matrix.search.RECORDS_BYTES", len(lines[0]) + 1)
    reader = threading.Thread(target=search.should_stop_early, args=(job,), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # waiting for a writer, as it did before: release it
        os.close(os.open(metrics, os.O_WRONLY | os.O_NONBLOCK))
    assert not reader.is_alive()
    trial = search.studies["en"].trials[0]
    assert trial.intermediate_values == ({} if attack == "a FIFO" else {2: 3.0})
