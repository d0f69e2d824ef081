"""Training and evaluation print no warnings of transformers' that asrforge's own calls cause:
the decoder's renamed cache argument, and the tokenizer's clean-up flag on a BPE vocabulary."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from asrforge.model.beam import beam_decode
from asrforge.model.decoding import DecodeOptions, decoder_states, greedy_decode
from asrforge.model.tokenizer import load_tokenizer, train_bpe_tokenizer

EOT = 2


def _model() -> WhisperForConditionalGeneration:
    torch.manual_seed(0)
    cfg = WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=40,
        pad_token_id=EOT, bos_token_id=1, eos_token_id=EOT, decoder_start_token_id=1,
        max_source_positions=20, max_target_positions=24, num_mel_bins=8,
        suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    return WhisperForConditionalGeneration(cfg).eval()


def test_decoding_passes_the_cache_under_the_name_transformers_expects():
    model = _model()
    enc = model.model.encoder(torch.randn(2, 8, 40)).last_hidden_state
    prompts = torch.tensor([[1, 5], [1, 6]])
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        greedy, _ = greedy_decode(model, enc, prompts, EOT, 6)
        beam_decode(model, enc, prompts, EOT, 6, DecodeOptions(beam_size=2))
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        states = decoder_states(model, prompts, enc, cache)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert states.shape == (2, 2, 32)
    # the cache was used: the next token's states equal a pass over the whole sequence
    nxt = torch.tensor([[7], [8]])
    with torch.no_grad():
        step = decoder_states(model, nxt, enc, cache)[:, -1]
        fresh = EncoderDecoderCache(DynamicCache(), DynamicCache())
        whole = decoder_states(model, torch.cat([prompts, nxt], 1), enc, fresh)[:, -1]
    torch.testing.assert_close(step, whole, atol=1e-5, rtol=1e-5)
    assert len(greedy) == 2


@pytest.mark.fast
def test_a_tokenizer_saved_with_clean_up_loads_without_the_per_decode_warning(tmp_path, caplog):
    tok = train_bpe_tokenizer(["hello world", "good morning"] * 20, 300)
    tok.clean_up_tokenization_spaces = True
    tok.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(tmp_path)
    assert loaded.clean_up_tokenization_spaces is False
    # transformers says it once per process: forget that it did, so this decode would say it
    logging.Logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        text = loaded.decode(loaded("hello world .")["input_ids"], skip_special_tokens=True)
    assert "clean_up_tokenization_spaces" not in caplog.text
    assert text.strip() == "hello world ."


def test_loading_a_pretrained_model_draws_no_bar_of_tensors(tmp_path, tones_dir, capfd):
    """The model is read from local files: transformers' bar would only fill logs and reports."""
    from transformers.utils import logging as hf_logging

    from asrforge.config import ModelConfig
    from asrforge.model.build import _load_pretrained
    from tests.conftest import save_english_only_model

    pretrained = save_english_only_model(tmp_path, tones_dir)
    capfd.readouterr()
    hf_logging.enable_progress_bar()
    _load_pretrained(ModelConfig(pretrained=str(pretrained)))
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # as the caller had it
