"""A data file that cannot be read says what is wrong with it, in the same words and with exit
code 2 whether the split is read whole or streamed: text that is not UTF-8 (file and line), a
corrupt parquet row group (the file), an empty file, a file of blank lines, a CSV/TSV without a
header row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asrforge.cli import main
from asrforge.config import DataConfig
from asrforge.data.sources import load_source
from asrforge.data.stream import StreamedSplit
from asrforge.errors import UserError
from tests.conftest import tiny_config

pytestmark = pytest.mark.fast

ROW = {"audio_filepath": "clips/a.wav", "text": "la la", "language": "en"}


def read_whole(path: Path, cache: Path) -> None:
    load_source(DataConfig(path=path, cache_dir=cache))


def read_streamed(path: Path, cache: Path) -> None:
    stream = StreamedSplit(DataConfig(path=path, stream={"enabled": True}), seed=0)
    list(stream.texts())  # a tokenizer trained on the stream reads every shard's text
    for i in range(len(stream.shards)):
        stream.read_shard(i)


def message(read, path: Path, tmp_path: Path) -> str:
    with pytest.raises(UserError) as err:
        read(path, tmp_path / "cache")
    return str(err.value)


def both(path: Path, tmp_path: Path) -> str:
    """The message of ``path`` read whole and streamed, which must be one."""
    whole = message(read_whole, path, tmp_path)
    assert message(read_streamed, path, tmp_path) == whole
    return whole


def jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def corrupt_parquet(path: Path) -> Path:
    """A parquet file of two row groups whose second one's compressed text is overwritten (its
    footer and page headers intact: the damage shows only when that row group is read)."""
    rows = [{**ROW, "text": f"word {i} " * 20} for i in range(200)]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, path, row_group_size=100, compression="snappy", use_dictionary=False)
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(1)
    data = bytearray(path.read_bytes())
    end = chunk.data_page_offset + chunk.total_compressed_size
    data[end - 200 : end - 160] = b"\xab" * 40
    path.write_bytes(bytes(data))
    return path


def test_text_that_is_not_utf8_names_its_file_and_line(tmp_path):
    good = json.dumps(ROW).encode()
    bad = good.replace(b"la la", b"caf\xe9 \xff\xfe")
    path = jsonl(tmp_path / "train.jsonl", [good, good, bad, good])
    said = both(path, tmp_path)
    assert said.startswith(f"data.path: {path} line 3: not UTF-8 text")


def test_a_corrupt_parquet_row_group_is_named_alike_whole_and_streamed(tmp_path):
    path = corrupt_parquet(tmp_path / "train.parquet")
    said = both(path, tmp_path)
    assert said.startswith(f"data.path: cannot read {path} as parquet: OSError: Corrupt snappy")


@pytest.mark.parametrize(
    ("content", "said"),
    [(b"", "empty file"), (b"\n\n  \n", "only blank lines, no rows")],
    ids=["empty", "blank lines"],
)
def test_a_manifest_without_rows_says_so(tmp_path, content, said):
    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    assert both(path, tmp_path) == f"data.path: {path}: {said}"


@pytest.mark.parametrize("sep", [",", "\t"], ids=["csv", "tsv"])
def test_a_table_of_a_header_line_alone_says_so(tmp_path, sep):
    path = tmp_path / ("train.csv" if sep == "," else "train.tsv")
    path.write_text(f"audio{sep}text{sep}language\n")
    assert both(path, tmp_path) == f"data.path: {path}: a header line and no rows"


def test_a_table_that_is_not_utf8_names_its_line(tmp_path, caplog):
    path = tmp_path / "train.csv"
    path.write_bytes(b"audio,text,language\nclips/a.wav,la la,en\nclips/b.wav,caf\xe9,en\n")
    with caplog.at_level("WARNING"):
        said = message(read_whole, path, tmp_path)
    assert said.startswith(f"data.path: {path} line 3: not UTF-8 text (bytes b'\\xe9,en")
    assert "Failed to read file" not in caplog.text  # the loader's own line, rows counted from 0


@pytest.mark.parametrize("sep", [",", "\t"], ids=["csv", "tsv"])
def test_a_table_without_a_header_row_is_named_as_such(tmp_path, sep):
    path = tmp_path / ("train.csv" if sep == "," else "train.tsv")
    path.write_text(f"clips/a.wav{sep}la la{sep}en\nclips/b.wav{sep}la{sep}en\n")
    said = both(path, tmp_path)
    assert said.startswith(f"data.path: {path}: no header row: the first line must name")
    assert "data.columns.audio" not in said


def test_the_command_exits_2_naming_the_line_without_a_traceback(tmp_path, capsys):
    good = json.dumps(ROW).encode()
    path = jsonl(tmp_path / "train.jsonl", [good, good.replace(b"la la", b"caf\xe9")])
    config = tmp_path / "c.yaml"
    data = {"path": str(path), "eval_carve": {"size": 1}, "cache_dir": str(tmp_path / "cache")}
    config.write_text(tiny_config(tmp_path / "run", path, data=data).to_yaml())
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{path} line 2: not UTF-8 text" in err and "Traceback" not in err
