"""Partial fine-tuning: the top encoder layers train above a frozen (and cacheable) lower part."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from asrforge.config import ConfigError, ModelConfig
from asrforge.errors import UserError
from asrforge.model.build import build_model, build_tokenizer
from asrforge.model.partial import (
    encode_frozen_part,
    encode_trained_part,
    freeze_encoder_part,
    frozen_part_id,
    set_frozen_eval,
)
from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config


def _encoder(layers: int = 3, **kw) -> WhisperEncoder:
    cfg = WhisperConfig(
        d_model=32,
        encoder_layers=layers,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        num_mel_bins=80,
        max_source_positions=50,
        **kw,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return WhisperEncoder(cfg)


@pytest.mark.fast
@pytest.mark.parametrize("top", [0, 1, 2, 3])
def test_the_two_parts_compute_the_encoder_exactly(top):
    encoder = _encoder().eval()
    feats = torch.randn(2, 80, 100)
    with torch.no_grad():
        want = encoder(feats).last_hidden_state
        got = encode_trained_part(encoder, encode_frozen_part(encoder, feats, top), top)
    assert torch.equal(got, want)


@pytest.mark.fast
def test_layerdrop_and_dropout_of_the_trained_layers_follow_the_encoder():
    # all layers trained: only the convolutions and positions are frozen; in training mode with
    # LayerDrop the stock forward and the split one draw the same random numbers
    encoder = _encoder(encoder_layerdrop=0.5, dropout=0.0, activation_dropout=0.3).train()
    set_frozen_eval(encoder, 3)
    feats = torch.randn(2, 80, 100)
    for seed in range(4):
        torch.manual_seed(seed)
        want = encoder(feats).last_hidden_state
        torch.manual_seed(seed)
        got = encode_trained_part(encoder, encode_frozen_part(encoder, feats, 3), 3)
        assert torch.equal(got, want)


@pytest.mark.fast
def test_the_frozen_part_must_be_in_eval_mode():
    encoder = _encoder().train()
    with pytest.raises(RuntimeError, match="eval mode"):
        encode_frozen_part(encoder, torch.randn(1, 80, 100), 1)


@pytest.mark.fast
def test_freezing_leaves_the_top_layers_and_the_norm_trainable():
    encoder = _encoder()
    freeze_encoder_part(encoder, 1)
    trainable = {
        n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("layers.") else "")
        for n, p in encoder.named_parameters()
        if p.requires_grad
    }
    assert trainable == {"layers.2", "layer_norm"}
    with pytest.raises(UserError, match="model.train_encoder_layers"):
        freeze_encoder_part(_encoder(), 4)


@pytest.mark.fast
def test_the_frozen_part_id_covers_the_split_and_the_frozen_weights_only():
    encoder = _encoder()
    ids = {top: frozen_part_id(encoder, top) for top in range(4)}
    assert len({json.dumps(i, sort_keys=True) for i in ids.values()}) == 4
    with torch.no_grad():
        encoder.layers[2].fc1.weight.add_(1.0)  # trained by top >= 1: not part of their key
    assert frozen_part_id(encoder, 1) == ids[1] and frozen_part_id(encoder, 2) == ids[2]
    assert frozen_part_id(encoder, 0) != ids[0]
    with torch.no_grad():
        encoder.conv1.weight.add_(1.0)
    assert all(frozen_part_id(encoder, top) != ids[top] for top in range(4))


# ---------------------------------------------------------------------------------------------
# Training runs


class Recorder(Callback):
    """Losses per step, the weights before and after, and the encoder's modes at each step."""

    name = "recorder"
    critical = True

    def __init__(self):
        self.losses: list[float] = []
        self.modes: list[tuple[bool, ...]] = []

    def on_train_begin(self, state, *, run):
        self.model = run.model
        self.before = {k: v.clone() for k, v in run.model.state_dict().items()}

    def on_step_begin(self, state, *, step):
        enc = self.model.model.encoder
        self.modes.append((enc.conv1.training, enc.layers[0].training, enc.layers[1].training))

    def on_step_end(self, state, *, metrics):
        self.losses.append(metrics["loss"])

    def on_train_end(self, state, *, result):
        self.after = {k: v.clone() for k, v in self.model.state_dict().items()}


