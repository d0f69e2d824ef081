"""``TrainingWhisper``: one module for the training forward of every kind of batch, whose
``train()`` keeps a frozen encoder part in eval mode, and which the loop runs (prepared by
accelerate, DDP-wrapped with several processes) for text-only batches too."""

from __future__ import annotations

import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from asrforge.data.dataset import IGNORE
from asrforge.evaluation.evaluate import token_loss
from asrforge.model.partial import encode_frozen_part, freeze_encoder_part
from asrforge.train.forward import TrainingWhisper, labelled_positions
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config
from tests.test_text_only import Steps, _multitask_config


def _whisper(**kw) -> WhisperForConditionalGeneration:
    cfg = WhisperConfig(
        vocab_size=60,
        d_model=32,
        encoder_layers=3,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=80,
        max_source_positions=50,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        **kw,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return WhisperForConditionalGeneration(cfg)


def _modes(whisper) -> dict[str, bool]:
    enc = whisper.model.encoder
    return {
        "conv1": enc.conv1.training,
        "layer0": enc.layers[0].training,
        "layer2": enc.layers[2].training,
        "layer_norm": enc.layer_norm.training,
        "encoder": enc.training,
        "decoder": whisper.model.decoder.training,
    }


@pytest.mark.fast
@pytest.mark.parametrize("top", [0, 1])
def test_train_keeps_the_frozen_part_in_eval_mode(top):
    whisper = _whisper(dropout=0.1)
    freeze_encoder_part(whisper.model.encoder, top)
    model = TrainingWhisper(whisper, frozen_top=top)
    for _ in range(2):  # after an evaluation's eval() too
        assert model.train() is model
        modes = _modes(whisper)
        assert not modes["conv1"] and not modes["layer0"] and modes["decoder"]
        assert modes["layer2"] == modes["layer_norm"] == (top > 0)
        model.eval()
        assert not any(_modes(whisper).values())


@pytest.mark.fast
def test_without_a_frozen_part_everything_trains():
    whisper = _whisper()
    TrainingWhisper(whisper, frozen_top=None).train()
    assert all(_modes(whisper).values())


def _batch(task: str = "asr", **extra) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "task": task,
        "decoder_input_ids": torch.randint(3, 60, (2, 5), generator=g),
        "input_features": torch.randn(2, 80, 100, generator=g),
        **extra,
    }


@pytest.mark.fast
def test_each_kind_of_batch_gives_whispers_logits():
    """In eval mode every path computes what Whisper's own forward (or, text-only, its decoder
    without encoder states) computes."""
    whisper = _whisper().eval()
    batch = _batch()
    want = whisper(
        input_features=batch["input_features"], decoder_input_ids=batch["decoder_input_ids"]
    ).logits
    for top in (None, 0, 1, 3):
        got = TrainingWhisper(whisper, frozen_top=top).eval()(batch)
        torch.testing.assert_close(got, want, msg=f"top {top}")
    # the frozen part's output cached in the batch (data.cache_encoder)
    cached = encode_frozen_part(whisper.model.encoder, batch["input_features"], 1)
    got = TrainingWhisper(whisper, frozen_top=1).eval()(_batch(encoder_hidden_states=cached))
    torch.testing.assert_close(got, want)
    # text-only: the decoder without encoder states, then the output projection
    text = _batch("lm")
    hidden = whisper.model.decoder(input_ids=text["decoder_input_ids"]).last_hidden_state
    got = TrainingWhisper(whisper, frozen_top=None).eval()(text)
    torch.testing.assert_close(got, whisper.proj_out(hidden))


@pytest.mark.fast
@pytest.mark.parametrize("task", ["asr", "lm"])
def test_logits_at_labelled_positions_give_the_full_projections_loss_and_gradients(task):
    """The loss over labelled positions only (no vocabulary projection at prompt or padding)
    equals the loss over full logits with the unlabelled positions ignored, and so do the
    gradients."""
    batch = _batch(task)
    labels = torch.randint(3, 60, (2, 5), generator=torch.Generator().manual_seed(2))
    labels[0, :2] = IGNORE  # a prompt
    labels[1, 3:] = IGNORE  # padding
    results = []
    for labelled_only in (False, True):
        whisper = _whisper()
        model = TrainingWhisper(whisper, frozen_top=None).train()
        torch.manual_seed(3)  # the same dropout masks on both sides
        if labelled_only:
            positions, targets = labelled_positions(labels, torch.device("cpu"))
            logits = model(batch, positions)
            assert logits.shape == (int((labels != IGNORE).sum()), 60)
            loss = token_loss(logits, targets)
        else:
            loss = token_loss(model(batch), labels)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in whisper.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (full_loss, full_grads), (ours_loss, our_grads) = results
    torch.testing.assert_close(ours_loss, full_loss, rtol=1e-6, atol=1e-7)
    assert our_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_text_only_batches_train_through_the_prepared_module(tmp_path, tones_dir, monkeypatch):
    """Every micro-batch, text-only ones included, is a call of the module accelerate prepared
    (the DDP wrapper with several processes), never of the raw decoder behind its back."""
    calls: list[tuple[str, bool]] = []
    original = TrainingWhisper.forward

    def spy(self, batch, positions=None):
        calls.append((batch.get("task", "asr"), self.training))
        return original(self, batch, positions)

    monkeypatch.setattr(TrainingWhisper, "forward", spy)
    decoder_calls = [0]
    from transformers.models.whisper import modeling_whisper

    decoder_forward = modeling_whisper.WhisperDecoder.forward

    def decoder_spy(self, *args, **kwargs):
        decoder_calls[0] += 1
        return decoder_forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_whisper.WhisperDecoder, "forward", decoder_spy)
    steps = Steps()
    cfg = _multitask_config(tmp_path, "run", tones_dir, max_steps=3)
    cfg.eval.eval_steps = None
    cfg.eval.at_end = False
    assert Trainer(cfg, [steps]).fit().status == "completed"
    tasks = [task for task, _ in calls]
    assert len(tasks) == 3 * 2 and tasks.count("lm") == 3 and all(t for _, t in calls)
    assert all(m["loss_lm"] > 0 for m in steps.metrics.values())
    assert decoder_calls[0] == len(calls)  # the decoder ran inside the module's forward only


def test_text_only_batches_train_with_two_processes(tmp_path, tones_dir):
    """torchrun with two CPU processes and ``data.asr_ratio: 0.5``: text-only batches go
    through the DDP wrapper (built with find_unused_parameters, the encoder idle on them), so the
    run trains instead of being refused."""
    import subprocess
    import sys

    cfg = _multitask_config(tmp_path, "run", tones_dir, max_steps=2)
    cfg.eval.eval_steps = None
    cfg.eval.at_end = False
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "asrforge",
            "train",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "2 process(es)" in log and "text-only batches: 50%" in log
    assert out.stdout.count("asrforge: completed at step 2") == 1


def test_a_frozen_part_stays_in_eval_mode_through_training_and_evaluation(tmp_path, tones_dir):
    """The loop's model.train() (at the start and after each evaluation) leaves the frozen part
    in eval mode: no hand-written restore after evaluate()."""
    from tests.test_partial_finetune import Recorder

    rec = Recorder()
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        model={"dropout": 0.1, "train_encoder_layers": 1},
        train={"max_steps": 4},
        eval={"eval_steps": 1, "at_end": False},
    )
    assert Trainer(cfg, [rec]).fit().status == "completed"
    assert rec.modes == [(False, False, True)] * 4  # conv1, layers[0] frozen; layers[1] trains
