"""The SLURM executor without a cluster: the sbatch parameters asrforge builds (partition, GPUs,
time limit, the signal before it) as submitit writes them, the checkpoint handler that stops a
run and requeues it with ``--resume``, and a real job through submitit's LocalExecutor, which
runs the same job code and signal handler on this machine: signalled after its first checkpoint,
it saves, is requeued and resumes to the end."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from asrforge.errors import ExitCode, UserError
from asrforge.matrix.executors import Attempt, parse_devices
from asrforge.matrix.plan import load_matrix
from asrforge.matrix.run import Launcher
from asrforge.matrix.slurm import (
    SIGNAL_DELAY_S,
    SlurmAttempt,
    SlurmExecutor,
    describe_sbatch,
    make_launch_dir,
    outcome_path,
    parse_slurm_args,
    read_outcome,
    sbatch_parameters,
    time_limit_minutes,
)
from asrforge.train.events import Callback
from tests.conftest import tiny_config

submitit = pytest.importorskip("submitit", reason="pip install 'asrforge[slurm]'")

ROOT = Path(__file__).resolve().parents[1]


class PauseAfterFirstSave(Callback):
    """In a run that starts from scratch, writes ``marker`` after its first checkpoint and then
    takes ``pause`` seconds per step: a run still going when the test signals it."""

    name = "pause_after_first_save"

    def __init__(self, marker: str, pause: float = 3.0):
        self.marker, self.pause, self.armed, self.saved = Path(marker), pause, False, False

    def on_train_begin(self, state, *, run):
        self.armed = state.step == 0

    def on_save(self, state, *, path, kind):
        if self.armed and not self.saved:
            self.saved = True
            self.marker.write_text(str(state.step))

    def on_step_end(self, state, *, metrics):
        if self.saved:
            time.sleep(self.pause)


@pytest.mark.fast
def test_time_limits_in_slurm_formats():
    assert time_limit_minutes("4:00:00") == 240
    assert time_limit_minutes("90") == 90
    assert time_limit_minutes("10:30") == 11  # MM:SS, rounded up
    assert time_limit_minutes("1-12") == 36 * 60
    assert time_limit_minutes("2-00:30:00") == 2 * 1440 + 30
    for bad in ("4h", "", "1:2:3:4", "3"):  # 3 minutes leave no time after the signal
        with pytest.raises(UserError, match="--time-limit"):
            time_limit_minutes(bad)
    assert parse_slurm_args(["account=abc", "--mem=200G"]) == {"account": "abc", "mem": "200G"}
    with pytest.raises(UserError, match="--slurm-arg"):
        parse_slurm_args(["exclusive"])


@pytest.mark.fast
def test_the_sbatch_script_has_partition_gpus_time_and_the_signal(tmp_path):
    from submitit.slurm.slurm import _get_default_parameters, _make_sbatch_string

    params = sbatch_parameters(partition="a100", gpus_per_job=4, time_limit="4:00:00",
                               slurm_args=parse_slurm_args(["account=asr", "cpus-per-task=32"]))
    script = _make_sbatch_string(command="python -m submitit.core._submit X", folder=tmp_path,
                                 **params)
    flags = {line for line in script.splitlines() if line.startswith("#SBATCH")}
    assert {"#SBATCH --partition=a100", "#SBATCH --gpus-per-node=4", "#SBATCH --time=240",
            f"#SBATCH --signal=USR2@{SIGNAL_DELAY_S}", "#SBATCH --nodes=1",
            "#SBATCH --ntasks-per-node=1", "#SBATCH --account=asr",
            "#SBATCH --cpus-per-task=32"} <= flags
    # names submitit's SlurmExecutor.update_parameters accepts
    assert set(params) <= set(_get_default_parameters())
    # what a dry run shows is what submitit writes
    assert {f"#SBATCH {flag}" for flag in describe_sbatch(params).split()} <= flags


def one_job_plan(tmp_path: Path, tones_dir: Path, **config):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(tiny_config(tmp_path / "unused", tones_dir, **config).to_yaml())
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump({
        "out": str(tmp_path / "root"), "languages": ["en"],
        "configs": [{"config_id": "tiny", "path": str(cfg)}], "retries": 0}))
    return load_matrix(matrix, allow_external_callbacks=True)


def events(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "events.jsonl").read_text().splitlines()]


def test_the_signal_handler_stops_the_run_and_requeues_it_with_resume(tmp_path, tones_dir):
    plan = one_job_plan(tmp_path, tones_dir)
    job = plan.jobs[0]
    attempt = Attempt(job, parse_devices("cpu:1")[0], 1, False, plan.log_path(job), tmp_path)
    run_dir = plan.run_dir(job)
    (run_dir / "checkpoints" / "step-000002").mkdir(parents=True)
    # a run that saves and exits 75 on SIGTERM
    run = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))\nprint('up', flush=True)\n"
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert run.stdout.readline() == "up\n"
    fn = SlurmAttempt(attempt, run_dir, plan.root, tmp_path)
    fn._proc = run
    delayed = fn.__submitit_checkpoint__()
    assert run.returncode == ExitCode.INTERRUPTED
    again = delayed.function
    assert isinstance(again, SlurmAttempt) and again.attempt == replace(attempt, resume=True)
    assert "--resume" in again.attempt.command()
    (requeue,) = events(plan.root)
    assert requeue["event"] == "requeue" and requeue["job_id"] == job.job_id
    assert requeue["returncode"] == ExitCode.INTERRUPTED and requeue["resume"] is True


def task_pid(controller: int, timeout: float = 60) -> int:
    """The job's task: the child process of submitit's local controller."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        children = Path(f"/proc/{controller}/task/{controller}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.1)
    raise AssertionError("the job's task did not start")


