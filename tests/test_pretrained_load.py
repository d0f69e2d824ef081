"""Loading pretrained weights: nothing is re-initialized or dropped without a word (issue 12
item 5), and EMA weights must fit the model exactly."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asrforge.config import ModelConfig
from asrforge.errors import UserError
from asrforge.model.build import build_model, build_tokenizer
from asrforge.train.optim import EMA
from tests.conftest import tiny_config

pytestmark = pytest.mark.fast

TEXTS = ["a b c", "hello world", "the quick brown fox"] * 40


@pytest.fixture
def pretrained(tmp_path, tones_dir) -> Path:
    """A tiny from-scratch model and its tokenizer saved as a transformers directory."""
    cfg = tiny_config(tmp_path / "run", tones_dir)
    tokenizer = build_tokenizer(cfg.model, TEXTS)
    path = tmp_path / "pretrained"
    build_model(cfg.model, tokenizer, 0).model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def _edit_weights(path: Path, drop: str | None = None, add: str | None = None) -> None:
    state = load_file(str(path / "model.safetensors"))
    if drop is not None:
        del state[drop]
    if add is not None:
        state[add] = torch.zeros(3)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def _load(path: Path):
    cfg = ModelConfig(pretrained=path)
    return build_model(cfg, build_tokenizer(cfg), 0).model


def test_a_complete_pretrained_directory_loads_every_tensor(pretrained, caplog):
    saved = load_file(str(pretrained / "model.safetensors"))
    with caplog.at_level(logging.WARNING):
        model = _load(pretrained)
    state = model.state_dict()
    assert all(state[name].equal(t) for name, t in saved.items())
    assert "ignored" not in caplog.text


def test_a_missing_pretrained_tensor_is_an_error_naming_it(pretrained):
    _edit_weights(pretrained, drop="model.encoder.layers.0.fc1.weight")
    with pytest.raises(
        UserError, match=r"missing from its weights: model\.encoder\.layers\.0\.fc1"
    ):
        _load(pretrained)


def test_an_unexpected_pretrained_tensor_is_a_warning_naming_it(pretrained, caplog):
    _edit_weights(pretrained, add="model.encoder.bogus.weight")
    with caplog.at_level(logging.WARNING, logger="asrforge"):
        model = _load(pretrained)
    assert "model.encoder.bogus.weight" in caplog.text and "ignored" in caplog.text
    assert "model.encoder.bogus.weight" not in model.state_dict()


def test_ema_weights_must_name_exactly_the_trainable_parameters():
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, 0.9)
    good = {n: torch.full_like(t, 7.0) for n, t in ema.state_dict().items()}
    ema.load_state_dict(good)
    assert ema.shadow["weight"].eq(7.0).all()
    with pytest.raises(UserError, match=r"missing: bias"):
        ema.load_state_dict({"weight": good["weight"]})
    with pytest.raises(UserError, match=r"not in the model: extra"):
        ema.load_state_dict({**good, "extra": torch.zeros(1)})
    with pytest.raises(UserError, match=r"of another shape: weight"):
        ema.load_state_dict({**good, "weight": torch.zeros(5)})


def test_a_pretrained_path_that_is_no_model_directory_is_named(tmp_path):
    (tmp_path / "long.wav").write_bytes(b"RIFF")
    with pytest.raises(UserError, match=r"^model\.pretrained: .*long\.wav: is a file, not a model"):
        build_tokenizer(ModelConfig(pretrained=tmp_path / "long.wav"))
    with pytest.raises(UserError, match=r"^model\.pretrained: .*: has no config\.json"):
        build_tokenizer(ModelConfig(pretrained=tmp_path))
