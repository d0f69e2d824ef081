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
    header, *rows, language, normalizer = out.strip().splitlines()[1:]
    assert language.startswith("language: forced from the data")
    assert normalizer == "normalizer: whisper"
    assert header.split() == ["language", "n", "WER", "%", "CER", "%", "raw", "WER", "raw", "CER", "loss", "rep-trap"]  # fmt: skip
    assert [r.split()[0] for r in rows] == ["all", "en", "es"]
    assert rows[0].split()[1] == "4"
    # both the normalized and the raw error rates, each the figure --json reports
    record = _evaluate(capsys, *argv[1:])
    for column, key in ((2, "wer"), (3, "cer"), (4, "wer_raw"), (5, "cer_raw")):
        assert float(rows[0].split()[column]) == pytest.approx(100 * record[key], abs=0.006)


def test_bad_input_exits_2_with_one_line(run, tones_dir, tmp_path, capsys) -> None:
    best = str(run / "checkpoints" / "best")
    for argv, message in (
        (["evaluate", best, "--data", str(tmp_path / "nope")], "no such file or directory"),
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
        f"--data {tmp_path / 'nope'}: no such file or directory",
    ]
    # a checkpoint that does not load is reported with the missing data
    broken = tmp_path / "broken"
    shutil.copytree(run / "checkpoints" / "best", broken)
    (broken / "config.yaml").write_text("model: [1]\n")
    assert main(["evaluate", str(broken), "--data", str(tmp_path / "nope")]) == 2
    first, second = cli_problems(capsys)
    assert "config.yaml" in first
    assert second == f"--data {tmp_path / 'nope'}: no such file or directory"


@pytest.fixture(scope="module")
def validation_clips(tmp_path_factory, tones_dir) -> tuple[Path, list[dict]]:
    """The tones' validation clips as wav files under ``root/clips``: (root, one row per clip
    with ``file`` relative to root, ``text``, ``language``)."""
    from asrforge.data.sources import read_split

    root = tmp_path_factory.mktemp("formats")
    (root / "clips").mkdir()
    rows = []
    for r in read_split(tones_dir, "validation"):
        file = f"clips/{r['id']}.wav"
        (root / file).write_bytes(r["audio"]["bytes"])
        rows.append({"file": file, "text": r["text"], "language": r["language"]})
    return root, rows


def _nemo_manifest(root: Path, rows: list[dict]) -> Path:
    path = root / "test_manifest.json"
    path.write_text("".join(json.dumps({"audio_filepath": r["file"], "text": r["text"],
                                        "duration": 1.0, "lang": r["language"]}) + "\n"
                            for r in rows))  # fmt: skip
    return path


def _common_voice_csv(root: Path, rows: list[dict]) -> Path:
    locales = {"en": "en-US", "es": "es-ES"}
    path = root / "test.csv"
    path.write_text("path,sentence,locale\n" + "".join(
        f"{r['file']},{r['text']},{locales[r['language']]}\n" for r in rows))  # fmt: skip
    return path


def _parquet_dir(root: Path, rows: list[dict]) -> Path:
    from datasets import Dataset

    path = root / "parquet"
    path.mkdir(exist_ok=True)
    for split, part in (("train", rows[:4]), ("validation", rows)):
        Dataset.from_dict({
            "audio": [(root / r["file"]).read_bytes() for r in part],
            "text": [r["text"] for r in part], "language": [r["language"] for r in part],
        }).to_parquet(str(path / f"{split}-00000-of-00001.parquet"))  # fmt: skip
    return path


CV_COLUMNS = ["data.columns.audio=path", "data.columns.text=sentence",
              "data.columns.language=locale"]  # fmt: skip


