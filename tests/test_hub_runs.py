"""Runs that start from a model and a data set named by Hub id (``model.pretrained: org/tiny``,
``data.path: org/speech`` + ``data.subset``), offline from a cache this test builds: they train
whole and streamed, record the commit of each in ``hub_commits.json`` and every checkpoint, resume
bit for bit, and refuse a resume after the branch moved unless the config names a commit."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter

import pytest

import asrforge.hub as hub_module
from asrforge.checkpoint.manifest import MANIFEST_NAME, read_manifest, write_manifest
from asrforge.errors import CheckpointCorruptError, UserError
from tests.conftest import tiny_config
from tests.hub_cache import add_repo
from tests.test_hub_data import repo_files  # noqa: F401 - a fixture
from tests.test_hub_models import tiny_model  # noqa: F401 - a fixture
from tests.test_resume import PreemptAt, run

OLD, NEW = "a" * 40, "b" * 40


@pytest.fixture
def hub(hf_home, repo_files, tiny_model):  # noqa: F811
    """``org/tiny`` at commit OLD and ``org/speech`` in the cache."""
    add_repo(hf_home, "org/tiny", {"": tiny_model}, commit=OLD)
    add_repo(hf_home, "org/speech", repo_files, repo_type="dataset", commit="c" * 40)
    return hf_home


def hub_config(out, **sections):
    data = {"path": "org/speech", "subset": "all", **sections.pop("data", {})}
    model = {"pretrained": "org/tiny", **sections.pop("model", {})}
    return tiny_config(out, "unused", model=model, data=data, **sections)


def test_a_run_trains_whole_from_hub_ids_and_records_their_commits(hub, tmp_path):
    _losses, result = run(hub_config(tmp_path / "run", train={"max_steps": 2}), [])
    assert result.status == "completed"
    commits = json.loads((tmp_path / "run" / "hub_commits.json").read_text())
    assert commits == {
        "model.pretrained": {"id": "org/tiny", "revision": None, "commit": OLD},
        "data.path": {"id": "org/speech", "revision": None, "commit": "c" * 40},
    }
    assert read_manifest(tmp_path / "run/checkpoints/latest")["hub_commits"] == commits
    assert result.last_metrics["n"] == 12  # the configuration's validation split


def test_a_run_start_asks_for_each_hub_request_once_and_reads_one_commit(
    hub, tmp_path, monkeypatch
):
    asked: Counter = Counter()
    snapshot = hub_module._snapshot

    def moving_main(ref, field, patterns, *where, commit=None):
        asked[(str(ref), patterns)] += 1
        path = snapshot(ref, field, patterns, *where, commit=commit)
        if ref.repo_id == "org/tiny" and sum(asked.values()) == 1:
            # main moves on once the start-up has read the model's files the first time
            add_repo(hub, "org/tiny", {"": tiny_model_dir(hub), "note.txt": "v2"}, commit=NEW)
        return path

    monkeypatch.setattr(hub_module, "_snapshot", moving_main)
    _losses, result = run(hub_config(tmp_path / "run", train={"max_steps": 2}), [])
    assert result.status == "completed"
    assert max(asked.values()) == 1, asked
    commits = json.loads((tmp_path / "run" / "hub_commits.json").read_text())
    assert commits["model.pretrained"]["commit"] == OLD  # the files the run read


def test_a_streamed_hub_run_resumes_bit_identically_and_refuses_a_moved_branch(hub, tmp_path):
    sections = dict(
        data={"stream": {"enabled": True, "shuffle_shards": 2}},
        model={"dropout": 0.1},
        eval={"eval_steps": None, "at_end": False},
        train={"max_steps": 4, "grad_accum": 4}, checkpoint={"save_total_limit": 5},
    )  # fmt: skip
    full, _ = run(hub_config(tmp_path / "full", **sections), [])
    cfg = hub_config(tmp_path / "split", **sections)
    first, interrupted = run(cfg, [PreemptAt(2)])
    assert interrupted.status == "interrupted"

    # main moves on: the resume is refused by name, nothing written
    add_repo(hub, "org/tiny", {"": tiny_model_dir(hub), "note.txt": "v2"}, commit=NEW)
    with pytest.raises(UserError, match=rf"model.pretrained org/tiny is at commit {NEW} now, "
                                        rf"the checkpoint was trained from {OLD}"):  # fmt: skip
        run(cfg, [], resume=True)

    # pinned to the commit it started from, it resumes exactly
    pinned = hub_config(
        tmp_path / "split", **{**sections, "model": {"dropout": 0.1, "pretrained": f"org/tiny@{OLD}"}}
    )  # fmt: skip
    second, result = run(pinned, [], resume=True)
    assert result.status == "completed"
    assert {**first, **second} == full  # per-step losses, exactly


def tiny_model_dir(home):
    return home / "hub" / "models--org--tiny" / "snapshots" / OLD


@pytest.fixture
def trained(hub, tmp_path):
    """A finished run from Hub ids, evaluated at its last step (2)."""
    cfg = hub_config(tmp_path / "run", train={"max_steps": 2}, eval={"eval_steps": 2})
    run(cfg, [])
    return tmp_path / "run"


def test_the_bundle_card_loads_in_huggingface_hub_with_the_wer_evaluate_prints(trained, tmp_path):
    from huggingface_hub import ModelCard

    from asrforge.bundle.export import export_bundle
    from asrforge.bundle.load import load_bundle
    from asrforge.config import DataConfig
    from asrforge.evaluation.evaluate import evaluate_split

    bundle = export_bundle(trained, tmp_path / "bundle", repo_id="me/tiny-tones")
    card = ModelCard.load(bundle / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "org/tiny" and data["datasets"] == ["org/speech"]
    assert data["pipeline_tag"] == "automatic-speech-recognition"
    assert OLD in card.text and "me/tiny-tones" in card.text
    results = {r["dataset"]["args"]["language"]: r for r in data["model-index"][0]["results"]}
    assert set(results) == {"en", "es"}
    assert results["en"]["dataset"] == {"name": "org/speech (en)", "type": "org/speech",
                                        "split": "validation", "config": "en",
                                        "revision": "c" * 40, "args": {"language": "en"}}  # fmt: skip
    loaded = load_bundle(bundle)  # the card is one of the files the manifest verifies
    metrics, _preds, _report = evaluate_split(
        loaded,
        DataConfig(path="org/speech", subset="all"),
        "validation",
        batch_size=8,
        max_new_tokens=8,
    )
    for lang, r in results.items():
        wer = next(m["value"] for m in r["metrics"] if m["type"] == "wer")
        assert wer == pytest.approx(100 * metrics["per_language"][lang]["wer"], abs=1e-3)


def test_export_push_to_hub_dry_run_lists_the_verified_files(trained, tmp_path, capsys):
    # An upload needs the Hub itself; its dry run proves what would be sent, and the card.
    from asrforge.cli import main

    out = tmp_path / "bundle"
    argv = ["export", str(trained), "--out", str(out), "--push-to-hub", "me/tiny", "--dry-run"]
    assert main(argv) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]
    listed = said.split(": ", 1)[1].split(", ")
    assert said.startswith("would upload ") and "/me/tiny" in said
    assert "README.md" in listed and "manifest.json" in listed and "model.safetensors" in listed
    assert sorted(p.name for p in out.iterdir()) == sorted(listed)


def test_a_bundle_loads_from_its_hub_id_with_every_file_verified(trained, hub, tmp_path):
    from asrforge.bundle.export import export_bundle
    from asrforge.bundle.load import load_bundle
    from asrforge.errors import CheckpointCorruptError

    bundle = export_bundle(trained, tmp_path / "bundle", repo_id="me/tiny")
    add_repo(hub, "me/tiny", {"": bundle, ".gitattributes": "*.safetensors filter=lfs\n"})
    loaded = load_bundle("me/tiny")
    assert (
        loaded.config.languages
        == json.loads((bundle / "inference_config.json").read_text())["languages"]
    )
    # a blob changed in the cache under another commit: refused, naming the file
    changed = {"": bundle, "tokenizer.json": (bundle / "tokenizer.json").read_text() + " "}
    add_repo(hub, "me/tiny", changed, commit="d" * 40)
    with pytest.raises(CheckpointCorruptError, match="tokenizer.json"):
        load_bundle("me/tiny")


def test_export_rebuilds_from_the_commit_the_run_started_from_after_main_moved(
    trained, hub, tmp_path
):
    from asrforge.bundle.export import export_bundle

    # main now holds a model of another shape: unpinned, export would refuse it as changed
    moved = tmp_path / "moved"
    shutil.copytree(tiny_model_dir(hub), moved)
    config = json.loads((moved / "config.json").read_text())
    config["encoder_attention_heads"] = 4 if config["encoder_attention_heads"] != 4 else 2
    (moved / "config.json").write_text(json.dumps(config))
    add_repo(hub, "org/tiny", {"": moved}, commit=NEW)
    bundle = export_bundle(trained, tmp_path / "bundle")
    exported = json.loads((bundle / "config.json").read_text())
    trained_with = json.loads((tiny_model_dir(hub) / "config.json").read_text())
    assert exported["encoder_attention_heads"] == trained_with["encoder_attention_heads"]


def test_the_card_states_each_language_s_recorded_figures_as_percent(trained):
    from huggingface_hub import ModelCard

    from asrforge.bundle.card import model_card
    from asrforge.bundle.contents import read_run_config

    ckpt = trained / "checkpoints" / "latest"
    step = read_manifest(ckpt)["step"]
    record = trained / "eval" / f"step-{step:06d}.jsonl"
    lines = record.read_text().splitlines()
    summary = json.loads(lines[-1])
    summary["per_language"] = {"en": {"wer": 0.25, "cer": 0.125, "n": 6},
                               "es": {"wer": 0.5, "cer": None, "n": 6}}  # fmt: skip
    record.write_text("\n".join([*lines[:-1], json.dumps(summary)]) + "\n")
    card = ModelCard(model_card(ckpt, read_run_config(ckpt), ["en", "es"], "me/x", {"step": step}))
    metrics = {m["name"]: m["value"] for r in card.data.to_dict()["model-index"][0]["results"]
               for m in r["metrics"]}  # fmt: skip
    assert metrics == {"WER (en)": 25.0, "CER (en)": 12.5, "WER (es)": 50.0}
    assert "| en | 25 | 12.5 | 6 |" in card.text


@pytest.mark.parametrize("answer", ["refused", "unreachable"])
def test_a_push_the_hub_refuses_or_cannot_take_is_one_line_exit_2(
    trained, tmp_path, capsys, monkeypatch, answer
):
    # A stand-in endpoint on 127.0.0.1 that refuses without a token, or a port nothing
    # listens on: the upload's failures, never the Hub itself.
    from asrforge.cli import main
    from tests.hub_cache import hub_answering

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    out = tmp_path / "bundle"
    argv = ["export", str(trained), "--out", str(out), "--push-to-hub", "me/tiny"]
    if answer == "refused":
        with hub_answering(401, "RepoNotFound", "Invalid credentials") as url:
            monkeypatch.setenv("HF_ENDPOINT", url)
            assert main(argv) == 2
        expected = "the Hub refused: "
    else:
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
        assert main(argv) == 1  # the network failed, not the input
        expected = "nothing was uploaded: "
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and expected in errors[0] and "--push-to-hub me/tiny" in errors[0]
    if answer == "refused":
        assert "HF_TOKEN" in errors[0]
    else:
        assert f"upload it again with `asrforge export {out} --push-to-hub me/tiny`" in errors[0]
    assert (out / "manifest.json").is_file()  # the bundle itself is written and kept


@pytest.mark.parametrize(
    ("repo", "offline", "expected"),
    [
        ("not a repo id", "0", "--push-to-hub 'not a repo id': not a Hub repository id (org/name)"),
        ("me/tiny", "1", "--push-to-hub me/tiny: HF_HUB_OFFLINE is set, so nothing can be uploaded"),
    ],
)  # fmt: skip
def test_a_push_that_cannot_happen_is_refused_before_the_bundle_is_written(
    trained, tmp_path, capsys, monkeypatch, repo, offline, expected
):
    from asrforge.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    out = tmp_path / "bundle"
    assert main(["export", str(trained), "--out", str(out), "--push-to-hub", repo]) == 2
    assert expected in capsys.readouterr().err
    assert not out.exists()


def test_a_bundle_written_earlier_is_pushed_as_it_is(trained, tmp_path, capsys):
    from asrforge.bundle.export import export_bundle
    from asrforge.cli import main

    bundle = export_bundle(trained, tmp_path / "bundle")
    before = {p.name: p.read_bytes() for p in bundle.iterdir()}
    argv = ["export", str(bundle), "--push-to-hub", "me/tiny", "--dry-run"]
    assert main(argv) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert said.startswith(f"would upload {len(before)} files to ") and "README.md" in said
    assert {p.name: p.read_bytes() for p in bundle.iterdir()} == before
    # options that would rewrite it are refused, naming them
    assert main([*argv, "--out", str(tmp_path / "other"), "--weights", "raw"]) == 2
    assert "a bundle is uploaded as it is: --out, --weights do not apply" in capsys.readouterr().err
    # without --push-to-hub, the refusal says how to upload it
    assert main(["export", str(bundle), "--out", str(tmp_path / "again")]) == 2
    assert f"`asrforge export {bundle} --push-to-hub ORG/NAME`" in capsys.readouterr().err


def test_export_takes_a_hub_model_id_as_train_does(hub, tmp_path):
    from asrforge.cli import main

    out = tmp_path / "bundle"
    assert main(["export", "org/tiny", "--out", str(out)]) == 0
    info = json.loads((out / "inference_config.json").read_text())
    assert info["config_id"] == "tiny"
    # the source named as the Hub names it, at its commit; never the cache's directory
    assert info["source"]["pretrained"] == "org/tiny" and info["source"]["revision"] is None
    assert re.fullmatch(r"[0-9a-f]{40}", info["source"]["commit"])
    assert str(tmp_path) not in (out / "inference_config.json").read_text()
    assert main(["export", "org/absent", "--out", str(tmp_path / "absent")]) == 2


def test_export_reads_the_license_of_the_commit_trained_from_and_asks_the_hub_nothing(
    trained, hub, tmp_path, monkeypatch
):
    from huggingface_hub import ModelCard

    from asrforge.bundle.export import export_bundle
    from tests.hub_cache import hub_answering

    # the commit the run trained from says apache-2.0; main has moved to one that says mit
    add_repo(hub, "org/tiny", {"README.md": "---\nlicense: apache-2.0\n---\n"}, commit=OLD,
             ref="trained")  # fmt: skip
    moved = {"": tiny_model_dir(hub), "README.md": "---\nlicense: mit\n---\n"}
    add_repo(hub, "org/tiny", moved, commit=NEW)
    # online, with an endpoint that records every request and answers none
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    seen: list[str] = []
    with hub_answering(404, "RepoNotFound", seen=seen) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        bundle = export_bundle(trained, tmp_path / "bundle")
    assert seen == []
    assert ModelCard.load(bundle / "README.md").data.to_dict()["license"] == "apache-2.0"


def test_the_card_names_the_policy_that_decided_and_the_starting_model_s_figures(trained, tmp_path):
    from huggingface_hub import ModelCard

    from asrforge.bundle.export import export_bundle

    bundle = export_bundle(trained, tmp_path / "tiny-es")
    card = ModelCard.load(bundle / "README.md")
    assert card.data.to_dict()["model-index"][0]["name"] == "tiny-es"  # not pushed: its directory
    assert card.text.lstrip().startswith("# tiny-es\n")
    state = json.loads((trained / "checkpoints/latest/train_state.json").read_text())
    assert f"selected by the `{state['selection']['policy']}` selection policy" in card.text
    assert "`auto`" not in card.text
    start = json.loads((trained / "eval/step-000000.jsonl").read_text().splitlines()[-1])
    header, _rule, *rows = [line for line in card.text.splitlines() if line.startswith("|")]
    assert header.endswith("| WER % at start | CER % at start |")
    for lang, m in start["per_language"].items():
        row = next(r for r in rows if r.startswith(f"| {lang} |"))
        assert row.split(" | ")[4] == f"{round(100 * m['wer'], 4):g}"


def test_the_card_says_a_translate_run_translates_and_an_extended_vocabulary_needs_no_pipeline(
    trained,
):
    from huggingface_hub import ModelCard

    from asrforge.bundle.card import model_card
    from asrforge.bundle.contents import read_run_config

    ckpt = trained / "checkpoints" / "latest"
    cfg = read_run_config(ckpt)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"task": "translate"})})
    step = read_manifest(ckpt)["step"]
    card = ModelCard(model_card(ckpt, cfg, ["en", "es"], None, {"step": step}, name="x",
                                extended_vocabulary=True))  # fmt: skip
    result = card.data.to_dict()["model-index"][0]["results"][0]
    assert result["task"]["name"] == "Speech Translation (into English)"
    assert "It translates speech into English text" in card.text
    assert "pipeline(" not in card.text and "batch_decode" in card.text
    assert "read them as timestamps and drop them from the text" in card.text


@pytest.mark.fast
@pytest.mark.parametrize(
    ("commits", "why"),
    [
        (
            {"model.pretrained": {"id": "org/tiny", "revision": None, "commit": "../../dev/zero"}},
            r"hub_commits\.model\.pretrained\.commit: '\.\./\.\./dev/zero' is not a commit",
        ),
        (["x"], r"hub_commits: \['x'\] is not an object"),
        ({"model.pretrained": "abc"}, r"hub_commits\.model\.pretrained: 'abc' is not an object"),
        ({"data.path": {"id": "../x", "commit": OLD}}, r"hub_commits\.data\.path\.id: '\.\./x'"),
        ({"data.path": {"id": "org/speech"}}, r"hub_commits\.data\.path\.commit: missing"),
    ],
)
def test_hub_commits_a_checkpoint_records_are_checked_when_its_manifest_is_read(
    tmp_path, commits, why
):
    """A handed checkpoint sealed again: its commits become revisions of the Hub cache."""
    ckpt = tmp_path / "step-000001"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text("{}")
    write_manifest(ckpt, {"step": 1, "hub_commits": commits})
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"{ckpt / MANIFEST_NAME}: ") + why):
        read_manifest(ckpt)
    good = {"model.pretrained": {"id": "org/tiny", "revision": "main", "commit": OLD}}
    write_manifest(ckpt, {"step": 1, "hub_commits": good})
    assert read_manifest(ckpt)["hub_commits"] == good
