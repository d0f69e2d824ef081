"""Encoder-output caching for a frozen encoder: same losses as recomputing, reused across runs."""

from __future__ import annotations

import json

import pytest

from asrforge.config import ConfigError
from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config


class Losses(Callback):
    name = "losses"

    def __init__(self):
        self.losses: list[float] = []

    def on_step_end(self, state, *, metrics):
        self.losses.append(metrics["loss"])


def _train(out, data, cache: bool, cache_dir=None) -> list[float]:
    rec = Losses()
    cfg = tiny_config(
        out, data, model={"freeze_encoder": True, "dropout": 0.1},
        data={"cache_encoder": cache, "cache_dir": str(cache_dir) if cache_dir else None},
        train={"max_steps": 8}, eval={"eval_steps": None, "at_end": False},
    )
    Trainer(cfg, [rec]).fit()
    return rec.losses


def test_cached_encoder_states_give_the_losses_of_recomputing(tmp_path, tones_dir):
    plain = _train(tmp_path / "plain", tones_dir, cache=False)
    cached = _train(tmp_path / "cached", tones_dir, cache=True, cache_dir=tmp_path / "cache")
    assert len(plain) == len(cached) == 8
    for a, b in zip(plain, cached, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    (directory,) = (tmp_path / "cache" / "encoder").iterdir()
    states = directory / json.loads((directory / "index.json").read_text())["states"]
    mtime = states.stat().st_mtime_ns
    # a second run with the same encoder weights reuses the cache without rewriting it
    again = _train(tmp_path / "again", tones_dir, cache=True, cache_dir=tmp_path / "cache")
    assert states.stat().st_mtime_ns == mtime
    assert again == cached


@pytest.mark.fast
def test_cache_needs_a_frozen_encoder(tmp_path, tones_dir):
    with pytest.raises(ConfigError, match="data.cache_encoder: needs model.freeze_encoder"):
        tiny_config(tmp_path, tones_dir, data={"cache_encoder": True})
