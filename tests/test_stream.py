"""The streamed training split (issue 15, item 2, ``data.stream``): every shard format and the
virtual shards of one JSONL manifest, an order that is a pure function of (seed, epoch), ranks
and DataLoader workers that partition the batches, skipped rows reported by reason, a language
without a token that stops the run, the config's refusals, and a resume that is bit-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asrforge.config import DataConfig
from asrforge.data.shards import _read_table, find_shards
from asrforge.data.stream import StreamedSplit, epoch_blocks
from asrforge.data.workers import worker_count
from asrforge.errors import UserError
from asrforge.model.build import feature_extractor
from asrforge.model.tokenizer import SpecialTokens, train_bpe_tokenizer
from tests.conftest import tiny_config
from tests.test_resume import PreemptAt, assert_resume_is_bit_identical, run
from tests.test_sources import by_split, write_jsonl, write_table

FORMATS = ["parquet row groups", "arrow files", "jsonl files", "csv", "tsv", "NeMo manifest"]


def stream_source(fmt: str, root: Path, rows: list[dict]) -> tuple[Path, dict]:
    """The training rows written as ``fmt`` under ``root`` (and a ``dev.jsonl`` evaluation split
    beside them in a directory): (data.path, the rest of the data config)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = by_split(rows, "train")
    columns = {
        "audio": [r["file"] for r in train],
        "text": [r["text"] for r in train],
        "language": [r["language"] for r in train],
    }
    table = pa.table(columns)
    evaluation = [{"audio": r["file"], "text": r["text"], "language": r["language"]}
                  for r in by_split(rows, "validation")]  # fmt: skip
    write_jsonl(root / "dev.jsonl", evaluation)
    if fmt == "parquet row groups":  # 2 files, row groups of 10: 3 + 2 shards
        pq.write_table(table.slice(0, 30), root / "train-0.parquet", row_group_size=10)
        pq.write_table(table.slice(30), root / "train-1.parquet", row_group_size=10)
        return root, {}
    if fmt == "arrow files":
        for k, part in enumerate((table.slice(0, 20), table.slice(20))):
            with pa.ipc.new_stream(str(root / f"train-{k}.arrow"), part.schema) as w:
                w.write_table(part)
        return root, {}
    if fmt == "jsonl files":
        rows_out = [dict(zip(columns, v, strict=True)) for v in zip(*columns.values(), strict=True)]
        write_jsonl(root / "train-a.jsonl", rows_out[:25])
        write_jsonl(root / "train-b.jsonl", rows_out[25:])
        return root, {}
    if fmt in ("csv", "tsv"):
        rows_out = [
            {"path": r["file"], "sentence": r["text"], "locale": r["language"]} for r in train
        ]
        write_table(root / f"train.{fmt}", rows_out, "," if fmt == "csv" else "\t")
        mapped = {"columns": {"audio": "path", "text": "sentence", "language": "locale"}}
        return root, mapped
    if fmt == "NeMo manifest":  # one file, no newline after its last line
        lines = [json.dumps({"audio_filepath": r["file"], "text": r["text"], "duration": 1.0,
                             "lang": r["language"]}) for r in train]  # fmt: skip
        (root / "manifest.json").write_text("\n".join(lines))
        return root / "manifest.json", {"stream": {"eval_path": str(root / "dev.jsonl")}}
    raise AssertionError(fmt)


def data_config(path: Path, extra: dict, **stream) -> DataConfig:
    stream = {"enabled": True, "shard_rows": 7, "shuffle_shards": 2, **extra.get("stream", {}),
              **stream}  # fmt: skip
    return DataConfig(**{"path": path, "batch_size": 5, **extra, "stream": stream})


@pytest.fixture(scope="module")
def tok_specials():
    tok = train_bpe_tokenizer(["la la tone beep boop"] * 20, 300)
    return tok, SpecialTokens.from_tokenizer(tok, True)


def open_split(cfg: DataConfig, tok_specials, seed: int = 0) -> StreamedSplit:
    tok, specials = tok_specials
    stream = StreamedSplit(cfg, seed)
    stream.prepare(tokenizer=tok, specials=specials, features=feature_extractor(80, 2.0),
                   eot=specials.eot, max_target_positions=64, max_seconds=30.0)  # fmt: skip
    return stream


