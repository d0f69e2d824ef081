"""An English-only base (``*.en``: its prompt has no language slot) is refused other languages
before its weights load, with the reason and the ways out, and leaves no run behind; relabelled
as English the same data trains. (``vocab build`` on such a base: tests/test_vocab.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import asrforge.model.build as model_build
from asrforge.cli import main
from asrforge.model.build import has_language_slot
from asrforge.train.loop import Trainer
from tests.conftest import save_english_only_model, tiny_config


@pytest.fixture(scope="module")
def english_only(tmp_path_factory, tones_dir) -> Path:
    """A tiny English-only Whisper directory (its generation config says so)."""
    return save_english_only_model(tmp_path_factory.mktemp("english-only"), tones_dir)


@pytest.mark.fast
def test_the_refusal_comes_before_the_weights_load_and_leaves_no_run(
    tmp_path, tones_dir, english_only, monkeypatch, capsys
):
    def no_load(cfg):
        raise AssertionError("the model's weights were loaded")

    monkeypatch.setattr(model_build, "_load_pretrained", no_load)
    out = tmp_path / "runs" / "es"
    cfg = tmp_path / "cfg.yaml"
    # the tones are English and Spanish
    cfg.write_text(tiny_config(out, tones_dir, model={"pretrained": str(english_only)}).to_yaml())
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "English-only model: its prompt has no language slot, so it cannot be taught 'es'" in err
    assert "data.language: en" in err and "multilingual Whisper (model.pretrained)" in err
    assert not (tmp_path / "runs").exists()


def test_relabelled_as_english_the_data_trains_the_english_only_prompt(
    tmp_path, tones_dir, english_only
):
    out = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        tiny_config(
            out, tones_dir, model={"pretrained": str(english_only)}, data={"language": "en"},
            train={"max_steps": 1, "log_every": 1}, eval={"eval_steps": None, "at_start": False},
        ).to_yaml()
    )  # fmt: skip
    assert main(["train", str(cfg)]) == 0
    assert (out / "checkpoints" / "latest").exists()


@pytest.mark.fast
def test_the_language_slot_is_read_from_the_files(tmp_path, english_only):
    assert not has_language_slot(english_only)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 51865}))
    assert has_language_slot(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"is_multilingual": False}))
    assert not has_language_slot(tmp_path)
    # a tokenizer directory alone: its size decides, as transformers' rule for Whisper
    assert not has_language_slot(tmp_path / "tokenizer-only", 51864)
    assert has_language_slot(tmp_path / "tokenizer-only", 51866)


@pytest.mark.parametrize("stream", [False, True])
def test_rows_without_a_language_evaluate_as_english(tmp_path, clips, english_only, stream):
    # Half the English rows name no language: under an English-only model they are scored as
    # English (its normalizer, its per-language figures), not as a language of their own.
    from tests.test_stream import stream_source

    english = [c for c in clips if c["language"] == "en"]
    rows = [dict(r, language="en" if k % 2 else None) for k, r in enumerate(english)]
    path, extra = stream_source("jsonl files", tmp_path / "corpus", rows)
    data = {**extra, "stream": {"enabled": stream}}
    cfg = tiny_config(
        tmp_path / "run", path, model={"pretrained": str(english_only)}, data=data,
        train={"max_steps": 1}, eval={"eval_steps": 1, "at_start": False},
    )  # fmt: skip
    result = Trainer(cfg).fit()
    assert result.status == "completed"
    assert set(result.last_metrics["per_language"]) == {"en"}
    assert result.last_metrics["n"] == len([r for r in rows if r["split"] == "validation"])


def test_evaluate_scores_other_languages_with_a_warning_or_leaves_them_out(
    english_only, tones_dir, capsys, caplog
):
    # the tones data holds en and es utterances
    argv = ["evaluate", str(english_only), "--data", str(tones_dir), "--max-samples", "4",
            "--max-new-tokens", "2", "--json"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="asrforge.data.prepare"):
        assert main(argv) == 0
    every = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    warned = [r.getMessage() for r in caplog.records if "English-only model" in r.getMessage()]
    assert len(warned) == 1 and "'es' (" in warned[0] and "--languages en" in warned[0]
    assert set(every["per_language"]) == {"en", "es"} and every["left_out"] == {}
    caplog.clear()
    assert main([*argv, "--languages", "en"]) == 0
    english = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(english["per_language"]) == {"en"} and english["left_out"]["es"] > 0
    assert not [r for r in caplog.records if "English-only model" in r.getMessage()]
    assert main([*argv, "--languages", "en,klingon"]) == 2
    assert "--languages.1" in capsys.readouterr().err
