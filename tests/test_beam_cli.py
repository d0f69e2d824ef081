"""``--beam-size`` of ``asrforge evaluate`` and ``asrforge transcribe``, and ``eval.beam_size``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import soundfile as sf
from test_bundle import cli_error, one_thread, train_tiny_run  # noqa: F401  (one_thread: autouse)

from asrforge.cli import main
from asrforge.data.audio import decode_audio
from asrforge.data.sources import load_arrow


@pytest.fixture(scope="module")
def best(tmp_path_factory, tones_dir) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("beam-run"), tones_dir) / "checkpoints" / "best"


def _json(capsys, argv: list[str]) -> list[dict]:
    assert main(argv) == 0
    return [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]


def test_evaluate_beam_size(best, tones_dir, capsys) -> None:
    common = ["evaluate", str(best), "--data", str(tones_dir), "--max-samples", "6", "--json"]
    [greedy] = _json(capsys, common)
    [one] = _json(capsys, [*common, "--beam-size", "1"])
    [beam] = _json(capsys, [*common, "--beam-size", "3"])
    assert one["wer"] == greedy["wer"] and one["loss"] == greedy["loss"]
    assert beam["n"] == 6 and math.isfinite(beam["wer"])
    assert beam["loss"] == greedy["loss"]  # teacher-forced: decoding does not change it
    assert main([*common, "--beam-size", "0"]) == 2
    assert "--beam-size: must be >= 1, got 0" in cli_error(capsys)


def test_transcribe_beam_size(best, tones_dir, tmp_path, capsys) -> None:
    validation = load_arrow(tones_dir)["validation"]
    paths = []
    for i in range(2):
        p = tmp_path / f"utt{i}.wav"
        sf.write(p, decode_audio(validation[i]["audio"]["bytes"], 16_000), 16_000)
        paths.append(str(p))
    common = ["transcribe", str(best), *paths, "--json", "--language", "en"]
    greedy = _json(capsys, common)
    beam = _json(capsys, [*common, "--beam-size", "4"])
    assert [x["path"] for x in beam] == paths
    assert all(isinstance(x["text"], str) for x in beam)
    assert _json(capsys, [*common, "--beam-size", "1"]) == greedy
    fallback = _json(capsys, [*common, "--beam-size", "2", "--temperature-fallback"])
    assert [x["path"] for x in fallback] == paths
    assert main([*common, "--beam-size", "-1"]) == 2
    assert "--beam-size: must be >= 1, got -1" in cli_error(capsys)


@pytest.mark.fast
def test_eval_beam_size_is_validated(tmp_path, tones_dir) -> None:
    from conftest import tiny_config

    from asrforge.errors import UserError

    assert tiny_config(tmp_path, tones_dir).eval.beam_size == 1
    with pytest.raises((UserError, ValueError), match="beam_size"):
        tiny_config(tmp_path, tones_dir, eval={"beam_size": 0})
