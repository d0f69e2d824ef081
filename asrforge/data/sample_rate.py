"""The sample rate Whisper's feature extractor takes, which every audio reader decodes to.

Its own module so light importers (the tones generator the matrix launcher runs) need not load
torch with :mod:`asrforge.data.audio`.
"""

SAMPLE_RATE = 16_000
"""Hz."""
