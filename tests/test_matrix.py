"""The matrix: MATRIX.yaml schema and expansion, claims, the launcher's retry / resume / skip
logic, and end to end: two launchers at once over 3 languages × 2 seeds of the tiny config on
CPU (one job crashes once after a checkpoint and resumes), and the same through Ray."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from asrforge.config import ALLOW_EXTERNAL_HINT, ConfigError, load_config
from asrforge.errors import ExitCode, UserError
from asrforge.matrix.claims import Claims, lock_is_held
from asrforge.matrix.executors import (
    Attempt,
    AttemptResult,
    Device,
    LocalExecutor,
    parse_devices,
    run_attempt,
)
from asrforge.matrix.plan import load_matrix
from asrforge.matrix.run import Launcher, Outcome
from asrforge.train.events import Callback
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]
LANGS = ("en", "es", "th")  # three selection groups: combined_gate, by_wer, by_loss


class CrashOnce(Callback):
    """Kills its process right after the first checkpoint of a run that starts from scratch
    (not a resume) with this seed: a job that fails once and leaves a checkpoint to resume."""

    name = "crash_once"

    def __init__(self, seed: int = 0):
        self.seed, self.armed = seed, False

    def on_train_begin(self, state, *, run):
        self.armed = state.step == 0 and run.config.seed == self.seed

    def on_save(self, state, *, path, kind):
        if self.armed:
            os._exit(3)


# ---------------------------------------------------------------------------------------------
# plan


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def two_configs(tmp_path, tones_dir) -> tuple[Path, Path]:
    a = tmp_path / "a.yaml"
    a.write_text(tiny_config(tmp_path / "unused", tones_dir).to_yaml())
    b = tmp_path / "b.yaml"
    b.write_text(tiny_config(tmp_path / "unused", tones_dir, optim={"lr": 1e-3}).to_yaml())
    return a, b


@pytest.mark.fast
def test_jobs_are_languages_x_configs_x_seeds_with_overrides_in_order(tmp_path, two_configs):
    a, b = two_configs
    m = write_yaml(tmp_path / "m.yaml", {
        "out": str(tmp_path / "root"), "languages": ["en", "no"],
        "configs": [{"config_id": "a", "path": str(a), "overrides": {"train.max_steps": 7}},
                    {"config_id": "b", "path": str(b), "overrides": ["optim.lr=2e-3"]}],
        "seeds": [0, 5], "overrides": ["train.max_steps=3", "eval.max_new_tokens=4"],
        "language_overrides": {"no": {"selection.policy": "by_loss", "train.precision": "no"}},
    })
    plan = load_matrix(m)
    assert [j.job_id for j in plan.jobs] == [
        "en-a-s0", "en-a-s5", "no-a-s0", "no-a-s5", "en-b-s0", "en-b-s5", "no-b-s0", "no-b-s5"]
    job = next(j for j in plan.jobs if j.job_id == "no-a-s5")
    cfg = load_config(job.config_path, list(job.overrides))
    # `no` (Norwegian) stays a string; the config entry's override beats the matrix-wide one
    assert cfg.data.languages == ["no"] and cfg.selection.language == "no"
    assert cfg.train.max_steps == 7 and cfg.eval.max_new_tokens == 4
    assert cfg.selection.policy == "by_loss" and cfg.train.precision == "no"
    assert cfg.seed == 5 and cfg.config_id == "a"
    assert cfg.output_dir == tmp_path / "root" / "runs" / "no-a-s5"
    assert plan.log_path(job) == tmp_path / "root" / "logs" / "matrix" / "no-a-s5.log"
    en_b = load_config(plan.jobs[4].config_path, list(plan.jobs[4].overrides))
    assert en_b.optim.lr == 2e-3 and en_b.selection.policy == "auto"
    # --out and CLI overrides win
    plan = load_matrix(m, out=tmp_path / "elsewhere", extra_overrides=["train.max_steps=9"])
    cfg = load_config(plan.jobs[0].config_path, list(plan.jobs[0].overrides))
    assert plan.root == tmp_path / "elsewhere" and cfg.train.max_steps == 9


@pytest.mark.fast
def test_matrix_errors_are_reported_together_by_yaml_path(tmp_path, two_configs):
    a, _ = two_configs
    m = write_yaml(tmp_path / "m.yaml", {
        "languages": ["en", "en", "es"], "seed": [1],
        "configs": [{"config_id": "a", "path": str(a)},
                    {"config_id": "bad id", "path": "nope.yaml"}],
        "retries": -1,
    })
    with pytest.raises(ConfigError) as e:
        load_matrix(m)
    problems = e.value.problems
    assert "seed: unknown field — did you mean seeds?" in problems
    assert any(p.startswith("configs.1.config_id: string should match pattern") for p in problems)
    assert "retries: must be >= 0, got -1" in problems
    # cross-field rules, once the shape is right
    m = write_yaml(tmp_path / "m.yaml", {
        "languages": ["en", "en"], "configs": [{"config_id": "a", "path": str(a)},
                                               {"config_id": "a", "path": "nope.yaml"}],
        "language_overrides": {"fr": ["seed=1"]},
    })
    with pytest.raises(ConfigError) as e:
        load_matrix(m)
    assert set(e.value.problems) == {
        "languages.1: 'en' is listed twice (also languages.0)",
        "configs.1.config_id: 'a' is listed twice (also configs.0)",
        "language_overrides.fr: not one of languages ['en', 'en']",
        "configs.1.path: nope.yaml: no such file",
    }
    # every job's training config is validated up front; one line per problem, not per job,
    # named by the matrix's YAML path of the override that wrote it
    m = write_yaml(tmp_path / "m.yaml", {
        "languages": ["en", "es"], "configs": [{"config_id": "a", "path": str(a)}],
        "overrides": ["optim.lr=-1"], "language_overrides": {"es": ["train.max_step=3"]},
    })
    with pytest.raises(ConfigError) as e:
        load_matrix(m)
    assert e.value.problems == [
        "overrides: optim.lr: must be > 0, got -1 (all 2 jobs)",
        "language_overrides.es: train.max_step: unknown field — did you mean train.max_steps? "
        "(job es-a-s0)",
    ]
    # a callback named by _target_ runs code: the person running the matrix must allow it
    m = write_yaml(tmp_path / "m.yaml", {
        "languages": ["en"], "configs": [{"config_id": "a", "path": str(a)}],
        "overrides": {"callbacks": [{"_target_": "x.Y"}]}})
    with pytest.raises(ConfigError, match=r"overrides: callbacks.0._target_: 'x.Y' would "
                                          r"import .*pass --allow-external-callbacks.* \(job "
                                          r"en-a-s0\)"):
        load_matrix(m)


LANGUAGES = ["en", "es", "fr", "de", "it", "pt", "nl", "sv", "da", "fi", "pl", "cs"]


@pytest.mark.fast
def test_every_problem_of_a_large_matrix_is_told_once_in_one_message(tmp_path, two_configs, capsys):
    """A user with many languages got the matrix file's problems, then, fixed, the jobs' ones:
    now every file's problems come at once, each once, naming its file (or the override that
    wrote it) and the jobs it holds for, with the command line's."""
    from asrforge.cli import main

    a, b = two_configs
    bad = yaml.safe_load(b.read_text())
    bad["optim"]["lr"] = -1
    bad["model"]["lora"] = {"target_modules": ["q_prj", "v_proj"]}
    write_yaml(b, bad)
    m = write_yaml(tmp_path / "m.yaml", {
        "out": str(tmp_path / "root"), "languages": LANGUAGES, "seed": [0, 1], "retries": -1,
        "configs": [{"config_id": "a", "path": str(a)}, {"config_id": "b", "path": str(b)}],
        "language_overrides": {"fr": {"train.max_steps": -3}, "de": {"train.max_steps": -3}},
    })
    with pytest.raises(ConfigError) as e:
        load_matrix(m)
    assert e.value.problems == [
        "retries: must be >= 0, got -1",
        "seed: unknown field — did you mean seeds?",
        "language_overrides.fr: train.max_steps: must be > 0, got -3 (2 jobs: language fr)",
        "language_overrides.de: train.max_steps: must be > 0, got -3 (2 jobs: language de)",
        f"{b}: optim.lr: must be > 0, got -1 (12 jobs: config b)",
    ]
    # the learning rate fixed, a LoRA target the job's start would refuse is told by the plan
    bad["optim"]["lr"] = 1e-3
    write_yaml(b, bad)
    assert main(["matrix", str(m), "--dry-run", "--gpus-per-job", "0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[1:] == [
        "  retries: must be >= 0, got -1",
        "  seed: unknown field — did you mean seeds?",
        "  language_overrides.fr: train.max_steps: must be > 0, got -3 (2 jobs: language fr)",
        "  language_overrides.de: train.max_steps: must be > 0, got -3 (2 jobs: language de)",
        f"  {b}: model.lora.target_modules.0: 'q_prj' names no layer of the model — did you mean "
        "q_proj? (10 jobs: every language but fr, de; config b)",  # theirs do not load
        "  --gpus-per-job: must be >= 1, got 0",
    ]
    assert not (tmp_path / "root").exists()


@pytest.mark.fast
def test_the_jobs_a_problem_holds_for_are_described_by_the_matrixs_dimensions():
    from asrforge.matrix.problems import describe_jobs, origin

    cells = {f"{lang}-{c}-s{s}": (lang, c, s)
             for c in ("a", "b") for lang in LANGUAGES for s in (0, 1)}  # fmt: skip
    ids = list(cells)
    assert describe_jobs(ids, cells) == "all 48 jobs"
    assert describe_jobs(["en-a-s1"], cells) == "job en-a-s1"
    assert describe_jobs([i for i in ids if "-b-" in i], cells) == "24 jobs: config b"
    assert describe_jobs([i for i in ids if i[:2] in ("es", "fr") and i.endswith("s1")],
                         cells) == "4 jobs: languages es, fr; seed 1"
    assert describe_jobs([i for i in ids if i[:2] != "pl"], cells) == \
        "44 jobs: every language but pl"
    assert describe_jobs([i for i in ids if i[:2] not in ("pl", "cs") or "-a-" in i][:30],
                         cells) == "30 jobs: " + ", ".join(ids[:6]) + " and 24 more"
    # where a job's problem was written: the last override that set its path, else the file
    overrides = [("optim.lr=1", "overrides"), ("callbacks=[]", "language_overrides.es"),
                 ("optim.lr=-1", "configs.0.overrides")]
    assert origin("optim.lr: must be > 0, got -1", overrides, "a.yaml") == "configs.0.overrides"
    assert origin("callbacks.0.monitor: 'x'", overrides, "a.yaml") == "language_overrides.es"
    assert origin("optim.weight_decay: must be >= 0", overrides, "a.yaml") == "a.yaml"


@pytest.mark.fast
def test_callbacks_and_metric_names_of_every_job_are_checked_before_launch(
    tmp_path, two_configs, capsys
):
    """A typo in a metric name used to pass the plan and fail each job as it started."""
    from asrforge.cli import main

    a, _ = two_configs
    m = write_yaml(tmp_path / "m.yaml", {
        "out": str(tmp_path / "root"), "languages": ["en", "es"],
        "configs": [{"config_id": "a", "path": str(a),
                     "overrides": {"checkpoint.keep_best": [{"metric": "wer_rw"}]}}],
        "language_overrides": {"es": {"callbacks": [
            {"name": "early_stopping", "monitor": "cerr"},
            {"name": "early_stoping"},
            {"_target_": "no_such_module_anywhere.Callback"},
        ]}},
    })
    assert main(["matrix", str(m)]) == 2
    lines = [line.strip() for line in capsys.readouterr().err.splitlines()]
    assert any(line.startswith("configs.0.overrides: checkpoint.keep_best.0.metric: 'wer_rw' is "
                               "not a metric evaluation produces, did you mean 'wer_raw'?")
               and line.endswith("(all 2 jobs)") for line in lines)
    assert any(line.startswith("language_overrides.es: callbacks.0.monitor: 'cerr' is not a "
                               "metric evaluation produces, did you mean 'cer'?")
               and line.endswith("(job es-a-s0)") for line in lines)
    assert "language_overrides.es: callbacks.1.name: unknown callback 'early_stoping' — did " \
           "you mean early_stopping? (job es-a-s0)" in lines
    # not imported (the matrix does not allow it): refused by name, not "cannot import"
    target = [line for line in lines if "callbacks.2._target_" in line]
    assert len(target) == 1 and "pass --allow-external-callbacks" in target[0]
    assert not (tmp_path / "root").exists()  # nothing launched, nothing written
    # allowed, the target is imported and checked like the rest
    with pytest.raises(ConfigError) as e:
        load_matrix(m, allow_external_callbacks=True)
    assert any(p.startswith("language_overrides.es: callbacks.2._target_: cannot import "
                            "'no_such_module_anywhere.Callback'") for p in e.value.problems)


@pytest.mark.fast
def test_augmentation_transforms_of_every_job_are_checked_before_launch(tmp_path, two_configs):
    """A 'module:function' transform imports code as a _target_ does: without the matrix's
    permission every job failed as it started (exit 2), after the launch."""
    a, _ = two_configs
    transforms = ["tests.test_augment:invert", "no_such_module_anywhere:f"]
    spec = {"languages": ["en"], "configs": [{"config_id": "a", "path": str(a)}],
            "overrides": {"data.augment.transforms": transforms}}
    with pytest.raises(ConfigError) as e:
        load_matrix(write_yaml(tmp_path / "m.yaml", spec))
    assert e.value.problems == [
        f"overrides: data.augment.transforms[{i}]: '{name}' imports code named in the "
        f"config; {ALLOW_EXTERNAL_HINT} (job en-a-s0)"
        for i, name in enumerate(transforms)
    ]
    # allowed, they are imported and checked like a _target_
    with pytest.raises(ConfigError) as e:
        load_matrix(write_yaml(tmp_path / "m.yaml", spec), allow_external_callbacks=True)
    assert len(e.value.problems) == 1
    assert e.value.problems[0].startswith(
        "overrides: data.augment.transforms[1]: cannot import 'no_such_module_anywhere:f'")


@pytest.mark.fast
@pytest.mark.fast
def test_a_launch_stopped_by_one_signal_exits_75_and_one_that_killed_its_jobs_130():
    # one signal: the running jobs save and stop, and a launch again resumes them
    assert Outcome(done=["a"], unfinished=["b"], interrupted=True).exit_code == 75
    assert Outcome(interrupted=True, killed=True).exit_code == 130
    assert Outcome(unfinished=["b"]).exit_code == 1 and Outcome(done=["a"]).exit_code == 0


def test_cli_reports_a_bad_matrix_with_exit_code_2(tmp_path, capsys):
    from asrforge.cli import main

    m = write_yaml(tmp_path / "m.yaml", {"languages": [], "configs": []})
    assert main(["matrix", str(m)]) == 2
    err = capsys.readouterr().err
    assert "languages: list should have at least 1 item" in err and "configs:" in err


MATRICES = sorted((ROOT / "configs").glob("matrix-*.yaml"))


@pytest.mark.fast
@pytest.mark.parametrize("path", MATRICES, ids=lambda p: p.name)
def test_shipped_matrices_load_and_name_their_command(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    plan = load_matrix(path)
    assert plan.jobs
    header = "".join(line for line in path.read_text().splitlines(True) if line.startswith("#"))
    assert f"asrforge matrix configs/{path.name}" in header


@pytest.mark.fast
def test_devices_spec():
    assert [d.label for d in parse_devices("0,2")] == ["cuda:0", "cuda:2"]
    assert parse_devices("0")[0].cuda_visible == "0"
    cpus = parse_devices("cpu:2")
    assert [d.label for d in cpus] == ["cpu:0", "cpu:1"]
    assert all(d.cuda_visible == "" and d.threads >= 1 for d in cpus)
    for bad in ("cpu:0", "gpu", "0,0"):
        with pytest.raises(Exception, match="--devices"):
            parse_devices(bad)


@pytest.mark.fast
def test_gpus_this_machine_does_not_see_are_refused_before_a_dry_run_too(
    tmp_path, two_configs, monkeypatch, capsys
):
    from asrforge.cli import main
    from asrforge.matrix.executors import unseen_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert unseen_gpus(parse_devices("cpu:2")) is None
    assert unseen_gpus(parse_devices("0")) == (
        "--devices: GPU 0: not visible here; this machine sees no GPU (use cpu or cpu:N)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert unseen_gpus(parse_devices("2,3")) is None
    assert unseen_gpus(parse_devices("0,3")).startswith("--devices: GPU 0: not visible here; "
                                                         "this machine sees GPU(s) 2, 3")
    assert [d.cuda_visible for d in parse_devices("auto")] == ["2", "3"]  # as the parent sees them
    a, _ = two_configs
    m = write_yaml(tmp_path / "m.yaml", {"out": str(tmp_path / "root"), "languages": ["en"],
                                         "configs": [{"config_id": "a", "path": str(a)}]})
    for spec in ("0", "cpu:0"):
        assert main(["matrix", str(m), "--devices", spec, "--dry-run"]) == 2
        assert "--devices" in capsys.readouterr().err
    assert main(["matrix", str(m), "--devices", "3", "--dry-run"]) == 0
    assert not (tmp_path / "root").exists()


# ---------------------------------------------------------------------------------------------
# claims


@pytest.mark.fast
def test_a_job_is_claimed_once_and_markers_end_it(tmp_path):
    run_dir = tmp_path / "runs" / "j"
    a, b = Claims(tmp_path, "A"), Claims(tmp_path, "B")
    got = a.try_claim("j", run_dir, "cpu:0")
    assert not isinstance(got, str)
    assert b.try_claim("j", run_dir, "cpu:0") == "held" and b.is_running("j")
    record = json.loads((tmp_path / "claims" / "j.claim").read_text())
    assert record["launcher"] == "A" and record["device"] == "cpu:0"
    got.release()
    assert not b.is_running("j") and not (tmp_path / "claims" / "j.claim").exists()
    got = b.try_claim("j", run_dir, "cpu:1")
    b.finish(got, run_dir, "done", {"attempts": 1})
    assert a.try_claim("j", run_dir, "cpu:0") == "done"
    (run_dir / "DONE").rename(run_dir / "FAILED")
    assert a.try_claim("j", run_dir, "cpu:0") == "failed"
    again = a.try_claim("j", run_dir, "cpu:0", retry_failed=True)
    assert not isinstance(again, str) and not (run_dir / "FAILED").exists()
    again.release()
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["launcher"]) for e in events] == [
        ("claim", "A"), ("claim", "B"), ("done", "B"), ("claim", "A")]


def test_a_dead_launchers_claim_is_stale_but_its_running_job_keeps_the_lock(tmp_path):
    run_dir = tmp_path / "runs" / "j"
    a = Claims(tmp_path, "A")
    claim = a.try_claim("j", run_dir, "cpu:0")
    # the job's process inherits the lock, as LocalExecutor arranges; then the launcher "dies"
    # (its descriptor closes without a release, the claim record stays behind)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             pass_fds=(claim.lock_fd,))
    try:
        os.close(claim.lock_fd)
        b = Claims(tmp_path, "B")
        assert b.try_claim("j", run_dir, "cpu:0") == "held"  # the orphaned job still runs
        assert lock_is_held(tmp_path / "claims" / "j.lock")
    finally:
        child.kill()
        child.wait()
    got = b.try_claim("j", run_dir, "cpu:0")
    assert not isinstance(got, str)
    assert json.loads((tmp_path / "claims" / "j.claim").read_text())["launcher"] == "B"
    got.release()
    events = [json.loads(x)["event"] for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events == ["claim", "stale_claim", "claim"]


# ---------------------------------------------------------------------------------------------
# the launcher, with a scripted executor (no training)


class ScriptedExecutor:
    """Runs each attempt instantly: ``outcomes[job_id]`` lists what each attempt does —
    ``ok``, ``crash`` (exit 1, a checkpoint left behind), ``interrupted`` (exit 75 without a
    normal end, as a run stopped by SIGTERM), ``out_of_time`` (exit 0, stopped at its
    ``max_time``) or ``bad`` (exit 2: a config to fix). Each submission takes the next one."""

    name = "scripted"

    def __init__(self, plan, outcomes: dict[str, list[str]], n_devices: int = 2):
        self.plan, self.outcomes, self.n = plan, outcomes, n_devices
        self.attempts: list = []
        self.results: list[AttemptResult] = []

    def devices(self):
        return [Device(f"cpu:{i}", "", 1) for i in range(self.n)]

    def submit(self, attempt, *, hold_fd=None):
        self.attempts.append(attempt)
        job = attempt.job
        run_dir = self.plan.run_dir(job)
        (run_dir / "checkpoints" / "step-000002").mkdir(parents=True, exist_ok=True)
        submitted = sum(x.job.job_id == job.job_id for x in self.attempts)
        what = self.outcomes.get(job.job_id, ["ok"] * submitted)[submitted - 1]
        lines = [{"event": "train_begin", "step": 2 if attempt.resume else 0}]
        if what == "ok":
            lines.append({"event": "train_end", "step": 4, "status": "completed", "reason": "max",
                          "best_step": 4, "best": {"wer": 0.5}})
        elif what == "interrupted":
            lines.append({"event": "train_end", "step": 3, "status": "interrupted"})
        elif what == "out_of_time":
            lines.append({"event": "train_end", "step": 3, "status": "stopped",
                          "reason": "reached max_time", "out_of_time": True})
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
        attempt.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(attempt.log_path, "a") as f:
            f.write(f"attempt {attempt.number}\n")
            if what == "crash":
                f.write("Traceback: boom\n")
        rc = {"crash": 1, "bad": 2, "interrupted": ExitCode.INTERRUPTED}.get(what, 0)
        self.results.append(AttemptResult(job.job_id, attempt.number, attempt.device.label, rc,
                                          time.time(), time.time(), "here"))

    def poll(self, timeout):
        out, self.results = self.results, []
        return out

    def cancel(self, job_id, *, force=False):
        pass

    def close(self):
        pass


@pytest.mark.fast
def test_launcher_retries_from_the_checkpoint_then_marks_failed(tmp_path, two_configs, capsys):
    a, _ = two_configs
    m = write_yaml(tmp_path / "m.yaml", {
        "out": str(tmp_path / "root"), "languages": ["en", "es"],
        "configs": [{"config_id": "a", "path": str(a)}], "seeds": [0, 1], "retries": 2})
    plan = load_matrix(m)
    outcomes = {"en-a-s1": ["crash", "interrupted", "ok"], "es-a-s0": ["crash"] * 3,
                "es-a-s1": ["bad"]}
    ex = ScriptedExecutor(plan, outcomes)
    out = Launcher(plan, ex, progress_every=0.0).run()
    assert sorted(out.done) == ["en-a-s0", "en-a-s1"]
    assert sorted(out.failed) == ["es-a-s0", "es-a-s1"] and out.exit_code == 1
    tries = [(x.job.job_id, x.number, x.resume) for x in ex.attempts if x.job.job_id == "en-a-s1"]
    assert tries == [("en-a-s1", 1, False), ("en-a-s1", 2, True), ("en-a-s1", 3, True)]
    done = json.loads((plan.root / "runs" / "en-a-s1" / "DONE").read_text())
    assert done["attempts"] == 3 and done["best_step"] == 4 and done["status"] == "completed"
    assert [h["error"] for h in done["history"]] == [
        "exit code 1", "interrupted by a signal after saving a checkpoint (exit code 75)", None]
    failed = json.loads((plan.root / "runs" / "es-a-s0" / "FAILED").read_text())
    assert failed["attempts"] == 3 and "Traceback: boom" in failed["log_tail"]
    bad = json.loads((plan.root / "runs" / "es-a-s1" / "FAILED").read_text())
    assert bad["attempts"] == 1 and "not retried" in bad["reason"]  # exit 2: bad input
    text = capsys.readouterr().out
    assert "FAILED es-a-s0 after 3 attempt(s)" in text and "2/4 done" in text and "ETA" in text

    # a re-launch skips done and failed jobs; --retry-failed runs the failed one again
    ex = ScriptedExecutor(plan, {"es-a-s0": ["ok"], "es-a-s1": ["ok"]})
    out = Launcher(plan, ex, progress_every=0.0).run()
    assert ex.attempts == [] and len(out.done) == 2 and len(out.failed) == 2
    out = Launcher(plan, ex, retry_failed=True, progress_every=0.0).run()
    assert sorted(x.job.job_id for x in ex.attempts) == ["es-a-s0", "es-a-s1"]
    assert all(x.resume for x in ex.attempts)
    assert len(out.done) == 4 and out.exit_code == 0


@pytest.mark.fast
def test_a_run_out_of_time_is_continued_with_resume_not_marked_done(tmp_path, two_configs,
                                                                    capsys):
    a, _ = two_configs
    m = write_yaml(tmp_path / "m.yaml", {
        "out": str(tmp_path / "root"), "languages": ["en"],
        "configs": [{"config_id": "a", "path": str(a)}], "retries": 0})
    plan = load_matrix(m)
    ex = ScriptedExecutor(plan, {"en-a-s0": ["out_of_time", "out_of_time", "ok"]})
    out = Launcher(plan, ex, progress_every=0.0).run()
    assert out.done == ["en-a-s0"] and out.exit_code == 0
    # continuations, not retries: retries is 0 and the attempt number stays 1
    assert [(x.number, x.resume) for x in ex.attempts] == [(1, False), (1, True), (1, True)]
    done = json.loads((plan.root / "runs" / "en-a-s0" / "DONE").read_text())
    assert done["status"] == "completed" and done["continuations"] == 2
    assert "reached its max_time at step 3; continuing it" in capsys.readouterr().out


@pytest.mark.fast
def test_a_job_log_that_is_a_symlink_ends_the_attempt_as_bad_input(tmp_path, two_configs):
    a, _ = two_configs
    m = write_yaml(tmp_path / "m.yaml", {"out": str(tmp_path / "r"), "languages": ["en"],
                                         "configs": [{"config_id": "a", "path": str(a)}]})
    plan = load_matrix(m)
    log = plan.log_path(plan.jobs[0])
    log.parent.mkdir(parents=True)
    log.symlink_to(tmp_path / "elsewhere.log")
    attempt = Attempt(plan.jobs[0], parse_devices("cpu:1")[0], 1, False, log, tmp_path)
    result = run_attempt(attempt)
    # exit code 2, which the launcher does not retry
    assert result.returncode == 2 and "a symlink" in result.error
    assert not (tmp_path / "elsewhere.log").exists()


@pytest.mark.fast
def test_eta_from_finished_jobs(tmp_path, two_configs):
    a, _ = two_configs
    m = write_yaml(tmp_path / "m.yaml", {"out": str(tmp_path / "r"), "languages": ["en"],
                                         "configs": [{"config_id": "a", "path": str(a)}]})
    launcher = Launcher(load_matrix(m), ScriptedExecutor(None, {}))
    assert launcher.eta(queued=3, n_devices=2) is None
    launcher.durations = [10.0, 30.0]
    assert launcher.eta(queued=3, n_devices=2) == pytest.approx(30.0)


# ---------------------------------------------------------------------------------------------
# end to end: real training runs


def three_language_tones(path: Path) -> Path:
    """The tones data set relabelled so that its utterances have three languages."""
    from datasets import load_from_disk

    from asrforge.data.synth import make_tones_dataset

    src = make_tones_dataset(path.with_name("tones-src"), sizes={"train": 36, "validation": 9})
    dd = load_from_disk(str(src))
    dd = dd.map(lambda _, i: {"language": LANGS[i % 3]}, with_indices=True)
    dd.save_to_disk(str(path))
    return path


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def matrix_run(tmp_path_factory):
    """Two launchers started together over 3 languages × 2 seeds (6 jobs, one CPU slot each);
    es seed 0 crashes once right after its step-2 checkpoint."""
    tmp = tmp_path_factory.mktemp("matrix")
    data = three_language_tones(tmp / "tones3")
    config = tmp / "tiny.yaml"
    config.write_text(tiny_config(
        tmp / "unused", data, train={"max_steps": 4, "log_every": 1, "precision": "no"},
        eval={"eval_steps": 2},
        data={"batch_size": 4}).to_yaml())
    matrix = write_yaml(tmp / "matrix.yaml", {
        "out": str(tmp / "root"), "languages": list(LANGS), "seeds": [0, 1],
        "configs": [{"config_id": "tiny", "path": str(config)}],
        "language_overrides": {
            "es": {"callbacks": [{"_target_": "test_matrix.CrashOnce", "seed": 0}]}},
        "retries": 1,
    })
    cmd = [sys.executable, "-m", "asrforge", "matrix", str(matrix), "--devices", "cpu:1",
           "--progress-every", "2", "--allow-external-callbacks"]
    procs = [subprocess.Popen(cmd, cwd=tmp, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    return {"root": tmp / "root", "codes": [p.returncode for p in procs], "outs": outs,
            "matrix": matrix}


def events(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "events.jsonl").read_text().splitlines()]


def train_begins(run_dir: Path) -> list[int]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["step"] for x in lines if x["event"] == "train_begin"]


@pytest.mark.slow
def test_two_launchers_share_the_matrix_without_duplicates(matrix_run):
    root = matrix_run["root"]
    assert matrix_run["codes"] == [0, 0], "\n".join(matrix_run["outs"])
    ids = [f"{lang}-tiny-s{s}" for lang in LANGS for s in (0, 1)]
    assert sorted(p.name for p in (root / "runs").iterdir()) == sorted(ids)
    ev = events(root)
    for job in ids:
        assert (root / "runs" / job / "DONE").is_file()
        assert (root / "logs" / "matrix" / f"{job}.log").is_file()
        claims = [e for e in ev if e["job_id"] == job and e["event"] == "claim"]
        starts = [e for e in ev if e["job_id"] == job and e["event"] == "start"]
        assert len(claims) == 1, f"{job} claimed {len(claims)} times"
        assert {e["launcher"] for e in starts} == {claims[0]["launcher"]}
        expected = [0, 2] if job == "es-tiny-s0" else [0]  # each train run happened once
        assert train_begins(root / "runs" / job) == expected
    assert len({e["launcher"] for e in ev if e["event"] == "claim"}) == 2, "both launchers worked"
    for out in matrix_run["outs"]:
        assert "6/6 done" in out and "ETA" in out


@pytest.mark.slow
def test_a_job_that_crashed_resumes_from_its_checkpoint(matrix_run):
    run_dir = matrix_run["root"] / "runs" / "es-tiny-s0"
    done = json.loads((run_dir / "DONE").read_text())
    assert done["attempts"] == 2 and done["step"] == 4 and done["status"] == "completed"
    assert done["history"][0]["returncode"] == 3 and done["history"][1]["returncode"] == 0
    log = (matrix_run["root"] / "logs" / "matrix" / "es-tiny-s0.log").read_text()
    first, second = log.split("==== asrforge matrix: es-tiny-s0 attempt ")[1:]
    assert "--resume" not in first.splitlines()[1] and "--resume" in second.splitlines()[1]
    assert "resumed from" in (run_dir / "train.log").read_text()
    other = json.loads((matrix_run["root"] / "runs" / "es-tiny-s1" / "DONE").read_text())
    assert other["attempts"] == 1  # the crash hit seed 0 only


@pytest.mark.slow
def test_relaunch_skips_finished_jobs_and_the_report_covers_them(matrix_run, tmp_path, capsys):
    from asrforge.matrix.report import collect, write_report

    n_events = len(events(matrix_run["root"]))
    plan = load_matrix(matrix_run["matrix"], allow_external_callbacks=True)  # as launched
    out = Launcher(plan, LocalExecutor(parse_devices("cpu:1")), progress_every=0.0).run()
    assert len(out.done) == 6 and out.exit_code == 0
    assert len(events(matrix_run["root"])) == n_events  # nothing claimed, nothing started
    assert "6/6 done" in capsys.readouterr().out

    rows = write_report(matrix_run["root"], tmp_path / "report.html")
    assert len(rows) == 6 and {r.status for r in rows} == {"done"}
    policy = {r.language: r.policy for r in rows}
    assert policy == {"en": "combined_gate", "es": "by_wer", "th": "by_loss"}
    by_id = {r.job_id: r for r in collect(matrix_run["root"] / "runs")}
    es0 = by_id["es-tiny-s0"]
    assert [e["step"] for e in es0.evals] == [2, 4] and es0.attempts == 2
    assert es0.best_step in (2, 4) and es0.chosen_by and es0.best["wer"] is not None
    page = (tmp_path / "report.html").read_text()
    assert page.count('class="job-row"') == 6
    # a curve per job on each of its language's plots: 6 jobs x (WER, CER, loss, training loss)
    plots = re.findall(r'<svg class="plot" data-metric="([^"]+)".*?</svg>', page, flags=re.S)
    assert sorted(set(plots)) == ["cer", "loss", "train loss", "wer"] and len(plots) == 3 * 4
    assert page.count('<polyline class="curve"') == 6 * 4


def test_a_relaunch_that_gives_finished_jobs_another_config_is_refused(matrix_run):
    """Counting them done would leave the report showing results of a config that never ran."""
    index = matrix_run["root"] / "matrix.json"
    before = index.read_text()
    plan = load_matrix(matrix_run["matrix"], allow_external_callbacks=True,
                       extra_overrides=["optim.lr=0.5"])  # fmt: skip
    with pytest.raises(UserError, match=r"6 finished job\(s\) ran another config .*en-tiny-s0: "
                       r"optim.lr: [0-9.e-]+ -> 0.5"):  # fmt: skip
        Launcher(plan, LocalExecutor(parse_devices("cpu:1")), progress_every=0.0).run()
    assert index.read_text() == before
    # the same root through another path (another mount): the same config, all done
    link = matrix_run["root"].parent / "root-link"
    link.symlink_to(matrix_run["root"])
    plan = load_matrix(matrix_run["matrix"], allow_external_callbacks=True, out=link)
    out = Launcher(plan, LocalExecutor(parse_devices("cpu:1")), progress_every=0.0).run()
    assert len(out.done) == 6 and out.exit_code == 0


@pytest.mark.slow
def test_the_ray_executor_runs_the_same_jobs(tmp_path, tones_dir):
    pytest.importorskip("ray", reason="ray is not installed (pip install 'asrforge[ray]')")
    config = tmp_path / "tiny.yaml"
    config.write_text(tiny_config(tmp_path / "unused", tones_dir,
                                  train={"max_steps": 2, "precision": "no"},
                                  eval={"eval_steps": 2}).to_yaml())
    matrix = write_yaml(tmp_path / "matrix.yaml", {
        "out": str(tmp_path / "root"), "languages": ["en", "es"],
        "configs": [{"config_id": "tiny", "path": str(config)}]})
    proc = subprocess.run(
        [sys.executable, "-m", "asrforge", "matrix", str(matrix), "--executor", "ray",
         "--progress-every", "5"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "via ray" in proc.stdout and "2/2 done" in proc.stdout
    root = tmp_path / "root"
    for job in ("en-tiny-s0", "es-tiny-s0"):
        done = json.loads((root / "runs" / job / "DONE").read_text())
        assert done["attempts"] == 1 and done["history"][0]["device"].startswith("ray:")
        assert train_begins(root / "runs" / job) == [0]


@pytest.mark.fast
def test_an_unknown_language_and_a_root_that_is_a_file_are_refused_before_any_job(
    tmp_path, two_configs, capsys
):
    from asrforge.cli import main

    a, _ = two_configs
    afile = tmp_path / "afile"
    afile.write_text("mine")
    m = write_yaml(tmp_path / "m.yaml", {
        "out": str(afile), "languages": ["en", "xx"], "configs": [{"config_id": "a", "path": str(a)}]})
    with pytest.raises(ConfigError) as e:
        load_matrix(m)
    first, second = e.value.problems
    assert first == f"out: {afile}: exists and is not a directory"
    # the rule `asrforge train` applies, told where the matrix wrote the language
    assert second.startswith(
        "languages: data.languages.0, selection.language: unknown language 'xx'")
    assert second.endswith("(job xx-a-s0)")
    with pytest.raises(ConfigError, match=r"--out: .*afile/root: a parent of it is a file"):
        load_matrix(m, out=afile / "root")
    assert main(["matrix", str(m), "--dry-run"]) == 2
    assert "unknown language 'xx'" in capsys.readouterr().err
    assert afile.read_text() == "mine"


@pytest.mark.fast
@pytest.mark.parametrize(
    "line, limit, ended",
    [
        ("[1]", None, True),  # stopped the launcher with an AttributeError
        ("[" * 100_000 + "]" * 100_000, None, True),  # a RecursionError
        ('{"event": "eval", "step": 3}', 100, False),  # over the limit: not read
    ],
    ids=["a list", "deep", "too large"],
)
def test_a_run_end_is_read_from_step_records_within_bounds(
    tmp_path, monkeypatch, line, limit, ended
):
    from asrforge.matrix.run import last_train_end

    if limit is not None:
        monkeypatch.setattr("asrforge.run_layout.RECORDS_BYTES", limit)
    end = {"event": "train_end", "step": 4, "status": "completed"}
    begin = {"event": "train_begin", "step": 0}
    (tmp_path / "metrics.jsonl").write_text(
        "".join(f"{x}\n" for x in (json.dumps(begin), line, json.dumps(end)))
    )
    assert last_train_end(tmp_path) == (end if ended else None)


@pytest.mark.fast
@pytest.mark.parametrize(
    "best, shown",
    [({"wer": 0.125, "cer": 0.05}, "wer 0.125, cer 0.05"),
     ({"wer": "low", "loss": 1.5}, "loss 1.5"), ([1], "–"), (None, "–")],
)  # fmt: skip
def test_the_launchers_done_line_shows_only_the_numbers_of_a_run_end(best, shown):
    from asrforge.matrix.run import best_scores

    assert best_scores({"event": "train_end", "step": 4, "best": best}) == shown
