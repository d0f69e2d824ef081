"""Checkpoint-selection policies, patience, step caps and the language-group table."""

import json
import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from asrforge.config import ConfigError, SelectionConfig, load_config
from asrforge.errors import UserError
from asrforge.selection.groups import default_groups
from asrforge.selection.guard_gate import GuardGate
from asrforge.selection.policies import ByLoss, ByWer, CombinedGate, Patience
from asrforge.selection.selector import Decision, Selector, build_selector


def _evals(*pairs):
    return [{"wer": w, "cer": w / 2, "loss": loss} for w, loss in pairs]


def _saves(policy, evals):
    return [policy.update(m) for m in evals]


# Loss keeps falling while WER explodes (the decoder collapses onto frequent tokens).
COLLAPSE = _evals((0.30, 1.00), (0.32, 0.90), (0.40, 0.80), (0.60, 0.70), (0.90, 0.60))
# The mirror: WER improves while the loss explodes (over-confident, still mostly right).
MIRROR = _evals((0.50, 1.00), (0.45, 1.03), (0.40, 1.50), (0.35, 3.00))


@pytest.mark.fast
def test_collapse_pattern():
    assert _saves(ByLoss(), COLLAPSE) == [True] * 5
    assert _saves(ByWer(), COLLAPSE) == [True, False, False, False, False]
    gate = CombinedGate(wer_tol=0.05, loss_eps=0.05)
    # 2nd: loss improves and wer 0.32 < 0.30 + 0.05. 3rd on: wer >= best 0.30 + 0.05.
    assert _saves(gate, COLLAPSE) == [True, True, False, False, False]
    assert "wer_tol" in gate.reason and "loss" in gate.reason
    # Refused evaluations do not move the bests: best_loss is the 2nd eval's, not 0.6.
    assert (gate.best_wer, gate.best_loss, gate.best_cer) == (0.30, 0.90, 0.15)


@pytest.mark.fast
def test_mirror_pattern():
    assert _saves(ByWer(), MIRROR) == [True] * 4
    assert _saves(ByLoss(), MIRROR) == [True, False, False, False]
    gate = CombinedGate(wer_tol=0.05, loss_eps=0.05)
    assert _saves(gate, MIRROR) == [True, True, False, False]
    assert "loss_eps" in gate.reason


@pytest.mark.fast
def test_combined_gate_bests_take_the_min_on_save():
    gate = CombinedGate(wer_tol=0.1, loss_eps=0.1)
    assert gate.update({"wer": 0.5, "cer": 0.3, "loss": 1.0})
    assert gate.update({"wer": 0.55, "cer": 0.2, "loss": 0.95})  # loss better, wer within tol
    assert (gate.best_wer, gate.best_loss, gate.best_cer) == (0.5, 0.95, 0.2)
    assert not gate.update({"wer": 0.52, "cer": 0.1, "loss": 0.99})  # neither improves
    assert "neither" in gate.reason
    assert gate.best_cer == 0.2


@pytest.mark.fast
def test_first_evaluation_always_saves():
    for policy in (ByWer(), ByLoss(), CombinedGate()):
        assert policy.update({"wer": 5.0, "cer": 4.0, "loss": 80.0})
        assert "first" in policy.reason


@pytest.mark.fast
@pytest.mark.parametrize("bad", [math.nan, math.inf, None])
def test_non_finite_is_never_better(bad):
    for make, key in (
        (ByWer, "wer"),
        (ByLoss, "loss"),
        (CombinedGate, "wer"),
        (CombinedGate, "loss"),
    ):
        policy = make()
        metrics = {"wer": 0.5, "cer": 0.2, "loss": 1.0, key: bad}
        assert not policy.update(metrics)
        assert policy.update({"wer": 0.5, "cer": 0.2, "loss": 1.0})  # bests untouched by it
        assert not policy.update({**metrics, "wer": 0.1, "loss": 0.1, key: bad})


@pytest.mark.fast
def test_by_wer_reason_names_the_comparison():
    policy = ByWer()
    policy.update({"wer": 0.35})
    assert policy.update({"wer": 0.31})
    assert policy.reason == "wer 0.31 < best 0.35"
    assert not policy.update({"wer": 0.4})
    assert policy.reason == "wer 0.4 >= best 0.31"


@pytest.mark.fast
def test_missing_metric_is_a_clear_error():
    with pytest.raises(KeyError, match="'loss'"):
        CombinedGate().update({"wer": 0.3})


