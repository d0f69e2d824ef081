"""Data sources (issue 15, item 1): every format built here from the tones clips, column
mapping, languages by name and locale, path audio relative to its manifest, missing files named
in the skip report, and an evaluation split carved out of the training split."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from asrforge.cli import main
from asrforge.config import CarveConfig, DataConfig
from asrforge.data.audio import decode_audio
from asrforge.data.carve import carve_eval, carve_rows, training_splits
from asrforge.data.ids import given_ids, standard_rows
from asrforge.data.prepare import prepare_split
from asrforge.data.sources import load_source, split_files
from asrforge.errors import UserError
from asrforge.model.tokenizer import SpecialTokens, train_bpe_tokenizer
from asrforge.run_layout import CARVE_FILE
from tests.conftest import tiny_config

LOCALES = {"en": "en-US", "es": "es-ES"}  # Common Voice's
NAMES = {"en": "English", "es": "Spanish"}  # FLEURS'


def by_split(rows: list[dict], split: str) -> list[dict]:
    return [r for r in rows if r["split"] == split]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_table(path: Path, rows: list[dict], sep: str) -> None:
    lines = [sep.join(rows[0])] + [sep.join(str(v) for v in r.values()) for r in rows]
    path.write_text("\n".join(lines) + "\n")


def source(fmt: str, root: Path, rows: list[dict]) -> tuple[Path, dict]:
    """Write ``rows`` in format ``fmt`` under ``root``: (data.path, the rest of the data config)."""
    from datasets import Dataset, DatasetDict

    carve = {"eval_carve": {"size": 12, "seed": 0}}
    if fmt == "parquet dir, audio bytes":
        for split in ("train", "validation"):
            Dataset.from_dict({
                "audio": [(root / r["file"]).read_bytes() for r in by_split(rows, split)],
                "text": [r["text"] for r in by_split(rows, split)],
                "language": [r["language"] for r in by_split(rows, split)],
            }).to_parquet(str(root / f"{split}-00000-of-00001.parquet"))  # fmt: skip
        return root, {}
    if fmt == "jsonl dir, paths":  # dev.jsonl: the validation split
        for split, name in (("train", "train.jsonl"), ("validation", "dev.jsonl")):
            write_jsonl(root / name, [{"audio": r["file"], "text": r["text"],
                                       "language": r["language"]} for r in by_split(rows, split)])  # fmt: skip
        return root, {}
    if fmt == "arrow dir":
        for split in ("train", "validation"):
            saved = root / f"saved-{split}"
            Dataset.from_dict({
                "id": [r["file"] for r in by_split(rows, split)],
                "audio": [(root / r["file"]).read_bytes() for r in by_split(rows, split)],
                "text": [r["text"] for r in by_split(rows, split)],
                "language": [r["language"] for r in by_split(rows, split)],
            }).save_to_disk(str(saved))  # fmt: skip
            (root / "arrow").mkdir(exist_ok=True)
            shutil.copy(next(saved.glob("*.arrow")), root / "arrow" / f"{split}-00000.arrow")
        return root / "arrow", {}
    if fmt == "NeMo manifest":
        write_jsonl(root / "train_manifest.json", [
            {"audio_filepath": r["file"], "text": r["text"], "duration": 1.0, "lang": r["language"]}
            for r in rows])  # fmt: skip
        return root / "train_manifest.json", carve
    if fmt == "CSV, Common Voice columns":
        write_table(root / "train.csv", [{"path": r["file"], "sentence": r["text"],
                                          "locale": LOCALES[r["language"]]} for r in rows], ",")  # fmt: skip
        return root / "train.csv", {**carve, "columns": {"audio": "path", "text": "sentence",
                                                         "language": "locale"}}  # fmt: skip
    if fmt == "TSV, FLEURS columns, absolute paths":
        write_table(root / "train.tsv", [{"path": str(root / r["file"]), "raw_transcription": r["text"],
                                          "language": NAMES[r["language"]]} for r in rows], "\t")  # fmt: skip
        return root / "train.tsv", {**carve, "columns": {"text": "raw_transcription"}}
    if fmt == "CSV without a language column":
        write_table(root / "all.csv", [{"audio": r["file"], "text": r["text"]} for r in rows], ",")
        return root / "all.csv", {**carve, "language": "en"}
    if fmt == "save_to_disk DatasetDict, paths":
        DatasetDict({split: Dataset.from_dict({
            "file": [str(root / r["file"]) for r in by_split(rows, split)],
            "transcription": [r["text"] for r in by_split(rows, split)],
            "lang": [r["language"] for r in by_split(rows, split)],
        }) for split in ("train", "validation")}).save_to_disk(str(root / "dd"))  # fmt: skip
        return root / "dd", {"columns": {"audio": "file", "text": "transcription"}}
    if fmt == "save_to_disk Dataset":
        Dataset.from_dict({
            "audio": [(root / r["file"]).read_bytes() for r in rows],
            "text": [r["text"] for r in rows],
            "language": [r["language"] for r in rows],
        }).save_to_disk(str(root / "ds"))  # fmt: skip
        return root / "ds", carve
    if fmt == "save_to_disk Dataset, Audio of relative paths, audio_dir":
        from datasets import Features, Value

        # Audio's {bytes, path} struct, as written without torchcodec (save_to_disk of an Audio
        # feature would look for the relative files from the working directory)
        paths = Features({"audio": {"bytes": Value("binary"), "path": Value("string")},
                          "text": Value("string"), "language": Value("string")})  # fmt: skip
        Dataset.from_dict({
            "audio": [{"bytes": None, "path": r["file"]} for r in rows],
            "text": [r["text"] for r in rows],
            "language": [r["language"] for r in rows],
        }, features=paths).save_to_disk(str(root / "ds"))  # fmt: skip
        return root / "ds", {**carve, "audio_dir": root}
    raise AssertionError(fmt)


FORMATS = [
    "parquet dir, audio bytes", "jsonl dir, paths", "arrow dir", "NeMo manifest",
    "CSV, Common Voice columns", "TSV, FLEURS columns, absolute paths",
    "CSV without a language column", "save_to_disk DatasetDict, paths", "save_to_disk Dataset",
    "save_to_disk Dataset, Audio of relative paths, audio_dir",
]  # fmt: skip


@pytest.fixture(scope="module")
def specials_and_tokenizer():
    tok = train_bpe_tokenizer(["la la tone beep boop"] * 20, 300)
    return tok, SpecialTokens.from_tokenizer(tok, True)


@pytest.mark.fast
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_source_format_loads_with_its_columns_mapped(
    fmt, tmp_path, clips, specials_and_tokenizer
):
    root = tmp_path / "corpus"
    path, data = source(fmt, root, clips)
    cfg = DataConfig(path=path, cache_dir=tmp_path / "cache", **data)
    before = sorted(p.name for p in path.rglob("*")) if path.is_dir() else None
    train, evaluation = training_splits(cfg, run_dir=tmp_path / "run", resuming=False, is_main=True)
    assert len(train) == 48 and len(evaluation) == 12
    assert {"audio", "text", "language"} <= set(train.column_names)
    assert sorted([*train["text"], *evaluation["text"]]) == sorted(r["text"] for r in clips)
    if "language" not in data:  # given by code, locale or name: all resolve to the clip's code
        tok, specials = specials_and_tokenizer
        utts, report = prepare_split(
            train, "train", cfg=cfg, tokenizer=tok, specials=specials,
            max_target_positions=64, max_seconds=30.0,
        )  # fmt: skip
        # path audio decodes (it was "unreadable audio" before) and no clip is skipped
        assert report.n_skipped == 0 and len(utts) == 48
        assert {u.language for u in utts} == {"en", "es"}
        assert sorted(u.text for u in utts) == sorted(list(train["text"]))
    expected = {r["text"]: (tmp_path / "corpus" / r["file"]).read_bytes() for r in clips}
    first = train[0]
    audio = first["audio"]
    assert audio["bytes"] or Path(audio["path"]).is_absolute()
    got = decode_audio(audio["bytes"] or audio["path"])
    np.testing.assert_array_equal(got, decode_audio(expected[first["text"]]))
    if before is not None:  # nothing written into the user's data directory
        assert sorted(p.name for p in path.rglob("*")) == before


@pytest.mark.fast
def test_a_missing_column_is_named_with_the_file_and_its_columns(tmp_path, clips, capsys):
    root = tmp_path / "corpus"
    write_table(root / "x.csv", [{"path": r["file"], "transcript": r["text"]} for r in clips], ",")
    cache = tmp_path / "cache"
    cfg = DataConfig(
        path=root / "x.csv", columns={"audio": "path", "text": "sentence"}, language="en",
        cache_dir=cache,
    )  # fmt: skip
    with pytest.raises(UserError) as e:
        load_source(cfg)
    assert str(e.value) == (f"data.columns.text: column 'sentence' not in {root / 'x.csv'} "
                            "(columns: path, transcript)")  # fmt: skip
    missing = r"data\.language: .* has no language column.*\(e\.g\. data\.language=en\)"
    with pytest.raises(UserError, match=missing):
        load_source(
            DataConfig(path=root / "x.csv", columns={"text": "transcript"}, cache_dir=cache)
        )
    write_table(root / "y.csv", [{"wav": r["file"], "text": r["text"]} for r in clips], ",")
    with pytest.raises(UserError, match=r"data\.columns\.audio: .*no audio column .*looked for"):
        load_source(DataConfig(path=root / "y.csv", language="en", cache_dir=cache))
    with pytest.raises(UserError, match=r"data\.language: unknown language 'Klingon'"):
        load_source(DataConfig(path=root / "x.csv", columns={"audio": "path", "text": "transcript"},
                               language="Klingon", cache_dir=cache))  # fmt: skip
    # and the CLI: exit 2, the message, no traceback
    config = tmp_path / "c.yaml"
    tiny = tiny_config(tmp_path / "run", root / "x.csv", data={
        "path": str(root / "x.csv"), "columns": {"audio": "path", "text": "sentence"},
        "language": "en", "eval_carve": {"size": 0.25}, "cache_dir": str(cache)})  # fmt: skip
    config.write_text(tiny.to_yaml())
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "data.columns.text: column 'sentence' not in" in err and "Traceback" not in err


@pytest.mark.fast
def test_a_missing_column_hint_suggests_a_column_no_other_role_holds(tmp_path, clips):
    nemo = tmp_path / "corpus" / "nemo.json"
    write_jsonl(nemo, [{"audio_filepath": r["file"], "transcript": r["text"], "duration": 1.0}
                       for r in clips])  # fmt: skip
    cfg = DataConfig(path=nemo, language="en", cache_dir=tmp_path / "cache")
    with pytest.raises(UserError) as e:
        load_source(cfg)
    assert str(e.value).startswith("data.columns.text: ")
    assert str(e.value).endswith("; name it, e.g. data.columns.text: transcript")
    # no column that looks like a transcript: the free string columns are listed
    odd = tmp_path / "corpus" / "odd.json"
    write_jsonl(odd, [{"audio_filepath": r["file"], "words": r["text"], "speaker": "a",
                       "duration": 1.0} for r in clips])  # fmt: skip
    with pytest.raises(UserError) as e:
        load_source(DataConfig(path=odd, language="en", cache_dir=tmp_path / "cache"))
    assert str(e.value).endswith("; name it in data.columns.text (one of: words, speaker)")
    # a CSV saved with semicolons reads as one column: the separator is named, not the column
    semi = tmp_path / "corpus" / "semi.csv"
    rows = "".join(f"{r['file']};{r['text']};en\n" for r in clips)
    semi.write_text("audio;text;language\n" + rows)
    with pytest.raises(UserError) as e:
        load_source(DataConfig(path=semi, cache_dir=tmp_path / "cache"))
    assert "columns look separated by ';'" in str(e.value) and "e.g." not in str(e.value)


@pytest.mark.fast
def test_a_language_without_a_token_stops_naming_the_value(tmp_path, clips, specials_and_tokenizer):
    tok, specials = specials_and_tokenizer
    rows = [{**r, "language": "Klingon" if i % 4 == 0 else NAMES[r["language"]]}
            for i, r in enumerate(clips)]  # fmt: skip
    write_jsonl(tmp_path / "m.jsonl", [{"audio": r["file"], "text": r["text"],
                                        "language": r["language"]} for r in rows])  # fmt: skip
    cfg = DataConfig(
        path=tmp_path / "m.jsonl", audio_dir=tmp_path / "corpus", cache_dir=tmp_path / "cache"
    )
    train = load_source(cfg).splits["train"]
    kw = dict(cfg=cfg, tokenizer=tok, specials=specials, max_target_positions=64, max_seconds=30.0)
    with pytest.raises(UserError, match=r"language 'Klingon' \(15 utterances\) has no token"):
        prepare_split(train, "train", **kw)
    # Ganda has no Whisper token: named with its code, and data.languages may leave it out
    ganda = train.map(
        lambda r: {"language": "Luganda" if r["language"] == "Klingon" else r["language"]}
    )
    with pytest.raises(UserError, match=r"'Luganda' \(15 utterances, code 'lg'\) has no token"):
        prepare_split(ganda, "train", **kw)
    kw["cfg"] = DataConfig(path=cfg.path, languages=["English", "es-ES"])
    utts, report = prepare_split(ganda, "train", **kw)
    assert len(utts) == 45 and report.n_skipped == 0


@pytest.mark.fast
def test_a_missing_audio_file_is_named_in_the_skip_report(tmp_path, clips, specials_and_tokenizer):
    tok, specials = specials_and_tokenizer
    root = tmp_path / "corpus"
    (root / clips[3]["file"]).unlink()
    path, data = source("NeMo manifest", root, clips)
    cfg = DataConfig(path=path, cache_dir=tmp_path / "cache", **data)
    train = load_source(cfg).splits["train"]
    utts, report = prepare_split(
        train, "train", cfg=cfg, tokenizer=tok, specials=specials, max_target_positions=64,
        max_seconds=30.0,
    )  # fmt: skip
    assert len(utts) == len(clips) - 1
    report.log(tmp_path)
    skipped = json.loads((tmp_path / "skipped-train.json").read_text())
    assert skipped == {
        "audio file not found": [clips[3]["file"]]
    }  # the path as the manifest has it


@pytest.mark.fast
def test_relative_paths_are_resolved_when_a_row_is_read_not_rewritten_up_front(tmp_path, clips):
    """The path column stays as the manifest writes it (memory-mapped, no column of absolute
    paths or of ids per row); a row read gives the absolute path, and the caches' key, as before."""

    from asrforge.data.ids import audio_key

    rows = by_split(clips, "train")
    manifest = tmp_path / "corpus" / "train.jsonl"
    write_jsonl(manifest, [{"audio_filepath": r["file"], "text": r["text"]} for r in rows])
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "corpus" / "clips", moved / "clips")
    for audio_dir, root in ((None, tmp_path / "corpus"), (moved, moved)):
        cfg = DataConfig(path=manifest, language="en", audio_dir=audio_dir,
                         cache_dir=tmp_path / "cache")  # fmt: skip
        split = load_source(cfg).splits["train"]
        assert "id" not in split.column_names
        assert split.data.table.column("audio").to_pylist() == [r["file"] for r in rows]
        absolute = f"{root.absolute()}/{rows[2]['file']}"
        assert split[2]["audio"] == {"bytes": None, "path": absolute} and Path(absolute).is_file()
        assert split[2]["id"] == rows[2]["file"]  # the path as given names the row
        # the caches' key is the resolved path's (with the file's size and mtime), as before
        assert audio_key(split[2]["audio"]) == audio_key({"bytes": None, "path": absolute})
        carved = split.select([5, 2])  # a carve's rows read alike, ids from those rows only
        assert carved[1] == split[2] and given_ids(carved, [1]) == [rows[2]["file"]]


