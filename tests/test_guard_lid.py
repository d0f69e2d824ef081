"""Language identity in the forgetting guard: the gate refuses a save whose language-ID
accuracy fell beyond its tolerance, and a run on a multilingual model measures it from real
decoding, records it and keeps its start through the selection state."""

from __future__ import annotations

import json

import pytest

from asrforge.config import GuardConfig
from asrforge.evaluation.guard_items import load_guard_items
from asrforge.selection.guard_gate import GuardGate, describe_refused
from asrforge.selection.policies import ByWer
from asrforge.selection.selector import Selector


def _gate(lid_tolerance: float | None = 0.05, lid_start: float | None = 0.95) -> GuardGate:
    gate = GuardGate(0.02, lid_tolerance)
    gate.set_start(0.0, "drift", {"a": "hello"}, lid_start)
    return gate


@pytest.mark.fast
def test_a_language_id_drop_beyond_its_tolerance_is_refused_and_within_it_accepted():
    gate = _gate()
    within, why = gate.check({"guard_wer": 0.01, "guard_lid": 0.80})
    assert not within
    assert why == "guard language-ID accuracy 0.8 < start 0.95 - tolerance 0.05"
    assert gate.check({"guard_wer": 0.01, "guard_lid": 0.90})[0]
    assert gate.check({"guard_wer": 0.01, "guard_lid": 1.0})[0]
    assert not gate.check({"guard_wer": 0.01, "guard_lid": float("nan")})[0]
    # the WER is judged first, and a drift beyond its tolerance refuses whatever the LID
    within, why = gate.check({"guard_wer": 0.05, "guard_lid": 1.0})
    assert not within and why.startswith("guard drift 0.05 >")
    # lid_tolerance null, or a guard that measured no LID at the start: not judged
    assert _gate(lid_tolerance=None).check({"guard_wer": 0.0, "guard_lid": 0.0})[0]
    assert _gate(lid_start=None).check({"guard_wer": 0.0, "guard_lid": 0.0})[0]


@pytest.mark.fast
def test_the_selector_refuses_the_save_on_a_language_id_drop():
    selector = Selector(ByWer(), patience=10, max_steps=None, guard=_gate())
    assert selector.update({"wer": 0.5, "guard_wer": 0.0, "guard_lid": 0.95}, step=1).save
    refused = selector.update({"wer": 0.4, "guard_wer": 0.0, "guard_lid": 0.5}, step=2)
    assert not refused.save and refused.unguarded
    assert "language-ID accuracy 0.5 < start 0.95 - tolerance 0.05" in refused.reason
    line = describe_refused(
        2, selector.unguarded, selector.best, before_step=1, selected_on="wer",
        why=selector.unguarded_why,
    )  # fmt: skip
    assert selector.update({"wer": 0.3, "guard_wer": 0.0, "guard_lid": 0.92}, step=3).save
    assert "guard language-ID accuracy 0.5 < start 0.95 - tolerance 0.05" in line
    assert "guard drift" not in line


@pytest.mark.fast
def test_the_language_id_start_rides_in_the_state_and_a_guard_without_one_is_unchanged():
    gate = _gate()
    restored = GuardGate(0.02, 0.05)
    restored.load_state_dict(json.loads(json.dumps(gate.state_dict())))
    assert restored.lid_start == 0.95 and restored.judges_lid
    assert not restored.check({"guard_wer": 0.0, "guard_lid": 0.85})[0]
    plain = _gate(lid_start=None)
    assert "lid_start" not in plain.state_dict()
    assert plain.check({"guard_wer": 0.0}) == (True, "guard drift 0 <= start 0 + tolerance 0.02")


