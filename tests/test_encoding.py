"""The encoder's output for a batch of windows: on the CPU one window at a time, the same rows
as one batch; with hooks on the encoder (a sharded model's gathers) or autograd, one batch."""

from __future__ import annotations

import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from asrforge.model.encoding import encoder_states


def _model() -> WhisperForConditionalGeneration:
    torch.manual_seed(0)
    cfg = WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=40,
        num_mel_bins=8, max_source_positions=20, max_target_positions=16, pad_token_id=2,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    return WhisperForConditionalGeneration(cfg).eval()


def _counted(model) -> list[int]:
    """The batch sizes the encoder is called with, recorded by a wrapper (not a hook)."""
    encoder, sizes = model.model.encoder, []
    forward = encoder.forward

    def counting(features, *args, **kwargs):
        sizes.append(features.shape[0])
        return forward(features, *args, **kwargs)

    encoder.forward = counting
    return sizes


@pytest.mark.fast
def test_cpu_windows_are_encoded_one_at_a_time_with_the_batchs_output():
    model = _model()
    features = torch.randn(3, 8, 40)
    with torch.no_grad():
        whole = model.model.encoder(features).last_hidden_state
        sizes = _counted(model)
        states = encoder_states(model, features)
    assert sizes == [1, 1, 1]
    assert states.shape == whole.shape
    assert torch.allclose(states, whole, atol=1e-6)


@pytest.mark.fast
def test_an_encoder_with_hooks_or_autograd_runs_one_batch():
    model = _model()
    features = torch.randn(3, 8, 40)
    sizes = _counted(model)
    encoder_states(model, features).sum().backward()  # autograd on
    assert sizes == [3]
    assert model.model.encoder.conv1.weight.grad is not None
    model.model.encoder.layers[0].register_forward_pre_hook(lambda module, args: None)
    with torch.no_grad():
        encoder_states(model, features)
    assert sizes == [3, 3]


@pytest.mark.fast
def test_float32_features_meet_a_bfloat16_encoder_in_its_dtype():
    model = _model()
    features = torch.randn(2, 8, 40)
    with torch.no_grad():
        full = encoder_states(model, features)
        half = encoder_states(model.to(torch.bfloat16), features)
    assert half.dtype == torch.bfloat16
    assert torch.allclose(half.float(), full, atol=0.1)
