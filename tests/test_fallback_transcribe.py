"""``asrforge transcribe --temperature-fallback`` and ``--beam-size`` on real tiny.en: clean
speech is transcribed as without them (no window falls back), in timestamp mode too."""

from __future__ import annotations

import numpy as np
import pytest
from audio_fixtures import synthesize
from test_bundle import one_thread  # noqa: F401  (autouse)
from test_ct2_import import ct2_tiny_en, hf_tiny_en  # noqa: F401  (session fixtures)

from asrforge.text import normalize, wer

TEXT = "The train to the city leaves every hour from platform two."


@pytest.fixture(scope="module")
def bundle(hf_tiny_en):  # noqa: F811  (the imported fixture)
    from asrforge.bundle.export import bundle_from_checkpoint

    return bundle_from_checkpoint(hf_tiny_en)


def test_beam_and_fallback_in_timestamp_mode(bundle) -> None:
    wave = synthesize(TEXT).astype(np.float32)
    [greedy] = bundle.recognize([wave], "en", chunking="timestamps")
    [beam] = bundle.recognize(
        [wave], "en", chunking="timestamps", beam_size=3, temperature_fallback=True
    )
    assert wer([normalize(TEXT, "en")], [normalize(beam.text, "en")]) <= 0.1
    assert beam.segments and all(s.end > s.start for s in beam.segments)
    assert wer([normalize(greedy.text, "en")], [normalize(beam.text, "en")]) <= 0.2
