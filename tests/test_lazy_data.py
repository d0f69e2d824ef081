"""Lazy data preparation (issue 15, item 2): start-up reads metadata only, what needs the audio
or the tokenizer is checked in the workers and still lands in the skip report, the rows are
numpy columns, and the epoch order is the one it always was."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from asrforge.cli import main
from asrforge.config import DataConfig
from asrforge.data import rules as data_rules
from asrforge.data.dataset import epoch_batches
from asrforge.data.prepare import prepare_split
from asrforge.data.sources import load_arrow, load_source
from asrforge.errors import UserError
from asrforge.model.tokenizer import SpecialTokens, train_bpe_tokenizer
from tests.conftest import tiny_config

LONG_TEXT = " ".join(["red blue cat dog"] * 20)  # far more than the tiny decoder's 32 positions


@pytest.fixture
def manifest_rows(tmp_path, tones_dir) -> list[dict]:
    """The tones' training clips as wav files under ``tmp_path/corpus``, as NeMo manifest rows
    (``audio_filepath`` relative to the corpus, ``text``, ``lang``, ``duration``)."""
    (tmp_path / "corpus" / "clips").mkdir(parents=True)
    rows = []
    for r in load_arrow(tones_dir)["train"]:
        file = f"clips/{r['id']}.wav"
        (tmp_path / "corpus" / file).write_bytes(r["audio"]["bytes"])
        seconds = sf.info(tmp_path / "corpus" / file).duration
        rows.append({"audio_filepath": file, "text": r["text"], "lang": r["language"],
                     "duration": seconds})  # fmt: skip
    return rows


def write_manifest(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer_and_specials():
    tok = train_bpe_tokenizer(["red blue cat dog sun one two sol mar gato"] * 20, 300)
    return tok, SpecialTokens.from_tokenizer(tok, True)


@pytest.mark.fast
def test_start_up_opens_no_audio_and_skips_durations_out_of_range(
    tmp_path, manifest_rows, tokenizer_and_specials, monkeypatch
):
    rows = [dict(r) for r in manifest_rows]
    rows[0]["duration"] = 45.0  # longer than the window: skipped up front, by its metadata
    rows[1]["duration"] = 0.0
    rows[2]["audio_filepath"] = "clips/gone.wav"  # missing: found only when a worker reads it
    rows[3]["text"] = LONG_TEXT  # too long: found only when a worker tokenizes it
    path = write_manifest(tmp_path / "corpus" / "train.jsonl", rows)
    cfg = DataConfig(path=path, cache_dir=tmp_path / "cache")
    train = load_source(cfg).splits["train"]
    assert "duration" in train.column_names

    opened = []
    for name in ("audio_info", "open_audio"):
        monkeypatch.setattr(data_rules, name, lambda *a, _n=name: opened.append(_n))
    tok, specials = tokenizer_and_specials
    table, report = prepare_split(train, "train", cfg=cfg, tokenizer=tok, specials=specials,
                                  max_target_positions=32, max_seconds=30.0, lazy=True)  # fmt: skip
    assert opened == []  # no audio header read, no clip decoded
    assert report.skipped == {"audio longer than 30 s": [rows[0]["audio_filepath"]],
                              "empty audio (0 samples)": [rows[1]["audio_filepath"]]}  # fmt: skip
    assert len(table) == len(rows) - 2 and table.lazy
    # the rows are numpy columns, not a Python object per row
    for column in (table.rows, table.language_index, table.seconds):
        assert isinstance(column, np.ndarray) and len(column) == len(table)
    assert sum(c.itemsize for c in (table.rows, table.language_index, table.seconds)) <= 18
    kept = [r["lang"] for r in rows[2:]]
    assert table.language_counts() == {lang: kept.count(lang) for lang in set(kept)}
    # an item is built on demand, from its row of the split
    u = table[1]
    assert (u.uid, u.text) == (rows[3]["audio_filepath"], LONG_TEXT)
    assert table.problem(u) == "labels longer than 32 tokens"
    assert table.problem(table[2]) is None


@pytest.mark.fast
def test_a_duration_column_must_hold_numbers(tmp_path, manifest_rows):
    rows = [{**r, "seconds": "long"} for r in manifest_rows]
    path = write_manifest(tmp_path / "corpus" / "train.jsonl", rows)
    cfg = DataConfig(path=path, columns={"duration": "seconds"}, cache_dir=tmp_path / "cache")
    with pytest.raises(
        UserError, match=r"data\.columns\.duration: column 'seconds' .* holds string"
    ):
        load_source(cfg)


def test_clips_found_unusable_in_the_workers_land_in_the_skip_report_once(tmp_path, manifest_rows):
    rows = [dict(r) for r in manifest_rows]
    (tmp_path / "corpus" / rows[2]["audio_filepath"]).unlink()  # missing
    rows[3]["text"] = LONG_TEXT  # labels too long
    long_clip = tmp_path / "corpus" / "clips" / "long.wav"  # 3 s, the tiny window is 2 s
    sf.write(long_clip, np.full(48_000, 0.1, dtype=np.float32), 16_000)
    rows[4] = {**rows[4], "audio_filepath": "clips/long.wav", "duration": None}  # not given
    (tmp_path / "corpus" / "clips" / "bad.wav").write_bytes(b"RIFF not a wav")
    rows[5] = {**rows[5], "audio_filepath": "clips/bad.wav"}
    path = write_manifest(tmp_path / "corpus" / "train.jsonl", rows)
    run = tmp_path / "run"
    data = {"path": str(path), "cache_dir": str(tmp_path / "cache"), "eval_carve": {"size": 4}}
    cfg = tiny_config(run, path, data=data, train={"max_steps": 6}, eval={"eval_steps": None})
    config = tmp_path / "c.yaml"
    config.write_text(cfg.to_yaml())
    assert main(["train", str(config)]) == 0
    carved = set(json.loads((run / "eval_carve.json").read_text())["rows"])
    expected = {
        "audio file not found": [rows[2]["audio_filepath"]],
        "labels longer than 32 tokens": [rows[3]["audio_filepath"]],
        "audio longer than 2 s": ["clips/long.wav"],
        "unreadable audio": ["clips/bad.wav"],
    }
    expected = {k: v for k, v in expected.items() if rows.index(next(
        r for r in rows if r["audio_filepath"] == v[0])) not in carved}  # fmt: skip
    # 44 training rows in batches of 8: 6 steps see every one of them once
    assert json.loads((run / "skipped-train.json").read_text()) == expected
    log_text = (run / "train.log").read_text()
    assert "skipped" in log_text and "up to step 6" in log_text
    # a resume into a second epoch drops them again: each is still listed once, and the
    # checkpoint's state holds them by reason
    config.write_text(cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"max_steps": 12})}).to_yaml())  # fmt: skip
    assert main(["train", str(config), "--resume"]) == 0
    assert json.loads((run / "skipped-train.json").read_text()) == expected
    state = json.loads((run / "checkpoints" / "step-000012" / "train_state.json").read_text())
    assert state["dropped"] == expected


@pytest.mark.fast
@pytest.mark.parametrize(("n", "batch", "world"), [(1, 4, 1), (50, 8, 1), (53, 8, 2), (9, 3, 3)])
def test_epoch_batches_keep_the_order_of_torch_randperm(n, batch, world):
    for epoch in (0, 1):
        g = torch.Generator().manual_seed(5 * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=g).tolist()
        old = [perm[i : i + batch] for i in range(0, n, batch)]
        for rank in range(world):
            got = epoch_batches(n, batch, 5, epoch, rank, world)
            assert [list(b) for b in got] == old[rank::world]
            assert [list(b) for b in got[1:]] == old[rank::world][1:]  # a resume's slice


@pytest.mark.fast
def test_a_split_checked_in_full_is_cached_by_its_fingerprint(
    tmp_path, manifest_rows, tokenizer_and_specials, monkeypatch
):
    rows = [{k: v for k, v in r.items() if k != "duration"} for r in manifest_rows]  # headers
    rows[3]["text"] = LONG_TEXT
    path = write_manifest(tmp_path / "corpus" / "train.jsonl", rows)
    cfg = DataConfig(path=path, cache_dir=tmp_path / "cache")
    tok, specials = tokenizer_and_specials
    headers = []
    real_info = data_rules.audio_info
    monkeypatch.setattr(data_rules, "audio_info", lambda src: headers.append(src) or real_info(src))
    cache = tmp_path / "prepared"

    def prepare(tokenizer=tok, positions=32, config=cfg):
        split = load_source(config).splits["train"]  # loaded afresh, as a resume does
        headers.clear()
        table, report = prepare_split(split, "train", cfg=config, tokenizer=tokenizer,
                                      specials=specials, max_target_positions=positions,
                                      max_seconds=30.0, cache=cache)  # fmt: skip
        return table, report, len(headers)

    first, report, read = prepare()
    assert read == len(rows) and len(list(cache.iterdir())) == 1
    assert report.skipped == {"labels longer than 32 tokens": [rows[3]["audio_filepath"]]}
    again, report_again, read = prepare()
    assert read == 0  # no header read: the cached result
    assert report_again.skipped == report.skipped and report_again.total == len(rows)
    for column in ("rows", "language_index", "seconds", "n_tokens"):
        np.testing.assert_array_equal(getattr(again, column), getattr(first, column))
    assert again[5] == first[5]  # items built alike
    # another decoder length, tokenizer or language filter: checked again, cached apart
    _, longer, read = prepare(positions=448)
    assert read == len(rows) and longer.n_skipped == 0
    other = train_bpe_tokenizer(["red blue cat dog sun"] * 20, 280)
    assert prepare(tokenizer=other)[2] == len(rows)
    english = DataConfig(path=path, cache_dir=tmp_path / "cache", languages=["en"])
    table, _, read = prepare(config=english)
    assert read == sum(r["lang"] == "en" for r in rows) and set(table.language_counts()) == {"en"}
    assert len(list(cache.iterdir())) == 4


def test_a_packed_run_checks_its_split_once_and_its_resume_reads_it(tmp_path, tones_dir):
    run = tmp_path / "run"
    cfg = tiny_config(run, tones_dir, data={"batch_size": 4, "pack": {"enabled": True}},
                      train={"max_steps": 2}, eval={"eval_steps": None, "at_end": False})  # fmt: skip
    config = tmp_path / "c.yaml"
    config.write_text(cfg.to_yaml())
    assert main(["train", str(config)]) == 0
    assert len(list((run / "cache" / "prepared").iterdir())) == 2  # train and validation
    assert "checked in full before" not in (run / "train.log").read_text()
    config.write_text(cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"max_steps": 4})}).to_yaml())  # fmt: skip
    assert main(["train", str(config), "--resume"]) == 0
    log_text = (run / "train.log").read_text()
    assert "split train: checked in full before" in log_text
    assert len(list((run / "cache" / "prepared").iterdir())) == 2