def epoch_uids(stream: StreamedSplit, tmp_path: Path, epoch: int = 0, *, start: int = 0,
               rank: int = 0, world: int = 1) -> list[list[str]]:  # fmt: skip
    """The ids of each batch (kept and dropped) the loader gives."""
    workers = worker_count(stream.cfg.num_workers, "cpu")
    loader = stream.loader(epoch, start, rank=rank, world=world, workers=workers)
    return [[*b.get("uid", []), *b["dropped"]] for b in loader]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_shard_format_streams_every_row_once_per_epoch(fmt, tmp_path, clips, tok_specials):
    root = tmp_path / "corpus"
    path, extra = stream_source(fmt, root, clips)
    stream = open_split(data_config(path, extra), tok_specials)
    assert len(stream) == 48
    n_shards = {"parquet row groups": 5, "arrow files": 2, "jsonl files": 8, "csv": 1, "tsv": 1,
                "NeMo manifest": 7}[fmt]  # fmt: skip
    assert len(stream.shards) == n_shards
    batches = epoch_uids(stream, tmp_path)
    assert [len(b) for b in batches] == [5] * 9 + [3]
    uids = [u for b in batches for u in b]
    train_files = {r["file"] for r in by_split(clips, "train")}
    assert sorted(uids) == sorted(train_files)  # ids are the paths as the data gives them
    assert stream.batches_per_epoch(0, 1) == 10
    assert set(stream.languages) == {"en", "es"}


@pytest.mark.fast
def test_virtual_shards_of_a_manifest_cover_every_line(tmp_path):
    lines = [json.dumps({"audio_filepath": f"{i}.wav", "text": "x"}) for i in range(23)]
    for text, n in (
        ("\n".join(lines), 23),
        ("\n".join(lines) + "\n", 23),
        ("\n".join(lines[:21]) + "\n", 21),
    ):
        (tmp_path / "m.jsonl").write_text(text)
        cfg = DataConfig(path=tmp_path / "m.jsonl", language="en",
                         stream={"enabled": True, "shard_rows": 7})  # fmt: skip
        shards, _ = find_shards(cfg)
        assert [s.rows for s in shards] == [7, 7, 7, n - 21][: 3 + (n > 21)]
        got = []
        for s in shards:
            with open(s.path, "rb") as f:
                f.seek(s.start)
                got += f.read(s.end - s.start).decode().splitlines()
        assert got == lines[:n]
    # pyarrow's reader skips a blank line: read line by line then, so rows stay where counted
    (tmp_path / "m.jsonl").write_text("\n".join([*lines[:3], "", *lines[4:9]]) + "\n")
    shards, _ = find_shards(cfg)
    tables = [_read_table(s) for s in shards]
    assert [t.num_rows for t in tables] == [7, 2]
    assert tables[0].column("text").to_pylist() == ["x", "x", "x", None, "x", "x", "x"]


def test_the_order_is_a_pure_function_of_seed_and_epoch(tmp_path, clips, tok_specials):
    path, extra = stream_source("NeMo manifest", tmp_path / "corpus", clips)
    cfg = data_config(path, extra)
    first = epoch_uids(open_split(cfg, tok_specials), tmp_path)
    assert epoch_uids(open_split(cfg, tok_specials), tmp_path) == first
    assert epoch_uids(open_split(cfg, tok_specials), tmp_path, epoch=1) != first
    assert epoch_uids(open_split(cfg, tok_specials, seed=1), tmp_path) != first
    # rows are shuffled beyond their shard: the first batch is not one shard's first rows
    in_file_order = [r["file"] for r in by_split(clips, "train")]
    assert first[0] != in_file_order[:5]
    # a start batch skips exactly: the rest of the epoch, batch for batch, reading only the
    # shards the rest is in (none of the skipped rows' shards, no audio of skipped rows)
    stream = open_split(cfg, tok_specials)
    read = []
    reader = stream.read_shard
    stream.read_shard = lambda i: read.append(i) or reader(i)
    assert epoch_uids(stream, tmp_path, start=9) == first[9:]
    blocks = epoch_blocks(len(stream.shards), 2, 0, 0)
    assert read == blocks[-1]  # the last batch's 3 rows are the last block's last rows


