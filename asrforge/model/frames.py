"""Whisper's time grid: how many encoder positions a second of audio makes, hence how long the
window the encoder sees is."""

from __future__ import annotations

HOP_LENGTH = 160
"""Samples between log-mel frames: 100 frames per second."""
ENCODER_POSITIONS_PER_SECOND = 50
"""The encoder's stride-2 convolution halves the 100 log-mel frames per second."""

TIME_PRECISION = 1 / ENCODER_POSITIONS_PER_SECOND
"""Seconds per timestamp token step (0.02: Whisper's ``<|0.00|>``, ``<|0.02|>``, ...): one
encoder position."""


def window_seconds(model_config) -> float:
    """The encoder's window in seconds (30 for Whisper's models): a ``WhisperConfig``'s (or a
    ``ModelConfig``'s) ``max_source_positions`` at :data:`ENCODER_POSITIONS_PER_SECOND`."""
    return model_config.max_source_positions / ENCODER_POSITIONS_PER_SECOND
