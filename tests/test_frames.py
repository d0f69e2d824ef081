"""The encoder's window length has one source, asrforge.model.frames (it was ``/ 50`` written in
five places); the config's own ``chunk_seconds`` must agree with it."""

from __future__ import annotations

import pytest
from transformers import WhisperConfig

from asrforge.bundle.contents import feature_config
from asrforge.config import ModelConfig
from asrforge.model.frames import window_seconds

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("positions", [1500, 100])
def test_every_window_length_is_the_same_rate(positions):
    whisper = WhisperConfig(max_source_positions=positions, num_mel_bins=80)
    seconds = positions / 50
    assert window_seconds(whisper) == seconds
    assert window_seconds(ModelConfig(max_source_positions=positions)) == seconds
    assert ModelConfig(max_source_positions=positions).chunk_seconds == seconds
    assert feature_config(whisper).chunk_length == positions // 50


def test_an_exported_window_of_a_fraction_of_a_second_rounds_down_as_before():
    """A pretrained model's window need not be whole seconds (the config only checks its own)."""
    whisper = WhisperConfig(max_source_positions=175, num_mel_bins=80)
    assert window_seconds(whisper) == 3.5
    assert feature_config(whisper).chunk_length == 3


def test_a_timestamp_token_is_one_encoder_position_in_every_layer():
    """model/ holds the step once; data/ (below model/ in the layers) keeps a copy that must
    stay equal, or packed targets and decoded timestamps would disagree."""
    from asrforge.data import targets
    from asrforge.model import decoding, frames, tokenizer

    assert frames.TIME_PRECISION == 0.02 == 1 / frames.ENCODER_POSITIONS_PER_SECOND
    assert targets.TIME_PRECISION == tokenizer.TIME_PRECISION == decoding.TIME_PRECISION == 0.02


def test_the_built_and_the_imported_front_ends_are_the_same(tmp_path):
    """Model building and the CTranslate2 import make the feature extractor in one place; its
    settings are transformers' for openai's Whisper (tiny.en's preprocessor_config.json)."""
    from transformers import WhisperFeatureExtractor

    from asrforge.model.build import feature_extractor

    ours = feature_extractor(80, window_seconds(WhisperConfig(max_source_positions=1500)))
    ours.save_pretrained(tmp_path)
    again = WhisperFeatureExtractor.from_pretrained(tmp_path)
    for name in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft"):
        assert getattr(again, name) == getattr(WhisperFeatureExtractor(), name), name
    assert (again.padding_value, again.return_attention_mask) == (0.0, False)
