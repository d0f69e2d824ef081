"""What a resume carries over beyond the weights: the EMA starts from the resumed weights, and
the logged loss averages the same steps as an uninterrupted run's."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from asrforge.callbacks import build_callbacks
from asrforge.callbacks.loggers import cut_metrics
from asrforge.checkpoint.manager import CheckpointManager
from asrforge.checkpoint.manifest import read_manifest, write_manifest
from asrforge.io.append import SymlinkRefused
from asrforge.run_layout import current_metrics
from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from asrforge.train.state import TrainState
from tests.conftest import tiny_config
from tests.test_resume import PreemptAt

NO_EVAL = {"eval_steps": None, "at_end": False}


def test_ema_switched_on_at_resume_starts_from_the_resumed_weights(tmp_path, tones_dir, caplog):
    out = tmp_path / "run"
    Trainer(tiny_config(out, tones_dir, train={"max_steps": 3}, eval=NO_EVAL)).fit()
    resumed = load_file(out / "checkpoints" / "step-000003" / "model.safetensors")

    cfg = tiny_config(out, tones_dir, train={"max_steps": 4, "ema_decay": 0.9999}, eval=NO_EVAL)
    caplog.set_level(logging.INFO, logger="asrforge")
    Trainer(cfg).fit(resume=True)
    assert any(
        "EMA (decay 0.9999) starts at step 3 from the resumed weights" in r.getMessage()
        for r in caplog.records
    )
    ema = load_file(out / "checkpoints" / "step-000004" / "ema.safetensors")
    # one step of decay 0.9999 away from the step-3 weights (from the initial weights, the
    # distance would be three steps of training)
    for name, shadow in ema.items():
        torch.testing.assert_close(shadow, resumed[name].float(), atol=1e-5, rtol=0)


def _train_lines(out) -> dict[int, dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x for x in lines if x["event"] == "train"}


def test_the_logged_loss_after_a_resume_is_the_uninterrupted_runs(tmp_path, tones_dir):
    sections = dict(train={"max_steps": 8, "log_every": 4}, eval=NO_EVAL)
    full_cfg = tiny_config(tmp_path / "full", tones_dir, **sections)
    Trainer(full_cfg, build_callbacks(full_cfg)).fit()

    cfg = tiny_config(tmp_path / "split", tones_dir, **sections)
    first = Trainer(cfg, [PreemptAt(6), *build_callbacks(cfg)]).fit()  # mid-window (5..8)
    assert first.status == "interrupted" and first.step == 6
    Trainer(cfg, build_callbacks(cfg)).fit(resume=True)

    full, split = _train_lines(tmp_path / "full"), _train_lines(tmp_path / "split")
    assert sorted(full) == sorted(split) == [4, 8]
    for step in (4, 8):
        for key in ("loss", "grad_norm", "skipped_steps"):
            assert split[step][key] == full[step][key], (step, key)


class Killed(BaseException):
    """Ends the process's run as ``kill -9`` would: no save, no ``train_end``."""


class KillAfterEval(Callback):
    """Raises :class:`Killed` once the evaluation of a step is logged, before its save."""

    name = "kill_after_eval"

    def __init__(self, step: int):
        self.step = step

    def on_eval_end(self, state, *, metrics, decision):
        if state.step == self.step:
            raise Killed


