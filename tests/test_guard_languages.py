"""A guard of several languages judges each language against its own start: a language too
small to move the pooled figure is still not forgotten unseen."""

from __future__ import annotations

import numpy as np
import pytest

from asrforge.evaluation.guard import Guard, log_text
from asrforge.evaluation.guard_items import GuardItem
from asrforge.selection.guard_gate import GuardGate, describe_refused, largest_share_within
from asrforge.selection.policies import ByWer
from asrforge.selection.selector import Selector

pytestmark = pytest.mark.fast

EN = ["the cat sat down", "a red sun rose", "we go home now", "it is very cold"] * 2
ES = ["el sol sale hoy", "la mar esta azul"]


def guard(mode: str = "wer", languages=("en", "es")) -> Guard:
    texts = [(t, "en") for t in EN] + ([(t, "es") for t in ES] if "es" in languages else [])
    items = [
        GuardItem(f"g{k}", np.zeros(16, np.float32), text, lang)
        for k, (text, lang) in enumerate(texts)
    ]
    return Guard(items, mode=mode, features=None, tokenizer=None, prompt=lambda lang: [0],
                 eot=0, batch_size=4, max_new_tokens=8)  # fmt: skip


def measured(g: Guard, gate: GuardGate, start_hyps: list[str], hyps: list[str]) -> dict:
    """The guard's metrics for ``hyps`` after a start that transcribed ``start_hyps``."""
    g.transcribe = lambda model, **kw: start_hyps
    g.measure_start(None, gate, device="cpu")
    g.transcribe = lambda model, **kw: hyps
    return g.measure(None, gate, device="cpu")


def test_a_language_that_drifts_alone_is_refused_though_the_pooled_figure_is_within():
    g, gate = guard(), GuardGate(0.3)
    # Spanish loses one of its two sentences: 4 of 40 words pooled, 4 of 8 in Spanish
    metrics = measured(g, gate, EN + ES, EN + ["uno dos tres cuatro", ES[1]])
    assert metrics["guard_wer"] == pytest.approx(0.1) and gate.start == 0.0
    spanish, english = metrics["guard_languages"]["es"], metrics["guard_languages"]["en"]
    assert spanish == {"value": 0.5, "start": 0.0, "metric": "wer", "within": False}
    assert english["within"] and english["value"] == 0.0
    assert metrics["guard_within"] is False
    within, why = gate.check(metrics)
    assert not within and why == "guard wer of 'es' 0.5 > start 0 + tolerance 0.3"
    assert "es 0.5000 (start 0.0000, OUTSIDE)" in log_text(metrics)
    # the same figures with Spanish kept pass
    kept = g.metrics(0.0, gate, None, g.score_by_language(EN + ES, gate.start_transcripts))
    assert kept["guard_within"] and gate.check(kept)[0]


def test_each_language_is_judged_against_its_own_start_which_a_resume_keeps():
    g, gate = guard(), GuardGate(0.3)
    # the start already gets a Spanish sentence wrong (0.5): 0.75 is within 0.5 + 0.3
    start = EN + ["uno dos tres cuatro", ES[1]]
    metrics = measured(g, gate, start, EN + ["uno dos tres cuatro", "la mar"])
    assert gate.language_starts == {"en": 0.0, "es": 0.5}
    assert metrics["guard_languages"]["es"]["within"] and gate.check(metrics)[0]
    resumed = GuardGate(0.3)
    resumed.load_state_dict(gate.state_dict())
    assert resumed.language_starts == gate.language_starts
    assert resumed.check(metrics) == gate.check(metrics)


def test_a_guard_of_one_language_keeps_one_pooled_figure():
    g, gate = guard(languages=("en",)), GuardGate(0.02)
    metrics = measured(g, gate, EN, EN)
    assert "guard_languages" not in metrics and gate.language_starts == {}
    assert "language_starts" not in gate.state_dict()


def test_the_end_message_names_the_language_the_guard_refused():
    """Through the selector, as a run reports it: the pooled figure was within, one language
    was not, and the end message says which (the figures the selector keeps are numbers only)."""
    g, gate = guard(), GuardGate(0.3)
    start = measured(g, gate, EN + ES, EN + ES)
    selector = Selector(ByWer(), patience=10, max_steps=None, guard=gate)
    assert selector.update({"wer": 0.4, **start}, step=0).save
    g.transcribe = lambda model, **kw: EN + ["uno dos tres cuatro", ES[1]]
    metrics = g.measure(None, gate, device="cpu")
    assert not selector.update({"wer": 0.2, **metrics}, step=6).save
    text = describe_refused(
        6, selector.unguarded, selector.start, before_step=0, selected_on="wer",
        why=selector.unguarded_why,
    )  # fmt: skip
    assert "wer 0.4000 -> 0.2000 since step 0; guard wer of 'es' 0.5 > start 0 + tolerance 0.3" in text
    # the pooled figure was within: the message does not say it was not
    assert "guard wer 0.1 >" not in text and "'en'" not in text
    resumed = Selector(ByWer(), patience=10, max_steps=None, guard=GuardGate(0.3))
    resumed.load_state_dict(selector.state_dict())
    assert resumed.unguarded_why == selector.unguarded_why


def test_interpolation_takes_the_largest_share_every_language_accepts():
    g, gate = guard(), GuardGate(0.3)
    measured(g, gate, EN + ES, EN + ES)
    hyps = {1.0: EN + ["uno dos tres cuatro", ES[1]], 0.8: EN + ES}
    share, pairs = largest_share_within(
        lambda s: g.metrics(
            g.score(hyps[s], gate), gate, None, g.score_by_language(hyps[s], gate.start_transcripts)
        ),
        [1.0, 0.8],
        gate,
    )
    assert share == 0.8
    assert [(a, m["guard_wer"]) for a, m in pairs] == [(1.0, pytest.approx(0.1)), (0.8, 0.0)]