@pytest.mark.fast
def test_a_manifest_of_segments_is_refused(tmp_path, clips):
    rows = [{"audio_filepath": r["file"], "text": r["text"], "offset": 0.5 * (i % 2)}
            for i, r in enumerate(clips)]  # fmt: skip
    write_jsonl(tmp_path / "corpus" / "m.jsonl", rows)
    cfg = DataConfig(path=tmp_path / "corpus" / "m.jsonl", language="en", cache_dir=tmp_path / "c")
    with pytest.raises(UserError, match=r"m\.jsonl has segments \(a nonzero 'offset'\)"):
        load_source(cfg)


@pytest.mark.fast
@pytest.mark.parametrize("bad", [0, 4])
def test_a_bad_jsonl_line_is_named_by_its_line_number(tmp_path, clips, bad, caplog):
    lines = [json.dumps({"audio_filepath": r["file"], "text": r["text"], "lang": r["language"]})
             for r in clips[:8]]  # fmt: skip
    lines[bad] = lines[bad].replace(', "text"', ' "text"')  # a comma left out
    manifest = tmp_path / "corpus" / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    loader_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = loader_log.level
    with pytest.raises(UserError, match=rf"m\.jsonl line {bad + 1}: not JSON \(Expecting ','"):
        load_source(DataConfig(path=manifest, cache_dir=tmp_path / "cache"))
    # datasets' own line, which counts rows from 0, is not said beside asrforge's
    assert "Failed to load JSON" not in caplog.text
    assert loader_log.level == level


