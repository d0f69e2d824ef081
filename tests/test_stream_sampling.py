"""Language sampling in the streamed reader (``data.sampling`` with ``data.stream``): each row's
multiplicity for an epoch drawn from the language column alone, at the shares the weights or
the temperature give, the epoch's length known before it is read, and a resume that sees
exactly the batches an uninterrupted run sees."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from asrforge.config import DataConfig, SamplingConfig, load_config
from asrforge.data.prepare import prepare_split
from asrforge.data.sampling import LanguageSampling, ShardSampling, language_shares
from asrforge.data.sources import load_source
from asrforge.errors import UserError
from asrforge.model.tokenizer import SpecialTokens, train_bpe_tokenizer
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


def _shards(rng, n_shards: int, sizes: dict[str, int]) -> list[np.ndarray]:
    """Each shard's rows' language codes: ``sizes`` rows per language, spread over the shards
    unevenly and shuffled within each."""
    rows = np.asarray([lang for lang, n in sizes.items() for _ in range(n)], dtype=object)
    rows = rows[rng.permutation(len(rows))]
    cuts = np.sort(rng.choice(np.arange(1, len(rows)), n_shards - 1, replace=False))
    return np.split(rows, cuts)


@pytest.mark.fast
@pytest.mark.parametrize(
    "cfg", [SamplingConfig(weights={"en": 1, "es": 1, "sw": 2}), SamplingConfig(temperature=3)]
)
def test_drawn_languages_match_the_shares_and_the_epochs_announced_length(cfg):
    sizes = {"en": 6000, "es": 900, "sw": 100}
    shards = _shards(np.random.default_rng(0), 25, sizes)
    counts = [Counter(s.tolist()) for s in shards]
    sampling = ShardSampling.of(counts, None, cfg, seed=3)
    want = language_shares(sizes, cfg)
    for epoch in (0, 1):
        per_shard = [sampling.multiplicity(epoch, i, s) for i, s in enumerate(shards)]
        # the length announced before the epoch is the one its rows make
        assert [int(m.sum()) for m in per_shard] == sampling.shard_rows(epoch).tolist()
        drawn = Counter()
        for s, m in zip(shards, per_shard, strict=True):
            for lang in sizes:
                drawn[lang] += int(m[s == lang].sum())
        total = sum(drawn.values())
        assert abs(total - 7000) <= 25  # about as long as the training set
        for lang in sizes:
            assert drawn[lang] / total == pytest.approx(want[lang], abs=0.005), lang
    # the rare language repeats, the large one is thinned; a pure function of (seed, epoch)
    m0 = np.concatenate([sampling.multiplicity(0, i, s) for i, s in enumerate(shards)])
    languages = np.concatenate(shards)
    assert m0[languages == "sw"].min() >= 1 and m0[languages == "sw"].mean() > 1
    assert m0[languages == "en"].mean() < 1
    again = np.concatenate([sampling.multiplicity(0, i, s) for i, s in enumerate(shards)])
    assert np.array_equal(m0, again)
    m1 = np.concatenate([sampling.multiplicity(1, i, s) for i, s in enumerate(shards)])
    assert not np.array_equal(m0, m1)


@pytest.mark.fast
def test_a_language_without_a_weight_or_left_out_or_changed_is_handled_by_name():
    counts = [Counter({"en": 10, "sw": 3}), Counter({"en": 5, "lg": 2})]
    with pytest.raises(UserError, match=r"data.sampling.weights: no weight for language\(s\) lg"):
        ShardSampling.of(counts, None, SamplingConfig(weights={"en": 1, "sw": 1}), seed=0)
    # lg left out by data.languages: it needs no weight and never appears
    kept = ShardSampling.of(counts, {"en", "sw"}, SamplingConfig(weights={"en": 1, "sw": 1}), 0)
    rows = np.asarray(["en"] * 5 + ["lg"] * 2, dtype=object)
    assert kept.multiplicity(0, 1, rows)[5:].tolist() == [0, 0]
    with pytest.raises(UserError, match="shard 1 .* 4 rows of language en, 5 when the run"):
        kept.multiplicity(0, 1, rows[1:])


@pytest.mark.fast
def test_sampling_and_replay_stream_and_packing_is_still_refused(tmp_path):
    data = {"path": str(tmp_path), "sampling": {"temperature": 2}, "stream": {"enabled": True},
            "replay": {"path": str(tmp_path)}}  # fmt: skip
    cfg = load_config(data={"output_dir": str(tmp_path), "data": data})
    assert cfg.data.sampling.temperature == 2 and cfg.data.replay is not None
    packed = {**data, "pack": {"enabled": True}}
    with pytest.raises(UserError, match="pack.enabled: not available with stream.enabled"):
        load_config(data={"output_dir": str(tmp_path), "data": packed})


def test_a_streamed_epoch_holds_each_row_its_drawn_times_and_resumes_at_a_batch(
    tmp_path,
    clips,
    tok_specials,  # noqa: F811
):
    path, extra = stream_source("parquet row groups", tmp_path / "corpus", clips)
    language = {r["file"]: r["language"] for r in by_split(clips, "train")}
    sizes = Counter(language.values())
    weights = {"sampling": {"weights": {"en": 1, "es": 3}}, "num_workers": 2}  # read in workers
    cfg = data_config(path, {**extra, **weights})
    stream = open_split(cfg, tok_specials)
    epochs = {}
    for epoch in (0, 1):
        batches = epochs[epoch] = epoch_uids(stream, tmp_path, epoch)
        assert len(batches) == stream.batches_per_epoch(0, 1, epoch)
        assert sum(map(len, batches)) == stream.epoch_rows(epoch)
        seen = Counter(u for b in batches for u in b)
        drawn = Counter()
        for u, n in seen.items():
            drawn[language[u]] += n
        # es is weighted 3 to en's 1 whatever the data's sizes
        assert drawn["es"] / sum(drawn.values()) == pytest.approx(0.75, abs=0.05), sizes
        # resume at batch k: exactly the batches an uninterrupted epoch has from k on
        assert epoch_uids(stream, tmp_path, epoch, start=3) == batches[3:]
    assert epochs[0] != epochs[1]
    # two ranks take the sampled epoch's batches between them, each as many as it is told
    ranks = [epoch_uids(stream, tmp_path, 1, rank=r, world=2) for r in (0, 1)]
    assert [len(b) for b in ranks] == [stream.batches_per_epoch(r, 2, 1) for r in (0, 1)]
    assert [b for pair in zip(*ranks, strict=False) for b in pair] == epochs[1][: 2 * len(ranks[1])]
    assert ranks[0][len(ranks[1]) :] == epochs[1][2 * len(ranks[1]) :]
    # a language of the stream without a weight stops the run before step 1, by name
    unweighted = data_config(path, {**extra, "sampling": {"weights": {"en": 1}}})
    with pytest.raises(UserError, match=r"data.sampling.weights: no weight for language\(s\) es"):
        open_split(unweighted, tok_specials)


def test_streamed_resume_with_language_sampling_is_bit_identical(tmp_path, clips):
    path, extra = stream_source("NeMo manifest", tmp_path / "corpus", clips)
    data = {"path": str(path), "num_workers": 0, "sampling": {"weights": {"en": 1, "es": 3}},
            "stream": {"enabled": True, "shard_rows": 7, "shuffle_shards": 2,
                       "eval_path": extra["stream"]["eval_path"]}}  # fmt: skip
    state = assert_resume_is_bit_identical(tmp_path, path, resume_sections(data))
    assert state["stream_position"]["epoch"] == state["epoch"]
    log = (tmp_path / "full" / "train.log").read_text()
    assert "data.sampling: per streamed epoch of about 48 rows, en 25.0%" in log


def test_rows_without_a_language_are_english_under_an_english_only_model(tmp_path, clips):
    # Half the English rows name no language: under an English-only model they are English's,
    # neither a language of their own in the draw nor left out by data.languages: [en].
    english = [c for c in clips if c["language"] == "en"]
    rows = [dict(r, language="en" if k % 2 else None) for k, r in enumerate(english)]
    path, extra = stream_source("jsonl files", tmp_path / "corpus", rows)
    tok = train_bpe_tokenizer(["la la tone beep boop"] * 20, 300)
    english_only = (tok, SpecialTokens.from_tokenizer(tok, False))
    train = sorted(r["file"] for r in by_split(rows, "train"))
    chosen = {**extra, "languages": ["en"], "sampling": {"temperature": 3}}
    stream = open_split(data_config(path, chosen), english_only)
    assert stream.sampling.languages == ["en"]
    assert stream.left_out() == {}
    # one language: every row once an epoch
    assert sorted(u for b in epoch_uids(stream, tmp_path) for u in b) == train
    # the whole reader reads them alike
    cfg = DataConfig(path=path, **chosen)
    table, report = prepare_split(load_source(cfg).splits["train"], "train", cfg=cfg,
                                  tokenizer=tok, specials=english_only[1],
                                  max_target_positions=64, max_seconds=30.0, lazy=True)  # fmt: skip
    assert table.language_counts() == {"en": len(train)} and not report.left_out
    assert LanguageSampling.of(table, cfg.sampling, seed=0).languages == ["en"]