def _train(out, data, *, cache: bool, cache_dir=None, dropout=0.0, **model) -> Recorder:
    rec = Recorder()
    cfg = tiny_config(
        out,
        data,
        model={"dropout": dropout, **model},
        data={"cache_encoder": cache, "cache_dir": str(cache_dir) if cache_dir else None},
        train={"max_steps": 6},
        eval={"eval_steps": 3, "at_end": False},
    )
    result = Trainer(cfg, [rec]).fit()
    assert result.status == "completed"
    return rec


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cached_lower_states_give_the_losses_of_recomputing(tmp_path, tones_dir, dropout):
    plain = _train(
        tmp_path / "plain", tones_dir, cache=False, dropout=dropout, train_encoder_layers=1
    )
    cached = _train(
        tmp_path / "cached",
        tones_dir,
        cache=True,
        cache_dir=tmp_path / "cache",
        dropout=dropout,
        train_encoder_layers=1,
    )
    assert len(plain.losses) == len(cached.losses) == 6
    torch.testing.assert_close(cached.losses, plain.losses, rtol=0, atol=1e-6)
    # the frozen part stays in eval mode, after evaluations too; the top layer trains
    assert plain.modes == cached.modes == [(False, False, True)] * 6
    for rec in (plain, cached):
        changed = {k for k in rec.before if not torch.equal(rec.before[k], rec.after[k])}
        frozen = [
            k
            for k in rec.before
            if k.startswith(
                ("model.encoder.conv", "model.encoder.embed_positions", "model.encoder.layers.0.")
            )
        ]
        assert frozen and not changed & set(frozen)
        assert any(k.startswith("model.encoder.layers.1.") for k in changed)
        assert "model.encoder.layer_norm.weight" in changed
        assert any(k.startswith("model.decoder.") for k in changed)
    for k in plain.after:  # both runs end with the same weights
        torch.testing.assert_close(cached.after[k], plain.after[k], rtol=0, atol=1e-5)


def test_cache_dirs_differ_by_split_and_are_reused(tmp_path, tones_dir):
    cache = tmp_path / "cache"
    _train(tmp_path / "frozen", tones_dir, cache=True, cache_dir=cache, freeze_encoder=True)
    _train(tmp_path / "top1", tones_dir, cache=True, cache_dir=cache, train_encoder_layers=1)
    dirs = sorted((cache / "encoder").iterdir())
    assert len(dirs) == 2
    splits = {json.loads((d / "producer.json").read_text())["split"]: d for d in dirs}
    assert set(splits) == {"whole encoder", "conv+positions+layers[:1]"}
    top1 = splits["conv+positions+layers[:1]"]
    states = top1 / json.loads((top1 / "index.json").read_text())["states"]
    mtime = states.stat().st_mtime_ns
    again = _train(
        tmp_path / "again", tones_dir, cache=True, cache_dir=cache, train_encoder_layers=1
    )
    assert states.stat().st_mtime_ns == mtime
    assert len(list((cache / "encoder").iterdir())) == 2
    log = (tmp_path / "again" / "train.log").read_text()
    assert "encoder cache: all" in log and "utterances cached in" in log
    assert "computing" not in log
    assert (
        again.losses
        == _train(
            tmp_path / "top1-b", tones_dir, cache=True, cache_dir=cache, train_encoder_layers=1
        ).losses
    )


@pytest.mark.fast
@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"train_encoder_layers": -1}, "model.train_encoder_layers: must be >= 0, got -1"),
        (
            {"train_encoder_layers": 3},
            "model.train_encoder_layers: must be <= model.encoder_layers (2), got 3",
        ),
        (
            {"train_encoder_layers": 1, "freeze_encoder": True},
            "model.train_encoder_layers: cannot be set together with model.freeze_encoder: true",
        ),
    ],
)
def test_config_errors_name_the_field(tmp_path, tones_dir, model, message):
    with pytest.raises(ConfigError) as err:
        tiny_config(tmp_path, tones_dir, model=model)
    assert message in str(err.value)


@pytest.mark.fast
def test_cache_is_allowed_with_train_encoder_layers(tmp_path, tones_dir):
    cfg = tiny_config(
        tmp_path, tones_dir, model={"train_encoder_layers": 0}, data={"cache_encoder": True}
    )
    assert cfg.model.trained_top_encoder_layers == 0
    with pytest.raises(
        ConfigError, match="needs model.freeze_encoder: true or model.train_encoder_layers"
    ):
        tiny_config(tmp_path, tones_dir, data={"cache_encoder": True})


def test_more_layers_than_a_pretrained_model_has_is_a_user_error(tmp_path, tones_dir):
    # a from-scratch model with 2 encoder layers, saved as a "pretrained" directory
    cfg = tiny_config(tmp_path / "run", tones_dir)
    tokenizer = build_tokenizer(cfg.model, ["a b c", "hello world"] * 50)
    pretrained = tmp_path / "pretrained"
    build_model(cfg.model, tokenizer, 0).model.save_pretrained(str(pretrained))
    model_cfg = ModelConfig(pretrained=pretrained, train_encoder_layers=3)
    with pytest.raises(UserError, match="model.train_encoder_layers: .* 2 encoder layers, got 3"):
        build_model(model_cfg, tokenizer, 0)



def test_specaugment_masks_the_features_on_the_split_path(tmp_path, tones_dir, monkeypatch):
    """Without a cache the frozen lower part runs apart from WhisperModel.forward; the features
    it sees are still passed through the model's SpecAugment masking, in training only."""
    from transformers.models.whisper import modeling_whisper

    seen: list[bool] = []
    original = modeling_whisper.WhisperModel._mask_input_features

    def spy(self, input_features, attention_mask=None):
        seen.append(self.training)
        return original(self, input_features, attention_mask=attention_mask)

    monkeypatch.setattr(modeling_whisper.WhisperModel, "_mask_input_features", spy)
    rec = _train(tmp_path / "run", tones_dir, cache=False, train_encoder_layers=1)
    assert len(rec.losses) == 6
    assert seen.count(True) >= 6  # every training micro-batch