def _break_saved(directory: Path, how: str) -> None:
    """One way a handed ``save_to_disk`` directory could hang or exhaust its reader."""
    split = directory / "validation"
    state = json.loads((split / "state.json").read_text())
    if how == "dict-fifo":
        (directory / "dataset_dict.json").unlink()
        os.mkfifo(directory / "dataset_dict.json")
    elif how == "dict-zero":
        (directory / "dataset_dict.json").unlink()
        (directory / "dataset_dict.json").symlink_to("/dev/zero")
    elif how == "dict-outside":
        (directory / "dataset_dict.json").write_text(json.dumps({"splits": ["../elsewhere"]}))
    elif how == "info-deep":
        (split / "dataset_info.json").write_text("[" * 100_000 + "]" * 100_000)
    elif how == "data-fifo":
        os.mkfifo(split / "f.arrow")
        state["_data_files"] = [{"filename": "f.arrow"}]
    elif how == "data-zero":
        (split / "z.arrow").symlink_to("/dev/zero")
        state["_data_files"] = [{"filename": "z.arrow"}]
    elif how == "data-outside":
        state["_data_files"] = [{"filename": "../../../../../../../../../dev/zero"}]
    elif how == "data-list":
        state["_data_files"] = "data.arrow"
    (split / "state.json").write_text(json.dumps(state))


