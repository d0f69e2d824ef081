"""Numbers past what the machine can take are refused by name in one line, before anything runs:
an integer of hundreds of digits anywhere in a config or a matrix file, a duration of inf, nan or
beyond 1000 days, more devices per job than one machine holds."""

from __future__ import annotations

import pytest
import yaml

from asrforge.cli import main
from asrforge.config import ConfigError, load_config, parse_duration
from asrforge.matrix.plan import load_matrix
from tests.conftest import tiny_config

pytestmark = pytest.mark.fast

HUGE = 10**400


@pytest.mark.parametrize(
    "value",
    [HUGE, -HUGE, "1" + "0" * 400, float("inf"), 1e308, 10**20, "9" * 400 + "d", "2000d",
     86400 * 1001],
)  # fmt: skip
def test_a_duration_too_large_is_one_short_line(value):
    with pytest.raises(ValueError) as e:
        parse_duration(value)
    assert len(str(e.value)) < 160 and ("at most 1000 days" in str(e.value) or
                                        "positive" in str(e.value))  # fmt: skip


def test_durations_within_the_bounds_still_read():
    assert parse_duration("1000d") == 1000 * 86400
    assert parse_duration(3600) == parse_duration("01:00:00") == 3600.0


@pytest.fixture
def config_path(tmp_path, tones_dir):
    path = tmp_path / "c.yaml"
    path.write_text(tiny_config(tmp_path / "run", tones_dir).to_yaml())
    return path


@pytest.mark.parametrize(
    "override, where",
    [
        (f"train.max_time={HUGE}", "train.max_time"),
        (f"train.max_steps={HUGE}", "train.max_steps"),
        (f"seed={-HUGE}", "seed"),
        (f"data.batch_size={2**63}", "data.batch_size"),
        (f"eval.eval_steps={HUGE}", "eval.eval_steps"),
    ],
)
def test_an_integer_past_int64_anywhere_in_a_config_is_named(config_path, override, where):
    with pytest.raises(ConfigError) as e:
        load_config(config_path, [override])
    message = str(e.value)
    assert f"{where}: " in message and ("larger than 2^63 - 1" in message
                                        or "at most 1000 days" in message)  # fmt: skip
    assert len(message) < 400  # the number is cut, not printed whole


def test_the_cli_refuses_a_huge_max_time_in_one_line(config_path, tmp_path, capsys):
    assert main(["train", str(config_path), f"train.max_time={HUGE}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "OverflowError" not in err and "train.max_time" in err
    assert not (tmp_path / "run").exists()


def matrix_file(tmp_path, config_path, **extra):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"languages": ["en"], "out": str(tmp_path / "root"),
                                    "configs": [{"config_id": "a", "path": str(config_path)}],
                                    **extra}))  # fmt: skip
    return path


@pytest.mark.parametrize("extra", [{"retries": HUGE}, {"seeds": [0, HUGE]}])
def test_a_matrix_file_with_a_huge_integer_is_refused(tmp_path, config_path, extra):
    with pytest.raises(ConfigError, match="larger than 2"):
        load_matrix(matrix_file(tmp_path, config_path, **extra))


@pytest.mark.parametrize("gpus", [65, 10**6])
def test_more_devices_per_job_than_a_machine_holds_fail_the_dry_run(
    tmp_path, config_path, capsys, gpus
):
    path = matrix_file(tmp_path, config_path, gpus_per_job=gpus)
    assert main(["matrix", str(path), "--dry-run"]) == 2
    assert "gpus_per_job" in capsys.readouterr().err
    path = matrix_file(tmp_path, config_path)
    assert main(["matrix", str(path), "--dry-run", "--gpus-per-job", str(gpus)]) == 2
    assert f"--gpus-per-job: must be at most 64 (a job runs on one machine), got {gpus}" in (
        capsys.readouterr().err
    )
    assert main(["matrix", str(path), "--dry-run", "--gpus-per-job", "8"]) == 0