@pytest.mark.parametrize("workers", [0, 3])  # 2 workers: the resume test
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker")  # 2 cores here
def test_ranks_and_workers_partition_the_batches(workers, tmp_path, clips, tok_specials):
    path, extra = stream_source("parquet row groups", tmp_path / "corpus", clips)
    one = epoch_uids(open_split(data_config(path, extra), tok_specials), tmp_path)
    cfg = data_config(path, {**extra, "num_workers": workers})
    for world in (1, 2, 3):
        for rank in range(world):
            # rank r takes batches r::world, in order; with 3 workers the ranks' counts (4 or 3)
            # are not multiples of the workers': the last worker ends first, nothing is lost
            got = epoch_uids(open_split(cfg, tok_specials), tmp_path, rank=rank, world=world)
            assert got == one[rank::world]
        resumed = epoch_uids(open_split(cfg, tok_specials), tmp_path, start=1, rank=1, world=2)
        assert resumed == one[1::2][1:]


def test_skipped_rows_are_reported_by_reason_and_a_tokenless_language_stops(tmp_path, clips):
    # through a training run: the drops go to TrainState.dropped and skipped-train.json as a
    # map-style split's do (written at each checkpoint and at the end, each id once)
    root = tmp_path / "corpus"
    train = by_split(clips, "train")
    (root / train[3]["file"]).unlink()
    rows = [{"audio_filepath": r["file"], "text": "" if i == 5 else r["text"],
             "lang": r["language"], "id": f"u{i}"} for i, r in enumerate(train)]  # fmt: skip
    write_jsonl(root / "m.jsonl", rows)
    write_jsonl(root / "dev.jsonl", [{"audio": r["file"], "text": r["text"],
                                      "language": r["language"]}
                                     for r in by_split(clips, "validation")])  # fmt: skip
    data = {"path": str(root / "m.jsonl"), "batch_size": 4,
            "stream": {"enabled": True, "shard_rows": 10, "eval_path": str(root / "dev.jsonl")}}  # fmt: skip
    sections = dict(data=data, train={"max_steps": 100, "max_epochs": 2},
                    eval={"eval_steps": None, "at_end": False})  # fmt: skip
    cfg = tiny_config(tmp_path / "run", root, **sections)
    # stopped after epoch 0 (12 batches): its checkpoint and the report hold both drops
    _, interrupted = run(cfg, [PreemptAt(12)])
    assert interrupted.status == "interrupted"
    # at the start nothing was read yet: the log says so, and the skips once they are known
    log = (tmp_path / "run" / "train.log").read_text()
    start = next(x for x in log.splitlines() if "split train: " in x)
    assert "none skipped up front; each row is checked as it is read, and what that skips is " \
           "reported at each save" in start and start.endswith("save")  # fmt: skip
    assert f"split train: skipped 2 of {len(rows)} utterances up to step 12" in log
    missing = root / train[3]["file"]  # named by its id and its path (the id does not say it)
    expected = {"audio file not found": [f"u3 ({missing})"], "empty text": ["u5"]}
    state = json.loads((tmp_path / "run/checkpoints/latest/train_state.json").read_text())
    assert {k: sorted(v) for k, v in state["dropped"].items()} == expected
    report = tmp_path / "run" / "skipped-train.json"
    assert {k: sorted(v) for k, v in json.loads(report.read_text()).items()} == expected
    # the resumed epoch 1 drops them again: still listed once; no per-rank file
    _, result = run(cfg, [], resume=True)
    assert (result.status, result.step) == ("completed", 24)
    assert {k: sorted(v) for k, v in json.loads(report.read_text()).items()} == expected
    assert [p.name for p in (tmp_path / "run").glob("skipped-train*.json")] == [report.name]
    assert "up to step 24" in (tmp_path / "run" / "train.log").read_text()

    # a language with no token in a later shard: the run stops naming the value
    rows[40]["lang"] = "Klingon"
    write_jsonl(root / "m.jsonl", rows)
    with pytest.raises(UserError, match=r"language 'Klingon' \(1 utterance\) has no token"):
        run(tiny_config(tmp_path / "klingon", root, **sections), [])
    rows[2]["lang"] = "Klingon"  # in the first shard: refused before training
    write_jsonl(root / "m.jsonl", rows)
    with pytest.raises(UserError, match="'Klingon'"):
        run(tiny_config(tmp_path / "klingon-first", root, **sections), [])