@pytest.mark.fast
@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("dict-fifo", r"dataset_dict\.json: a FIFO, not a regular file"),
        ("dict-zero", r"dataset_dict\.json: a character device, not a regular file"),
        ("dict-outside", r"dataset_dict\.json: 'splits' must be a list of the names"),
        ("info-deep", r"dataset_info\.json: not valid JSON \(nested deeper than"),
        ("data-fifo", r"f\.arrow: not a regular file \(listed in .*state\.json\)"),
        ("data-zero", r"z\.arrow: not a regular file \(listed in .*state\.json\)"),
        ("data-outside", r"'_data_files' must be a list of .* naming files of its own directory"),
        ("data-list", r"state\.json: '_data_files' must be a list"),
    ],
)
def test_a_saved_dataset_whose_files_would_hang_or_exhaust_its_reader_is_named(
    tmp_path, tones_dir, how, message
):
    """datasets' load_from_disk waited forever on a FIFO, read /dev/zero until memory ran out
    and failed on deep JSON with a RecursionError."""
    copy = Path(shutil.copytree(tones_dir, tmp_path / "tones"))
    _break_saved(copy, how)
    with pytest.raises(UserError, match=rf"data\.path: .*{message}"):
        load_source(DataConfig(path=copy, cache_dir=tmp_path / "cache"))


