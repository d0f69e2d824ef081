"""Models named by their Hugging Face Hub id: resolved through the real ``huggingface_hub`` code
against a cache this test builds (``HF_HUB_OFFLINE=1``: the path a user's second run takes), and
each error a user meets one line naming what to do. The errors only an online Hub gives (gated,
private, a revision that does not exist) come from a stand-in endpoint on 127.0.0.1."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from asrforge.config import ModelConfig
from asrforge.errors import CheckpointCorruptError, UserError
from asrforge.hub import hub_ref, materialize, resolve, resolve_model
from asrforge.io.append import SymlinkRefused
from asrforge.model.build import build_model, build_tokenizer
from tests.conftest import tiny_config
from tests.hub_cache import add_repo, hub_answering

TEXTS = ["a b c", "hello world", "the quick brown fox"] * 40



@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tones_dir) -> Path:
    """A tiny from-scratch model and its tokenizer as a transformers directory."""
    root = tmp_path_factory.mktemp("tiny")
    cfg = tiny_config(root / "run", tones_dir)
    tokenizer = build_tokenizer(cfg.model, TEXTS)
    path = root / "model"
    build_model(cfg.model, tokenizer, 0).model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def test_an_id_loads_the_cached_snapshot_it_names_with_its_commit(hf_home, tiny_model):
    snapshot = add_repo(hf_home, "org/tiny", {"": tiny_model}, commit="a" * 40)
    resolved = resolve_model("org/tiny")
    assert resolved.path == snapshot and resolved.commit == "a" * 40
    assert resolved.record() == {"id": "org/tiny", "revision": None, "commit": "a" * 40}
    cfg = ModelConfig(pretrained="org/tiny")
    model = build_model(cfg, build_tokenizer(cfg), 0).model
    saved = load_file(str(tiny_model / "model.safetensors"))
    state = model.state_dict()
    assert all(state[name].equal(t) for name, t in saved.items())


@pytest.mark.fast
def test_a_pinned_revision_wins_over_a_moved_main(hf_home, tiny_model):
    old = add_repo(hf_home, "org/tiny", {"": tiny_model}, commit="a" * 40)
    add_repo(hf_home, "org/tiny", {"": tiny_model, "extra.json": "{}"}, commit="b" * 40)
    assert resolve_model("org/tiny").commit == "b" * 40
    assert resolve_model(f"org/tiny@{'a' * 40}").path == old


@pytest.mark.fast
def test_an_existing_local_path_wins_and_dot_slash_is_always_local(
    hf_home, tiny_model, tmp_path, monkeypatch
):
    add_repo(hf_home, "org/tiny", {"": tiny_model})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert resolve_model("org/tiny").ref is None
    assert hub_ref("./org/other") is None and hub_ref("org/other") is not None
    # kept as written by the config, so ./ still says "local" after validation
    assert ModelConfig(pretrained="./org/other").pretrained == "./org/other"


@pytest.mark.fast
def test_an_id_not_in_the_cache_offline_names_the_download_command(hf_home):
    with pytest.raises(UserError, match=r"org/absent.*HF_HUB_OFFLINE.*`hf download org/absent`"):
        resolve_model("org/absent")


@pytest.mark.fast
def test_a_revision_not_in_the_cache_offline_is_named(hf_home, tiny_model):
    add_repo(hf_home, "org/tiny", {"": tiny_model})
    with pytest.raises(
        UserError,
        match=r"org/tiny@v9: no such local path \(from .*\), and no revision.*--revision v9",
    ):
        resolve_model("org/tiny@v9")


@pytest.mark.fast
def test_a_repository_with_only_pickle_weights_is_refused_naming_the_conversion(hf_home):
    add_repo(hf_home, "org/old", {"config.json": "{}", "pytorch_model.bin": b"\x80\x02pickle"})
    with pytest.raises(UserError, match=r"only pytorch_model\.bin.*safetensors/convert"):
        resolve_model("org/old")


@pytest.mark.fast
def test_a_repository_with_no_weights_at_all_is_not_told_about_pickles(hf_home):
    add_repo(hf_home, "org/empty", {"config.json": "{}"})
    with pytest.raises(UserError, match=r"org/empty \(commit \w+\) has no weights") as e:
        resolve_model("org/empty")
    assert "pickle" not in str(e.value)


@pytest.mark.fast
@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (
            403,
            "GatedRepo",
            r"org/tiny is gated: accept its terms at http://127\.0\.0\.1:\d+/org/"
            r"tiny and set HF_TOKEN",
        ),  # fmt: skip
        (401, "RepoNotFound", r"nor a repository at .*org/tiny \(or it is private.*HF_TOKEN"),
        (404, "RevisionNotFound", r"revision 'v9' does not exist"),
    ],
)
def test_what_the_hub_refuses_is_one_line_naming_what_to_do(
    hf_home, monkeypatch, status, code, expected
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with hub_answering(status, code) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        ref = "org/tiny@v9" if code == "RevisionNotFound" else "org/tiny"
        with pytest.raises(UserError, match=expected) as err:
            resolve_model(ref)
    assert "\n" not in str(err.value)


def test_the_cli_refuses_an_uncached_id_offline_with_exit_2_and_one_line(hf_home, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "asrforge", "evaluate", "org/absent", "--data", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ},
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "hf download org/absent" in lines[0]


def test_transcribe_takes_a_hub_id(hf_home, tiny_model, tones_dir, tmp_path, capsys):
    from asrforge.cli import main
    from asrforge.data.sources import load_arrow

    add_repo(hf_home, "org/tiny", {"": tiny_model})
    clip = tmp_path / "clip.wav"
    clip.write_bytes(load_arrow(tones_dir)["test"][0]["audio"]["bytes"])
    assert main(["transcribe", "org/tiny", str(clip), "--max-new-tokens", "4"]) == 0
    # the note on stderr names the model as given, not its snapshot
    assert "asrforge: org/tiny: a transformers directory" in capsys.readouterr().err


@pytest.mark.fast
def test_a_commands_model_argument_and_the_id_are_named_once(hf_home, tmp_path, capsys):
    from asrforge.cli import main

    assert main(["transcribe", "org/absent", str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err
    assert "bundle: org/absent: no such local path" in err and "org/absent: org/absent" not in err


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory) -> Path:
    """A random 1-layer bundle, exported in a moment."""
    from asrforge.bundle import export_bundle
    from tests.test_data_hardening import save_random_whisper

    root = tmp_path_factory.mktemp("bundle")
    save_random_whisper(root / "hf")
    return export_bundle(root / "hf", root / "bundle")


def _blob(snapshot: Path, name: str) -> Path:
    """The cache's blob a snapshot's file links to."""
    return Path(os.path.realpath(snapshot / name))


@pytest.mark.fast
def test_a_hub_bundle_damaged_in_the_cache_loads_once_the_cache_is_repaired(
    hf_home, tiny_bundle
):
    from asrforge.bundle.load import load_bundle

    snapshot = add_repo(hf_home, "me/tiny", {"": tiny_bundle})
    blob = _blob(snapshot, "config.json")
    good = blob.read_bytes()
    blob.write_bytes(good + b"  ")  # grown, not truncated
    with pytest.raises(CheckpointCorruptError) as refused:
        load_bundle("me/tiny")
    said = str(refused.value)
    assert f"{snapshot / 'config.json'}: size differs" in said
    assert f"expected {len(good)} bytes, found {len(good) + 2}" in said
    assert "truncated" not in said and "hf download me/tiny" in said
    blob.write_bytes(good)  # the cache repaired (downloaded again)
    assert load_bundle("me/tiny").path.is_relative_to(hf_home / "asrforge")


@pytest.mark.fast
def test_a_damaged_copy_of_a_hub_bundle_is_copied_again(hf_home, tiny_bundle):
    from asrforge.bundle.load import load_bundle

    add_repo(hf_home, "me/tiny", {"": tiny_bundle})
    copy = load_bundle("me/tiny").path
    (copy / "config.json").write_text("{}")
    assert load_bundle("me/tiny").path == copy
    assert (copy / "config.json").read_bytes() == (tiny_bundle / "config.json").read_bytes()


def _tiny_repo(hf_home: Path) -> Path:
    """A repository of two small files, one in a subdirectory; returns its snapshot."""
    return add_repo(hf_home, "org/tiny", {"config.json": "{}", "sub/vocab.txt": "a b"})


def _listed(snapshot: Path) -> dict[str, int]:
    """What the tiny repository's listing says it holds: its two files, and one model file."""
    return {"config.json": 2, "sub/vocab.txt": 3, "model.safetensors": 0}


