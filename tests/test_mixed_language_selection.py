"""A run whose languages fall in different selection groups says so at start, naming the groups
and the rule that picked the policy; ``selection.language`` names the deciding language."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from asrforge.config import load_config
from asrforge.train.setup import build_run_selector

pytestmark = pytest.mark.fast


def _cfg(tmp_path, **selection):
    data = {"output_dir": str(tmp_path / "run"), "data": {"path": str(tmp_path / "data")}}
    return load_config(data={**data, "train": {"max_steps": 10000}, "selection": selection})


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_languages_in_different_groups_are_named_with_the_rule(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="asrforge.train"):
        selector, _ = build_run_selector(_cfg(tmp_path), Counter({"th": 10, "de": 9}))
    assert selector.policy_name == "by_loss"  # Thai, the most frequent, is in group C
    [warning] = _warnings(caplog)
    assert "group C (by_loss): th" in warning and "group A (by_wer): de" in warning
    assert "'th', the most frequent language of the training split (10 of 19)" in warning
    assert "selection.language" in warning
    assert "the most frequent language of the training split (10 of 19)" in selector.why


def test_a_tie_goes_to_the_language_met_first_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="asrforge.train"):
        selector, max_steps = build_run_selector(_cfg(tmp_path), Counter({"de": 10, "th": 10}))
    assert selector.policy_name == "by_wer" and max_steps == 3000
    [warning] = _warnings(caplog)
    assert "'de', the most frequent language of the training split (10 of 20)" in warning


def test_selection_language_decides_without_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="asrforge.train"):
        selector, _ = build_run_selector(
            _cfg(tmp_path, language="de"), Counter({"th": 10, "de": 9})
        )
    assert selector.policy_name == "by_wer" and not _warnings(caplog)
    assert "set in selection.language" in selector.why


def test_languages_of_one_group_need_no_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="asrforge.train"):
        selector, _ = build_run_selector(_cfg(tmp_path), Counter({"de": 10, "es": 9}))
    assert selector.policy_name == "by_wer" and not _warnings(caplog)


def test_a_selection_language_no_training_clip_is_in_is_warned_of(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="asrforge.train"):
        selector, _ = build_run_selector(_cfg(tmp_path, language="zh"), Counter({"en": 10}))
    assert "set in selection.language" in selector.why  # zh's group picks the policy, as asked
    [warning] = _warnings(caplog)
    assert warning.startswith("selection.language zh: no usable clip of the training split")
    assert warning.endswith("picks the checkpoints of a run on en")
