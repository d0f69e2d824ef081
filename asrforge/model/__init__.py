"""Model and tokenizer building (``ModelConfig`` -> ``WhisperForConditionalGeneration``)."""