@pytest.mark.fast
def test_materialize_copies_the_snapshots_files_as_regular_files(hf_home):
    _tiny_repo(hf_home)
    copy = materialize(resolve("org/tiny", field="bundle", patterns=None), _listed)
    assert copy.parent.parent == hf_home / "asrforge"
    assert not (copy / "config.json").is_symlink() and (copy / "config.json").read_text() == "{}"
    assert (copy / "sub" / "vocab.txt").read_text() == "a b"


@pytest.mark.fast
@pytest.mark.parametrize("entry", ["device", "outside", "fifo", "directory"])
def test_materialize_copies_only_regular_files_of_the_repositorys_cache_folder(
    hf_home, tmp_path, entry
):
    snapshot = _tiny_repo(hf_home)
    outside = tmp_path / "secret.txt"
    outside.write_text("not the cache's")
    evil = snapshot / "model.safetensors"
    if entry == "device":
        evil.symlink_to("/dev/zero")
    elif entry == "outside":
        evil.symlink_to(outside)
    elif entry == "fifo":
        os.mkfifo(evil)
    else:
        evil.symlink_to(".")
    resolved = resolve("org/tiny", field="bundle", patterns=None)
    pointed = {"device": "/dev/zero", "outside": str(outside)}.get(entry)
    named = f"{evil}: points to {pointed}" if pointed else f"{evil}:"
    with pytest.raises(CheckpointCorruptError, match=re.escape(named)):
        materialize(resolved, _listed)
    # nothing of the refused copy stays, not even its temporary
    assert not [p for p in (hf_home / "asrforge").rglob("*") if p.is_file()]
    assert not (hf_home / "asrforge" / "models--org--tiny" / resolved.commit).exists()