@pytest.mark.fast
def test_audio_files_carry_no_language_of_their_own_and_data_rows_do(tones_dir, tmp_path):
    from asrforge.data.sources import read_split

    rows = load_guard_items(GuardConfig(path=tones_dir, max_items=4), "en", 4.0)
    assert all(i.language_given for i in rows)
    (tmp_path / "clips").mkdir()
    for r in list(read_split(tones_dir, "validation"))[:2]:
        (tmp_path / "clips" / f"{r['id']}.wav").write_bytes(r["audio"]["bytes"])
    files = load_guard_items(GuardConfig(path=tmp_path / "clips"), "en", 4.0)
    assert files and not any(i.language_given for i in files)


@pytest.mark.parametrize("lid_tolerance", [1.0, None])
def test_a_run_on_a_multilingual_model_measures_language_id_and_records_it(
    tones_dir, tmp_path, lid_tolerance
):
    from conftest import tiny_config

    from asrforge.callbacks import build_callbacks
    from asrforge.train.loop import Trainer

    guard = {"path": str(tones_dir), "split": "validation", "mode": "drift", "max_items": 6,
             "tolerance": 10.0, "lid_tolerance": lid_tolerance}  # fmt: skip
    cfg = tiny_config(tmp_path / "run", tones_dir, eval={"guard": guard})
    Trainer(cfg, build_callbacks(cfg)).fit()
    out = tmp_path / "run"
    start = [json.loads(line) for line in (out / "eval" / "guard-step-000000.jsonl").open()]
    evals = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    evals = [e for e in evals if e.get("event") == "eval"]
    state = json.loads((out / "checkpoints" / "best" / "train_state.json").read_text())
    if lid_tolerance is None:
        assert not any("detected" in r for r in start)
        assert not any("guard_lid" in e for e in evals)
        assert "lid_start" not in state["selection"]["guard"]
        return
    assert {r["language"] for r in start} == {"en", "es"}
    right = sum(r["detected"] == r["language"] for r in start) / len(start)
    assert state["selection"]["guard"]["lid_start"] == pytest.approx(right)
    assert [e["step"] for e in evals] == [3, 6]
    for e in evals:
        assert 0.0 <= e["guard_lid"] <= 1.0 and e["guard_lid_start"] == pytest.approx(right)
        assert e["guard_lid_tolerance"] == 1.0
    later = [json.loads(line) for line in (out / "eval" / "guard-step-000006.jsonl").open()]
    assert evals[-1]["guard_lid"] == pytest.approx(
        sum(r["detected"] == r["language"] for r in later) / len(later)
    )
    manifest = json.loads((out / "checkpoints" / "best" / "manifest.json").read_text())
    assert "guard_lid" in manifest["guard"]
    assert "language-ID accuracy" in (out / "train.log").read_text()


@pytest.mark.fast
def test_an_english_only_model_refuses_a_guard_in_another_language(tones_dir, tmp_path):
    from asrforge.data.sources import read_split
    from asrforge.errors import UserError
    from asrforge.evaluation.guard import check_guard_languages

    (tmp_path / "clips").mkdir()
    for r in list(read_split(tones_dir, "validation"))[:2]:
        (tmp_path / "clips" / f"{r['id']}.wav").write_bytes(r["audio"]["bytes"])
    spanish = load_guard_items(GuardConfig(path=tmp_path / "clips", language="es"), "es", 4.0)
    # the rule training data meets under the same model
    with pytest.raises(UserError, match=r"eval.guard: English-only model: its prompt has no "
                                        r"language slot, so it cannot be guarded on 'es' \(2 items\)"):
        check_guard_languages(spanish, multilingual=False, stated="es")
    check_guard_languages(spanish, multilingual=True, stated="es")
    english = load_guard_items(GuardConfig(path=tmp_path / "clips"), "en", 4.0)
    check_guard_languages(english, multilingual=False)
    # audio files that took the run's language (demo-es: tiny.en taught Spanish, guarded on
    # English clips) are English to the model, as rows without a language are
    unlabelled = load_guard_items(GuardConfig(path=tmp_path / "clips"), "es", 4.0)
    assert not any(i.language_given for i in unlabelled)
    check_guard_languages(unlabelled, multilingual=False)
