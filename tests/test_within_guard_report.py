"""What an export within the guard reports: each share's verdict names the figure that decided
it (a language's own, when only that language is outside), the bundle records every language's
figures, and its ``source.metrics`` are what was measured of the interpolated weights."""

from __future__ import annotations

import json
import re

import pytest
from conftest import tiny_config

import asrforge.bundle.within_guard as within_guard
from asrforge.callbacks import build_callbacks
from asrforge.evaluation.guard import Guard, log_text
from asrforge.selection.guard_gate import GuardGate
from asrforge.train.loop import Trainer


@pytest.fixture
def refused_run(tmp_path, tones_dir, monkeypatch):
    """A run whose guard refused every trained step (kept in best-unguarded/), its guard's start
    recorded with a start for English and for French."""
    monkeypatch.setattr(Guard, "measure", lambda self, model, gate, **kw: self.metrics(0.5, gate))
    guard = {"path": str(tones_dir), "split": "validation", "mode": "drift", "max_items": 2}
    cfg = tiny_config(
        tmp_path / "run", tones_dir,
        eval={"at_start": True, "guard": guard}, selection={"policy": "by_loss"},
    )  # fmt: skip
    Trainer(cfg, build_callbacks(cfg)).fit()
    recorded = within_guard.recorded_gate

    def with_languages(ckpt, tolerance):
        gate = recorded(ckpt, tolerance)
        gate.language_starts = {"en": 0.0, "fr": 0.0}
        return gate

    monkeypatch.setattr(within_guard, "recorded_gate", with_languages)
    return tmp_path / "run"


def by_share(monkeypatch, figures):
    """Guard.measure gives, share after share, ``(pooled, french)`` drift (English none)."""
    queue = iter(figures)

    def measure(self, model, gate, **kw):
        pooled, french = next(queue)
        return self.metrics(pooled, gate, by_language={"en": (0.0, "wer"), "fr": (french, "wer")})

    monkeypatch.setattr(Guard, "measure", measure)


def test_a_share_refused_by_one_language_names_it_and_the_bundle_describes_its_own_weights(
    refused_run, tmp_path, monkeypatch, capsys
):
    from asrforge.cli import main

    by_share(monkeypatch, [(0.01, 0.05), (0.005, 0.01)])  # share 1.0: pooled within, fr not
    out = tmp_path / "bundle"
    monkeypatch.chdir(tmp_path)  # the run named relative to here
    assert main(["export", refused_run.name, "--within-guard", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    first = next(x for x in printed.splitlines() if "share 1:" in x)
    assert "outside: guard drift of 'fr' 0.05 > start 0 + tolerance 0.02" in first
    assert "(start 0.0000, within tolerance 0.02)" in first  # the pooled figure was within
    assert "fr 0.0500 (start 0.0000, OUTSIDE)" in first
    assert re.search(r"0\.9 of the \w+ weights of step \d+ over 0\.1 of the starting", printed)

    source = json.loads((out / "inference_config.json").read_text())["source"]
    facts = source["within_guard"]
    refused, chosen = facts["measured"]
    assert refused["within"] is False and "'fr'" in refused["why"]
    assert refused["languages"]["fr"]["value"] == 0.05 and not refused["languages"]["fr"]["within"]
    assert chosen["languages"]["fr"]["value"] == 0.01 and chosen["within"] is True
    # source.metrics: measured of the 0.9 share; the step's own figures kept apart, named
    assert source["metrics"]["guard_wer"] == 0.005
    assert source["metrics"]["guard_languages"]["fr"]["value"] == 0.01
    assert "loss" not in source["metrics"]
    unguarded = refused_run / "checkpoints" / "best-unguarded" / "manifest.json"
    assert source["finetuned_metrics"] == json.loads(unguarded.read_text())["metrics"]
    # named from the run down, as from any directory, and never the directories above it
    assert facts["start"] == "run/checkpoints/step-000000"
    assert facts["finetuned"] == source["checkpoint"] == "run/checkpoints/best-unguarded"
    assert str(tmp_path) not in (out / "inference_config.json").read_text()


def test_no_share_within_names_the_language_that_refused_the_last(
    refused_run, tmp_path, monkeypatch, capsys
):
    from asrforge.cli import main

    by_share(monkeypatch, [(0.01, 0.05), (0.01, 0.04)])
    argv = ["export", str(refused_run), "--within-guard", "--shares", "1,0.5", "--out",
            str(tmp_path / "b")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "share 0.5: guard drift of 'fr' 0.04 > start 0 + tolerance 0.02" in err
    assert not (tmp_path / "b").exists()


def test_the_log_line_keeps_the_pooled_verdict_and_names_the_language_outside():
    gate = GuardGate(0.02)
    gate.set_start(0.0163, "wer", {}, language_starts={"en": 0.01, "fr": 0.02})
    guard = Guard([], mode="wer", features=None, tokenizer=None, prompt=lambda lang: [0], eot=0,
                  batch_size=1, max_new_tokens=4)  # fmt: skip
    metrics = guard.metrics(0.0347, gate, by_language={"en": (0.02, "wer"), "fr": (0.0526, "wer")})
    line = log_text(metrics)
    assert "guard wer 0.0347 (start 0.0163, within tolerance 0.02)" in line
    assert "fr 0.0526 (start 0.0200, OUTSIDE)" in line and line.endswith("OUTSIDE by fr")