@pytest.mark.slow
def test_a_job_signalled_before_its_time_limit_is_requeued_and_resumes(
        tmp_path, tones_dir, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    marker = tmp_path / "saved"
    plan = one_job_plan(
        tmp_path, tones_dir, train={"max_steps": 10, "log_every": 1, "precision": "no"},
        eval={"eval_steps": 2}, data={"batch_size": 4},
        callbacks=[{"_target_": "test_matrix_slurm.PauseAfterFirstSave", "marker": str(marker)}])
    launch_dir = make_launch_dir(plan.root)
    local = submitit.LocalExecutor(folder=launch_dir / "%j")
    local.update_parameters(timeout_min=10, signal_delay_s=60)
    executor = SlurmExecutor(local, plan.root, launch_dir, slots=1)
    signalled = []

    def signal_after_the_first_save() -> None:
        deadline = time.time() + 300
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.1)
        (job, _), = executor._jobs.values()
        # what SLURM sends signal_delay_s before the time limit
        os.kill(task_pid(job._process.pid), signal.SIGUSR2)
        signalled.append(int(marker.read_text()))

    helper = threading.Thread(target=signal_after_the_first_save, daemon=True)
    helper.start()
    out = Launcher(plan, executor, progress_every=60.0).run()
    helper.join(5)
    job = plan.jobs[0]
    log = plan.log_path(job).read_text()
    assert out.done == [job.job_id] and signalled, log
    run_dir = plan.run_dir(job)
    begins = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    begins = [x["step"] for x in begins if x["event"] == "train_begin"]
    assert len(begins) == 2 and begins[0] == 0 and begins[1] >= signalled[0]
    first, second = log.split(f"==== asrforge matrix: {job.job_id} attempt 1")[1:]
    assert "--resume" not in first.splitlines()[1] and "(resume)" in second.splitlines()[0]
    assert "--resume" in second.splitlines()[1]
    done = json.loads((run_dir / "DONE").read_text())
    assert done["attempts"] == 1 and done["step"] == 10 and done["status"] == "completed"
    ev = [e["event"] for e in events(plan.root)]
    assert ev == ["claim", "start", "requeue", "exit", "done"]
    assert "via slurm" in capsys.readouterr().out


