"""Whisper's encoder run over a batch of windows (:func:`encoder_states`) and over windows of
audio (:func:`encode_waves`), the one way every decoder, evaluation and bundle encodes audio."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from asrforge.data.audio import SAMPLE_RATE


@torch.no_grad()
def encode_waves(
    model, extractor, waves: Sequence[np.ndarray], device, sample_rate: int = SAMPLE_RATE
) -> torch.Tensor:
    """(batch, frames, d_model) the encoder output of ``waves``, (n_samples,) windows of audio
    at ``sample_rate`` each at most one encoder window long, through ``extractor`` (a
    transformers ``WhisperFeatureExtractor``) and :func:`encoder_states` on ``device``.

    The features are computed in float32 also under a caller's CPU autocast (a guard measured
    in bf16): the extractor's products would run in bf16 there, which numpy cannot hold."""
    with torch.autocast("cpu", enabled=False):
        feats = np.stack(
            [
                extractor(w, sampling_rate=sample_rate, return_tensors="np").input_features[0]
                for w in waves
            ]
        )
    return encoder_states(model, torch.from_numpy(feats.astype(np.float32)).to(device))


def encoder_states(model, features: torch.Tensor) -> torch.Tensor:
    """(batch, frames, d_model) the encoder's output for log-mel ``features`` (batch, mels,
    frames) of a ``WhisperForConditionalGeneration``.

    On the CPU, without autograd or hooks, the windows are encoded one at a time: a batch's
    activations (four windows of tiny.en: 36 MB for one feed-forward layer) outgrow the CPU's
    caches: four or eight windows of tiny.en or base encoded one at a time took 0.77-0.96x a
    batch's CPU time, with the same output (bench/README.md, "Packed projections and windows
    encoded one at a time").
    A module with hooks (a sharded model's gathers) runs once, on the whole batch.
    The features are cast to the encoder's weight dtype (a float16 or bfloat16 bundle).
    """
    encoder = model.model.encoder
    # transformers' WhisperEncoder feeds its input to conv1 as it comes, and a float32 input
    # meets half-precision weights there.
    features = features.to(encoder.conv1.weight.dtype)
    if (
        features.shape[0] == 1
        or features.device.type != "cpu"
        or torch.is_grad_enabled()
        or any(m._forward_pre_hooks or m._forward_hooks for m in encoder.modules())
    ):
        return encoder(features).last_hidden_state
    return torch.cat([encoder(window[None]).last_hidden_state for window in features])
