"""Language sampling (``data.sampling``): each epoch's utterances drawn by language at shares
from weights or a temperature, a pure function of (seed, epoch), resumed exactly."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from asrforge.config import SamplingConfig
from asrforge.data.prepare import Utterance
from asrforge.data.sampling import LanguageSampling, language_shares
from asrforge.errors import UserError
from tests.test_resume import assert_resume_is_bit_identical


def _utts(counts: dict[str, int]) -> list[Utterance]:
    rows = [lang for lang, n in counts.items() for _ in range(n)]
    return [Utterance(i, f"u{i}", lang, "t", [1], [2]) for i, lang in enumerate(rows)]


@pytest.mark.fast
def test_shares_follow_the_weights_or_the_temperature_over_the_sizes():
    counts = {"en": 90, "es": 10}
    assert language_shares(counts, SamplingConfig(weights={"en": 1, "es": 3})) == {
        "en": 0.25,
        "es": 0.75,
    }
    same = language_shares(counts, SamplingConfig(temperature=1))
    assert same == pytest.approx({"en": 0.9, "es": 0.1})
    flatter = language_shares(counts, SamplingConfig(temperature=5))
    assert 0.1 < flatter["es"] < 0.5 and flatter["en"] + flatter["es"] == pytest.approx(1)
    with pytest.raises(UserError, match="no weight for language"):
        language_shares(counts, SamplingConfig(weights={"en": 1}))
    with pytest.raises(UserError, match="weighs 0"):
        language_shares(counts, SamplingConfig(weights={"en": 0, "es": 0}))


@pytest.mark.fast
def test_sampling_config_needs_one_way():
    with pytest.raises(ValueError, match="one of weights and temperature"):
        SamplingConfig()
    with pytest.raises(ValueError, match="finite and >= 0"):
        SamplingConfig(weights={"en": -1})


@pytest.mark.fast
def test_packed_windows_hold_the_drawn_utterances():
    from types import SimpleNamespace

    from asrforge.config import PackConfig
    from asrforge.data.packing import Packing

    utts = _utts({"en": 30, "es": 6})
    for u in utts:
        u.seconds = 1.0
    sampling = LanguageSampling.of(utts, SamplingConfig(weights={"en": 1, "es": 1}), seed=0)
    packing = Packing(
        base=SimpleNamespace(utts=utts, augment=None), cfg=PackConfig(enabled=True), seed=0,
        max_samples=16000 * 30, max_positions=448, no_timestamps=0, start_of_prev=None,
        timestamps=None, sampling=sampling,
    )  # fmt: skip
    windows, stats = packing.windows(0)
    placed = Counter(p.utt for w in windows for p in w.pieces)
    assert stats.utterances == 36 and sum(placed.values()) == 36
    assert placed == Counter(sampling.order(0).tolist())  # the draw, each place once
    assert all(len({utts[p.utt].language for p in w.pieces}) == 1 for w in windows)
    assert {placed[i] for i in range(30, 36)} == {3}  # each Spanish utterance three times


@pytest.mark.fast
def test_an_epoch_draws_each_language_at_its_share_repeating_the_small_one_evenly():
    utts = _utts({"en": 30, "es": 6})
    sampling = LanguageSampling.of(utts, SamplingConfig(weights={"en": 1, "es": 1}), seed=0)
    order = sampling.order(0)
    assert len(order) == 36
    by_lang = Counter(utts[i].language for i in order)
    assert by_lang == {"en": 18, "es": 18}
    es_draws = Counter(int(i) for i in order if utts[i].language == "es")
    assert set(es_draws.values()) == {3}  # each Spanish utterance three times
    en_draws = Counter(int(i) for i in order if utts[i].language == "en")
    assert set(en_draws.values()) == {1}  # 18 distinct English ones
    assert np.array_equal(order, sampling.order(0))
    assert not np.array_equal(order, sampling.order(1))
    other_seed = LanguageSampling.of(utts, SamplingConfig(weights={"en": 1, "es": 1}), seed=1)
    assert not np.array_equal(order, other_seed.order(0))


PACKED = {
    "model": {"max_source_positions": 200, "max_target_positions": 64},
    "pack": {"enabled": True, "gap_seconds": [0.05, 0.3]},
}


@pytest.mark.parametrize("packed", [False, True], ids=["utterances", "packed"])
def test_resume_with_language_sampling_is_bit_identical(tmp_path, tones_dir, packed):
    pack = {"pack": PACKED["pack"], "batch_size": 2} if packed else {"batch_size": 8}
    sections = dict(
        model={"dropout": 0.1, **(PACKED["model"] if packed else {})},
        data={**pack, "sampling": {"weights": {"en": 1, "es": 3}}},
        train={"max_steps": 8, "grad_accum": 2},
        eval={"eval_steps": 4},
        checkpoint={"save_total_limit": 5},
    )
    assert_resume_is_bit_identical(tmp_path, tones_dir, sections, stop_at=3)
    log = (tmp_path / "full" / "train.log").read_text()
    assert "data.sampling: per epoch of 48 utterances, en 25.0% (has 66.7%), es 75.0%" in log
