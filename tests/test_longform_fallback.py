"""``asrforge evaluate --longform-items N --temperature-fallback``: the long-form pass decodes
its windows with temperature fallback, as ``transcribe --temperature-fallback`` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bundle import one_thread, train_tiny_run  # noqa: F401  (one_thread: autouse)

import asrforge.model.longform as longform
from asrforge.cli import main
from asrforge.model.fallback import Fallback


@pytest.fixture(scope="module")
def run(tmp_path_factory, tones_dir) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("fallback-run"), tones_dir)


def test_the_longform_pass_decodes_with_the_fallback_when_asked(
    run, tones_dir, monkeypatch, capsys
):
    seen: list = []
    real = longform.decode_with_fallback

    def spy(*args, **kwargs):
        seen.append(args[5].fallback)
        return real(*args, **kwargs)

    monkeypatch.setattr(longform, "decode_with_fallback", spy)
    argv = ["evaluate", str(run / "checkpoints" / "best"), "--data", str(tones_dir),
            "--max-samples", "4", "--longform-items", "1", "--longform-min-seconds", "3",
            "--longform-max-seconds", "4", "--json"]  # fmt: skip
    assert main(argv) == 0
    assert seen == []  # off by default, as in transcribe
    assert main([*argv, "--temperature-fallback"]) == 0
    assert seen and all(isinstance(f, Fallback) for f in seen)
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["longform_n"] == 1
