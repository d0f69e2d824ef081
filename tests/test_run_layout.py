"""The run directory's names have one owner, ``asrforge/run_layout.py``: its places are the ones
a run writes, and no other module of asrforge spells them."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from asrforge.run_layout import (
    TRAIN_STATE_FILE,
    CheckpointsLayout,
    RunLayout,
    checkpoint_name,
    recorded_selection,
    step_dir_name,
    step_of,
)

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
OWNER = ROOT / "asrforge" / "run_layout.py"

# How a second copy of a name would be written: in a string, or as a path part of one.
SPELLINGS = {
    "the eval folder": re.compile(r"^eval/$"),
    "a step directory": re.compile(r"step-\{|step-%|step-0{6}|\"step-\*|guard-step-|longform-step-"),
    "the checkpoints folder": re.compile(r"^checkpoints$"),
    "best-unguarded": re.compile(r"^best-unguarded"),
    "latest": re.compile(r"^latest(\.txt)?$"),
    "a run's files": re.compile(r"^(train\.log|metrics\.jsonl|eval_carve\.json)$"),
    "a checkpoint's training state": re.compile(r"train_state\.json"),
}


def string_constants(path: Path) -> list[tuple[int, str]]:
    """Each string constant and f-string in ``path``'s code (docstrings left out), and
    ``/ "eval"`` written as a path (the word alone also names an event and a config section)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant | ast.JoinedStr)
    }
    # an f-string is read whole: its literal parts alone ("eval/" of f"eval/{k}") say little
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for n in ast.walk(tree):
        if id(n) in docstrings or id(n) in parts:
            continue
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            found.append((n.lineno, n.value))
        elif isinstance(n, ast.JoinedStr):
            found.append((n.lineno, ast.unparse(n)))
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            part = n.right
            if isinstance(part, ast.Constant) and part.value == "eval":
                found.append((n.lineno, "eval/"))
    return found


def test_no_module_but_the_layout_spells_a_run_directory_name():
    copies = []
    for path in sorted((ROOT / "asrforge").rglob("*.py")):
        if path == OWNER:
            continue
        for line, text in string_constants(path):
            for what, spelling in SPELLINGS.items():
                if spelling.search(text):
                    copies.append(f"{path.relative_to(ROOT)}:{line} spells {what} ({text!r})")
    assert not copies, "ask asrforge.run_layout instead:\n" + "\n".join(copies)


def test_the_check_finds_a_second_copy(tmp_path):
    """The spellings above catch the forms a copy took before the layout owned them."""
    copy = tmp_path / "copy.py"
    copy.write_text(
        '"""A docstring may say eval/step-000001.jsonl."""\n'
        'a = root / "checkpoints" / f"step-{step:06d}"\n'
        'b = out / "eval" / f"guard-step-{step:06d}.jsonl"\n'
        'c = root / "latest.txt"\n'
    )
    texts = [t for _line, t in string_constants(copy)]
    hits = {w for t in texts for w, s in SPELLINGS.items() if s.search(t)}
    assert hits == {"a step directory", "the checkpoints folder", "the eval folder", "latest"}


def test_step_names_round_trip_and_sort():
    assert step_dir_name(200) == "step-000200" and step_dir_name(1234567) == "step-1234567"
    assert step_of("step-000200") == 200 and step_of(step_dir_name(1234567)) == 1234567
    assert step_of("step-x") is None and step_of("best") is None and step_of("step-1.tmp") is None


def test_a_run_layout_names_the_places_a_run_writes(tmp_path):
    run = RunLayout(tmp_path)
    assert run.checkpoints.step(4) == tmp_path / "checkpoints" / "step-000004"
    assert run.checkpoints.best.name == "best"
    assert run.checkpoints.best_unguarded.name == "best-unguarded"
    assert run.eval_record(3) == tmp_path / "eval" / "step-000003.jsonl"
    assert run.guard_record(0) == tmp_path / "eval" / "guard-step-000000.jsonl"
    assert run.longform_record(12).name == "longform-step-000012.jsonl"
    assert (run.config.name, run.log.name, run.metrics.name) == (
        "config.yaml", "train.log", "metrics.jsonl")  # fmt: skip


def test_steps_and_latest_read_what_is_there(tmp_path):
    layout = CheckpointsLayout(tmp_path / "checkpoints")
    assert layout.steps() == [] and layout.latest() is None  # before the folder exists
    for step in (10, 2):
        layout.step(step).mkdir(parents=True)
    (layout.root / "step-000099.tmp").mkdir()
    (layout.root / "best").mkdir()
    os.symlink(layout.step(10), layout.root / "step-000050")  # a link is not a step directory
    assert layout.steps() == [(2, layout.step(2)), (10, layout.step(10))]
    layout.latest_txt.write_text("step-000002\n")
    assert layout.latest() == layout.step(2)
    os.symlink("step-000010", layout.latest_link)  # the link wins over the text file
    assert layout.latest() == layout.step(10)
    eval_dir = RunLayout(tmp_path).eval_dir
    eval_dir.mkdir()
    for name in ("step-000010.jsonl", "guard-step-000010.jsonl", "step-000002.jsonl"):
        (eval_dir / name).write_text("{}\n")
    assert [p.name for p in RunLayout(tmp_path).eval_records()] == [
        "step-000002.jsonl", "step-000010.jsonl"]  # fmt: skip


def test_a_checkpoints_recorded_selection_is_read_in_one_place(tmp_path):
    """The policy and guard start a checkpoint recorded; {} for none; a damaged record is a
    ValueError naming the file, never an AttributeError in a reader."""
    ckpt = tmp_path / "best"
    ckpt.mkdir()
    state = ckpt / TRAIN_STATE_FILE
    state.write_text('{"step": 3, "selection": {"policy": "wer", "guard": {"kind": "wer"}}}')
    assert recorded_selection(ckpt) == {"policy": "wer", "guard": {"kind": "wer"}}
    state.write_text('{"step": 3, "selection": null}')
    assert recorded_selection(ckpt) == {}
    for damaged in ('["a list"]', '{"selection": "wer"}', "{not json",
                    '{"selection": {"guard": "wer"}}', '{"selection": {"policy": 3}}'):  # fmt: skip
        state.write_text(damaged)
        with pytest.raises(ValueError):
            recorded_selection(ckpt)
    state.unlink()
    with pytest.raises(OSError):
        recorded_selection(ckpt)


def test_a_bundle_names_its_source_from_the_run_down(tmp_path, monkeypatch):
    run = tmp_path / "home" / "me" / "fleurs-sw"
    assert checkpoint_name(run / "checkpoints" / "step-000200") == "fleurs-sw/checkpoints/step-000200"
    assert checkpoint_name(run / "checkpoints" / "best") == "fleurs-sw/checkpoints/best"
    assert checkpoint_name(tmp_path / "models" / "whisper-base") == "whisper-base"
    run.mkdir(parents=True)
    monkeypatch.chdir(run)  # a relative path names the same run
    assert checkpoint_name(Path("checkpoints/best")) == "fleurs-sw/checkpoints/best"
