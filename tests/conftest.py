"""Shared fixtures: a small generated tones data set and tiny configs that train in seconds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import settings

from asrforge.config import TrainConfig, load_config
from asrforge.data.synth import make_tones_dataset

# In CI, property tests draw the same examples every run: a failure there is reproducible.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def tones_dir(tmp_path_factory) -> Path:
    """The tones data set: 48 train, 12 validation, 8 test utterances (en and es)."""
    return make_tones_dataset(
        tmp_path_factory.mktemp("data") / "tones", sizes={"train": 48, "validation": 12, "test": 8}
    )


@pytest.fixture
def clips(tmp_path, tones_dir) -> list[dict]:
    """The tones' train and validation clips as wav files under ``tmp_path/corpus/clips``: one
    row per clip (``file`` relative to ``tmp_path/corpus``, ``text``, ``language``, ``split``)."""
    (tmp_path / "corpus" / "clips").mkdir(parents=True)
    from asrforge.data.sources import load_arrow

    rows = []
    for split in ("train", "validation"):
        for r in load_arrow(tones_dir)[split]:
            file = f"clips/{r['id']}.wav"
            (tmp_path / "corpus" / file).write_bytes(r["audio"]["bytes"])
            rows.append(
                {"file": file, "text": r["text"], "language": r["language"], "split": split}
            )
    return rows


def tiny_config(out: Path, data_dir: Path, **sections) -> TrainConfig:
    """A 2+2-layer d_model 32 model on 2 s windows: a step takes milliseconds on a CPU."""
    base = {
        "output_dir": str(out),
        "seed": 0,
        "model": {
            "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
            "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
            "max_source_positions": 100, "max_target_positions": 32, "bpe_vocab_size": 300,
        },
        "data": {"path": str(data_dir), "batch_size": 8, "num_workers": 0},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"max_steps": 6, "log_every": 2},
        "eval": {"eval_steps": 3, "max_new_tokens": 8},
        # tests inspect and resume the step checkpoints a run leaves; test_disk_budget tests
        # the default (after_run: best, which prunes them)
        "checkpoint": {"save_total_limit": 2, "after_run": "all"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return load_config(data=base)


def save_english_only_model(root: Path, data_dir: Path) -> Path:
    """A tiny English-only Whisper directory under ``root`` (its generation config says so),
    saved from a 2-layer model with a BPE tokenizer."""
    from asrforge.model.build import build_model, build_tokenizer

    base = tiny_config(root / "base", data_dir)
    tokenizer = build_tokenizer(base.model, ["la la tone beep boop"] * 20)
    pretrained = root / "tiny-en"
    build_model(base.model, tokenizer, 0).model.save_pretrained(str(pretrained))
    tokenizer.save_pretrained(str(pretrained))
    gen = pretrained / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "is_multilingual": False}))
    return pretrained


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face home, offline, with an endpoint nothing listens on."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return home
