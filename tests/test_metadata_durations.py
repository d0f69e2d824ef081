"""A ``duration`` from the data is metadata, not the file: a clip longer than the window is
dropped and reported when it is decoded, whatever its metadata said, never cut silently."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

from asrforge.config import DataConfig
from asrforge.data.dataset import SpeechDataset
from asrforge.data.prepare import prepare_split
from asrforge.data.sources import load_source
from asrforge.model.tokenizer import SpecialTokens, train_bpe_tokenizer

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("lazy", [True, False])
def test_a_clip_longer_than_its_duration_says_is_dropped_not_cut(tmp_path, lazy):
    (tmp_path / "clips").mkdir()
    rows = []
    for k, seconds in enumerate([1.0, 3.0]):  # the window is 2 s: the second clip is too long
        sf.write(tmp_path / "clips" / f"{k}.wav", np.full(int(seconds * 16_000), 0.1), 16_000)
        rows.append({"audio_filepath": f"clips/{k}.wav", "text": "red blue", "lang": "en",
                     "duration": 1.0})  # fmt: skip  # the second's metadata is wrong
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=tmp_path / "train.jsonl", cache_dir=tmp_path / "cache")
    split = load_source(cfg).splits["train"]
    tok = train_bpe_tokenizer(["red blue cat dog sun one two sol mar gato"] * 20, 300)
    specials = SpecialTokens.from_tokenizer(tok, True)
    table, report = prepare_split(split, "train", cfg=cfg, tokenizer=tok, specials=specials,
                                  max_target_positions=32, max_seconds=2.0, lazy=lazy)  # fmt: skip
    assert len(table) == 2 and not report.skipped  # the metadata is all start-up reads
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(chunk_length=2, n_samples=32_000, nb_max_frames=200)
    ds = SpeechDataset(split, table, fe, specials.eot)
    assert "input_features" in ds[0]
    assert ds[1] == {"dropped": "clips/1.wav", "reason": "audio longer than 2 s"}