@pytest.mark.fast
@pytest.mark.parametrize("entry", ["unlisted", "larger", "smaller"])
def test_materialize_copies_nothing_of_a_snapshot_its_listing_does_not_describe(hf_home, entry):
    snapshot = _tiny_repo(hf_home)
    blob = _blob(snapshot, "config.json")
    if entry == "unlisted":  # a sparse file: copied, it would take its whole size on disk
        with open(blob.parent / ("f" * 64), "wb") as f:
            f.truncate(2**40)
        (snapshot / "big.safetensors").symlink_to(os.path.relpath(blob.parent / ("f" * 64),
                                                                  snapshot))
        named = f"{snapshot / 'big.safetensors'}: not listed in the snapshot's manifest"
    else:
        blob.write_text("{}  " if entry == "larger" else "{")
        found = 4 if entry == "larger" else 1
        named = f"{snapshot / 'config.json'}: size differs: expected 2 bytes, found {found}"
    copied = []
    with pytest.raises(CheckpointCorruptError, match=re.escape(named)):
        materialize(resolve("org/tiny", field="bundle", patterns=None),
                    lambda path: copied.append(path) or _listed(path))
    assert copied == [snapshot]  # the listing is read from the cache's snapshot
    assert not [p for p in (hf_home / "asrforge").rglob("*") if p.is_file()]


@pytest.mark.fast
def test_a_hub_bundle_whose_copy_is_refused_leaves_no_copy(hf_home, tiny_bundle):
    from asrforge.bundle.load import load_bundle

    snapshot = add_repo(hf_home, "me/tiny", {"": tiny_bundle})
    blob = _blob(snapshot, "config.json")
    blob.write_bytes(blob.read_bytes().replace(b"{", b" ", 1))  # same size, another sha256
    for _ in range(2):
        with pytest.raises(CheckpointCorruptError, match="does not match the manifest"):
            load_bundle("me/tiny")
        assert not [p for p in (hf_home / "asrforge").rglob("*") if p.is_file()]


@pytest.mark.fast
@pytest.mark.parametrize("fmt, says", [("ct2", "a CTranslate2 export; run it with"),
                                       ("ggml", "a whisper.cpp export (ggml-model.bin)"),
                                       ("onnx", "a 'onnx' bundle, not 'hf'")])