@pytest.mark.fast
def test_patience_counts_evaluations_without_a_save():
    sel = Selector(ByWer(), patience=3, max_steps=None)
    decisions = [
        sel.update({"wer": w}, step=i) for i, w in enumerate([0.5, 0.6, 0.4, 0.7, 0.7, 0.7])
    ]
    assert [d.save for d in decisions] == [True, False, True, False, False, False]
    assert [d.should_stop for d in decisions] == [False] * 5 + [True]
    assert "patience 3" in decisions[-1].stop_reason
    assert sel.best_step == 2


@pytest.mark.fast
def test_the_selector_owns_the_best_evaluation_and_resumes_it():
    sel = Selector(ByWer(), patience=3, max_steps=None)
    sel.update({"wer": 0.5, "cer": math.nan, "n": 3, "per_language": {"en": {}}}, step=2)
    sel.update({"wer": 0.6, "cer": 0.1, "n": 3}, step=4)
    # the saved evaluation's finite numbers: the state goes to strict JSON
    assert sel.best_step == 2 and sel.best == {"wer": 0.5, "n": 3}
    assert sel.tracked_bests == {"best_wer": 0.5}
    fresh = Selector(ByWer(), patience=3, max_steps=None)
    fresh.load_state_dict(json.loads(json.dumps(sel.state_dict(), allow_nan=False)))
    assert (fresh.best_step, fresh.best, fresh.evals_without_save) == (2, sel.best, 1)


@pytest.mark.fast
def test_early_stopping_shares_the_selectors_decision_and_patience():
    from asrforge.callbacks.early_stopping import EarlyStopping
    from asrforge.train import events
    from asrforge.train.state import TrainState

    assert events.Decision is Decision  # one payload type for on_eval_end
    es, state = EarlyStopping(monitor="wer", patience=2), TrainState()
    assert isinstance(es.without_improvement, Patience)
    for wer in (0.5, math.inf, math.nan):  # as for the selector, inf and nan never improve
        es.on_eval_end(state, metrics={"wer": wer}, decision=Decision(False, ""))
    assert es.best == 0.5 and state.should_stop and "patience 2" in state.stop_reason
    with pytest.raises(ValueError, match="patience must be >= 1"):
        Patience(0)


@pytest.mark.fast
def test_step_cap_stops():
    sel = Selector(ByLoss(), patience=5, max_steps=3000)
    assert not sel.update({"loss": 1.0}, step=2500).should_stop
    decision = sel.update({"loss": 0.9}, step=3000)
    assert decision.save and decision.should_stop and "max_steps 3000" in decision.stop_reason


_metric = st.one_of(st.floats(0, 2), st.just(math.nan))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(_metric, _metric, _metric), min_size=2, max_size=14),
    st.integers(0, 14),
    st.sampled_from(["by_wer", "by_loss", "combined_gate"]),
)
def test_state_dict_round_trip_mid_sequence(seq, cut, policy):
    cut = min(cut, len(seq))
    evals = [{"wer": w, "cer": c, "loss": loss} for w, c, loss in seq]
    cfg = SelectionConfig(policy=policy, patience=2, wer_tol=0.1, loss_eps=0.1)
    straight = build_selector(cfg, "en", partial=False)
    resumed = build_selector(cfg, "en", partial=False)
    for i, m in enumerate(evals[:cut]):
        straight.update(m, step=i)
        resumed.update(m, step=i)
    state = json.loads(json.dumps(resumed.state_dict(), allow_nan=False))  # strict JSON
    fresh = build_selector(cfg, "en", partial=False)
    fresh.load_state_dict(state)
    for i, m in enumerate(evals[cut:], start=cut):
        assert fresh.update(m, step=i) == straight.update(m, step=i)
    assert fresh.state_dict() == straight.state_dict()


@pytest.mark.fast
def test_loading_another_policys_state_is_refused():
    state = build_selector(SelectionConfig(policy="by_wer"), "en", False).state_dict()
    with pytest.raises(UserError, match="by_wer"):
        build_selector(SelectionConfig(policy="by_loss"), "en", False).load_state_dict(state)


@pytest.mark.fast
@pytest.mark.parametrize(
    "language, policy, max_steps",
    [("de", "by_wer", 3000), ("German", "by_wer", 3000), ("yue", "by_wer", 3000),
     ("Cantonese", "by_wer", 3000), ("th", "by_loss", None), ("burmese", "by_loss", None),
     ("my", "by_loss", None), ("lg", "by_loss", None), ("en", "combined_gate", None),
     ("french", "combined_gate", None), ("haw", "combined_gate", None)],
)  # fmt: skip
def test_shipped_table(language, policy, max_steps):
    sel = build_selector(SelectionConfig(), language, partial=False)
    assert (sel.policy_name, sel.max_steps, sel.patience) == (policy, max_steps, 5)
    assert repr(language) in sel.why and policy in sel.why


