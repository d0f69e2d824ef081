"""Selection for languages written without spaces judges the character error rate: there a word
error rate counts whole sentences (one wrong character of nine: WER 1.0, CER 0.11).
``selection.unspaced_error_rate: wer`` keeps WER; the selection line and the evaluation records
say which."""

from __future__ import annotations

import json

import pytest

from asrforge.config import SelectionConfig
from asrforge.errors import UserError
from asrforge.selection.selector import build_selector
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config

# one wrong character in every sentence, fewer of them at the second evaluation
FIRST = {"wer": 1.0, "cer": 0.30, "loss": 2.0}
SECOND = {"wer": 1.0, "cer": 0.11, "loss": 2.0}


@pytest.mark.fast
@pytest.mark.parametrize("language, policy", [("yue", "by_wer"), ("zh", "combined_gate")])
def test_unspaced_languages_are_selected_by_cer(language, policy):
    selector = build_selector(SelectionConfig(), language, partial=False)
    assert selector.policy_name == policy and selector.error_metric == "cer"
    assert f"→ {policy} on CER" in selector.why
    selector.update(FIRST, step=10)
    decision = selector.update(SECOND, step=20)
    assert decision.save and selector.best_step == 20
    assert "cer 0.11 < best 0.3" in decision.reason


@pytest.mark.fast
def test_the_setting_restores_wer_and_the_line_says_so():
    cfg = SelectionConfig(unspaced_error_rate="wer")
    selector = build_selector(cfg, "cantonese", partial=False)
    assert selector.error_metric == "wer" and "selection.unspaced_error_rate: wer" in selector.why
    selector.update(FIRST, step=10)
    decision = selector.update(SECOND, step=20)
    assert not decision.save and "wer 1 >= best 1" in decision.reason


@pytest.mark.fast
def test_spaced_languages_keep_wer():
    selector = build_selector(SelectionConfig(), "de", partial=False)
    assert selector.error_metric == "wer" and "CER" not in selector.why


@pytest.mark.fast
def test_a_resume_judged_by_the_other_rate_names_the_setting():
    state = build_selector(SelectionConfig(unspaced_error_rate="wer"), "yue", False).state_dict()
    with pytest.raises(UserError, match="selection.unspaced_error_rate: wer to resume"):
        build_selector(SelectionConfig(), "yue", False).load_state_dict(state)


@pytest.mark.fast
def test_a_by_loss_language_resumes_a_state_saved_before_the_rate_was_recorded():
    selector = build_selector(SelectionConfig(), "th", partial=False)  # group C: by_loss
    state = selector.state_dict()
    del state["error_metric"]
    build_selector(SelectionConfig(), "th", False).load_state_dict(state)
    assert selector.selected_on == "loss"


def test_the_evaluation_records_name_the_rate_selected_on(tmp_path, tones_dir):
    cfg = tiny_config(tmp_path / "run", tones_dir, selection={"language": "yue"})
    Trainer(cfg).fit()
    lines = (tmp_path / "run" / "eval" / "step-000003.jsonl").read_text().splitlines()
    summary = json.loads(lines[-1])
    assert summary["selected_on"] == "cer" and "cer" in summary["reason"]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "→ by_wer on CER" in log