def test_a_hub_bundle_of_a_format_not_loaded_is_refused_before_any_byte_is_copied(
    hf_home, tiny_bundle, tmp_path, monkeypatch, fmt, says
):
    from asrforge import hub
    from asrforge.bundle.load import load_bundle
    from asrforge.bundle.write import update_bundle_manifest
    from asrforge.errors import CheckpointNotSupportedError

    pushed = tmp_path / "pushed"
    shutil.copytree(tiny_bundle, pushed)
    update_bundle_manifest(pushed, {"format": fmt})
    with pytest.raises(CheckpointNotSupportedError, match=re.escape(says)) as local:
        load_bundle(pushed)
    snapshot = add_repo(hf_home, "me/tiny", {"": pushed})
    copied, copy = [], hub._copy_exactly
    monkeypatch.setattr(hub, "_copy_exactly", lambda *a: copied.append(a[1]) or copy(*a))
    for _ in range(2):  # a later load copies nothing either
        with pytest.raises(CheckpointNotSupportedError) as refused:
            load_bundle("me/tiny")
        # the loader's own words, of the cache's snapshot (no copy of it was made)
        assert str(refused.value) == str(local.value).replace(str(pushed), str(snapshot))
        assert copied == [] and not [p for p in (hf_home / "asrforge").rglob("*") if p.is_file()]


@pytest.mark.fast
def test_materialize_refuses_a_snapshot_folder_that_is_a_link(hf_home, tmp_path):
    snapshot = _tiny_repo(hf_home)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(snapshot, elsewhere)
    shutil.rmtree(snapshot)
    snapshot.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"{snapshot}: a symlink")):
        materialize(resolve("org/tiny", field="bundle", patterns=None), _listed)


@pytest.mark.fast
@pytest.mark.parametrize("linked", ["asrforge", "asrforge/models--org--tiny", "commit"])
def test_materialize_writes_through_no_link_under_hf_home(hf_home, tmp_path, linked):
    _tiny_repo(hf_home)
    resolved = resolve("org/tiny", field="bundle", patterns=None)
    if linked == "commit":
        linked = f"asrforge/models--org--tiny/{resolved.commit}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (hf_home / linked).parent.mkdir(parents=True, exist_ok=True)
    (hf_home / linked).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(SymlinkRefused, match=re.escape(f"{hf_home / linked}: a symlink")):
        materialize(resolved, _listed)
    assert not any(elsewhere.iterdir())


@pytest.mark.fast
def test_materialize_takes_an_hf_home_that_is_itself_a_link(hf_home, tmp_path, monkeypatch):
    _tiny_repo(hf_home)
    (tmp_path / "chosen").symlink_to(hf_home, target_is_directory=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "chosen"))
    copy = materialize(resolve("org/tiny", field="bundle", patterns=None), _listed)
    assert (copy / "config.json").read_text() == "{}"


@pytest.mark.fast
@pytest.mark.parametrize("made", ["fifo", "device", "traversal", "listing"])
def test_a_cached_ref_or_listing_that_is_no_small_regular_file_is_refused_by_name(
    hf_home, made
):
    snapshot = _tiny_repo(hf_home)
    repo = snapshot.parent.parent
    path = repo / "refs" / "main"
    path.unlink()
    if made == "fifo":  # read whole, it would hang
        os.mkfifo(path)
    elif made == "device":  # read whole, it would exhaust memory
        path.symlink_to("/dev/zero")
    elif made == "traversal":  # it would name a snapshot outside the cache
        path.write_text("../../../../elsewhere")
    else:
        path.write_text(snapshot.name)
        path = repo / "trees" / f"{snapshot.name}.json"
        path.unlink()
        os.mkfifo(path)
    with pytest.raises(UserError, match=re.escape(f"model.pretrained: org/tiny: {path} in the")):
        resolve_model("org/tiny")


@pytest.mark.fast
def test_a_revision_leading_out_of_the_cache_is_refused_and_branches_stay_allowed():
    for bad in ("org/tiny@../../../dev/zero", "org/tiny@/dev/zero", "org/tiny@refs/../../x"):
        with pytest.raises(UserError, match=re.escape(f"{bad}: revision")):
            hub_ref(bad)
    with pytest.raises(UserError, match=r"data\.path: org/tiny: revision '\.\./x'"):
        hub_ref("org/tiny", "dataset", "../x", section="data")
    for good in ("refs/pr/1", "v1.0", "release..2", "a" * 40):
        assert hub_ref(f"org/tiny@{good}").revision == good