def ids(split) -> list[str] | None:
    """Every row's id, as reports name them."""
    return given_ids(split, np.arange(len(split)))


@pytest.mark.fast
def test_carving_an_eval_split_is_disjoint_deterministic_and_recorded(tmp_path, clips):
    path, data = source("CSV, Common Voice columns", tmp_path / "corpus", clips)
    cfg = DataConfig(path=path, cache_dir=tmp_path / "cache", **data)
    full = load_source(cfg).splits["train"]
    run = tmp_path / "run"

    def carve(size, seed, resuming=False, data=full):
        train, held = carve_eval(data, CarveConfig(size=size, seed=seed), run_dir=run,
                                 resuming=resuming, is_main=True, where=str(path))  # fmt: skip
        return ids(train), ids(held)

    train, held = carve(0.25, 0)
    assert len(held) == 15 and len(train) == 45
    assert not set(train) & set(held) and sorted(train + held) == sorted(ids(full))
    assert carve(0.25, 0) == (train, held)  # the same rows again
    assert carve(0.25, 1)[1] != held  # another seed, other rows
    assert len(carve(7, 0)[1]) == 7  # a count
    carve(0.25, 0)
    recorded = json.loads((run / CARVE_FILE).read_text())
    assert recorded["seed"] == 0 and len(recorded["rows"]) == 15 and recorded["train_rows"] == 60
    # a resumed run keeps the rows it started with, whatever data.eval_carve says now
    assert carve(0.5, 3, resuming=True) == (train, held)
    with pytest.raises(UserError, match=r"60-row training split; .* has 59 rows now"):
        carve(0.25, 0, resuming=True, data=full.select(range(59)))
    for size in (60, 0.001):
        with pytest.raises(UserError, match=r"data\.eval_carve\.size: .* at least one row"):
            carve(size, 0)
    # data with its own validation split is not carved silently
    (tmp_path / "other").mkdir()
    dd, _ = source("jsonl dir, paths", tmp_path / "other", clips)
    with pytest.raises(UserError, match=r"data\.eval_carve: .* has a 'validation' split already"):
        training_splits(DataConfig(path=dd, eval_carve={"size": 5}, cache_dir=tmp_path / "cache"), run_dir=run, resuming=False,
                        is_main=True)  # fmt: skip


@pytest.mark.fast
def test_a_split_read_from_several_files_names_them(tmp_path, caplog):
    for name in ("train.jsonl", "train_backup_old.jsonl", "test.jsonl"):
        (tmp_path / name).write_text("{}\n")
    with caplog.at_level("INFO", logger="asrforge"):
        files = split_files(tmp_path)
    assert [f.name for f in files["train"]] == ["train.jsonl", "train_backup_old.jsonl"]
    assert "split 'train' is read from 2 files: train.jsonl, train_backup_old.jsonl" in caplog.text
    assert "split 'test'" not in caplog.text


@pytest.mark.fast
def test_a_carve_holds_out_the_repeats_of_its_rows_with_them(tmp_path, clips, caplog):
    from datasets import concatenate_datasets

    path, data = source("CSV, Common Voice columns", tmp_path / "corpus", clips)
    full = load_source(DataConfig(path=path, cache_dir=tmp_path / "cache", **data)).splits["train"]
    doubled = concatenate_datasets([full, full])  # a stray copy of the file read in too
    with caplog.at_level("WARNING", logger="asrforge"):
        train, held = carve_eval(doubled, CarveConfig(size=8, seed=0), run_dir=tmp_path / "run",
                                 resuming=False, is_main=True, where=str(path))  # fmt: skip
    assert len(held) == 16 and not set(ids(train)) & set(ids(held))
    assert sorted(ids(held)) == sorted(2 * sorted(set(ids(held))))
    assert "8 more training rows are copies of held-out ones" in caplog.text
    recorded = json.loads((tmp_path / "run" / CARVE_FILE).read_text())
    assert len(recorded["rows"]) == 16
    # rows sharing an id but not their audio (FLEURS: one sentence, many voices) stay apart
    from datasets import Dataset

    voices = Dataset.from_dict({"id": [f"s{i // 2}" for i in range(20)], "text": ["a"] * 20,
                                "audio": [f"/clips/{i}.wav" for i in range(20)]})  # fmt: skip
    caplog.clear()
    with caplog.at_level("WARNING", logger="asrforge"):
        _, held = carve_eval(voices, CarveConfig(size=4, seed=0), run_dir=tmp_path / "run3",
                             resuming=False, is_main=True, where="voices")  # fmt: skip
    assert len(held) == 4 and "copies of held-out ones" not in caplog.text
    # a repeated row whose copy would be all that trains: nothing is left on the training side
    with pytest.raises(UserError, match=r"with their copies, the held-out rows are all"):
        carve_eval(concatenate_datasets([full.select([0])] * 2), CarveConfig(size=1, seed=0),
                   run_dir=tmp_path / "run2", resuming=False, is_main=True,
                   where=str(path))  # fmt: skip


