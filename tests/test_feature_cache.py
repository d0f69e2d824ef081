"""The log-mel cache: windows read back bit for bit, stored trimmed, reused, extended, refused
when features are random."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from transformers import WhisperFeatureExtractor

from asrforge.data.cache.features import FeatureCache, trim, untrim
from asrforge.data.dataset import SpeechDataset
from asrforge.data.prepare import prepare_split
from asrforge.data.sources import load_arrow
from asrforge.errors import UserError
from asrforge.model.build import build_model, build_tokenizer
from tests.conftest import tiny_config


def _dataset(tones_dir, tmp_path, split="train", fe=None) -> SpeechDataset:
    cfg = tiny_config(tmp_path / "run", tones_dir)
    dd = load_arrow(cfg.data.path)
    tokenizer = build_tokenizer(cfg.model, dd["train"]["text"])
    bundle = build_model(cfg.model, tokenizer, cfg.seed)
    utts, _ = prepare_split(
        dd[split],
        split,
        cfg=cfg.data,
        tokenizer=tokenizer,
        specials=bundle.specials,
        max_target_positions=bundle.model.config.max_target_positions,
        max_seconds=bundle.model.config.max_source_positions / 50.0,
    )
    return SpeechDataset(dd[split], utts, fe or bundle.features, bundle.specials.eot)


@pytest.mark.fast
@given(
    arrays(
        np.float32,
        st.tuples(st.integers(1, 6), st.integers(1, 12)),
        elements=st.sampled_from([-0.5, 0.0, 0.25, 1.0]),
    ),
)
def test_trim_then_untrim_gives_back_every_bit(features):
    columns, fill = trim(features)
    assert columns.shape[1] <= features.shape[1]
    assert np.array_equal(untrim(columns, fill, features.shape[1]), features)


def test_cached_windows_equal_computed_ones_and_are_stored_trimmed(tones_dir, tmp_path, caplog):
    # a 30 s Whisper window over 1-2 s clips: most of each window is padding
    ds = _dataset(tones_dir, tmp_path, fe=WhisperFeatureExtractor(feature_size=80))
    computed = [ds.features_of(i) for i in range(len(ds))]
    cache = FeatureCache.build(tmp_path / "cache", ds)
    assert len(cache) == len({u.audio_key for u in ds.utts})
    ds.feature_cache = cache
    for i, want in enumerate(computed):
        got = ds.features_of(i)
        assert got.dtype == np.float32 and got.shape == want.shape == (80, 3000)
        assert np.array_equal(got, want)
    stored = sum(n for _, n, _ in cache.index.values())
    assert stored < 0.2 * 3000 * len(cache)  # the padding is not stored
    # a second build (another run, same extractor) computes nothing
    with caplog.at_level(logging.INFO, logger="asrforge"):
        again = FeatureCache.build(tmp_path / "cache", ds)
    assert f"all {len(ds.utts)} utterances cached" in caplog.text
    assert again.values == cache.values


def test_a_new_split_extends_the_cache_and_earlier_rows_still_read_back(tones_dir, tmp_path):
    train = _dataset(tones_dir, tmp_path, "train")
    valid = _dataset(tones_dir, tmp_path, "validation")
    first = FeatureCache.build(tmp_path / "cache", train)
    both = FeatureCache.build(tmp_path / "cache", valid)
    assert both.values != first.values and len(both) == len(first) + len(valid.utts)
    reopened = FeatureCache.open(tmp_path / "cache", train.fe)
    for ds in (train, valid):
        want = [ds.features_of(i) for i in range(len(ds))]
        ds.feature_cache = reopened
        assert all(np.array_equal(ds.features_of(i), w) for i, w in enumerate(want))
    # each build streamed into its own named file; no temporary is left behind
    assert reopened.values == both.values and not list(reopened.directory.glob(".*"))
    # another extractor's settings: another cache
    assert FeatureCache.open(tmp_path / "cache", WhisperFeatureExtractor(feature_size=128)) is None


@pytest.mark.fast
def test_dithering_extractor_is_refused(tones_dir, tmp_path):
    ds = _dataset(tones_dir, tmp_path, fe=WhisperFeatureExtractor(feature_size=80, dither=1.0))
    with pytest.raises(UserError, match="data.cache_features.*dither"):
        FeatureCache.build(tmp_path / "cache", ds)
    assert not (tmp_path / "cache").exists()


def test_a_run_with_cache_features_trains_like_one_without(tones_dir, tmp_path):
    from asrforge.train.events import Callback
    from asrforge.train.loop import Trainer

    class Losses(Callback):
        name = "losses"

        def __init__(self):
            self.losses = []

        def on_step_end(self, state, *, metrics):
            self.losses.append(metrics["loss"])

    runs = {}
    for cached in (False, True):
        cfg = tiny_config(
            tmp_path / f"run-{cached}",
            tones_dir,
            train={"max_steps": 4},
            data={"cache_features": cached, "cache_dir": str(tmp_path / "cache")},
            eval={"eval_steps": 2},
        )
        rec = Losses()
        result = Trainer(cfg, [rec]).fit()
        runs[cached] = (rec.losses, result)
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 4
    (key_dir,) = (tmp_path / "cache" / "features").iterdir()
    assert (
        len(FeatureCache.open(tmp_path / "cache" / "features", _dataset(tones_dir, tmp_path).fe))
        > 0
    )
    assert key_dir.is_dir()


def test_a_build_never_removes_a_data_file_another_run_reads(tones_dir, tmp_path):
    """Run A reads the cache (its DataLoader workers reopen the file by name every epoch); run B
    extends it: A's file survives while A holds it, and goes with the next build after A ends."""
    import pickle

    train = _dataset(tones_dir, tmp_path, "train")
    valid = _dataset(tones_dir, tmp_path, "validation")
    first = FeatureCache.build(tmp_path / "cache", train)
    reader = FeatureCache.open(tmp_path / "cache", train.fe)  # run A, held
    worker = pickle.loads(pickle.dumps(reader))  # what a spawned DataLoader worker gets
    second = FeatureCache.build(tmp_path / "cache", valid)  # run B
    assert second.values != first.values
    key = train.utts[0].audio_key
    assert np.array_equal(worker.features(key), first.features(key))  # reopened by name
    assert (first.directory / first.values).exists()
    for held in (first, reader, worker):  # run A ends
        held.data.close()
    test = _dataset(tones_dir, tmp_path, "test")
    third = FeatureCache.build(tmp_path / "cache", test)
    # A's file is gone now; the second build's is still held by `second` in this process
    names = sorted(p.name for p in third.directory.iterdir())
    assert names == sorted(["index.json", third.values, second.values])


@pytest.mark.fast
def test_killed_builds_leave_temporaries_the_next_build_removes(tmp_path):
    from asrforge.data.cache.files import SharedData, remove_unused

    (tmp_path / "values-current.f32").write_bytes(b"\0" * 8)
    (tmp_path / ".values-killed.f32").write_bytes(b"\0" * 8)  # its writer is gone: no lock
    (tmp_path / "values-read.f32").write_bytes(b"\0" * 8)
    held = SharedData(tmp_path / "values-read.f32", "f32")
    assert held.array.shape == (2,)
    removed = remove_unused(tmp_path, "values-*.f32", keep="values-current.f32")
    assert removed == [".values-killed.f32"]
    held.close()
    assert remove_unused(tmp_path, "values-*.f32", keep="values-current.f32") == ["values-read.f32"]