def test_a_manifest_a_csv_and_a_parquet_directory_score_as_the_saved_dataset(
    run, tones_dir, validation_clips, tmp_path, capsys
):
    """Data in the forms training reads evaluates as the same clips in a save_to_disk
    DatasetDict; a single file is its split whatever --split says."""
    root, rows = validation_clips
    bundle = str(export_bundle(run / "checkpoints" / "best", tmp_path / "bundle"))
    common = ["--max-samples", "6", "--batch-size", "8", "--max-new-tokens", "4",
              "--longform-items", "1", "--longform-min-seconds", "3", "--longform-max-seconds", "6"]  # fmt: skip
    saved = _evaluate(capsys, bundle, "--data", str(tones_dir), *common)
    assert saved["n"] == 6 and saved["longform_n"] == 1
    assert saved["split"] == "validation"
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    for data, options in (
        (_nemo_manifest(root, rows), []),
        (_common_voice_csv(root, rows), CV_COLUMNS),
        (_parquet_dir(root, rows), []),
    ):
        got = _evaluate(capsys, bundle, "--data", str(data), *common, *options, cache)
        assert got["data"] == str(data) and got["skipped"] == {}
        # a single file has no splits: it was read whole, and the record says so
        assert got["split"] == (None if data.is_file() else "validation"), data
        for key in ("n", "wer", "cer", "wer_raw", "rep_trap_count", "longform_n", "longform_wer"):
            assert got[key] == saved[key], (data, key)
        assert got["loss"] == pytest.approx(saved["loss"], rel=1e-6), data
        assert set(got["per_language"]) == {"en", "es"}
    # the checkpoint reads the manifest too; a language given by data.language for all rows
    no_lang = root / "en.jsonl"
    no_lang.write_text("".join(json.dumps({"audio_filepath": r["file"], "text": r["text"]}) + "\n"
                               for r in rows if r["language"] == "en"))  # fmt: skip
    got = _evaluate(capsys, str(run / "checkpoints" / "best"), "--data", str(no_lang),
                    "data.language=English", cache)  # fmt: skip
    assert set(got["per_language"]) == {"en"}
    assert got["n"] == sum(r["language"] == "en" for r in rows)


def test_bad_data_options_exit_2_naming_the_split_or_the_mapping(
    run, validation_clips, tmp_path, capsys
):
    root, rows = validation_clips
    best = str(run / "checkpoints" / "best")
    csv = str(_common_voice_csv(root, rows))
    parquet = str(_parquet_dir(root, rows))
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    for argv, message in (
        ([parquet, "--split", "test", cache],
         f"--split 'test': not in {parquet} (it has train, validation)"),
        ([csv, "data.columns.audio=path", "data.columns.text=transcript", cache],
         f"data.columns.text: column 'transcript' not in {csv} (columns: path, sentence, locale)"),
        ([csv, *CV_COLUMNS, "data.batch_size=2", cache], "data.batch_size: not an option here"),
        ([csv, "data.columns.sentence=text", cache], "data.columns.sentence: unknown field"),
        ([csv, "data.language=Klingon", "data.columns.audio=path",
          "data.columns.text=sentence", cache], "data.language: unknown language 'Klingon'"),
        ([str(root / "clips" / f"{Path(rows[0]['file']).name}")], "not a format asrforge reads"),
    ):  # fmt: skip
        assert main(["evaluate", best, "--data", *argv]) == 2, argv
        assert message in cli_error(capsys), argv
    # Common Voice's own column names (path, sentence, locale) need no data.columns
    assert main(["evaluate", best, "--data", csv, cache]) == 0


