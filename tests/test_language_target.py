"""The language token as a training target (``data.language_target``): the position of
``<|startoftranscript|>`` is labelled with the row's language, in whole clips and packed windows,
with or without previous text; evaluation sets never carry it; and a run that trains it teaches
the model to detect the language it is taught, which a run without it does not."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

from asrforge.bundle.export import export_bundle
from asrforge.data.audio import decode_audio
from asrforge.data.dataset import IGNORE, prompt_labels
from asrforge.data.sources import load_arrow
from asrforge.data.targets import decoder_sequences
from asrforge.model.tokenizer import SpecialTokens
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config

SOT, ES, TRANSCRIBE, NO_TIMESTAMPS, PREV, EOT = 50, 60, 70, 71, 80, 99


@pytest.mark.fast
def test_the_start_of_transcript_position_is_labelled_with_the_language_and_nothing_else():
    prompt = [SOT, ES, TRANSCRIBE, NO_TIMESTAMPS]
    assert prompt_labels(prompt, SOT) == [ES, IGNORE, IGNORE]
    assert prompt_labels(prompt, None) == [IGNORE] * 3
    # previous text comes before the prompt and stays context
    dec, labels = decoder_sequences(prompt, [1, 2], EOT, prev=[PREV, 7, 8], language_after=SOT)
    assert dec == [PREV, 7, 8, SOT, ES, TRANSCRIBE, NO_TIMESTAMPS, 1, 2]
    assert labels == [IGNORE, IGNORE, IGNORE, ES, IGNORE, IGNORE, 1, 2, EOT]
    # timestamp mode: no <|notimestamps|>, the task's position predicts the first timestamp
    dec, labels = decoder_sequences([SOT, ES, TRANSCRIBE], [90, 1, 91], EOT, language_after=SOT)
    assert labels == [ES, IGNORE, 90, 1, 91, EOT]


def _language_probability(bundle_dir, clips, code: str) -> float:
    """The mean probability the exported model gives ``code``'s token among every language
    token after ``<|startoftranscript|>`` (Whisper's language detection), read through
    transformers as a user would."""
    model = WhisperForConditionalGeneration.from_pretrained(bundle_dir).eval()
    features = WhisperFeatureExtractor.from_pretrained(bundle_dir)
    specials = SpecialTokens.from_tokenizer(AutoTokenizer.from_pretrained(bundle_dir), True)
    codes = list(specials.languages)
    ids = torch.tensor([specials.languages[c] for c in codes])
    feats = features(
        [decode_audio(r["audio"]["bytes"]) for r in clips], sampling_rate=16000,
        return_tensors="pt",
    ).input_features  # fmt: skip
    start = torch.full((len(clips), 1), specials.sot)
    with torch.no_grad():
        logits = model(input_features=feats, decoder_input_ids=start).logits[:, -1]
    return float(logits[:, ids].softmax(-1)[:, codes.index(code)].mean())


def test_a_run_that_trains_the_language_token_learns_to_detect_the_language(tmp_path, tones_dir):
    spanish = [r for r in load_arrow(tones_dir)["validation"] if r["language"] == "es"]
    learned = {}
    for on in (True, False):
        out = tmp_path / f"run-{on}"
        cfg = tiny_config(
            out, tones_dir, data={"language_target": on, "languages": ["es"]},
            train={"max_steps": 30, "log_every": 10}, eval={"eval_steps": 30},
        )  # fmt: skip
        Trainer(cfg, []).fit()
        bundle = export_bundle(out, tmp_path / f"bundle-{on}")
        learned[on] = _language_probability(bundle, spanish, "es")
        shutil.rmtree(out)
    # a hundred language tokens: untrained, <|es|> stays near a hundredth
    assert learned[False] < 0.05
    assert learned[True] > 0.1 and learned[True] > 5 * learned[False]


@pytest.mark.fast
def test_the_training_set_carries_the_language_target_and_the_evaluation_set_does_not(
    tmp_path, tones_dir
):
    from accelerate import Accelerator

    from asrforge.model.build import build_model, build_tokenizer
    from asrforge.train.setup_data import build_datasets, load_splits

    cfg = tiny_config(tmp_path / "run", tones_dir)
    acc = Accelerator(cpu=True)
    train_split, eval_split = load_splits(cfg, acc, tmp_path / "run", resuming=False)
    tokenizer = build_tokenizer(cfg.model, train_split["text"])
    bundle = build_model(cfg.model, tokenizer, cfg.seed)
    train_set, eval_set, _ = build_datasets(
        cfg, tmp_path / "run", acc, bundle, train_split, eval_split
    )
    sot = bundle.specials.sot
    for i in range(4):
        item, held = train_set[i], eval_set[i]
        language = bundle.specials.languages[item["language"]]
        assert item["decoder_input_ids"][0] == sot and item["labels"][0] == language
        assert held["decoder_input_ids"][0] == sot and held["labels"][0] == IGNORE
