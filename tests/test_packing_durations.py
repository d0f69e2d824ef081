"""Packed windows are laid out by the durations start-up knows (the data's ``duration``
column): a clip that decodes longer than its duration said is dropped from its window and
reported, not cut to its planned length with its whole transcript kept."""

from __future__ import annotations

import numpy as np
import pytest

from asrforge.config import PackConfig
from asrforge.data.audio import SAMPLE_RATE, AudioFile
from asrforge.data.dataset import Collator
from tests.test_packing import _packed, tones_parts  # noqa: F401 - the fixture

pytestmark = pytest.mark.fast


def test_a_clip_longer_than_its_duration_is_dropped_from_its_window(tones_parts, monkeypatch):  # noqa: F811
    cfg = PackConfig(enabled=True, single_share=0.0, timestamp_share=0.0, prev_text_share=0.0)
    packing, specials = _packed(tones_parts, multilingual=True, cfg=cfg)
    ds = packing.dataset(0)
    j = next(j for j, w in enumerate(ds.windows) if len(w.pieces) >= 2)
    w = ds.windows[j]
    long = packing.base.utts[w.pieces[0].utt]  # its metadata said less than the file holds
    real = AudioFile.decode

    def longer(self, *args, **kwargs):
        wave = real(self, *args, **kwargs)
        if self.source == packing.base.split[long.row]["audio"]["bytes"]:
            return np.concatenate([wave, np.full(SAMPLE_RATE // 2, 0.1, dtype=np.float32)])
        return wave

    monkeypatch.setattr(AudioFile, "decode", longer)
    batch = Collator(pad_id=specials.eot)([ds[j]])
    assert batch["dropped"] == [long.uid]
    assert batch["dropped_reasons"] == ["audio longer than its duration"]
    kept = [packing.base.utts[p.utt] for p in w.pieces[1:]]
    assert batch["text"] == [" ".join(u.text for u in kept)]


def test_a_clip_whose_header_says_it_is_too_long_is_dropped_without_being_decoded(
    tones_parts,  # noqa: F811
    monkeypatch,
):
    cfg = PackConfig(enabled=True, single_share=0.0, timestamp_share=0.0, prev_text_share=0.0)
    packing, specials = _packed(tones_parts, multilingual=True, cfg=cfg)
    ds = packing.dataset(0)
    j = next(j for j, w in enumerate(ds.windows) if len(w.pieces) >= 2)
    w = ds.windows[j]
    long = packing.base.utts[w.pieces[0].utt]  # hours long, its metadata said a second
    long_bytes = packing.base.split[long.row]["audio"]["bytes"]
    real_seconds, real_decode = AudioFile.seconds, AudioFile.decode
    decoded = []

    def hours(self):
        return 36_000.0 if self.source == long_bytes else real_seconds.fget(self)

    def recording(self, *args, **kwargs):
        decoded.append(self.source == long_bytes)
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(AudioFile, "seconds", property(hours))
    monkeypatch.setattr(AudioFile, "decode", recording)
    batch = Collator(pad_id=specials.eot)([ds[j]])
    assert batch["dropped"] == [long.uid]
    assert batch["dropped_reasons"] == ["audio longer than its duration"]
    assert decoded and not any(decoded)