def test_predictions_show_what_the_model_heard_and_the_table_how_its_language_was_set(
    run, tones_dir, tmp_path, capsys
):
    from asrforge.text import normalize

    out = tmp_path / "heard.jsonl"
    argv = ["evaluate", str(run), "--data", str(tones_dir), "--split", "test",
            "--max-samples", "5", "--predictions", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "language: forced from the data (each utterance's own), not detected" in printed
    assert f"predictions: 5 utterance(s) in {out}" in printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 5 and len({r["id"] for r in records}) == 5
    for r in records:
        assert {"id", "language", "reference", "hypothesis"} <= set(r) and r["reference"]
        assert r["reference_normalized"] == normalize(r["reference"], r["language"])
        assert r["hypothesis_normalized"] == normalize(r["hypothesis"], r["language"])
    assert {r["language"] for r in records} <= {"en", "es"}
    # a file that cannot be written is named before any work
    bad = ["evaluate", str(run), "--data", str(tones_dir), "--predictions", str(tmp_path)]
    assert main(bad) == 2
    assert f"--predictions {tmp_path}: a directory" in capsys.readouterr().err


def test_predictions_are_written_as_the_runs_evaluation_records(run, tones_dir, tmp_path):
    best = run / "checkpoints" / "best"
    step = read_manifest(best)["step"]
    logged = [json.loads(x) for x in (run / "eval" / f"step-{step:06d}.jsonl").open()][:-1]
    out = tmp_path / "heard.jsonl"
    argv = ["evaluate", str(best), "--data", str(tones_dir), "--split", "validation",
            "--batch-size", "8", "--max-samples", str(len(logged)),
            "--predictions", str(out)]  # fmt: skip
    assert main(argv) == 0
    predicted = [json.loads(line) for line in out.read_text().splitlines()]
    assert [sorted(r) for r in predicted] == [sorted(r) for r in logged]
    assert {"id", "reference", "hypothesis", "reference_normalized"} <= set(logged[0])
    # the same utterances heard the same way, with the same loss
    heard = ("id", "language", "reference", "hypothesis", "hypothesis_normalized", "n_tokens")
    assert [[r[k] for k in heard] for r in predicted] == [[r[k] for k in heard] for r in logged]
    assert [r["loss"] for r in predicted] == pytest.approx([r["loss"] for r in logged], rel=1e-5)


def test_predictions_that_cannot_be_written_are_refused_first_or_leave_the_metrics_printed(
    run, tones_dir, tmp_path, capsys, monkeypatch
):
    from asrforge.errors import CheckpointSaveError
    from asrforge.io import atomic

    long = tmp_path / ("p" * 256)
    argv = ["evaluate", str(run), "--data", str(tones_dir), "--max-samples", "2"]
    monkeypatch.setattr("asrforge.evaluation.evaluate.evaluate_split",
                        lambda *a, **k: pytest.fail("evaluated"))  # fmt: skip
    assert main([*argv, "--predictions", str(long)]) == 2
    assert f"--predictions {long}: its name is longer than 255 bytes" in cli_error(capsys)
    (tmp_path / "afile").write_text("")
    under_file = tmp_path / "afile" / "p.jsonl"
    assert main([*argv, "--predictions", str(under_file)]) == 2
    said = cli_error(capsys)
    assert f"{tmp_path / 'afile'} is a file, not a directory" in said
    assert "does not exist" not in said
    assert main([*argv, "--predictions", str(tmp_path / "none" / "p.jsonl")]) == 2
    assert "its directory does not exist" in cli_error(capsys)
    monkeypatch.undo()

    def fails(path, text):
        raise CheckpointSaveError(f"could not write {path}: Operation not permitted (errno 1)")

    monkeypatch.setattr(atomic, "atomic_write_text", fails)
    assert main([*argv, "--predictions", str(tmp_path / "p.jsonl")]) != 0
    captured = capsys.readouterr()
    assert "WER %" in captured.out and "predictions:" not in captured.out
    assert "Operation not permitted" in captured.err


def test_the_normalizer_s_options_score_evaluations_and_are_named(run, tones_dir, capsys):
    argv = [str(run), "--data", str(tones_dir), "--max-samples", "4"]
    plain = _evaluate(capsys, *argv)
    told = _evaluate(capsys, *argv, "--remove-diacritics", "--numbers", "as_written")
    assert plain["normalizer"] == "whisper"
    assert told["normalizer"] == "whisper, no diacritics, numbers as written"


def test_a_run_s_evaluations_are_scored_and_named_by_its_normalizer(tmp_path, tones_dir):
    from conftest import tiny_config

    from asrforge.train.loop import Trainer

    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 2},
                      eval={"eval_steps": 2, "normalizer": {"numbers": "as_written"}})  # fmt: skip
    Trainer(cfg, []).fit()
    lines = (tmp_path / "run" / "eval" / "step-000002.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["normalizer"] == "whisper, numbers as written"


def test_a_split_with_no_readable_clip_exits_2_naming_it(run, tmp_path, capsys) -> None:
    import numpy as np
    import soundfile as sf

    best = str(run / "checkpoints" / "best")
    # a file of text named .wav: its header is read up front
    (tmp_path / "x.wav").write_text("this is not audio\n" * 50)
    row = {"audio_filepath": "x.wav", "text": "tone beep", "duration": 1.0, "lang": "en"}
    (tmp_path / "dead.json").write_text(f"{json.dumps(row)}\n" * 4)
    assert main(["evaluate", best, "--data", str(tmp_path / "dead.json")]) == 2
    message = cli_error(capsys)
    assert "no usable utterances in split" in message and "4 unreadable audio: x.wav" in message
    # NaN samples under a sound header: every clip is dropped when decoded, and nothing scored
    sf.write(tmp_path / "nan.wav", np.full(8000, np.nan, dtype=np.float32), 16000, subtype="FLOAT")
    row = {**row, "audio_filepath": "nan.wav", "duration": 0.5}
    (tmp_path / "nan.json").write_text(f"{json.dumps(row)}\n" * 3)
    assert main(["evaluate", best, "--data", str(tmp_path / "nan.json")]) == 2
    message = cli_error(capsys)
    assert "all 3 clips were dropped when read (3 non-finite audio" in message
