"""Learning without forgetting while training: rehearsal (``data.replay``), distillation toward
the starting model (``train.distill_weight``) and L2-SP (``optim.l2sp``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from asrforge.config import GuardConfig, ReplayConfig, load_config
from asrforge.data.replay import (
    REPLAY_PREFIX,
    JoinedRows,
    ReplayUtterances,
    check_apart_from_guard,
    read_replay,
    replay_count,
    replay_picks,
)
from asrforge.errors import UserError
from asrforge.evaluation.guard_items import guard_clip_files
from asrforge.train.forgetting import StartingModel
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config
from tests.test_resume import assert_resume_is_bit_identical


def _replay_manifest(root: Path, clips: list[dict], n: int = 12) -> Path:
    """A JSONL replay set of ``n`` of the clips, its audio given as paths."""
    rows = [c for c in clips if c["split"] == "train"][:n]
    path = root / "replay.jsonl"
    path.write_text(
        "".join(
            json.dumps({"audio": c["file"], "text": c["text"], "language": c["language"]}) + "\n"
            for c in rows
        )
    )
    return path


@pytest.mark.fast
def test_replay_draws_every_row_once_before_any_twice_and_depends_on_the_seed_only():
    picks = replay_picks(5, 12, seed=3)
    assert len(picks) == 12
    assert sorted(picks[:5].tolist()) == list(range(5))
    assert sorted(picks[5:10].tolist()) == list(range(5))
    assert np.array_equal(picks, replay_picks(5, 12, seed=3))
    assert not np.array_equal(picks, replay_picks(5, 12, seed=4))
    # a share of 0.2 of the training utterances: 48 training rows take 12 replay rows
    assert replay_count(48, 0.2) == 12
    assert replay_count(1, 0.01) == 1


@pytest.mark.fast
def test_replay_utterances_follow_the_training_ones_with_their_rows_shifted():
    from asrforge.data.prepare import Utterance

    def utt(row, lang):
        return Utterance(row, f"u{row}", lang, "t", [1, 2], [3])

    train = [utt(0, "es"), utt(1, "es")]
    replay = [utt(0, "en"), utt(1, "en"), utt(2, "en")]
    joined = ReplayUtterances(train, replay, np.array([2, 0]), row_offset=10)
    assert len(joined) == 4 and joined.first_replay == 2
    assert joined[1] is train[1]
    assert (joined[2].row, joined[2].uid, joined[2].language) == (12, REPLAY_PREFIX + "u2", "en")
    assert [u.row for u in joined[-2:]] == [12, 10]
    rows = JoinedRows(list("ab"), list("xyz"))
    assert len(rows) == 5 and rows[1] == "b" and rows[2] == "x" and rows[4] == "z"


@pytest.mark.fast
def test_replay_config_is_refused_with_a_share_of_one(tmp_path):
    base = {"output_dir": str(tmp_path), "data": {"path": str(tmp_path)}}
    with pytest.raises(UserError, match="data.replay.share"):
        load_config(data={**base, "data": {"path": str(tmp_path),
                                           "replay": {"path": str(tmp_path), "share": 1}}})  # fmt: skip


@pytest.mark.fast
def test_replay_of_the_guard_set_or_of_its_clips_is_refused_by_name(tmp_path, clips):
    corpus = tmp_path / "corpus"
    replay_path = _replay_manifest(corpus, clips)
    replay = ReplayConfig(path=replay_path)
    split = read_replay(replay, None)
    shared = corpus / clips[0]["file"]
    # the guard set itself
    with pytest.raises(UserError, match="is the forgetting guard's set"):
        check_apart_from_guard(split, replay, replay_path, set())
    # a directory of audio files holding one of the replay clips
    guard_dir = tmp_path / "guard"
    guard_dir.mkdir()
    guard = GuardConfig(path=corpus / "clips")
    with pytest.raises(UserError, match=f"reads {shared}, a clip of the forgetting guard"):
        check_apart_from_guard(split, replay, guard.path, guard_clip_files(guard))
    # a guard set built from clips (its manifest names them), one of them replayed
    shutil.copy(shared, guard_dir / "w0.wav")
    (guard_dir / "validation.jsonl").write_text(
        json.dumps(
            {
                "id": "w0",
                "audio": "w0.wav",
                "language": "en",
                "clips": [f"../corpus/{clips[0]['file']}"],
            }
        )
        + "\n"  # fmt: skip
    )
    files = guard_clip_files(GuardConfig(path=guard_dir))
    assert shared.resolve() in files and (guard_dir / "w0.wav").resolve() in files
    with pytest.raises(UserError, match="a clip of the forgetting guard"):
        check_apart_from_guard(split, replay, guard_dir, files)
    # other clips pass
    check_apart_from_guard(split, replay, guard_dir, {(guard_dir / "w0.wav").resolve()})


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(3, 3)
        self.trained = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


@pytest.mark.fast
def test_l2sp_pulls_the_trained_parameters_toward_the_start_at_the_group_lr_and_leaves_frozen_ones():
    torch.manual_seed(0)
    model = _Toy()
    start = StartingModel(model, l2sp=0.5, distill_weight=0.0, replay_only=False)
    assert set(start.weights) == set(model.trained.parameters())  # frozen ones are not kept
    w0 = model.trained.weight.detach().clone()
    frozen0 = model.frozen.weight.detach().clone()
    optimizer = torch.optim.SGD(
        [{"params": [model.trained.weight], "lr": 0.2}, {"params": [model.trained.bias], "lr": 0.4}]
    )
    model.trained(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    w1, b1 = model.trained.weight.detach().clone(), model.trained.bias.detach().clone()
    b0 = start.weights[model.trained.bias]
    start.pull(optimizer)
    torch.testing.assert_close(model.trained.weight, w1 + 0.2 * 0.5 * (w0 - w1))
    torch.testing.assert_close(model.trained.bias, b1 + 0.4 * 0.5 * (b0 - b1))
    assert torch.equal(model.frozen.weight, frozen0)


def _tiny_whisper(tmp_path, tones_dir):
    from asrforge.model.build import build_model, build_tokenizer
    from asrforge.train.forward import TrainingWhisper

    cfg = tiny_config(tmp_path, tones_dir, model={"dropout": 0.0})
    tokenizer = build_tokenizer(cfg.model, ["la la tone beep boop"] * 20)
    whisper = build_model(cfg.model, tokenizer, seed=0).model
    return TrainingWhisper(whisper, None).eval()


@pytest.mark.fast
def test_distillation_is_zero_at_the_start_and_counts_only_the_replay_rows(tmp_path, tones_dir):
    from asrforge.data.dataset import IGNORE

    torch.manual_seed(0)
    model = _tiny_whisper(tmp_path, tones_dir)
    start = StartingModel(model, l2sp=0.0, distill_weight=2.0, replay_only=True)
    n_mels = model.whisper.config.num_mel_bins
    frames = 2 * model.whisper.config.max_source_positions
    labels = torch.tensor([[IGNORE, 5, 6, 7], [IGNORE, IGNORE, 8, 9]])
    batch = {
        "input_features": torch.randn(2, n_mels, frames),
        "decoder_input_ids": torch.tensor([[1, 5, 6, 7], [1, 2, 8, 9]]),
        "labels": labels,
        "replay": torch.tensor([False, True]),
    }
    positions = (labels.flatten() != IGNORE).nonzero().squeeze(1)
    kl = start.distill_loss(batch, model(batch, positions), positions)
    assert kl is not None and abs(kl.item()) < 1e-6  # the model is still the start
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    student = model(batch, positions)
    kl = start.distill_loss(batch, student, positions)
    # by hand: the second row's two labelled positions (the last two of the five)
    teacher = start.teacher(batch, positions[3:]).log_softmax(-1)
    mine = student[3:].log_softmax(-1)
    expected = 2.0 * (teacher.exp() * (teacher - mine)).sum(-1).mean()
    torch.testing.assert_close(kl, expected)
    assert start.distill_loss({**batch, "replay": torch.tensor([False, False])}, student,
                              positions) is None  # fmt: skip
    # the teacher reads only the rows it distils: the second row here
    rows = []
    hook = start.teacher.register_forward_pre_hook(
        lambda _m, args: rows.append(len(args[0]["decoder_input_ids"]))
    )
    start.distill_loss(batch, student, positions)
    hook.remove()
    assert rows == [1]


def test_replay_distillation_and_l2sp_train_with_packing_and_resume_bit_identically(
    tmp_path, tones_dir, clips
):
    replay = _replay_manifest(tmp_path / "corpus", clips)
    sections = dict(
        model={"max_source_positions": 200, "max_target_positions": 64, "dropout": 0.1},
        data={
            "batch_size": 4,
            "pack": {"enabled": True, "gap_seconds": [0.05, 0.3]},
            "replay": {"path": str(replay), "share": 0.25},
        },
        optim={"l2sp": 0.5},
        train={"max_steps": 4, "grad_accum": 2, "distill_weight": 1.0},
        eval={"eval_steps": 2},
        checkpoint={"save_total_limit": 5},
    )
    assert_resume_is_bit_identical(tmp_path, tones_dir, sections)
    log = (tmp_path / "full" / "train.log").read_text()
    # a quarter of 48 + 16 utterances, the 12 replay rows drawn again where they run out
    assert "data.replay: 16 utterances drawn from 12 usable ones" in log


def test_the_training_set_holds_the_replay_rows_under_their_own_language(
    tmp_path, tones_dir, clips
):
    from asrforge.train.setup import prepare_run

    replay = _replay_manifest(tmp_path / "corpus", clips, n=6)
    replay.write_text(
        "".join(
            json.dumps({**json.loads(line), "language": "es"}) + "\n"
            for line in replay.read_text().splitlines()
        )
    )
    cfg = tiny_config(
        tmp_path / "run", tones_dir, data={"replay": {"path": str(replay), "share": 0.5}}
    )
    setup = prepare_run(cfg, precision="no", resume=False)
    try:
        train_set = setup.train_set
        assert len(train_set) == 96 and train_set.replay_from == 48  # half of them replay
        item = train_set[60]
        assert item["replay"] and item["uid"].startswith(REPLAY_PREFIX)
        assert item["language"] == "es"
        es = setup.model_bundle.specials.prompt("es")
        assert item["decoder_input_ids"][: len(es)].tolist() == list(es)
        assert not train_set[0]["replay"]
        # the run's own languages are the training split's, not the replay set's
        assert sum(setup.train_languages.values()) == 48
        # packing and sampling read both tables' columns, as a pass over the rows would give
        from asrforge.data.packing import PackItems
        from asrforge.data.sampling import utterance_languages

        utts = train_set.utts
        assert PackItems.of(utts) == PackItems.of(list(utts))
        assert utts.replay_uids() == [u.uid for u in utts[48:]]
        codes, index = utterance_languages(utts)
        assert [codes[k] for k in index] == [u.language for u in utts]
    finally:
        setup.close()


@pytest.mark.fast
def test_l2sp_and_distillation_with_lora_keep_the_adapters_only(tmp_path, tones_dir):
    pytest.importorskip("peft")
    from asrforge.config import LoraConfig
    from asrforge.model import lora
    from asrforge.train.forward import TrainingWhisper

    torch.manual_seed(0)
    whisper = _tiny_whisper(tmp_path, tones_dir).whisper
    tuned = lora.add_adapters(whisper, LoraConfig(r=2, alpha=4, target_modules=["q_proj"]))
    model = TrainingWhisper(tuned, None)
    start = StartingModel(model, l2sp=1.0, distill_weight=1.0, replay_only=False)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert set(start.weights) == set(trained) and len(trained) < len(list(model.parameters()))
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    # the frozen copy is its own: training the adapters leaves it at the start
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.SGD([{"params": trained, "lr": 0.5}])
    with torch.no_grad():
        for p in trained:
            p.add_(1.0)
    moved = [p.detach().clone() for p in trained]
    start.pull(optimizer)
    for p, before in zip(trained, moved, strict=True):
        torch.testing.assert_close(p, before + 0.5 * (start.weights[p] - before))
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    teacher = dict(start.teacher.named_parameters())
    assert all(not p.requires_grad for p in teacher.values())
    assert not any(
        torch.equal(teacher[n], p) for n, p in model.named_parameters() if p.requires_grad
        and "lora_B" in n
    )  # fmt: skip


def test_the_distillation_term_is_logged_zero_at_the_start_then_growing(tmp_path, tones_dir):
    from asrforge.train.events import Callback

    seen = {}

    class Distill(Callback):
        name = "distill"

        def on_step_end(self, state, *, metrics):
            seen[state.step] = metrics["distill"]

    cfg = tiny_config(
        tmp_path / "run", tones_dir,
        train={"max_steps": 3, "distill_weight": 1.0, "log_every": 1},
        eval={"eval_steps": None, "at_end": False},
    )  # fmt: skip
    assert Trainer(cfg, [Distill()]).fit().status == "completed"
    assert seen[1] == pytest.approx(0.0, abs=1e-6)  # the first step's model is the start
    assert 0 < seen[2] < seen[3]


def test_a_resume_on_other_replay_data_is_refused_by_name(tmp_path, tones_dir, clips):
    replay = _replay_manifest(tmp_path / "corpus", clips, n=8)
    sections = dict(
        data={"replay": {"path": str(replay), "share": 0.2}},
        train={"max_steps": 2},
        eval={"eval_steps": None, "at_end": False},
    )
    cfg = tiny_config(tmp_path / "run", tones_dir, **sections)
    assert Trainer(cfg, []).fit().status == "completed"
    record = json.loads((tmp_path / "run" / "replay.json").read_text())
    assert record["rows"] == 8
    lines = replay.read_text().splitlines()
    replay.write_text("\n".join(lines[:-1]) + "\n")  # one row fewer
    longer = tiny_config(tmp_path / "run", tones_dir, **{**sections, "train": {"max_steps": 4}})
    with pytest.raises(UserError, match="resume on the replay data the run started with"):
        Trainer(longer, []).fit(resume=True)
