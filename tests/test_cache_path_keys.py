"""The log-mel cache of audio given as paths: a file rewritten in place is other audio, and a
cache that outlives the run (``data.cache_dir``) must not serve the old file's log-mels."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
from transformers import WhisperFeatureExtractor

from asrforge.config import DataConfig
from asrforge.data.cache.features import FeatureCache
from asrforge.data.dataset import SpeechDataset
from asrforge.data.prepare import prepare_split
from asrforge.data.sources import load_source
from asrforge.model.tokenizer import SpecialTokens, train_bpe_tokenizer

pytestmark = pytest.mark.fast


def test_a_file_rewritten_in_place_is_not_served_its_old_log_mels(tmp_path):
    (tmp_path / "clips").mkdir()
    tone = np.sin(np.arange(16_000) * 0.05).astype(np.float32) * 0.3
    for k in range(2):
        sf.write(tmp_path / "clips" / f"{k}.wav", tone, 16_000)
    rows = [
        {"audio_filepath": f"clips/{k}.wav", "text": "red blue", "lang": "en"} for k in range(2)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=tmp_path / "train.jsonl", cache_dir=tmp_path / "cache")
    tok = train_bpe_tokenizer(["red blue cat dog sun one two sol mar gato"] * 20, 300)
    specials = SpecialTokens.from_tokenizer(tok, True)
    fe = WhisperFeatureExtractor(chunk_length=2, n_samples=32_000, nb_max_frames=200)

    def dataset() -> SpeechDataset:  # the data read afresh, as the next run reads it
        split = load_source(cfg).splits["train"]
        table, _ = prepare_split(split, "train", cfg=cfg, tokenizer=tok, specials=specials,
                                 max_target_positions=32, max_seconds=2.0)  # fmt: skip
        return SpeechDataset(split, table, fe, specials.eot)

    FeatureCache.build(tmp_path / "features", dataset())
    sf.write(tmp_path / "clips" / "0.wav", tone[:8_000] * 2, 16_000)  # other audio, same path
    ds = dataset()
    fresh = ds.features_of(0)
    ds.feature_cache = FeatureCache.open(tmp_path / "features", fe)
    assert np.array_equal(ds.features_of(0), fresh)
    assert ds.utts[1].audio_key in ds.feature_cache  # the unchanged file is still cached
