"""A bundle of a multilingual base keeps every language the base had, beside the trained ones:
it detects among all of them, as Whisper does, and accepts any of them by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asrforge.bundle.load import load_bundle
from asrforge.data.sources import load_arrow
from asrforge.model.build import build_model, build_tokenizer
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config

BASE_LANGUAGES = ["en", "fr", "de"]


def multilingual_base(tmp_path: Path, tones_dir: Path, detects: str) -> Path:
    """A tiny multilingual "pretrained" Whisper of ``BASE_LANGUAGES`` whose decoder ranks
    ``detects``'s token first after ``<|startoftranscript|>`` whatever it hears: its last layer
    norm outputs one vector, which only that token's embedding points along."""
    cfg = tiny_config(tmp_path / "scratch", tones_dir)
    tokenizer = build_tokenizer(cfg.model, ["one two three", "uno dos tres", "un deux"] * 40)
    model = build_model(cfg.model, tokenizer, 0).model
    direction = torch.zeros(cfg.model.d_model)
    direction[0] = 1.0
    with torch.no_grad():
        model.model.decoder.layer_norm.weight.zero_()
        model.model.decoder.layer_norm.bias.copy_(direction)
        token = tokenizer.convert_tokens_to_ids(f"<|{detects}|>")
        model.model.decoder.embed_tokens.weight[token] = 8.0 * direction
    path = tmp_path / "base"
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    gen = json.loads((path / "generation_config.json").read_text())
    gen.pop("_from_model_config")  # transformers would read nothing else of a derived config
    gen.update(
        is_multilingual=True,
        lang_to_id={f"<|{c}|>": tokenizer.convert_tokens_to_ids(f"<|{c}|>") for c in BASE_LANGUAGES},
        task_to_id={t: tokenizer.convert_tokens_to_ids(f"<|{t}|>") for t in ("transcribe", "translate")},
    )  # fmt: skip
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


@pytest.fixture
def spanish_bundle(tmp_path, tones_dir):
    """A bundle of the base above fine-tuned on the tones' Spanish rows only (a learning rate too
    small to move what the base detects)."""
    from asrforge.bundle.export import export_bundle

    base = multilingual_base(tmp_path, tones_dir, detects="fr")
    cfg = tiny_config(
        tmp_path / "run", tones_dir,
        model={"pretrained": str(base)}, data={"languages": ["es"]},
        optim={"lr": 1e-6, "warmup_steps": 0}, train={"max_steps": 2}, eval={"eval_steps": 2},
    )  # fmt: skip
    Trainer(cfg, []).fit()
    return export_bundle(tmp_path / "run", tmp_path / "bundle")


def test_a_bundle_of_a_multilingual_base_keeps_its_languages_and_detects_among_them(
    spanish_bundle, tones_dir
):
    info = json.loads((spanish_bundle / "inference_config.json").read_text())
    assert info["languages"] == [*BASE_LANGUAGES, "es"] and info["trained_languages"] == ["es"]
    gen = json.loads((spanish_bundle / "generation_config.json").read_text())
    assert sorted(gen["lang_to_id"]) == sorted(f"<|{c}|>" for c in info["languages"])
    assert "language" not in gen  # transformers detects too

    bundle = load_bundle(spanish_bundle)
    english = next(r for r in load_arrow(tones_dir)["test"] if r["language"] == "en")
    wave = bundle.load_audio(english["audio"]["bytes"])
    detected = bundle.recognize([wave])[0]
    assert detected.language == "fr"  # a base language the training never saw, detected
    assert bundle.recognize([wave], "en")[0].language == "en"  # and one accepted by name
    assert bundle.recognize([wave], "es")[0].language == "es"


def test_transcribe_accepts_a_base_language_by_name(spanish_bundle, tones_dir, tmp_path, capsys):
    from asrforge.cli import main

    english = next(r for r in load_arrow(tones_dir)["test"] if r["language"] == "en")
    clip = tmp_path / "en.wav"
    clip.write_bytes(english["audio"]["bytes"])
    argv = ["transcribe", str(spanish_bundle), str(clip), "--language", "en", "--format", "json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["language"] == "en"


def test_a_bundle_from_scratch_knows_the_trained_languages_only(tmp_path, tones_dir):
    from asrforge.bundle.export import export_bundle

    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 2}, eval={"eval_steps": 2})
    Trainer(cfg, []).fit()
    info = json.loads(
        (export_bundle(tmp_path / "run", tmp_path / "b") / "inference_config.json").read_text()
    )
    assert info["languages"] == ["en", "es"] == info["trained_languages"]