def test_two_ranks_drops_are_gathered_into_rank_zeros_skip_report(tmp_path, clips):
    """torchrun, two CPU processes: each rank checks its own batches' rows; rank zero's
    skipped-train.json lists both ranks' drops (gathered at the checkpoint), and no rank writes
    a file of its own."""
    import subprocess
    import sys

    root = tmp_path / "corpus"
    train = by_split(clips, "train")
    empty = set(range(0, 48, 5))  # spread over the batches of both ranks
    rows = [{"audio_filepath": r["file"], "text": "" if i in empty else r["text"],
             "lang": r["language"], "id": f"u{i}"} for i, r in enumerate(train)]  # fmt: skip
    write_jsonl(root / "m.jsonl", rows)
    write_jsonl(root / "dev.jsonl", [{"audio": r["file"], "text": r["text"],
                                      "language": r["language"]}
                                     for r in by_split(clips, "validation")])  # fmt: skip
    data = {"path": str(root / "m.jsonl"), "batch_size": 4,
            "stream": {"enabled": True, "shard_rows": 10, "eval_path": str(root / "dev.jsonl")}}  # fmt: skip
    cfg = tiny_config(tmp_path / "run", root, data=data, train={"max_steps": 100, "max_epochs": 1},
                      eval={"eval_steps": None, "at_end": False})  # fmt: skip
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "asrforge", "train", str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    skipped = json.loads((tmp_path / "run" / "skipped-train.json").read_text())
    assert sorted(skipped["empty text"]) == sorted(f"u{i}" for i in empty)
    files = [p.name for p in (tmp_path / "run").glob("skipped-train*.json")]
    assert files == ["skipped-train.json"]


def test_an_english_only_model_refuses_a_streamed_language_other_than_english(
    tmp_path, clips, tok_specials
):
    root = tmp_path / "corpus"
    rows = [{"audio_filepath": r["file"], "text": r["text"], "lang": "en"}
            for r in by_split(clips, "train")]  # fmt: skip
    rows[40]["lang"] = "Swedish"  # in a later shard: stops when it is read
    write_jsonl(root / "m.jsonl", rows)
    cfg = DataConfig(
        path=root / "m.jsonl", batch_size=4, stream={"enabled": True, "shard_rows": 10}
    )
    tok, _ = tok_specials
    english_only = (tok, SpecialTokens.from_tokenizer(tok, False))
    stream = open_split(cfg, english_only)
    with pytest.raises(UserError, match=r"English-only.*'Swedish' \(1 utterance, code 'sv'\)"):
        epoch_uids(stream, tmp_path)
    rows[2]["lang"] = "sv"  # in the first shard: refused before training
    write_jsonl(root / "m.jsonl", rows)
    with pytest.raises(UserError, match="English-only.*'sv'"):
        open_split(cfg, english_only)


@pytest.mark.fast
def test_incompatible_options_are_refused_by_name(tmp_path):
    from asrforge.config import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, tmp_path, data={"path": str(tmp_path), "stream": {"enabled": True},
                                              "pack": {"enabled": True}, "cache_features": True,
                                              "eval_carve": {"size": 3}})  # fmt: skip
    for name in ("data.pack.enabled", "data.cache_features", "data.eval_carve"):
        assert f"{name}: not available with stream.enabled" in str(e.value)
    saved = tmp_path / "saved"
    (saved / "train").mkdir(parents=True)
    (saved / "dataset_dict.json").write_text("{}")
    with pytest.raises(UserError, match="is a save_to_disk directory"):
        find_shards(DataConfig(path=saved, stream={"enabled": True}))
    (tmp_path / "m.jsonl").write_text("{}\n")
    from asrforge.data.stream import stream_eval_split

    with pytest.raises(UserError, match="data.stream.eval_path: data.path .* is one file"):
        stream_eval_split(DataConfig(path=tmp_path / "m.jsonl", stream={"enabled": True}))
    missing = {"enabled": True, "eval_path": str(tmp_path / "dev.jsonl")}
    with pytest.raises(UserError, match=r"^data\.stream\.eval_path: .*dev\.jsonl: no such file"):
        stream_eval_split(DataConfig(path=tmp_path / "m.jsonl", stream=missing))