def test_a_resume_after_a_kill_logs_each_step_once_and_keeps_the_rest(tmp_path, tones_dir):
    out = tmp_path / "run"
    sections = dict(train={"max_steps": 8, "log_every": 1}, eval={"eval_steps": 2, "at_end": False})
    cfg = tiny_config(out, tones_dir, **sections)
    with pytest.raises(Killed):
        Trainer(cfg, [*build_callbacks(cfg), KillAfterEval(6)]).fit()
    saved = max(step for step, _ in CheckpointManager(out / "checkpoints").step_dirs())
    metrics = out / "metrics.jsonl"
    before = metrics.read_text().splitlines()
    assert saved < 6 and json.loads(before[-1]) == {**json.loads(before[-1]), "step": 6}

    Trainer(cfg, build_callbacks(cfg)).fit(resume=True)
    lines = metrics.read_text().splitlines()
    records = [json.loads(x) for x in lines]
    logged = [(r["event"], r["step"]) for r in records if r["event"] in ("train", "eval", "save")]
    assert len(set(logged)) == len(logged)
    assert [s for e, s in logged if e == "train"] == list(range(1, 9))
    assert [s for e, s in logged if e == "eval"] == [2, 4, 6, 8]
    # what was logged up to the checkpoint the run resumed from is kept as it was written
    kept = [x for x in before if json.loads(x)["step"] <= saved]
    assert lines[: len(kept)] == kept and len(kept) < len(before)
    begins = [r for r in records if r["event"] == "train_begin"]
    assert [(b["step"], b["resumed"]) for b in begins] == [(0, False), (saved, True)]


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.mark.fast
def test_a_metrics_file_is_cut_to_the_records_the_run_does_not_log_again(tmp_path, caplog):
    # an attempt resumed at step 2 by a release that did not cut, then killed mid-line at 5
    path = tmp_path / "metrics.jsonl"
    first = [{"event": "train_begin", "step": 0, "n_params": 1},
             {"event": "train", "step": 1, "loss": 3.0}, {"event": "train", "step": 2, "loss": 2.5},
             {"event": "eval", "step": 2, "wer": 0.9}, {"event": "save", "step": 2, "path": "a"},
             {"event": "train", "step": 3, "loss": 2.0}]  # fmt: skip
    second = [{"event": "train_begin", "step": 2}, {"event": "train", "step": 3, "loss": 2.1},
              {"event": "train", "step": 4, "loss": 1.8}, {"event": "eval", "step": 4, "wer": 0.7},
              {"event": "save", "step": 4, "path": "b"},
              {"event": "train", "step": 5, "loss": 1.5}]  # fmt: skip
    path.write_text(_jsonl(first) + "not json, kept\n" + _jsonl(second) + '{"event": "tra')
    begin = {"event": "train_begin", "step": 4, "resumed": True}
    with caplog.at_level(logging.INFO, logger="asrforge"):
        cut_metrics(path, begin)
    kept = first[:5] + second[:5]
    assert path.read_text() == _jsonl(first[:5]) + "not json, kept\n" + _jsonl(second[:5])
    assert f"{path}: 2 record(s) of steps this run logs again (it starts at step 4) moved " \
           "to metrics.replaced.jsonl, and a last line cut short (14 bytes) dropped" \
           in caplog.text  # fmt: skip
    # the records taken out are kept beside it, in the order they were written
    assert (tmp_path / "metrics.replaced.jsonl").read_text() == _jsonl([first[5], second[5]])
    # the readers see the same records, of the file as cut or as it was
    assert current_metrics([*kept, begin]) == [*kept, begin]
    assert current_metrics([*first, *second, begin]) == [*kept, begin]

    # a file with nothing to cut is left as it is
    inode = path.stat().st_ino
    cut_metrics(path, begin)
    assert path.stat().st_ino == inode


@pytest.mark.fast
def test_a_start_afresh_takes_out_the_evaluation_and_save_of_step_0_it_repeats(tmp_path):
    # no checkpoint survived (or --start-over): the run evaluates and saves step 0 again
    path = tmp_path / "metrics.jsonl"
    dead = [{"event": "train_begin", "step": 0, "resumed": False},
            {"event": "eval", "step": 0, "wer": 1.0}, {"event": "save", "step": 0, "path": "s"},
            {"event": "train", "step": 1, "loss": 3.0}]  # fmt: skip
    path.write_text(_jsonl(dead))
    cut_metrics(path, {"event": "train_begin", "step": 0, "resumed": False})
    assert path.read_text() == _jsonl(dead[:1])
    # the set-aside attempt's records are kept beside it
    assert (tmp_path / "metrics.replaced.jsonl").read_text() == _jsonl(dead[1:])
    # a resume from step-000000 keeps them: they are its checkpoint's
    path.write_text(_jsonl(dead))
    cut_metrics(path, {"event": "train_begin", "step": 0, "resumed": True})
    assert path.read_text() == _jsonl(dead[:3])


