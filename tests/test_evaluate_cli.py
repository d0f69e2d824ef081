"""``asrforge evaluate``: a checkpoint and its bundle score the same, and as the loop did."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_bundle import (  # noqa: F401  (one_thread: autouse)
    cli_error,
    cli_problems,
    one_thread,
    train_tiny_run,
)

from asrforge.bundle.export import export_bundle
from asrforge.checkpoint.manifest import read_manifest
from asrforge.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory, tones_dir) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("eval-run"), tones_dir)


def _evaluate(capsys, *argv: str) -> dict:
    assert main(["evaluate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_checkpoint_and_its_bundle_give_the_loops_numbers(run, tones_dir, tmp_path, capsys):
    best = run / "checkpoints" / "best"
    bundle = export_bundle(best, tmp_path / "bundle")
    common = [
        "--data",
        str(tones_dir),
        "--split",
        "validation",
        "--max-samples",
        "6",
        "--batch-size",
        "8",
    ]
    from_ckpt = _evaluate(capsys, str(best), *common)
    from_bundle = _evaluate(capsys, str(bundle), *common)
    for key in ("wer", "cer", "n", "rep_trap_count"):
        assert from_ckpt[key] == from_bundle[key], key
    assert from_ckpt["loss"] == pytest.approx(from_bundle["loss"], rel=1e-6)
    assert set(from_ckpt["per_language"]) == {"en", "es"} and from_ckpt["n"] == 6
    # the training loop evaluated the same utterances in the same batches, with the EMA weights
    loop = read_manifest(best)["metrics"]
    assert from_ckpt["wer"] == loop["wer"] and from_ckpt["cer"] == loop["cer"]
    assert from_ckpt["loss"] == pytest.approx(loop["loss"], rel=1e-5)
    # a run directory resolves to its best checkpoint
    assert _evaluate(capsys, str(run), *common)["loss"] == pytest.approx(
        from_ckpt["loss"], rel=1e-6
    )


def test_the_table_lists_each_language(run, tones_dir, capsys) -> None:
    best = run / "checkpoints" / "best"
    argv = [
        "evaluate",
        str(best),
        "--data",
        str(tones_dir),
        "--max-samples",
        "4",
        "--max-new-tokens",
        "2",
        "--weights",
        "raw",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header, *rows = out.strip().splitlines()[1:]
    assert header.split() == ["language", "n", "WER", "%", "CER", "%", "loss", "rep-trap"]
    assert [r.split()[0] for r in rows] == ["all", "en", "es"]
    assert rows[0].split()[1] == "4"


def test_bad_input_exits_2_with_one_line(run, tones_dir, tmp_path, capsys) -> None:
    best = str(run / "checkpoints" / "best")
    for argv, message in (
        (["evaluate", best, "--data", str(tmp_path / "nope")], "no such directory"),
        (["evaluate", str(tmp_path / "none"), "--data", str(tones_dir)], "no such directory"),
        (["evaluate", best, "--data", str(tones_dir), "--split", "dev"], "not in"),
        (["evaluate", best, "--data", str(tones_dir), "--batch-size", "0"], "must be >= 1"),
    ):
        assert main(argv) == 2, argv
        assert message in cli_error(capsys)


def test_the_model_and_the_data_are_reported_at_once(run, tmp_path, capsys) -> None:
    argv = ["evaluate", str(tmp_path / "none"), "--data", str(tmp_path / "nope")]
    assert main([*argv, "--max-samples", "0"]) == 2
    assert cli_problems(capsys) == [
        "--max-samples: must be >= 1, got 0",
        f"{tmp_path / 'none'}: no such directory",
        f"--data {tmp_path / 'nope'}: no such directory",
    ]
    # a checkpoint that does not load is reported with the missing data
    broken = tmp_path / "broken"
    shutil.copytree(run / "checkpoints" / "best", broken)
    (broken / "config.yaml").write_text("model: [1]\n")
    assert main(["evaluate", str(broken), "--data", str(tmp_path / "nope")]) == 2
    first, second = cli_problems(capsys)
    assert "config.yaml" in first and second == f"--data {tmp_path / 'nope'}: no such directory"
