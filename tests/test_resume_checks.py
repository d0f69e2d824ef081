"""What ``--resume`` refuses before it changes anything: a config that no longer fits the
checkpoint (issue 12 item 18), a run whose every checkpoint is damaged (item 19), and training
data other than the checkpoint's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from asrforge.checkpoint.manifest import read_manifest, verify, write_manifest
from asrforge.cli import main
from asrforge.config import OptimConfig, load_config
from asrforge.data.dataset import epoch_batches
from asrforge.data.ids import keys_digest
from asrforge.errors import CheckpointCorruptError
from asrforge.train.loop import Trainer
from asrforge.train.optim import build_optimizer, build_scheduler, follow_config, lr_factor
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tones_dir) -> Path:
    """A 3-step run with its checkpoint at step 3, and the YAML it was started from."""
    root = tmp_path_factory.mktemp("resume-checks")
    cfg = tiny_config(root / "run", tones_dir, train={"max_steps": 3}, eval={"eval_steps": 3})
    (root / "run.yaml").write_text(cfg.to_yaml())
    Trainer(cfg).fit()
    return root


@pytest.fixture
def run(trained, tmp_path) -> tuple[Path, Path]:
    """(a private copy of the run directory, its config file)."""
    out = tmp_path / "run"
    shutil.copytree(trained / "run", out, symlinks=True)
    yaml_text = (trained / "run.yaml").read_text().replace(str(trained / "run"), str(out))
    (tmp_path / "run.yaml").write_text(yaml_text)
    return out, tmp_path / "run.yaml"


def _snapshot(out: Path) -> dict[str, bytes]:
    """Every file under the run directory but its log, by path."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != "train.log"
    }


def test_a_shape_or_tokenizer_change_is_refused_listing_every_field(run, capsys):
    out, config = run
    before = _snapshot(out)
    code = main(["train", str(config), "--resume", "model.d_model=64", "model.bpe_vocab_size=400"])
    err = capsys.readouterr().err
    assert code == 2
    assert "model.d_model: 32 -> 64" in err and "model.bpe_vocab_size: 300 -> 400" in err
    assert "Traceback" not in err
    assert _snapshot(out) == before  # config.yaml included: nothing was rewritten


def test_allowed_changes_are_logged_and_the_run_continues(run, capsys):
    out, config = run
    code = main(["train", str(config), "--resume", "train.max_steps=4", "optim.lr=0.002"])
    err = capsys.readouterr().err
    assert code == 0
    assert "resume: config changed since step-000003" in err
    assert "optim.lr: 0.003 -> 0.002" in err and "train.max_steps: 3 -> 4" in err
    assert "vocab_size" not in err  # resolved when the model was built, not changed by the user
    assert verify(out / "checkpoints" / "step-000004")["step"] == 4
    assert "max_steps: 4" in (out / "config.yaml").read_text()


def _damage(step_dir: Path) -> None:
    weights = step_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))


