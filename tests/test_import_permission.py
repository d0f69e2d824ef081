"""Only the person running a command may allow importing code a config names (a callback's
``_target_``, an augmentation transform's ``module:function``): by ``--allow-external-callbacks``
or ``ASRFORGE_ALLOW_EXTERNAL_CALLBACKS=1``, never by a key in a file they were handed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asrforge.config import ALLOW_EXTERNAL_ENV, ConfigError, external_code_allowed
from asrforge.matrix.plan import load_matrix
from tests.conftest import tiny_config

EVIL = """from pathlib import Path
Path(__file__).with_name("RAN").write_text("imported")
from asrforge.train.events import Callback
class X(Callback):
    name = "x"
"""


@pytest.fixture
def handed_matrix(tmp_path, tones_dir) -> Path:
    """A matrix file that grants itself the permission, with the module it names beside it."""
    (tmp_path / "evilmod_perm.py").write_text(EVIL)
    config = tmp_path / "a.yaml"
    config.write_text(tiny_config(tmp_path / "unused", tones_dir).to_yaml())
    matrix = tmp_path / "m.yaml"
    matrix.write_text(
        yaml.safe_dump(
            {
                "out": str(tmp_path / "root"),
                "languages": ["en"],
                "allow_external_callbacks": True,
                "configs": [
                    {
                        "config_id": "a",
                        "path": str(config),
                        "overrides": {"callbacks": [{"_target_": "evilmod_perm.X"}]},
                    }
                ],
            }
        )
    )
    return matrix


@pytest.mark.fast
def test_a_matrix_file_cannot_allow_its_own_imports(handed_matrix, monkeypatch):
    monkeypatch.syspath_prepend(str(handed_matrix.parent))
    monkeypatch.delenv(ALLOW_EXTERNAL_ENV, raising=False)
    with pytest.raises(ConfigError) as e:
        load_matrix(handed_matrix)
    assert e.value.problems[0].startswith(
        "allow_external_callbacks: a matrix file cannot allow importing code"
    )
    assert "--allow-external-callbacks" in e.value.problems[0]
    assert not (handed_matrix.parent / "RAN").exists()
    assert "evilmod_perm" not in sys.modules


def test_the_matrix_command_refuses_the_file_key_before_importing(handed_matrix):
    env = {k: v for k, v in os.environ.items() if k != ALLOW_EXTERNAL_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    # run from the file's directory, where `python -m` puts the module on sys.path
    proc = subprocess.run(
        [sys.executable, "-m", "asrforge", "matrix", handed_matrix.name, "--dry-run"],
        cwd=handed_matrix.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "allow_external_callbacks: a matrix file cannot allow importing code" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (handed_matrix.parent / "RAN").exists()


@pytest.mark.fast
def test_the_person_allows_it_by_flag_or_environment(handed_matrix, monkeypatch):
    monkeypatch.delenv(ALLOW_EXTERNAL_ENV, raising=False)
    assert not external_code_allowed(False)
    assert external_code_allowed(True)
    monkeypatch.setenv(ALLOW_EXTERNAL_ENV, "1")
    assert external_code_allowed(False)
    monkeypatch.setenv(ALLOW_EXTERNAL_ENV, "0")
    assert not external_code_allowed(False)

    # without the file's key, the person's permission imports the target as before
    spec = yaml.safe_load(handed_matrix.read_text())
    del spec["allow_external_callbacks"]
    handed_matrix.write_text(yaml.safe_dump(spec))
    monkeypatch.syspath_prepend(str(handed_matrix.parent))
    with pytest.raises(ConfigError, match="pass --allow-external-callbacks"):
        load_matrix(handed_matrix)
    assert not (handed_matrix.parent / "RAN").exists()
    try:
        plan = load_matrix(handed_matrix, allow_external_callbacks=True)
    finally:  # imported afresh by every test that allows it
        sys.modules.pop("evilmod_perm", None)
    assert plan.allow_external_callbacks
    assert (handed_matrix.parent / "RAN").read_text() == "imported"
