"""Data sets named by their Hugging Face Hub id (``data.path: org/name`` + ``data.subset``): their
configurations read from the README.md's YAML ``configs:`` as Hub data sets declare them, read
whole from a cache this test builds (``HF_HUB_OFFLINE=1``) and streamed shard by shard, Common
Voice's column names recognised without ``data.columns``, a directory downloaded with ``hf
download`` read as the id is, and the shard-by-shard fsspec path over ``memory://`` and
``file://`` (retries included). Nothing here reaches a network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from asrforge.config import DataConfig
from asrforge.data import shards as shards_module
from asrforge.data.shards import find_shards
from asrforge.data.sources import load_arrow, load_source, read_split
from asrforge.errors import UserError
from asrforge.text.languages import resolve_language
from tests.hub_cache import add_repo, audio_parquet
from tests.test_stream import epoch_uids, open_split, tok_specials  # noqa: F401 - a fixture

README = """---
license: cc0-1.0
configs:
- config_name: all
  data_files:
  - split: train
    path: all/train-*.parquet
  - split: validation
    path: all/validation-*.parquet
- config_name: es
  data_files:
  - split: test
    path: es/test-*.parquet
---
# Tones, as Common Voice lays out its columns
"""


def common_voice_rows(rows) -> list[dict]:
    """Rows of the tones set with Common Voice's columns (``path``, ``audio``, ``sentence``,
    ``locale``, and a column asrforge does not read)."""
    return [
        {"client_id": "c0", "path": f"{r['id']}.wav",
         "audio": {"bytes": r["audio"]["bytes"], "path": f"{r['id']}.wav"},
         "sentence": r["text"], "locale": r["language"]}
        for r in rows
    ]  # fmt: skip


@pytest.fixture(scope="module")
def repo_files(tones_dir) -> dict[str, bytes | str]:
    """The files of a Hub data set repository: two configurations, parquet shards with audio
    bytes (the training split in two files of row groups of 10)."""
    tones = load_arrow(tones_dir)
    train = common_voice_rows(tones["train"])
    return {
        "README.md": README,
        "all/train-00000-of-00002.parquet": audio_parquet(train[:30], row_group_size=10),
        "all/train-00001-of-00002.parquet": audio_parquet(train[30:], row_group_size=10),
        "all/validation-00000-of-00001.parquet": audio_parquet(
            common_voice_rows(tones["validation"])
        ),
        "es/test-00000-of-00001.parquet": audio_parquet(
            common_voice_rows([r for r in tones["test"] if r["language"] == "es"])
        ),
    }



@pytest.fixture
def speech(hf_home, repo_files) -> Path:
    """``org/speech`` in the cache; its snapshot directory."""
    return add_repo(hf_home, "org/speech", repo_files, repo_type="dataset", commit="c" * 40)


@pytest.mark.fast
def test_a_hub_data_set_reads_its_subset_whole_from_the_cache(speech, tones_dir):
    source = load_source(DataConfig(path="org/speech", subset="all"))
    assert sorted(source.names) == ["train", "validation"]
    assert source.resolved.record() == {"id": "org/speech", "revision": None, "commit": "c" * 40}
    train = source.splits["train"]
    assert len(train) == 48
    row = train[0]
    original = load_arrow(tones_dir)["train"][0]
    # Common Voice's sentence and locale are the text and language; the audio is its bytes
    assert (row["text"], row["language"]) == (original["text"], original["language"])
    assert row["audio"]["bytes"] == original["audio"]["bytes"]


@pytest.mark.fast
def test_a_subset_or_split_the_data_set_lacks_is_named_with_those_it_has(speech, tones_dir):
    with pytest.raises(UserError, match=r"data.subset: org/speech has 2 configurations and no "
                                        r"default: name one \(all, es\) with data.subset, or "
                                        r"--subset with --data$"):  # fmt: skip
        load_source(DataConfig(path="org/speech"))
    with pytest.raises(UserError, match=r"data.subset 'sw': org/speech has no such configuration "
                                        r"\(it has all, es\)"):  # fmt: skip
        load_source(DataConfig(path="org/speech", subset="sw"))
    with pytest.raises(UserError, match=r"--split 'test': not in org/speech \(subset all\) "
                                        r"\(it has train, validation\)"):  # fmt: skip
        read_split(DataConfig(path="org/speech", subset="all"), "test")
    spanish = [r for r in load_arrow(tones_dir)["test"] if r["language"] == "es"]
    assert len(read_split(DataConfig(path="org/speech", subset="es"), "test")) == len(spanish)


@pytest.mark.fast
def test_a_directory_downloaded_with_hf_download_reads_as_the_id(speech, tmp_path):
    local = tmp_path / "downloaded"
    shutil.copytree(speech, local)  # regular files, as `hf download --local-dir` writes them
    by_id = load_source(DataConfig(path="org/speech", subset="all")).splits["validation"]
    by_dir = load_source(DataConfig(path=local, subset="all")).splits["validation"]
    assert [r["text"] for r in by_dir] == [r["text"] for r in by_id]
    assert [r["audio"]["bytes"] for r in by_dir] == [r["audio"]["bytes"] for r in by_id]


@pytest.mark.fast
def test_a_loading_script_is_never_run_its_parquet_conversion_is_read(
    hf_home, repo_files, tmp_path
):
    script = {"scripted.py": "raise SystemExit('never run')\n", "README.md": "# x\n"}
    add_repo(hf_home, "org/scripted", script, repo_type="dataset")
    with pytest.raises(UserError, match=r"org/scripted@refs/convert/parquet: no such local path "
                       r"\(from .*\), and no revision of it in the Hugging Face cache.*"
                       r"--revision refs/convert/parquet"):  # fmt: skip
        load_source(DataConfig(path="org/scripted", subset="all"))
    # the Hub's conversion: <config>/<split>/NNNN.parquet on refs/convert/parquet
    converted = {"all/validation/0000.parquet": repo_files["all/validation-00000-of-00001.parquet"],
                 "all/train/0000.parquet": repo_files["all/train-00000-of-00002.parquet"]}  # fmt: skip
    add_repo(hf_home, "org/scripted", converted, repo_type="dataset", ref="refs/convert/parquet")
    split = read_split(DataConfig(path="org/scripted", subset="all"), "validation")
    assert len(split) == 12
    # a local directory with only the script is refused
    local = tmp_path / "scripted"
    local.mkdir()
    (local / "scripted.py").write_text(script["scripted.py"])
    with pytest.raises(UserError, match=r"loading script.*never runs.*refs/convert/parquet"):
        load_source(DataConfig(path=local))


@pytest.mark.fast
def test_a_hub_data_set_streams_shard_by_shard_from_the_cache(speech, tok_specials):  # noqa: F811
    cfg = DataConfig(path="org/speech", subset="all", batch_size=5,
                     stream={"enabled": True, "shuffle_shards": 2})  # fmt: skip
    shards, _root = find_shards(cfg)
    assert [s.rows for s in shards] == [10, 10, 10, 10, 8]  # the row groups of two files
    assert all(f"snapshots/{'c' * 40}/all/train-" in s.path for s in shards)
    stream = open_split(cfg, tok_specials)
    assert len(stream) == 48


def _mirror(fs_root: str, files: dict[str, bytes | str]) -> None:
    for name, data in files.items():
        with fsspec.open(f"{fs_root}/{name}", "wb", auto_mkdir=True) as f:
            f.write(data.encode() if isinstance(data, str) else data)


@pytest.mark.parametrize("protocol", ["memory", "file"])
def test_fsspec_urls_stream_the_same_batches_as_the_local_directory(
    protocol,
    repo_files,
    tmp_path,
    tok_specials,  # noqa: F811
):
    local = tmp_path / "local"
    _mirror(str(local), repo_files)
    url = f"memory://corpus-{tmp_path.name}" if protocol == "memory" else f"file://{tmp_path}/url"
    _mirror(url, repo_files)
    batches = []
    for path in (str(local), url):
        cfg = DataConfig(path=path, subset="all", batch_size=5,
                         stream={"enabled": True, "shuffle_shards": 2})  # fmt: skip
        stream = open_split(cfg, tok_specials)
        assert len(stream.shards) == 5
        batches.append(epoch_uids(stream, tmp_path))
    assert batches[0] == batches[1] and sum(map(len, batches[0])) == 48


class FlakyMemory(MemoryFileSystem):
    """memory:// whose every file fails its first open, as a dropped connection does."""

    protocol = "flakymem"
    failed: set = set()  # noqa: RUF012 - shared by the instances fsspec caches

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).replace("flakymem://", "memory://", 1))

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode and path not in self.failed:
            self.failed.add(path)
            raise ConnectionResetError(f"connection reset reading {path}")
        return super()._open(path, mode, **kwargs)