@pytest.mark.fast
def test_a_metrics_file_that_is_a_link_is_refused_not_cut(tmp_path):
    target = tmp_path / "elsewhere.jsonl"
    target.write_text(_jsonl([{"event": "train", "step": 5, "loss": 1.0}]))
    (tmp_path / "metrics.jsonl").symlink_to(target)
    with pytest.raises(SymlinkRefused, match="metrics.jsonl: a symlink"):
        cut_metrics(tmp_path / "metrics.jsonl", {"event": "train_begin", "step": 2})
    assert (tmp_path / "metrics.jsonl").is_symlink() and '"step": 5' in target.read_text()


OLD_SHAPES = [
    # the ids once more, flat, beside the ids by reason
    (
        {
            "step": 5,
            "dropped": {"audio file not found": ["a", "b"]},
            "dropped_utterances": ["a", "b"],
        },
        {"audio file not found": ["a", "b"]},
    ),
    # before reasons were kept: the flat ids alone, all dropped for failing to decode
    ({"step": 5, "dropped_utterances": ["a", "b", "a"]}, {"failed to decode": ["a", "b"]}),
]


@pytest.mark.fast
@pytest.mark.parametrize(("saved", "dropped"), OLD_SHAPES)
def test_an_old_state_loads_with_the_same_dropped_ids(saved, dropped):
    state = TrainState.from_dict(json.loads(json.dumps(saved)))
    assert state.step == 5 and state.dropped == dropped
    assert "dropped_utterances" not in state.to_dict()
    assert TrainState.from_dict(state.to_dict()) == state


def test_a_checkpoint_with_an_old_state_resumes(tmp_path, tones_dir, caplog):
    out = tmp_path / "run"
    Trainer(tiny_config(out, tones_dir, train={"max_steps": 3}, eval=NO_EVAL)).fit()
    ckpt = out / "checkpoints" / "step-000003"
    state = json.loads((ckpt / "train_state.json").read_text())
    recorded = state.pop("train_data")  # the old shape, resealed
    state.update(dropped={}, dropped_utterances=["ghost"])
    (ckpt / "train_state.json").write_text(json.dumps(state, indent=2) + "\n")
    manifest = read_manifest(ckpt)
    write_manifest(
        ckpt, {k: v for k, v in manifest.items() if k not in ("format_version", "files")}
    )

    with caplog.at_level(logging.INFO, logger="asrforge"):
        result = Trainer(tiny_config(out, tones_dir, train={"max_steps": 4}, eval=NO_EVAL)).fit(
            resume=True
        )
    assert result.status == "completed" and result.step == 4
    # the training data is not compared, once, and recorded from then on
    unchecked = [r for r in caplog.records if "records no fingerprint" in r.getMessage()]
    assert len(unchecked) == 1 and unchecked[0].levelno == logging.INFO
    resumed = json.loads((out / "checkpoints" / "step-000004" / "train_state.json").read_text())
    assert resumed["train_data"] == recorded
    assert resumed["dropped"] == {"failed to decode": ["ghost"]}
    assert "dropped_utterances" not in resumed
    assert json.loads((out / "skipped-train.json").read_text())["failed to decode"] == ["ghost"]


@pytest.mark.fast
def test_a_deeply_nested_metrics_line_is_kept_as_a_line_that_is_no_record(tmp_path):
    """Its parse ran out of recursion and stopped the resumed run before it began."""
    path = tmp_path / "metrics.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    dead = [{"event": "train", "step": s, "loss": 3.0} for s in (1, 2)]
    path.write_text(_jsonl(dead[:1]) + deep + "\n" + _jsonl(dead[1:]))
    cut_metrics(path, {"event": "train_begin", "step": 1, "resumed": True})
    assert path.read_text() == _jsonl(dead[:1]) + deep + "\n"
