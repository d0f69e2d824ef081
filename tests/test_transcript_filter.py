"""Filtering poor transcripts (``data.filter_wer``): rows the starting model disagrees with are
dropped before training and reported by reason; the scores are computed once and cached."""

from __future__ import annotations

import json

import pytest

from asrforge.config import load_config
from asrforge.data.rules import SkipReport
from asrforge.errors import UserError
from asrforge.train import transcript_filter
from asrforge.train.loop import Trainer
from asrforge.train.transcript_filter import REASON, filter_transcripts
from tests.conftest import save_english_only_model, tiny_config


@pytest.mark.fast
def test_filter_wer_needs_a_pretrained_model_and_refuses_streaming(tmp_path):
    base = {"output_dir": str(tmp_path)}
    with pytest.raises(UserError, match="data.filter_wer: needs model.pretrained"):
        load_config(data={**base, "data": {"path": str(tmp_path), "filter_wer": 0.5}})
    with pytest.raises(UserError, match="filter_wer: not available with stream.enabled"):
        load_config(data={**base, "data": {"path": str(tmp_path), "filter_wer": 0.5,
                                           "stream": {"enabled": True}}})  # fmt: skip


def _prepared(tmp_path, tones_dir):
    """The tones' English training rows as a run prepares them, with a tiny pretrained model."""
    from asrforge.train.setup import prepare_run

    pretrained = save_english_only_model(tmp_path, tones_dir)
    cfg = tiny_config(
        tmp_path / "run", tones_dir,
        model={"pretrained": str(pretrained)}, data={"languages": ["en"]},
    )  # fmt: skip
    return cfg, prepare_run(cfg, precision="no", resume=False)


@pytest.mark.fast
def test_rows_above_the_threshold_are_dropped_reported_and_scored_once(
    tmp_path, tones_dir, monkeypatch
):
    from asrforge.data.dataset import SpeechDataset

    cfg, setup = _prepared(tmp_path, tones_dir)
    try:
        train_set = setup.train_set
        utts = train_set.utts
        bad = set(utts.uids()[:5])
        calls = []

        def fake_evaluate(model, loader, **kw):
            preds = []
            for batch in loader:
                calls.append(batch["size"])
                for uid, ref, lang in zip(
                    batch["uid"], batch["text"], batch["language"], strict=True
                ):
                    preds.append({"uid": uid, "ref": ref, "language": lang,
                                  "hyp": "zzz qqq" if uid in bad else ref})  # fmt: skip
            return {}, preds

        monkeypatch.setattr(transcript_filter, "evaluate", fake_evaluate)
        kw = dict(model=setup.model, tokenizer=setup.model_bundle.tokenizer,
                  eot=setup.model_bundle.specials.eot, device="cpu")  # fmt: skip
        strict = cfg.model_copy(update={"data": cfg.data.model_copy(update={"filter_wer": 0.5})})
        dataset = SpeechDataset(train_set.split, utts, train_set.fe, train_set.eot)
        report = SkipReport("train", total=len(utts))
        kept = filter_transcripts(strict, tmp_path / "cache", dataset, report, **kw)
        assert len(kept) == len(utts) - 5
        assert set(kept.uids()).isdisjoint(bad)
        assert sorted(report.skipped[REASON]) == sorted(bad)
        assert sum(calls) == len(utts)
        # scored once: a second run (another threshold) reads the cached scores
        calls.clear()
        lenient = strict.model_copy(
            update={"data": strict.data.model_copy(update={"filter_wer": 2.0})}
        )
        again = filter_transcripts(lenient, tmp_path / "cache", dataset, SkipReport("train"), **kw)
        assert calls == [] and len(again) == len(utts)
        cached = list((tmp_path / "cache" / "filter").glob("*.json"))
        assert len(cached) == 1 and len(json.loads(cached[0].read_text())) == len(utts)
        # eval_batch_size auto scores in batches of batch_size off a GPU
        auto = strict.model_copy(
            update={"data": strict.data.model_copy(update={"eval_batch_size": "auto"})}
        )
        calls.clear()
        filter_transcripts(auto, tmp_path / "cache-auto", dataset, SkipReport("train"), **kw)
        assert sum(calls) == len(utts) and max(calls) == cfg.data.batch_size < len(utts)
    finally:
        setup.close()


def test_a_run_filters_with_the_real_starting_model_and_reuses_its_scores(
    tmp_path, tones_dir, caplog
):
    pretrained = save_english_only_model(tmp_path, tones_dir)
    shared = {"languages": ["en"], "cache_dir": str(tmp_path / "cache")}
    # an untrained model gets every row wrong: a strict threshold leaves nothing to train on
    cfg = tiny_config(
        tmp_path / "strict", tones_dir,
        model={"pretrained": str(pretrained)}, data={**shared, "filter_wer": 0.01},
        train={"max_steps": 1},
    )  # fmt: skip
    with pytest.raises(UserError, match="no usable utterances"), caplog.at_level("INFO"):
        Trainer(cfg, []).fit()
    assert "data.filter_wer: 0 of 32 training utterances kept" in caplog.text
    assert REASON in caplog.text  # the skip report's line names the reason
    # a lenient one keeps every row, from the scores the first run cached
    lenient = tiny_config(
        tmp_path / "lenient", tones_dir,
        model={"pretrained": str(pretrained)}, data={**shared, "filter_wer": 1000.0},
        train={"max_steps": 1}, eval={"eval_steps": None, "at_start": False},
    )  # fmt: skip
    result = Trainer(lenient, []).fit()
    assert result.status == "completed"
    log = (tmp_path / "lenient" / "train.log").read_text()
    assert "data.filter_wer: the starting model's scores read from" in log
    assert "data.filter_wer: 32 of 32 training utterances kept" in log
