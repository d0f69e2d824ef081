"""Rehearsal in the streamed reader (``data.replay`` with ``data.stream``): the drawn replay
utterances, checked before step 1, join every streamed epoch once each, spread over its blocks,
and a resume sees exactly the batches an uninterrupted run sees."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from asrforge.config import ReplayConfig
from asrforge.data.prepare import prepare_split
from asrforge.data.replay import REPLAY_PREFIX, read_replay, replay_picks
from asrforge.data.stream import replay_blocks
from tests.test_forgetting import _replay_manifest
from tests.test_resume import assert_resume_is_bit_identical
from tests.test_sources import by_split
from tests.test_stream import (  # noqa: F401 - tok_specials is a fixture
    data_config,
    epoch_uids,
    open_split,
    resume_sections,
    stream_source,
    tok_specials,
)


@pytest.mark.fast
def test_replay_utterances_are_spread_over_the_blocks_by_their_rows():
    parts = replay_blocks(10, [30, 0, 10, 60], seed=0, epoch=4)
    assert [len(p) for p in parts] == [3, 0, 1, 6]
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))
    again = replay_blocks(10, [30, 0, 10, 60], seed=0, epoch=4)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = replay_blocks(10, [30, 0, 10, 60], seed=0, epoch=5)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))
    assert [len(p) for p in replay_blocks(3, [0, 0], seed=0, epoch=0)] == [3, 0]


def test_a_streamed_epoch_holds_every_row_and_each_replay_pick_once(
    tmp_path,
    clips,
    tok_specials,  # noqa: F811
):
    path, extra = stream_source("parquet row groups", tmp_path / "corpus", clips)
    stream = open_split(data_config(path, {**extra, "num_workers": 2}), tok_specials)
    tok, specials = tok_specials
    replay = ReplayConfig(path=_replay_manifest(tmp_path / "corpus", clips, n=5))
    split = read_replay(replay, None)
    utts, _ = prepare_split(split, "replay", cfg=stream.cfg, tokenizer=tok, specials=specials,
                            max_target_positions=64, max_seconds=30.0)  # fmt: skip
    picks = replay_picks(len(utts), 12, seed=0)  # 5 usable, 12 drawn: some twice
    stream.join_replay(split, utts, picks)
    batches = epoch_uids(stream, tmp_path)
    assert len(batches) == stream.batches_per_epoch(0, 1, 0) == -(-(48 + 12) // 5)
    seen = Counter(u for b in batches for u in b)
    train = {r["file"] for r in by_split(clips, "train")}
    assert {u: n for u, n in seen.items() if u in train} == dict.fromkeys(train, 1)
    replayed = Counter(u for u in seen.elements() if u.startswith(REPLAY_PREFIX))
    assert replayed == Counter(REPLAY_PREFIX + utts[int(k)].uid for k in picks)
    # the replay rows are spread through the epoch, not gathered at its end
    assert any(u.startswith(REPLAY_PREFIX) for u in batches[0] + batches[1] + batches[2])
    assert epoch_uids(stream, tmp_path, 0, start=4) == batches[4:]


def test_streamed_resume_with_replay_and_sampling_is_bit_identical(tmp_path, clips):
    path, extra = stream_source("NeMo manifest", tmp_path / "corpus", clips)
    replay = _replay_manifest(tmp_path / "corpus", clips, n=6)
    data = {"path": str(path), "num_workers": 0, "sampling": {"weights": {"en": 1, "es": 3}},
            "replay": {"path": str(replay), "share": 0.2},
            "stream": {"enabled": True, "shard_rows": 7, "shuffle_shards": 2,
                       "eval_path": extra["stream"]["eval_path"]}}  # fmt: skip
    sections = resume_sections(data, distill_weight=1.0)
    state = assert_resume_is_bit_identical(tmp_path, path, sections)
    assert state["stream_position"]["epoch"] == state["epoch"]
    log = (tmp_path / "full" / "train.log").read_text()
    # a fifth of 48 + 12: 12 replay rows drawn from the 6, each twice
    assert "data.replay: 12 utterances drawn from 6 usable ones" in log