def resume_sections(data: dict, **train) -> dict:
    """The config sections of a streamed resume test on ``data``: 4 steps of 4 micro-batches
    (``train`` added), dropout on, so a resume must restore the RNG too; no evaluation; every
    checkpoint kept."""
    return dict(
        data=data, model={"dropout": 0.1}, eval={"eval_steps": None, "at_end": False},
        train={"max_steps": 4, "grad_accum": 4, **train}, checkpoint={"save_total_limit": 5},
    )  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
def test_streaming_resume_is_bit_identical(workers, tmp_path, clips):
    # 48 rows / 8 = 6 batches an epoch, 4 micro-batches a step: steps cross epoch boundaries;
    # the run stops mid-epoch (after 8 batches: epoch 1, batch 2)
    path, extra = stream_source("NeMo manifest", tmp_path / "corpus", clips)
    data = {"path": str(path), "num_workers": workers,
            "stream": {"enabled": True, "shard_rows": 7, "shuffle_shards": 2,
                       "eval_path": extra["stream"]["eval_path"]}}  # fmt: skip
    sections = resume_sections(data)
    state = assert_resume_is_bit_identical(tmp_path, path, sections)
    assert (state["epoch"], state["batch_in_epoch"]) == (1, 2)
    assert state["stream_position"]["batch"] == 1

    # other shards (a changed shard size): the resume is refused, nothing written
    moved = tiny_config(tmp_path / "split", path, **{**sections, "data": {
        **data, "stream": {**data["stream"], "shard_rows": 5}}})  # fmt: skip
    with pytest.raises(UserError, match="was trained on other shards"):
        run(moved, [], resume=True)


def test_a_run_on_a_directory_streams_and_evaluates_on_its_dev_file(tmp_path, clips):
    path, extra = stream_source("jsonl files", tmp_path / "corpus", clips)
    # the epoch's length is known from the row counts: max_epochs ends the run after 6 batches
    cfg = tiny_config(tmp_path / "run", path, data={"path": str(path), "stream": {"enabled": True}},
                      train={"max_steps": 100, "max_epochs": 1}, eval={"eval_steps": None})  # fmt: skip
    losses, result = run(cfg, [])
    assert (result.status, result.reason) == ("completed", "reached max_epochs=1")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert result.last_metrics["n"] == 12  # dev.jsonl
    assert not list((tmp_path / "run").glob("skipped-train*.json"))  # nothing skipped, no file


def test_the_selection_language_is_the_whole_streams_most_frequent_not_its_first_shards(
    tmp_path, clips
):
    # the Spanish rows come first and fill the first shard; English has more rows in all
    train = by_split(clips, "train")
    n_es = sum(r["language"] == "es" for r in train)
    rows = [r for r in train if r["language"] == "es"]
    rows += [r for r in train if r["language"] == "en"] * 2
    write_jsonl(tmp_path / "corpus" / "train.jsonl", [
        {"audio": r["file"], "text": r["text"], "language": r["language"]} for r in rows
    ])  # fmt: skip
    evaluation = [{"audio": r["file"], "text": r["text"], "language": r["language"]}
                  for r in by_split(clips, "validation")]  # fmt: skip
    write_jsonl(tmp_path / "corpus" / "dev.jsonl", evaluation)
    data = {"path": str(tmp_path / "corpus"), "stream": {"enabled": True, "shard_rows": n_es}}
    cfg = tiny_config(tmp_path / "run", tmp_path / "corpus", data=data,
                      train={"max_steps": 1}, eval={"eval_steps": None, "at_end": False})  # fmt: skip
    run(cfg, [])
    log = (tmp_path / "run" / "train.log").read_text()
    n_en = len(rows) - n_es
    assert f"language 'en' (english), the most frequent language of the training split ({n_en} " \
           f"of {len(rows)})" in log  # fmt: skip