def test_a_remote_shard_that_fails_once_is_read_on_the_next_try(
    repo_files,
    tmp_path,
    monkeypatch,
    caplog,
    tok_specials,  # noqa: F811
):
    fsspec.register_implementation("flakymem", FlakyMemory, clobber=True)
    monkeypatch.setattr(shards_module, "RETRY_SECONDS", (0.0, 0.0))
    _mirror("memory://flaky", {k: v for k, v in repo_files.items() if k != "README.md"})
    cfg = DataConfig(path="flakymem://flaky/all", batch_size=5,
                     stream={"enabled": True, "shuffle_shards": 2})  # fmt: skip
    stream = open_split(cfg, tok_specials)
    assert sum(map(len, epoch_uids(stream, tmp_path))) == 48
    assert "trying again" in caplog.text


@pytest.mark.fast
def test_columns_of_fleurs_are_recognised(hf_home, tones_dir):
    tones = load_arrow(tones_dir)["test"]
    rows = [{"id": 7, "num_samples": 1, "path": "a.wav",
             "audio": {"bytes": r["audio"]["bytes"], "path": "a.wav"},
             "transcription": r["text"].lower(), "raw_transcription": r["text"],
             "gender": 0, "lang_id": 1, "language": "Spanish" if r["language"] == "es" else "English",
             "lang_group_id": 0} for r in tones]  # fmt: skip
    add_repo(hf_home, "google/fleurs", {
        "README.md": "---\nconfigs:\n- config_name: es_419\n  data_files:\n    test: es_419/test-*\n---\n",
        "es_419/test-00000.parquet": audio_parquet(rows)}, repo_type="dataset")  # fmt: skip
    split = read_split(DataConfig(path="google/fleurs", subset="es_419"), "test")
    assert [r["text"] for r in split] == [r["text"] for r in tones]
    # FLEURS names its languages; they resolve to codes as every language value does
    assert {resolve_language(r["language"]) for r in split} == {"es", "en"}
    assert json.dumps(split[0]["id"]) == '"7"'