class PlantedPickle:
    """What a planted result pickle would run when unpickled: it leaves a file behind."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pickle ran"))


@pytest.mark.slow
def test_a_planted_result_pickle_is_never_read_the_outcome_comes_from_json(
        tmp_path, tones_dir, monkeypatch):
    """A job whose folder already holds a result pickle (someone who could write the root put it
    there for a job id the queue hands out): the launcher reads the job's own JSON record."""
    import pickle

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    plan = one_job_plan(tmp_path, tones_dir, train={"max_steps": 2, "precision": "no"},
                        eval={"eval_steps": None})
    launch_dir = make_launch_dir(plan.root)
    local = submitit.LocalExecutor(folder=launch_dir / "%j")
    local.update_parameters(timeout_min=10)
    executor = SlurmExecutor(local, plan.root, launch_dir, slots=1)
    marker = tmp_path / "ran"
    job = plan.jobs[0]
    attempt = Attempt(job, executor.devices()[0], 1, False, plan.log_path(job), tmp_path)
    plan.log_path(job).parent.mkdir(parents=True, exist_ok=True)
    executor.submit(attempt)
    (submitted, _), = executor._jobs.values()
    deadline = time.time() + 300
    while not submitted.done() and time.time() < deadline:
        time.sleep(0.5)
    # replaced after the job ended, before the launcher looks: as a planted file would be
    submitted.paths.result_pickle.write_bytes(pickle.dumps(("success", PlantedPickle(marker))))
    (result,) = executor.poll(1.0)
    assert not marker.exists()
    assert result.returncode == 0 and result.error is None
    assert result == read_outcome(outcome_path(launch_dir, attempt))


def test_an_outcome_record_is_read_with_every_field_type_checked(tmp_path):
    plan_job = type("J", (), {"job_id": "en-a-s0"})()
    attempt = Attempt(plan_job, parse_devices("cpu:1")[0], 2, False, tmp_path / "l", tmp_path)
    path = outcome_path(tmp_path, attempt)
    good = {"job_id": "en-a-s0", "number": 2, "device": "slurm:0", "returncode": 0,
            "started": 1.0, "finished": 2.5, "host": "n1", "error": None}
    path.write_text(json.dumps(good))
    assert read_outcome(path).returncode == 0
    for key, bad in [("returncode", "0"), ("number", True), ("started", None), ("error", 3),
                     ("job_id", ["x"])]:
        path.write_text(json.dumps({**good, key: bad}))
        assert read_outcome(path).startswith(f"{path}: {key}: ")
    path.write_text(json.dumps({**good, "extra": 1}))
    assert "not an outcome record" in read_outcome(path)
    path.write_bytes(b"\xff\xfe")
    assert read_outcome(path).endswith("not JSON")
    path.unlink()
    assert read_outcome(path) == "no outcome recorded"
    os.mkfifo(path)  # a FIFO never hangs the launcher
    assert "not a regular file" in read_outcome(path)
    path.unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps(good))
    path.symlink_to(tmp_path / "elsewhere.json")
    assert "a symlink" in read_outcome(path)


def test_each_launch_gets_a_fresh_private_folder_and_a_planted_one_is_refused(tmp_path):
    root = tmp_path / "root"
    first, second = make_launch_dir(root), make_launch_dir(root)
    assert first != second and first.parent == second.parent == root / "slurm"
    assert stat.S_IMODE(first.stat().st_mode) == 0o700 and not any(first.iterdir())
    # a slurm/ folder that is a link to elsewhere: never written through
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for planted in (tmp_path / "r2", tmp_path / "r3"):
        planted.mkdir()
    (tmp_path / "r2" / "slurm").symlink_to(elsewhere)
    with pytest.raises(UserError, match="slurm: a symlink"):
        make_launch_dir(tmp_path / "r2")
    (tmp_path / "r3" / "slurm").write_text("a file")
    with pytest.raises(UserError, match="not a directory"):
        make_launch_dir(tmp_path / "r3")
    assert not any(elsewhere.iterdir())