@pytest.mark.fast
def test_a_resumed_carve_refuses_reordered_or_replaced_rows(tmp_path, clips, caplog):
    path, data = source("CSV, Common Voice columns", tmp_path / "corpus", clips)
    full = load_source(DataConfig(path=path, cache_dir=tmp_path / "cache", **data)).splits["train"]
    run = tmp_path / "run"

    def carve(split, resuming=False):
        train, held = carve_eval(split, CarveConfig(size=12, seed=0), run_dir=run,
                                 resuming=resuming, is_main=True, where=str(path))  # fmt: skip
        return ids(held) or list(held["text"])

    held = carve(full)
    assert carve(full, resuming=True) == held
    shuffled = full.shuffle(seed=1)  # the same rows, in another order: other rows held out
    with pytest.raises(UserError, match=r"eval_carve\.json was carved from .*12 held-out"):
        carve(shuffled, resuming=True)
    # the held-out rows where they were, the others swapped: still not the split carved
    rows = np.flatnonzero(~np.isin(np.asarray(ids(full)), held))
    order = np.arange(len(full))
    order[[rows[0], rows[1]]] = order[[rows[1], rows[0]]]
    with pytest.raises(UserError, match=r"eval_carve\.json.*other rows are reordered"):
        carve(full.select(order), resuming=True)
    # without ids (audio given as bytes), rows are named by their audio's path and text
    no_ids = full.with_transform(dataclasses.replace(standard_rows(full), path_ids=False))
    carve(no_ids)
    with pytest.raises(UserError, match=r"eval_carve\.json was carved from other data"):
        carve(no_ids.shuffle(seed=1), resuming=True)
    # a record an older asrforge wrote (rows, no fingerprint) still resumes, with a warning
    record = json.loads((run / CARVE_FILE).read_text())
    old = {k: record[k] for k in ("size", "seed", "train_rows", "rows")}
    (run / CARVE_FILE).write_text(json.dumps(old))
    with caplog.at_level("WARNING", logger="asrforge"):
        assert carve(full, resuming=True) == [ids(full)[i] for i in old["rows"]]
    assert "records no fingerprint" in caplog.text


@pytest.mark.fast
def test_a_carve_holds_out_rows_of_every_language_in_proportion():
    en_sv = ["en"] * 20 + ["sv"] * 20
    held = carve_rows(en_sv, CarveConfig(size=1))  # one row asked: one of each language
    assert sorted(en_sv[i] for i in held) == ["en", "sv"]
    skewed = ["en"] * 36 + ["sv"] * 3 + ["fi"] * 1
    for seed in range(3):
        held = carve_rows(skewed, CarveConfig(size=0.25, seed=seed))
        by_lang = Counter(skewed[i] for i in held)
        assert by_lang == {"en": 9, "sv": 1}  # fi's one row trains
        assert list(held) == list(carve_rows(skewed, CarveConfig(size=0.25, seed=seed)))
    # one language: the rows the unstratified carve drew (runs carved before keep their split)
    old = np.sort(np.random.default_rng(4).permutation(60)[:15])
    assert list(carve_rows(["en"] * 60, CarveConfig(size=0.25, seed=4))) == list(old)
    assert list(carve_rows(60, CarveConfig(size=0.25, seed=4))) == list(old)
    with pytest.raises(UserError, match="every language .* has one row only"):
        carve_rows(["en", "sv", "fi"], CarveConfig(size=1))


@pytest.mark.fast
def test_a_carved_split_names_the_languages_it_has_no_rows_of(tmp_path, caplog):
    from datasets import Dataset

    langs = ["en"] * 10 + ["sv"] * 10 + ["Finnish"]
    train = Dataset.from_dict({"id": [f"u{i}" for i in range(21)], "text": ["a"] * 21,
                               "language": langs})  # fmt: skip
    with caplog.at_level("INFO", logger="asrforge"):
        _, held = carve_eval(train, CarveConfig(size=2), run_dir=tmp_path, resuming=False,
                             is_main=True, where="data")  # fmt: skip
    assert sorted(held["language"]) == ["en", "sv"]
    assert "held out by language: en 1/10, fi 0/1, sv 1/10" in caplog.text
    assert "language(s) fi have no evaluation rows (fi: 1 row(s))" in caplog.text