def test_rows_left_out_by_data_languages_are_counted_not_dropped(tmp_path, clips):
    # as for a map-style split: counted per language up front, not skips (no skipped-train.json,
    # no "dropped clips" warnings); a filter that leaves nothing names the split's languages
    path, _ = stream_source("jsonl files", tmp_path / "corpus", clips)
    languages = [r["language"] for r in by_split(clips, "train")]
    n = {lang: languages.count(lang) for lang in ("en", "es")}
    data = {"path": str(path), "stream": {"enabled": True}, "languages": ["English"]}
    cfg = tiny_config(tmp_path / "run", path, data=data, train={"max_steps": 100, "max_epochs": 1},
                      eval={"eval_steps": None})  # fmt: skip
    _, result = run(cfg, [])
    assert result.status == "completed"
    log = (tmp_path / "run" / "train.log").read_text()
    assert (f"split train: 48 utterances: {n['en']} kept, {n['es']} left out by data.languages "
            f"(es {n['es']}), none skipped") in log  # fmt: skip
    assert "dropped clips" not in log
    assert not list((tmp_path / "run").glob("skipped-train*.json"))

    german = tiny_config(tmp_path / "de", path, data={**data, "languages": ["German"]})
    with pytest.raises(UserError) as e:
        run(german, [])
    assert str(e.value).endswith(
        f"data.languages ['German'] leaves out 48 of its 48 utterances, whose languages are "
        f"en ({n['en']}), es ({n['es']})"
    )


@pytest.mark.fast
def test_a_parquet_stream_reads_only_the_text_and_language_columns_in_one_pass(
    tmp_path, clips, monkeypatch
):
    import pyarrow.parquet as pq

    path, extra = stream_source("parquet row groups", tmp_path / "corpus", clips)
    stream = StreamedSplit(data_config(path, {**extra, "languages": ["English"]}), seed=0)
    read = []
    real = pq.ParquetFile.read_row_group

    def spy(self, i, columns=None, **kwargs):
        read.append(columns)
        return real(self, i, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    train = by_split(clips, "train")
    # the texts are the rows data.languages keeps; the counts are every row's
    assert list(stream.texts()) == [r["text"] for r in train if r["language"] == "en"]
    languages = [r["language"] for r in train]
    assert stream.language_counts() == {lang: languages.count(lang) for lang in ("en", "es")}
    assert stream.left_out() == {"es": languages.count("es")}
    assert read == [["text", "language"]] * len(stream.shards)  # no audio column, no second pass


@pytest.mark.fast
def test_a_tokenizer_trained_on_a_stream_with_a_language_filter_reads_each_shard_once(
    tmp_path, clips, monkeypatch
):
    from types import SimpleNamespace

    import asrforge.data.stream as stream_module
    from asrforge.train.setup import run_tokenizer
    from asrforge.train.setup_data import SplitTexts

    path, _ = stream_source("jsonl files", tmp_path / "corpus", clips)
    data = {"path": str(path), "stream": {"enabled": True}, "languages": ["English"]}
    cfg = tiny_config(tmp_path / "run", path, data=data)
    stream = StreamedSplit(cfg.data, seed=0)
    read = []
    real = stream_module.read_table
    monkeypatch.setattr(stream_module, "read_table", lambda s, *a: read.append(s) or real(s, *a))
    acc = SimpleNamespace(is_main_process=True, num_processes=1)
    tok = run_tokenizer(cfg, tmp_path / "run", acc, SplitTexts(cfg.data, stream=stream))
    assert tok.convert_tokens_to_ids("<|es|>") != tok.unk_token_id
    assert stream.left_out() == {"es": sum(r["language"] == "es" for r in by_split(clips, "train"))}
    assert read == stream.shards  # texts, languages and what the filter leaves out: one pass


@pytest.mark.fast
def test_a_line_that_is_not_utf8_in_a_later_shard_is_refused_when_the_stream_opens(tmp_path):
    lines = [json.dumps({"audio_filepath": f"{i}.wav", "text": "la"}).encode() for i in range(20)]
    lines[16] = lines[16].replace(b"la", b"caf\xe9")
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = DataConfig(path=path, language="en", stream={"enabled": True, "shard_rows": 7})
    with pytest.raises(UserError, match=rf"^data.path: {path} line 17: not UTF-8 text"):
        StreamedSplit(cfg, seed=0)