def test_resume_with_every_checkpoint_damaged_is_refused_unless_starting_over(run, capsys):
    out, config = run
    ckpts = out / "checkpoints"
    steps = sorted(p.name for p in ckpts.glob("step-*"))
    for name in steps:
        _damage(ckpts / name)
    before = _snapshot(out)

    assert main(["train", str(config), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"none of the {len(steps)} checkpoint(s)" in err and "--start-over" in err
    assert "model.safetensors: sha256" in err
    assert _snapshot(out) == before  # the damaged checkpoints are all still there, untouched

    assert main(["train", str(config), "--resume", "--start-over"]) == 0
    err = capsys.readouterr().err
    (aside,) = out.glob("checkpoints.damaged-*")
    assert str(aside) in err
    assert sorted(p.name for p in aside.glob("step-*")) == steps
    for name in steps:  # kept as they were, damage included
        assert (aside / name / "model.safetensors").read_bytes() == before[
            f"checkpoints/{name}/model.safetensors"
        ]
        with pytest.raises(CheckpointCorruptError):
            verify(aside / name)
    assert verify(ckpts / "step-000003")["step"] == 3  # trained again from step 0


def _write_corpus(root: Path, clips: list[dict]) -> Path:
    """The ``clips`` fixture's rows as ``train.jsonl`` and ``validation.jsonl`` beside them."""
    for split in ("train", "validation"):
        rows = [{"audio": c["file"], "text": c["text"], "language": c["language"]}
                for c in clips if c["split"] == split]  # fmt: skip
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_a_resume_on_other_training_data_is_refused_naming_what_changed(tmp_path, clips, capsys):
    corpus = _write_corpus(tmp_path / "corpus", clips)
    out, config = tmp_path / "run", tmp_path / "run.yaml"
    no_eval = {"eval_steps": None, "at_end": False}
    config.write_text(tiny_config(out, corpus, train={"max_steps": 2}, eval=no_eval).to_yaml())
    assert main(["train", str(config)]) == 0
    capsys.readouterr()
    train = corpus / "train.jsonl"
    lines = train.read_text().splitlines(keepends=True)
    before = _snapshot(out)
    for edited, changed in (
        (lines[::-1], f"the same count ({len(lines)}), but other utterances, another order"),
        (lines[::-1][:-10], f"{len(lines)} usable utterance(s) then, {len(lines) - 10} now"),
    ):
        train.write_text("".join(edited))
        assert main(["train", str(config), "--resume", "train.max_steps=3"]) == 2
        err = capsys.readouterr().err
        assert changed in err, err
        assert f"checkpoint {out / 'checkpoints' / 'step-000002'}" in err and "output_dir" in err
        assert "Traceback" not in err
        assert _snapshot(out) == before
    # the same data staged elsewhere (other absolute paths, the same files) resumes
    moved = tmp_path / "moved"
    moved.mkdir()
    rows = [json.loads(line) for line in lines]
    for row in rows:
        row["audio"] = str(Path(shutil.copy(Path(corpus, row["audio"]), moved)).resolve())
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", str(config), "--resume", "train.max_steps=3"]) == 0
    assert verify(out / "checkpoints" / "step-000003")["step"] == 3


def test_a_transcript_edited_under_its_id_is_refused_and_an_older_record_still_resumes(
    tmp_path, clips, capsys
):
    corpus = tmp_path / "corpus"
    _write_corpus(corpus, clips)
    train = corpus / "train.jsonl"
    rows = [{**json.loads(line), "id": f"u{i}"} for i, line in enumerate(train.open())]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, config = tmp_path / "run", tmp_path / "run.yaml"
    no_eval = {"eval_steps": None, "at_end": False}
    config.write_text(tiny_config(out, corpus, train={"max_steps": 2}, eval=no_eval).to_yaml())
    assert main(["train", str(config)]) == 0
    capsys.readouterr()
    edited = [*rows[:5], {**rows[5], "text": rows[5]["text"] + " again"}, *rows[6:]]
    train.write_text("".join(json.dumps(r) + "\n" for r in edited))
    before = _snapshot(out)
    assert main(["train", str(config), "--resume", "train.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert f"the same count ({len(rows)}), but other utterances, another order or other " \
           "transcripts (by id and text, else audio file name and text)" in err, err  # fmt: skip
    assert "Traceback" not in err and _snapshot(out) == before

    # a checkpoint of a release that digested the ids alone is compared the old way
    ckpt = out / "checkpoints" / "step-000002"
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["train_data"]["keys"] == 2
    state["train_data"] = {"utterances": len(rows), "sha256": keys_digest(r["id"] for r in rows)}
    (ckpt / "train_state.json").write_text(json.dumps(state, indent=2) + "\n")
    manifest = read_manifest(ckpt)
    write_manifest(
        ckpt, {k: v for k, v in manifest.items() if k not in ("format_version", "files")}
    )
    assert main(["train", str(config), "--resume", "train.max_steps=3"]) == 0
    # and the next checkpoint records the digest of ids and texts
    resumed = json.loads((out / "checkpoints" / "step-000003" / "train_state.json").read_text())
    assert resumed["train_data"]["keys"] == 2
    assert resumed["train_data"]["sha256"] != keys_digest(r["id"] for r in rows)

    # keys a newer release made are refused by name, not compared
    ckpt = out / "checkpoints" / "step-000003"
    resumed["train_data"]["keys"] = 99
    (ckpt / "train_state.json").write_text(json.dumps(resumed, indent=2) + "\n")
    manifest = read_manifest(ckpt)
    write_manifest(
        ckpt, {k: v for k, v in manifest.items() if k not in ("format_version", "files")}
    )
    capsys.readouterr()
    before = _snapshot(out)
    assert main(["train", str(config), "--resume", "train.max_steps=4"]) == 2
    err = capsys.readouterr().err
    assert "made from keys 99, which this asrforge does not know" in err, err
    assert "Traceback" not in err and _snapshot(out) == before


def test_another_batch_size_continues_the_epoch_after_its_taken_utterances_or_is_refused(
    run, capsys
):
    out, config = run  # stopped at step 3: 3 batches of 8 of epoch 0's 48 utterances taken
    before = _snapshot(out)
    assert main(["train", str(config), "--resume", "data.batch_size=16"]) == 2
    err = capsys.readouterr().err
    assert "data.batch_size 8 -> 16 mid-epoch" in err and "first 24 item(s) of epoch 0" in err
    assert "data.batch_size=8, or with one that divides 24 (12 or 24)" in err
    assert "Traceback" not in err
    # a size larger than every divisor of the items taken: only those below it are named
    assert main(["train", str(config), "--resume", "data.batch_size=32"]) == 2
    err = capsys.readouterr().err
    assert "one that divides 24 (24)" in err and "Traceback" not in err
    assert _snapshot(out) == before

    assert main(["train", str(config), "--resume", "data.batch_size=12", "train.max_steps=4"]) == 0
    assert "at step 3 (epoch 0, batch 2)" in (out / "train.log").read_text()
    # the epoch's order is the batch size's cut of one permutation: 2 batches of 12 are the 24
    # utterances 3 batches of 8 took, and the ones after them are the rest, each once
    taken = [i for b in epoch_batches(48, 8, seed=0, epoch=0)[:3] for i in b]
    assert taken == [i for b in epoch_batches(48, 12, seed=0, epoch=0)[:2] for i in b]
    rest = [i for b in epoch_batches(48, 12, seed=0, epoch=0)[2:] for i in b]
    assert sorted(taken + rest) == list(range(48))


def test_a_new_learning_rate_and_schedule_apply_from_the_resumed_step(run):
    out, config = run  # lr 3e-3, 2 warmup steps, cosine to 0 at step 3
    changes = ["optim.lr=0.001", "optim.schedule=linear", "optim.warmup_steps=0",
               "optim.min_lr_ratio=0.5", "optim.embedding_lr_scale=2", "train.max_steps=5",
               "train.log_every=1"]  # fmt: skip
    assert main(["train", str(config), "--resume", *changes]) == 0
    new = load_config(config, overrides=changes)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r for r in records if r["event"] == "train"}
    for step in (4, 5):  # a step's record holds the learning rate the next step takes
        peak = 0.001 * lr_factor(step, new.optim, 5)
        assert lrs[step]["lr/decay"] == pytest.approx(peak)
        assert lrs[step]["lr/embeddings"] == pytest.approx(2 * peak)


@pytest.mark.fast
def test_a_resumed_optimizer_takes_the_new_settings_and_keeps_unchanged_ones_exactly():
    model = torch.nn.Linear(2, 2)  # a weight (decayed) and a bias
    old = OptimConfig(lr=3e-3, warmup_steps=2)
    new = OptimConfig(lr=1e-3, schedule="constant", weight_decay=0.1, betas=(0.8, 0.9))
    optimizer = build_optimizer(model, old)
    scheduler = build_scheduler(optimizer, old, 10)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    saved = [g["lr"] for g in optimizer.param_groups]
    follow_config(optimizer, scheduler, old)
    assert [g["lr"] for g in optimizer.param_groups] == saved  # bit for bit

    resumed = build_optimizer(model, new)
    schedule = build_scheduler(resumed, new, 10)
    resumed.load_state_dict(optimizer.state_dict())
    schedule.load_state_dict(scheduler.state_dict())
    follow_config(resumed, schedule, new)
    decay = next(g for g in resumed.param_groups if g["name"] == "decay")
    assert (decay["lr"], decay["weight_decay"], tuple(decay["betas"])) == (1e-3, 0.1, (0.8, 0.9))
    schedule.step()
    assert schedule.get_last_lr() == [1e-3, 1e-3]


def test_a_max_steps_below_the_checkpoints_step_is_refused_and_equal_to_it_ends_the_run(
    run, capsys
):
    out, config = run  # its checkpoint is at step 3
    before = _snapshot(out)
    assert main(["train", str(config), "--resume", "train.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "train.max_steps is 2, below step 3 of the checkpoint" in err
    assert "Traceback" not in err and _snapshot(out) == before

    assert main(["train", str(config), "--resume", "train.max_steps=3"]) == 0
    assert "completed at step 3" in capsys.readouterr().out
    assert verify(out / "checkpoints" / "step-000003")["step"] == 3
    assert (out / "checkpoints" / "best").is_dir()


def test_another_seed_is_refused_since_the_data_order_is_drawn_from_it(run, capsys):
    out, config = run  # stopped mid-epoch: 3 batches of 8 of epoch 0's 48 utterances taken
    before = _snapshot(out)
    assert main(["train", str(config), "--resume", "seed=5"]) == 2
    err = capsys.readouterr().err
    assert "seed: 0 -> 5 (each epoch's order and packing" in err
    assert "another would repeat some utterances and skip others" in err
    assert "Traceback" not in err and _snapshot(out) == before


def test_a_damaged_checkpoint_a_resume_passed_by_is_kept_when_its_step_is_saved_again(
    tmp_path, tones_dir, capsys
):
    cfg = tiny_config(
        tmp_path / "run", tones_dir, train={"max_steps": 4}, eval={"eval_steps": None},
        checkpoint={"checkpoint_every": 2, "save_total_limit": None},
    )  # fmt: skip
    (tmp_path / "run.yaml").write_text(cfg.to_yaml())
    Trainer(cfg).fit()
    ckpts = tmp_path / "run" / "checkpoints"
    _damage(ckpts / "step-000004")
    damaged = (ckpts / "step-000004" / "model.safetensors").read_bytes()
    capsys.readouterr()

    assert main(["train", str(tmp_path / "run.yaml"), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "step-000002 at step 2" in err
    (aside,) = ckpts.glob("step-000004.damaged-*")
    assert "step-000004 does not verify" in err and f"kept as {aside.name}" in err
    assert (aside / "model.safetensors").read_bytes() == damaged
    assert verify(ckpts / "step-000004")["step"] == 4  # saved anew beside it


def test_start_over_on_a_run_that_verifies_says_it_is_only_for_damaged_checkpoints(run, capsys):
    out, config = run
    before = _snapshot(out)
    assert main(["train", str(config), "--start-over"]) == 2
    err = capsys.readouterr().err
    assert "--start-over applies only when none of the checkpoints verifies; step-000003 does" in err
    assert "pass --resume to continue that run" in err
    assert "Traceback" not in err and _snapshot(out) == before


@pytest.mark.fast
@pytest.mark.parametrize(
    "epoch, into, max_epochs, refused",
    [(2, 0, 2, False), (2, 0, 1, True), (2, 5, 2, True), (2, 5, 3, False), (0, 3, None, False)],
)  # fmt: skip
def test_a_max_epochs_the_checkpoint_trained_past_is_refused(epoch, into, max_epochs, refused):
    from types import SimpleNamespace

    from asrforge.checkpoint.resume import check_resume_epochs
    from asrforge.errors import UserError

    ckpt = SimpleNamespace(path="step-000040", train_state={"epoch": epoch, "batch_in_epoch": into})
    if not refused:
        check_resume_epochs(ckpt, max_epochs)
        return
    with pytest.raises(UserError, match=rf"train.max_epochs is {max_epochs}, below the \d epoch"):
        check_resume_epochs(ckpt, max_epochs)