def test_train_on_a_csv_with_a_carved_eval_split_and_a_missing_file(tmp_path, clips, capsys):
    root = tmp_path / "corpus"
    (root / clips[5]["file"]).unlink()
    path, data = source("CSV, Common Voice columns", root, clips)
    run = tmp_path / "run"
    cfg = tiny_config(run, path, data={"path": str(path), "cache_dir": str(tmp_path / "cache"), **data},
                      train={"max_steps": 4}, eval={"eval_steps": 4, "max_new_tokens": 4})  # fmt: skip
    config = tmp_path / "c.yaml"
    config.write_text(cfg.to_yaml())
    assert main(["train", str(config)]) == 0
    assert (run / CARVE_FILE).exists() and (run / "checkpoints" / "step-000004").is_dir()
    # the missing clip is in whichever split the carve put it: named there, with its reason
    skipped = [json.loads(f.read_text()) for f in run.glob("skipped-*.json")]
    assert skipped == [{"audio file not found": [clips[5]["file"]]}]
    summary = json.loads((run / "eval" / "step-000004.jsonl").read_text().splitlines()[-1])
    assert summary["step"] == 4 and summary["wer"] is not None

    # a resume evaluates on the rows the run started with, though data.eval_carve changed
    def eval_ids(step: int) -> list[str]:
        lines = (run / "eval" / f"step-{step:06d}.jsonl").read_text().splitlines()[:-1]
        return sorted(json.loads(line)["id"] for line in lines)

    args = [
        "train",
        str(config),
        "train.max_steps=6",
        "eval.eval_steps=6",
        "data.eval_carve.seed=9",
    ]
    assert main([*args, "--resume"]) == 0
    held_missing = (run / "skipped-validation.json").exists()  # the missing clip: in either
    assert eval_ids(6) == eval_ids(4) and len(eval_ids(4)) == 12 - held_missing
    # export reads the CSV too: its languages and the log-mel statistics of 16 training clips
    from asrforge.bundle.export import export_bundle
    from asrforge.bundle.schema import INFERENCE_CONFIG

    bundle = export_bundle(run / "checkpoints" / "step-000004", tmp_path / "bundle")
    info = json.loads((bundle / INFERENCE_CONFIG).read_text())
    assert info["languages"] == ["en", "es"] and info["features"]["stats_utterances"] == 16
    # the card says which rows its figures are on, and evaluate --carve scores those rows
    card = (bundle / "README.md").read_text()
    assert "rows held out of its `train` split before training" in card
    assert "`validation` split" not in card and "--carve RUN/eval_carve.json" in card
    predictions = tmp_path / "predictions.jsonl"
    argv = ["evaluate", str(bundle), "--data", str(path), "--carve", str(run), "--json",
            "--predictions", str(predictions), f"data.cache_dir={tmp_path / 'cache'}",
            *(f"data.columns.{k}={v}" for k, v in data["columns"].items())]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    scored = [json.loads(line)["id"] for line in predictions.read_text().splitlines()]
    assert sorted(scored) == eval_ids(4)


@pytest.mark.fast
def test_csv_and_tsv_keep_transcripts_as_written(tmp_path, clips):
    """ "NA" is a transcript, not a missing value; a Common Voice TSV's quotes are text."""
    root = tmp_path / "corpus"
    texts = ["NA", 'he said "go" now', "null", '"quoted"']
    rows = [{"audio": r["file"], "text": t} for r, t in zip(clips, texts, strict=False)]
    write_table(root / "a.tsv", rows, "\t")
    tsv = load_source(DataConfig(path=root / "a.tsv", language="en", cache_dir=tmp_path / "c"))
    assert list(tsv.splits["train"]["text"]) == texts
    write_table(root / "a.csv", [r for r in rows if '"' not in r["text"]], ",")
    csv = load_source(DataConfig(path=root / "a.csv", language="en", cache_dir=tmp_path / "c"))
    assert list(csv.splits["train"]["text"]) == ["NA", "null"]


@pytest.mark.fast
def test_a_hub_snapshot_layout_splits_by_file_name(tmp_path, clips, caplog):
    """Files in data/, dev_clean + dev_other are the validation split, a file whose name says
    no split is named in a warning (not silently read or dropped)."""
    from datasets import Dataset

    root = tmp_path / "corpus"
    (root / "data").mkdir()
    (root / "README.md").write_text("a dataset card")
    parts = {"train-00000-of-00001": by_split(clips, "train"),
             "dev_clean": by_split(clips, "validation")[:5],
             "dev_other": by_split(clips, "validation")[5:]}  # fmt: skip
    for name, rows in parts.items():
        Dataset.from_dict({
            "audio": [(root / r["file"]).read_bytes() for r in rows],
            "text": [r["text"] for r in rows], "language": [r["language"] for r in rows],
        }).to_parquet(str(root / "data" / f"{name}.parquet"))  # fmt: skip
    write_jsonl(root / "data" / "notes.jsonl", [{"note": "not data"}])
    cfg = DataConfig(path=root, cache_dir=tmp_path / "cache")
    with caplog.at_level("WARNING", logger="asrforge"):
        train, evaluation = training_splits(
            cfg, run_dir=tmp_path / "run", resuming=False, is_main=True
        )
    assert (len(train), len(evaluation)) == (48, 12)
    assert "not read, their names say no split: data/notes.jsonl" in caplog.text


