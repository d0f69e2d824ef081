"""Records read back from disk are type-checked field by field as a config is: a training state
whose step is a string, a selection state whose guard start is not a number, a recorded base
sha256 that is a number, a vocabulary record of the wrong kinds, a truncated pretrained
``model.safetensors``: each is one line naming the file and the field (exit code 2), never a
traceback from deep inside a resume."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from asrforge.checkpoint.manifest import write_manifest
from asrforge.cli import main
from asrforge.errors import UserError
from asrforge.selection.selector import selection_state_problems
from asrforge.train.loop import Trainer
from asrforge.train.state import TrainState
from tests.conftest import save_english_only_model, tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tones_dir) -> Path:
    """A 2-step run with a checkpoint at step 2, and the YAML it was started from."""
    root = tmp_path_factory.mktemp("records")
    cfg = tiny_config(root / "run", tones_dir, train={"max_steps": 2}, eval={"eval_steps": 2})
    (root / "run.yaml").write_text(cfg.to_yaml())
    Trainer(cfg).fit()
    return root


def resume_with(trained: Path, tmp_path: Path, edit, edit_manifest=None) -> tuple[int, Path]:
    """Resume a copy of the run after ``edit(state)`` changed its checkpoint's
    ``train_state.json`` and ``edit_manifest(meta)`` its manifest's records (the manifest
    resealed, as anyone can): (exit code, the file)."""
    out = tmp_path / "run"
    shutil.copytree(trained / "run", out, symlinks=True)
    config = tmp_path / "run.yaml"
    config.write_text((trained / "run.yaml").read_text().replace(str(trained / "run"), str(out)))
    ckpt = out / "checkpoints" / "step-000002"
    path = ckpt / "train_state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    meta = {k: v for k, v in manifest.items() if k not in ("files", "format_version")}
    if edit_manifest is not None:
        edit_manifest(meta)
        path = ckpt / "manifest.json"
    write_manifest(ckpt, meta)
    return main(["train", str(config), "--resume", "train.max_steps=4"]), path


def set_path(state: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = state
    for key in parents:
        node = node[key]
    node[last] = value


@pytest.mark.parametrize(
    "dotted, value, named",
    [
        ("step", "2", "step: '2' is not an integer >= 0"),
        ("step", -1, "step: -1 is not an integer >= 0"),
        ("epoch", 1.5, "epoch: 1.5 is not an integer >= 0"),
        ("dropped", {"x": "id-1"}, "dropped: {'x': 'id-1'} is not an object of a list"),
        ("best_step", True, "best_step: True is not an integer >= 0 or null"),
        ("selection", ["by_wer"], "selection: ['by_wer'] is not an object"),
        ("selection.n_evals", "1", "selection.n_evals: '1' is not an integer >= 0"),
        ("selection.policy_state", {"best_wer": "0.5"}, "selection.policy_state: "),
        ("selection.best_step", [2], "selection.best_step: [2] is not an integer >= 0 or null"),
    ],
)
def test_a_training_state_of_the_wrong_kinds_is_refused_by_file_and_field(
    trained, tmp_path, capsys, dotted, value, named
):
    code, path = resume_with(trained, tmp_path, lambda s: set_path(s, dotted, value))
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and f"{path}: " in err and named in err


@pytest.mark.fast
@pytest.mark.parametrize(
    "dotted, value, named",
    [
        ("best_step", "2", "checkpoint_manager.best_step: '2' is not an integer >= 0 or null"),
        ("top_k", {"wer": []}, "checkpoint_manager.top_k: {'wer': []} is not a list of"),
        ("top_k.0.entries.0.value", "0.5", "entries.0.value: '0.5' is not a number"),
        ("top_k.0.entries.0.step", None, "entries.0.step: None is not an integer >= 0"),
        ("top_k.0.mode", 1, "checkpoint_manager.top_k.0.mode: 1 is not a string"),
    ],
)
def test_the_managers_record_in_the_manifest_is_type_checked(
    trained, tmp_path, capsys, dotted, value, named
):
    def edit_manifest(meta):
        record = meta["checkpoint_manager"]
        if dotted.startswith("top_k.0") and not record.get("top_k"):
            record["top_k"] = [{"metric": "wer", "mode": "min",
                                "entries": [{"step": 2, "value": 0.5}]}]  # fmt: skip
        *parents, last = dotted.split(".")
        node = record
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value

    code, path = resume_with(trained, tmp_path, lambda s: None, edit_manifest)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and f"{path}: " in err and named in err


@pytest.mark.fast
def test_a_training_state_without_a_step_or_not_an_object_is_refused():
    with pytest.raises(ValueError, match="step: missing"):
        TrainState.from_dict({"epoch": 0})
    with pytest.raises(ValueError, match="is not an object"):
        TrainState.from_dict([1, 2])
    with pytest.raises(ValueError, match="dropped_utterances: 7 is not"):
        TrainState.from_dict({"step": 1, "dropped_utterances": 7})
    # an older checkpoint's flat list still migrates
    old = TrainState.from_dict({"step": 1, "dropped_utterances": ["a", "b"]})
    assert old.dropped == {"failed to decode": ["a", "b"]}


GUARD = {"start": 0.25, "kind": "drift", "tolerance": 0.02,
         "start_transcripts": {"u1": "hello"}, "language_starts": {"en": 0.25}}  # fmt: skip
SELECTION = {"policy": "combined_gate", "error_metric": "wer", "evals_without_save": 0,
             "n_evals": 1, "best_step": 0, "best": {"wer": 0.3}, "start": {"wer": 0.3},
             "policy_state": {"best_wer": 0.3, "best_loss": 1.2, "best_cer": None},
             "guard": GUARD, "held_out_state": None, "unguarded_step": None,
             "unguarded": {}}  # fmt: skip


@pytest.mark.fast
@pytest.mark.parametrize(
    "key, value, named",
    [
        ("start", "0.25", "selection.guard.start: '0.25' is not a number or null"),
        ("start", [0.25], "selection.guard.start: [0.25] is not a number or null"),
        ("kind", 3, "selection.guard.kind: 3 is not a string"),
        ("language_starts", {"en": "x"}, "selection.guard.language_starts: {'en': 'x'}"),
        ("start_transcripts", {"u1": 5}, "selection.guard.start_transcripts: {'u1': 5}"),
        ("lid_start", "high", "selection.guard.lid_start: 'high' is not a number or null"),
    ],
)
def test_a_guard_start_of_the_wrong_kind_is_named(key, value, named):
    assert selection_state_problems(SELECTION) == []
    state = {**SELECTION, "guard": {**GUARD, key: value}}
    assert any(p.startswith(named) for p in selection_state_problems(state)), (
        selection_state_problems(state)
    )
    missing = {**SELECTION, "guard": {k: v for k, v in GUARD.items() if k != "start"}}
    assert selection_state_problems(missing) == ["selection.guard.start: missing"]


@pytest.mark.fast
@pytest.mark.parametrize("recorded", [12345, 1.5, ["ab"], {"sha256": "x"}])
def test_a_recorded_base_sha256_that_is_not_text_is_refused_by_name(recorded):
    from asrforge.model.lora import BASE_KEY, check_base

    with pytest.raises(UserError, match=f"its manifest's {BASE_KEY} is .*, not a sha256"):
        check_base(recorded, "a" * 64, "runs/x/checkpoints/step-000002")


@pytest.mark.fast
@pytest.mark.parametrize(
    "field, value",
    [("base_tokenizer_sha256", 7), ("language", ["es"]), ("format", "1"), ("new_tokens", True)],
)
def test_a_vocabulary_record_of_the_wrong_kinds_is_refused_by_field(tmp_path, field, value):
    from asrforge.model.vocab import EXTENSION_FILE, VocabExtension

    record = {"language": "es", "base_vocab_size": 10, "vocab_size": 12, "new_tokens": 2,
              "base_tokenizer_sha256": "a" * 64, "format": 1, field: value}  # fmt: skip
    (tmp_path / EXTENSION_FILE).write_text(json.dumps(record))
    with pytest.raises(UserError, match=f"{EXTENSION_FILE}: {field} must be"):
        VocabExtension.read(tmp_path)


@pytest.mark.fast
@pytest.mark.parametrize("keep", [0.5, 0.01, 8])
def test_a_truncated_pretrained_safetensors_is_one_line_naming_the_model(
    tmp_path, tones_dir, capsys, keep
):
    pretrained = save_english_only_model(tmp_path, tones_dir)
    weights = pretrained / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    cfg = tiny_config(tmp_path / "run", tones_dir, model={"pretrained": str(pretrained)},
                      data={"language": "en"}, train={"max_steps": 1})  # fmt: skip
    (tmp_path / "c.yaml").write_text(cfg.to_yaml())
    assert main(["train", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"model.pretrained: cannot load {pretrained}" in err


@pytest.fixture(scope="module")
def stopping_run(tmp_path_factory, tones_dir) -> Path:
    """A 2-step run with an early-stopping callback, whose state callbacks.json holds."""
    root = tmp_path_factory.mktemp("callbacks-state")
    cfg = tiny_config(root / "run", tones_dir, train={"max_steps": 2}, eval={"eval_steps": 2},
                      callbacks=[{"name": "early_stopping", "monitor": "loss", "patience": 5}])  # fmt: skip
    (root / "run.yaml").write_text(cfg.to_yaml())
    assert main(["train", str(root / "run.yaml")]) == 0
    return root


@pytest.mark.parametrize(
    "states, named",
    [
        ([], "[] is not an object"),
        ({"early_stopping": "patience"}, "early_stopping: 'patience' is not an object"),
        ({"early_stopping": {"best": "0.5", "bad_evals": 0}}, "best: '0.5' is not a number"),
        ({"early_stopping": {"best": 0.5, "bad_evals": "x"}}, "bad_evals: 'x' is not an integer"),
    ],
)
def test_a_callbacks_state_of_the_wrong_kinds_is_refused_by_key(
    stopping_run, tmp_path, capsys, states, named
):
    ckpt = "checkpoints/step-000002"
    assert "early_stopping" in json.loads(
        (stopping_run / "run" / ckpt / "callbacks.json").read_text()
    )

    def edit_manifest(meta):
        (tmp_path / "run" / ckpt / "callbacks.json").write_text(json.dumps(states))

    code, _ = resume_with(stopping_run, tmp_path, lambda s: None, edit_manifest)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    path = tmp_path / "run" / ckpt / "callbacks.json"
    assert "Traceback" not in err and f"{path}: " in err and named in err


@pytest.mark.fast
@pytest.mark.parametrize(
    "name, summary, named",
    [
        ("DONE", {"duration_s": "12 s", "attempts": 1}, "duration_s: '12 s' is not a number"),
        ("DONE", {"best": [0.3], "step": 4}, "best: [0.3] is not an object or null"),
        ("FAILED", {"log_tail": ["a"], "reason": "x"}, "log_tail: ['a'] is not a string"),
        ("DONE", ["done"], "['done'] is not an object"),
    ],
)
def test_a_result_marker_of_the_wrong_kinds_is_named_by_the_launcher_and_the_report(
    tmp_path, capsys, caplog, name, summary, named
):
    from asrforge.matrix.claims import read_marker

    run_dir = tmp_path / "root" / "runs" / "en-a-s0"
    run_dir.mkdir(parents=True)
    (run_dir / name).write_text(json.dumps(summary))
    with pytest.raises(UserError, match=re.escape(f"{name}: ") + ".*" + re.escape(named)):
        read_marker(run_dir)
    # the report shows the run as unreadable, naming the field, and the rest as ever
    assert main(["report", str(tmp_path / "root"), "--out", str(tmp_path / "r.html")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert str(run_dir / name) in caplog.text and named in caplog.text
    assert "st-unreadable" in (tmp_path / "r.html").read_text()
    (run_dir / name).write_text(json.dumps({"duration_s": 3.5, "attempts": 1, "best": None}))
    assert read_marker(run_dir)[1]["duration_s"] == 3.5