@pytest.mark.fast
def test_a_split_read_alone_downloads_only_its_files():
    # Offline the cache holds what it holds; online these patterns are what snapshot_download
    # is asked for, so they are checked against a repository's file names.
    from fnmatch import fnmatch

    from asrforge.data.locate import _layout_patterns

    files = ["es_419/train/0000.parquet", "es_419/validation/0000.parquet",
             "es_419/test/0000.parquet", "es_419/test/0001.parquet", "fr_fr/test/0000.parquet",
             "data/dev-00000.parquet", "data/train-00000.parquet"]  # fmt: skip

    def picked(subset, only):
        patterns = _layout_patterns(subset, only)
        return [f for f in files if any(fnmatch(f, p) for p in patterns)]

    assert picked("es_419", "test") == ["es_419/test/0000.parquet", "es_419/test/0001.parquet"]
    assert picked("es_419", None) == files[:4]
    assert picked(None, "validation") == ["es_419/validation/0000.parquet",
                                          "data/dev-00000.parquet"]  # fmt: skip


@pytest.mark.fast
@pytest.mark.parametrize("protocol", ["memory", "file"])
def test_a_url_reads_whole_as_the_local_directory_does(protocol, repo_files, tmp_path):
    local = tmp_path / "local"
    _mirror(str(local), repo_files)
    url = f"memory://whole-{tmp_path.name}" if protocol == "memory" else f"file://{local}"
    if protocol == "memory":
        _mirror(url, repo_files)
    by_url = load_source(DataConfig(path=url, subset="all")).splits["validation"]
    by_dir = load_source(DataConfig(path=local, subset="all")).splits["validation"]
    assert [r["text"] for r in by_url] == [r["text"] for r in by_dir]
    assert [r["audio"]["bytes"] for r in by_url] == [r["audio"]["bytes"] for r in by_dir]


@pytest.mark.fast
def test_a_url_whose_protocol_cannot_be_read_here_is_named_with_what_is_missing(monkeypatch):
    def no_package(url):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_package)
    with pytest.raises(UserError, match=r"^data\.path: s3://bucket/x: Install s3fs to access S3$"):
        load_source(DataConfig(path="s3://bucket/x"))
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"^data\.path: nosuch://x: Protocol not known: nosuch$"):
        load_source(DataConfig(path="nosuch://x"))


@pytest.mark.fast
@pytest.mark.parametrize(
    "argv",
    [
        ["evaluate", "some/model"],
        ["lm", "build", "--out", "lm.arpa"],
        ["lm", "tune", "bundle"],
        ["vocab", "build", "--language", "es", "--vocab-size", "300", "--out", "t", "--base", "b"],
        ["vocab", "report", "--language", "es", "--tokenizer", "t"],
        ["align-heads", "bundle"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_every_command_reading_data_takes_a_hub_address_and_its_subset_and_revision(argv):
    """``--data`` reaches the data section as written (a path would fold ``hf://``'s double
    slash), with ``--subset`` and ``--revision``, in every command that reads data."""
    from asrforge.cli import build_parser
    from asrforge.cli.data_options import data_options

    address = "hf://datasets/org/speech/data"
    args = build_parser().parse_args(
        [*argv, "--data", address, "--subset", "es_419", "--revision", "v2"]
    )
    args.overrides = []
    data = data_options(args)
    assert (str(data.path), data.subset, data.revision) == (address, "es_419", "v2")


@pytest.mark.fast
def test_a_revision_in_the_id_and_another_apart_name_both_fields():
    with pytest.raises(UserError, match=r"^data.path: org/speech@abc names revision 'abc', and "
                                        r"data.revision is 'def': give the revision in one place$"):
        load_source(DataConfig(path="org/speech@abc", revision="def"))


@pytest.mark.fast
def test_a_missing_manifest_is_not_offered_the_generated_tones(tmp_path):
    with pytest.raises(UserError) as e:
        load_source(DataConfig(path=tmp_path / "nothere.json"))
    assert str(e.value) == f"data.path: {tmp_path / 'nothere.json'} does not exist"
    with pytest.raises(UserError, match=r"does not exist; data.generate: tones makes a small"):
        load_source(DataConfig(path=tmp_path / "nothere"))


@pytest.mark.fast
def test_a_missing_relative_data_path_names_the_directory_it_was_read_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        load_source(DataConfig(path="corpus"))
    assert str(e.value).startswith(f"data.path: corpus (read from {tmp_path}) does not exist")