@pytest.mark.fast
def test_shipped_table_matches_the_issue():
    groups = default_groups()
    assert {name: g.policy for name, g in groups.items()} == {
        "A": "by_wer",
        "B": "combined_gate",
        "C": "by_loss",
    }
    assert groups["A"].max_steps == 3000 and groups["B"].max_steps is None
    assert len(groups["A"].languages) == 17 and groups["B"].languages == []


@pytest.mark.fast
def test_partial_training_and_explicit_settings():
    sel = build_selector(SelectionConfig(), "de", partial=True)
    assert sel.patience == 3 and "part of the model" in sel.why
    cfg = SelectionConfig(policy="combined_gate", max_steps=100, patience=7, wer_tol=0.2)
    sel = build_selector(cfg, "de", partial=True)
    assert (sel.policy_name, sel.max_steps, sel.patience) == ("combined_gate", 100, 7)
    assert sel.policy.wer_tol == 0.2
    assert "selection.policy set in config" in sel.why


@pytest.mark.fast
def test_config_language_wins():
    sel = build_selector(SelectionConfig(language="thai"), "de", partial=False)
    assert sel.policy_name == "by_loss"
    with pytest.raises(UserError, match="selection.language"):
        build_selector(SelectionConfig(), None, partial=False)


@pytest.mark.fast
def test_unknown_language_names_it():
    with pytest.raises(UserError, match="'germna'.*did you mean 'german'"):
        build_selector(SelectionConfig(), "germna", partial=False)


@pytest.mark.fast
def test_yaml_override_of_groups(tmp_path):
    text = """
output_dir: runs/x
data: {path: data/x}
selection:
  groups:
    tonal: {languages: [thai, vi, zh], policy: by_wer, max_steps: 500}
    rest: {languages: [], policy: by_loss}
"""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    cfg = load_config(path).selection
    sel = build_selector(cfg, "vietnamese", partial=False)
    assert (sel.policy_name, sel.max_steps) == ("by_wer", 500)
    assert "group tonal of selection.groups" in sel.why
    # The shipped table no longer applies: German falls to the override's catch-all.
    assert build_selector(cfg, "de", partial=False).policy_name == "by_loss"


@pytest.mark.fast
def test_bad_group_tables_report_every_problem():
    groups = {
        "X": {"languages": ["de", "germna"], "policy": "by_wer"},
        "Y": {"languages": ["german"], "policy": "by_loss"},
        "Z": {"policy": "by_loss"},
        "W": {"policy": "combined_gate"},
    }
    cfg = SelectionConfig.model_validate({"groups": groups})
    with pytest.raises(ConfigError) as err:
        build_selector(cfg, "en", partial=False)
    problems = "\n".join(err.value.problems)
    assert "selection.groups.X.languages.1: unknown language 'germna'" in problems
    assert "selection.groups.Y.languages.0: 'german' is also in group X" in problems
    assert "Z, W" in problems


@pytest.mark.fast
def test_no_catch_all_group():
    cfg = SelectionConfig.model_validate(
        {"groups": {"only": {"languages": ["de"], "policy": "by_wer"}}}
    )
    assert build_selector(cfg, "de", partial=False).policy_name == "by_wer"
    with pytest.raises(UserError, match="'fr' is in no group"):
        build_selector(cfg, "fr", partial=False)


@pytest.mark.fast
def test_shipped_yaml_is_plain_data():
    from asrforge.selection.groups import GROUPS_FILE

    data = yaml.safe_load(GROUPS_FILE.read_text())
    assert set(data) == {"A", "B", "C"}


@pytest.mark.fast
def test_the_guard_gate_names_the_error_rate_it_judged_by():
    gate = GuardGate(tolerance=0.02)
    gate.set_start(0.10, "wer", {})
    within, why = gate.check({"guard_wer": 0.30, "guard_metric": "cer"})
    assert not within and why.startswith("guard cer 0.3 > start 0.1")
    assert gate.check({"guard_wer": 0.11})[1].startswith("guard wer 0.11 <= start 0.1")
    drift = GuardGate(tolerance=0.02)
    drift.set_start(0.0, "drift", {})
    assert drift.check({"guard_wer": 0.5, "guard_metric": "cer"})[1].startswith("guard drift 0.5")
