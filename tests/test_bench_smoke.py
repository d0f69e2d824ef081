"""The benchmarks in ``bench/`` still run: each main function, quick model, one or two steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

pytest.importorskip("transformers.trainer_seq2seq")


def test_bench_train_runs_both_loops_on_the_same_batches(tmp_path, capsys):
    import bench_train

    out = bench_train.main(
        [
            "--quick",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--threads",
            "1",
            "--work-dir",
            str(tmp_path),
        ]
    )
    assert out["same_init"] and out["loss_diff"] < 1e-4
    assert out["asrforge"] > 0 and out["hf"] > 0
    assert "RESULT train samples/s asrforge=" in capsys.readouterr().out


def test_bench_eval_decodes_alike_on_both_sides(tmp_path, capsys):
    import bench_eval

    out = bench_eval.main(
        [
            "--quick",
            "--n",
            "4",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "3",
            "--threads",
            "1",
            "--work-dir",
            str(tmp_path),
        ]
    )
    assert out["same_hyps"] == out["n"] == 4 and out["wer_agree"] and out["loss_agree"]
    assert "RESULT eval seconds asrforge=" in capsys.readouterr().out
