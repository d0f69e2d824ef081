"""Matrix jobs on several devices: slots of ``gpus_per_job`` devices, each job launched under
torchrun; a 2-process CPU job (gloo) through the local executor leaves the same run directory as
a 1-process one."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from pathlib import Path

import pytest
import yaml

from asrforge.errors import (
    EXIT_DIR_ENV,
    ExitCode,
    UserError,
    report_exit_code,
    reported_exit_code,
)
from asrforge.matrix.executors import (
    Attempt,
    LocalExecutor,
    group_devices,
    parse_devices,
    run_attempt,
)
from asrforge.matrix.plan import load_matrix
from asrforge.matrix.run import Launcher
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.fast
def test_devices_are_grouped_into_slots_of_gpus_per_job():
    gpus = group_devices(parse_devices("0,1,2,3,5"), 2)
    assert [(d.label, d.cuda_visible, d.processes) for d in gpus] == [
        ("cuda:0,1", "0,1", 2), ("cuda:2,3", "2,3", 2)]  # cuda:5 stays idle
    cpus = group_devices(parse_devices("cpu:4"), 2)
    assert [d.label for d in cpus] == ["cpu:0,1", "cpu:2,3"]
    assert all(d.cuda_visible == "" and d.processes == 2 for d in cpus)
    assert cpus[0].threads == parse_devices("cpu:4")[0].threads  # per process
    assert group_devices(parse_devices("0,1"), 1) == parse_devices("0,1")
    with pytest.raises(UserError, match="--gpus-per-job 4: only 2 device"):
        group_devices(parse_devices("0,1"), 4)


def test_a_job_on_several_devices_runs_under_torchrun(tmp_path, tones_dir):
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(tmp_path / "unused", tones_dir).to_yaml())
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump({
        "languages": ["en"], "configs": [{"config_id": "a", "path": str(config)}],
        "gpus_per_job": 2}))
    plan = load_matrix(matrix)
    assert plan.gpus_per_job == 2 and load_matrix(matrix, gpus_per_job=4).gpus_per_job == 4
    job = plan.jobs[0]
    one, two = parse_devices("cpu:1")[0], group_devices(parse_devices("cpu:2"), 2)[0]
    single = Attempt(job, one, 1, False, tmp_path / "log", tmp_path).command()
    multi = Attempt(job, two, 1, True, tmp_path / "log", tmp_path).command()
    assert single[:4] == [sys.executable, "-m", "asrforge", "train"]
    assert multi[:7] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc_per_node", "2", "-m"]
    assert multi[7:] == [*single[2:], "--resume"]


def test_the_cli_takes_gpus_per_job_and_dry_run_shows_torchrun(tmp_path, tones_dir, capsys):
    from asrforge.cli import main

    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(tmp_path / "unused", tones_dir).to_yaml())
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump({
        "languages": ["en"], "configs": [{"config_id": "a", "path": str(config)}]}))
    assert main(["matrix", str(matrix), "--dry-run", "--gpus-per-job", "4"]) == 0
    assert "en-a-s0: torchrun --standalone --nproc_per_node 4 -m asrforge train" in (
        capsys.readouterr().out)
    assert main(["matrix", str(matrix), "--gpus-per-job", "0"]) == 2
    assert "--gpus-per-job: must be >= 1, got 0" in capsys.readouterr().err
    assert main(["matrix", str(matrix), "--devices", "cpu:2", "--gpus-per-job", "3"]) == 2
    assert "--gpus-per-job 3: only 2 device(s)" in capsys.readouterr().err


def files_of(run_dir: Path) -> set[str]:
    """The run directory's shape: each file's path, step numbers and all (a TensorBoard file's
    name holds its time and pid)."""
    return {re.sub(r"tfevents\..*", "tfevents.*", str(p.relative_to(run_dir)))
            for p in run_dir.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_a_two_process_cpu_job_leaves_the_run_dir_of_a_one_process_job(
        tmp_path, tones_dir, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(
        tmp_path / "unused", tones_dir, train={"max_steps": 2, "log_every": 1, "precision": "no"},
        eval={"eval_steps": 2}, data={"batch_size": 4}).to_yaml())
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump({
        "languages": ["en"], "configs": [{"config_id": "tiny", "path": str(config)}],
        "retries": 0}))
    plans = {n: load_matrix(matrix, out=tmp_path / f"root{n}", gpus_per_job=n) for n in (1, 2)}
    outcomes = {}

    def launch(n: int) -> None:
        executor = LocalExecutor(group_devices(parse_devices(f"cpu:{n}"), n))
        outcomes[n] = Launcher(plans[n], executor, progress_every=60.0).run()

    # The 1-process job runs beside the 2-process one, to keep the test short.
    single = threading.Thread(target=launch, args=(1,))
    single.start()
    launch(2)
    single.join()
    runs = {n: plans[n].run_dir(plans[n].jobs[0]) for n in (1, 2)}
    for n in (1, 2):
        log = plans[n].log_path(plans[n].jobs[0]).read_text()
        assert outcomes[n].done == ["en-tiny-s0"] and outcomes[n].exit_code == 0, log
    assert "torch.distributed.run --standalone --nproc_per_node 2" in log
    assert "on cpu:0,1" in capsys.readouterr().out
    assert "2 process(es)" in (runs[2] / "train.log").read_text()
    assert files_of(runs[2]) == files_of(runs[1])
    done = [json.loads((runs[n] / "DONE").read_text()) for n in (1, 2)]
    assert [d["step"] for d in done] == [2, 2] and done[1]["history"][0]["device"] == "cpu:0,1"


def test_each_process_reports_its_exit_code_where_the_launcher_says(tmp_path, monkeypatch):
    """torchrun exits 1 whatever its processes exited with: the processes report their own."""
    reports = tmp_path / "exit"
    reports.mkdir()
    monkeypatch.setenv(EXIT_DIR_ENV, str(reports))
    monkeypatch.setenv("RANK", "1")
    report_exit_code(2)
    assert (reports / "rank-1").read_text() == "2\n"
    # a file already there, or a link planted in its place, is never written through
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (reports / "rank-3").symlink_to(target)
    monkeypatch.setenv("RANK", "3")
    report_exit_code(ExitCode.INTERRUPTED)
    assert target.read_text() == "keep"
    monkeypatch.delenv(EXIT_DIR_ENV)
    report_exit_code(1)  # outside a matrix job: nothing to report, nothing written
    assert sorted(p.name for p in reports.iterdir()) == ["rank-1", "rank-3"]


@pytest.mark.parametrize(
    ("reported", "returncode", "expected"),
    [
        ({"rank-0": "2", "rank-1": "75"}, 1, 2),  # bad input is the cause, whoever saw it
        ({"rank-0": "75", "rank-1": "1"}, 1, ExitCode.INTERRUPTED),
        ({"rank-0": "1"}, 1, 1),  # a crash stays a crash
        ({}, 1, 1),  # a process that died without a word
        ({"rank-0": "2"}, 0, 0),  # torchrun's own success or a signal's code stands
        ({"rank-0": "2"}, -9, -9),
        ({"rank-0": "not a number", "rank-1": "75"}, 1, ExitCode.INTERRUPTED),
    ],
)
def test_the_launcher_reads_the_processes_codes_when_torchrun_failed(
    tmp_path, reported, returncode, expected
):
    for name, text in reported.items():
        (tmp_path / name).write_text(text)
    assert reported_exit_code(returncode, str(tmp_path)) == expected


@pytest.mark.slow
def test_a_two_process_job_with_bad_input_ends_with_exit_code_2(
        tmp_path, tones_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(tmp_path / "unused", tones_dir).to_yaml())
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump({
        "languages": ["en"], "configs": [{"config_id": "a", "path": str(config)}]}))
    job = load_matrix(matrix, out=tmp_path / "root").jobs[0]
    config.unlink()  # each process of the job now stops on a missing config: bad input
    device = group_devices(parse_devices("cpu:2"), 2)[0]
    log = tmp_path / "job.log"
    result = run_attempt(Attempt(job, device, 1, False, log, tmp_path))
    text = log.read_text()
    # torchrun stops the other process once one fails, so it may not live to report its own error.
    assert "torch.distributed.run" in text and text.count("c.yaml: no such file") >= 1, text[-2000:]
    assert result.returncode == 2, text[-2000:]  # torchrun itself exited 1