@pytest.mark.fast
def test_columns_a_reader_does_not_need_may_be_absent(tmp_path, clips):
    """The guard reads recordings without transcripts; text alone reads without audio."""
    root = tmp_path / "corpus"
    write_table(root / "audio.csv", [{"audio": r["file"]} for r in clips], ",")
    write_table(root / "text.csv", [{"text": r["text"]} for r in clips], ",")
    cache = tmp_path / "cache"
    audio = load_source(DataConfig(path=root / "audio.csv", cache_dir=cache), required=("audio",),
                        default_language="sw").splits["train"]  # fmt: skip
    assert set(audio.column_names) == {"audio", "language"} and len(audio) == len(clips)
    assert audio[0]["id"] == clips[0]["file"]  # the path as the data gives it
    assert set(audio["language"]) == {"sw"} and Path(audio[0]["audio"]["path"]).is_file()
    text = load_source(DataConfig(path=root / "text.csv", language="en", cache_dir=cache),
                       required=("text",)).splits["train"]  # fmt: skip
    assert list(text["text"]) == [r["text"] for r in clips] and "audio" not in text.column_names
    with pytest.raises(UserError, match=r"data\.columns\.text: .* has no text column"):
        load_source(DataConfig(path=root / "audio.csv", language="en", cache_dir=cache))


@pytest.mark.fast
def test_messages_name_the_section_read_and_leave_paths_as_written(tmp_path, clips):
    """The guard's data (eval.guard.*) and a run's (data.*) each name their own fields, however
    the message is worded; a user's path holding ``data.path`` is quoted as it is."""
    root = tmp_path / "data.path"  # what a rewrite of data.* messages into eval.guard.* would hit
    root.mkdir()
    write_table(root / "x.csv", [{"path": r["file"], "transcript": r["text"]} for r in clips], ",")
    (root / "notes.txt").write_text("not data")
    cache = tmp_path / "cache"
    missing = DataConfig(path=root / "x.csv", columns={"text": "sentence"}, cache_dir=cache)
    for section in ("data", "eval.guard"):
        with pytest.raises(UserError) as e:
            load_source(missing, section=section, required=("audio",), default_language="en")
        assert str(e.value) == (
            f"{section}.columns.text: column 'sentence' not in {root / 'x.csv'} "
            "(columns: path, transcript)"
        )
        with pytest.raises(UserError) as e:
            load_source(DataConfig(path=root / "notes.txt"), section=section)
        assert str(e.value).startswith(f"{section}.path: {root / 'notes.txt'}: not a format")


@pytest.mark.fast
def test_reading_one_split_leaves_the_others_unread(tmp_path, clips):
    """Evaluating the validation split does not convert (or even open) the training files."""
    from asrforge.data.sources import read_split

    root = tmp_path / "corpus"
    path, _ = source("parquet dir, audio bytes", root, clips)
    (root / "train-00000-of-00001.parquet").write_bytes(b"not parquet")
    cache = tmp_path / "cache"
    validation = read_split(DataConfig(path=path, cache_dir=cache), "validation")
    assert sorted(validation["text"]) == sorted(r["text"] for r in by_split(clips, "validation"))
    with pytest.raises(UserError, match=r"--split 'dev': not in .* \(it has train, validation\)"):
        read_split(DataConfig(path=path, cache_dir=cache), "dev")
    with pytest.raises(UserError, match="cannot read .*train-00000-of-00001.parquet as parquet"):
        read_split(DataConfig(path=path, cache_dir=cache), "train")


@pytest.mark.fast
def test_data_language_is_part_of_the_split_fingerprint(tmp_path, clips):
    """The prepared-split cache is keyed by the split's fingerprint: another data.language (or
    audio root) must not read back the other's result; the same config must."""
    manifest = tmp_path / "corpus" / "train.jsonl"
    rows = by_split(clips, "train")
    write_jsonl(manifest, [{"audio_filepath": r["file"], "text": r["text"]} for r in rows])

    def fingerprint(**data):
        cfg = DataConfig(path=manifest, cache_dir=tmp_path / "cache", **data)
        return load_source(cfg).splits["train"]._fingerprint

    assert fingerprint(language="en") == fingerprint(language="en")
    assert fingerprint(language="en") != fingerprint(language="sw")
    assert fingerprint(language="en") != fingerprint(language="en", audio_dir=tmp_path)