def test_on_cluster_puts_submitit_in_this_launchs_folder(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit looks for it, never runs it
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    params = sbatch_parameters(partition=None, gpus_per_job=1, time_limit="1:00:00")
    executor = SlurmExecutor.on_cluster(tmp_path / "root", 1, params)
    folder = Path(str(executor._submitter.folder))
    assert folder.parent == executor._launch_dir and folder.name == "%j"
    assert executor._launch_dir.parent == tmp_path / "root" / "slurm"


@pytest.mark.fast
def test_a_launch_that_finds_no_slurm_leaves_no_folder_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-srun-here"))
    params = sbatch_parameters(partition=None, gpus_per_job=1, time_limit="1:00:00")
    with pytest.raises(UserError, match='--executor slurm: Could not detect "srun"'):
        SlurmExecutor.on_cluster(tmp_path / "runs" / "new", 1, params)
    assert not (tmp_path / "runs").exists()
    # a root that was there stays, with what it holds; only the launch's folders go
    (tmp_path / "old" / "runs").mkdir(parents=True)
    with pytest.raises(UserError, match="Could not detect"):
        SlurmExecutor.on_cluster(tmp_path / "old", 1, params)
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["runs"]


@pytest.mark.fast
def test_the_dry_run_checks_the_slurm_options_and_shows_the_sbatch_ones(
    tmp_path, tones_dir, capsys
):
    from asrforge.cli import main

    one_job_plan(tmp_path, tones_dir)
    matrix = str(tmp_path / "m.yaml")
    slurm = ["matrix", matrix, "--executor", "slurm", "--dry-run"]
    assert main([*slurm, "--time-limit", "banana", "--slurm-arg", "foo",
                 "--slurm-arg", "=x", "--slurm-arg", "qos=high"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "3 problems" in err and "--time-limit: 'banana'" in err
    assert "--slurm-arg: 'foo'" in err and "--slurm-arg: '=x'" in err and "qos" not in err
    assert main([*slurm, "--partition", "gpu", "--time-limit", "1:00:00",
                 "--slurm-arg", "account=asr"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert ("slurm: 1 job(s) queued at once, each with sbatch --job-name=asrforge --nodes=1 "
            "--ntasks-per-node=1 --gpus-per-node=1 --time=60 --signal=USR2@180 "
            "--partition=gpu --account=asr") in out
    assert not (tmp_path / "root").exists()  # a dry run makes no folder


@pytest.mark.fast
def test_an_option_of_another_executor_is_refused_not_ignored(tmp_path, tones_dir, capsys):
    """`--partition gpu` without `--executor slurm` would train on this machine instead."""
    from asrforge.cli import main

    one_job_plan(tmp_path, tones_dir)
    matrix = str(tmp_path / "m.yaml")
    assert main(["matrix", matrix, "--dry-run", "--partition", "gpu", "--time-limit", "1:00:00",
                 "--slurm-arg", "account=asr", "--ray-address", "ray://head:10001"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "4 problems" in err
    assert "--partition: an option of --executor slurm; this launch is --executor local" in err
    assert "--time-limit: an option of --executor slurm" in err
    assert "--ray-address: an option of --executor ray" in err
    assert main(["matrix", matrix, "--dry-run", "--executor", "slurm", "--devices", "0"]) == 2
    assert "--devices: an option of --executor local" in capsys.readouterr().err
    assert main(["matrix", matrix, "--dry-run", "--executor", "slurm"]) == 0  # its default limit
    assert "--time=240" in capsys.readouterr().out
    assert main(["matrix", matrix, "--dry-run", "--executor", "slurm", "--time-limit", ""]) == 2
    assert "--time-limit: ''" in capsys.readouterr().err  # an empty limit is no default
    assert not (tmp_path / "root").exists()
