"""``asrforge demo`` and signals: a signal that stops the fine-tune (after its checkpoint) stops
the demo with exit 75 and a line saying how to continue; a SIGTERM anywhere else stops it as
Ctrl-C does (130, not the 143 of a process killed by it); the demo's lines say what happened,
not a raw None. The corpus, tiny.en, the measurements and the fine-tune itself are stand-ins: the
demo's own decisions are what is tested."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asrforge.recipes import demo
from asrforge.train.run import FitResult

ROOT = Path(__file__).resolve().parents[1]


class Stage:
    """Stand-ins for the demo's heavy steps; records what ran."""

    def __init__(self, fit_result, *, signal_in_before: bool = False):
        self.fit_result = fit_result
        self.signal_in_before = signal_in_before
        self.ran: list[str] = []

    def install(self, setattr_) -> None:

        stage = self

        class FakeTrainer:
            def __init__(self, cfg, callbacks):
                self.run_dir = Path(cfg.output_dir)

            def fit(self):
                stage.ran.append("fit")
                return FitResult(**{**stage.fit_result, "output_dir": self.run_dir})

        def measure(bundle, *, label, **_kw):
            stage.ran.append(f"measure {label}")
            if stage.signal_in_before and label == "before":
                os.kill(os.getpid(), signal.SIGTERM)
            if label == "after":  # the demo got past the export: enough is known
                raise SystemExit(99)
            return demo.Measurement({"guard_hyps": {}}, [])

        def export_bundle(source, out, **_kw):
            stage.ran.append(f"export {Path(source).name}")
            return out

        card = {"splits": {"validation": {"utterances": 4}}}
        setattr_(demo, "build_corpus", lambda *a, **k: card)
        setattr_(demo, "export_bundle", export_bundle)
        setattr_(demo, "load_bundle", lambda path: path)
        setattr_(demo, "build_callbacks", lambda cfg: [])
        setattr_(demo, "Trainer", FakeTrainer)
        setattr_(demo, "ensure_tiny_en", lambda *a: None)
        setattr_(demo, "ensure_guard_set", lambda *a: None)
        setattr_(demo, "ensure_rehearsal_set", lambda *a: None)
        setattr_(demo, "longform_recording", lambda *a: (Path("long.wav"), "ref", 60.0))
        setattr_(demo, "measure", measure)
        setattr_(demo, "_ct2", lambda *a: (None, None))


def _demo(monkeypatch, tmp_path, capsys, **fit) -> tuple[int, str, Stage]:
    monkeypatch.chdir(ROOT)
    result = dict(
        status="completed", reason="reached max_steps=60", step=60, best_step=None, best={}
    )
    stage = Stage({**result, **fit})
    stage.install(monkeypatch.setattr)
    from asrforge.cli import main

    try:
        rc = main(["demo", "--out", str(tmp_path / "demo")])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().out, stage


@pytest.mark.fast
def test_a_signal_in_the_fine_tune_stops_the_demo_with_75_and_says_how_to_continue(
    monkeypatch, tmp_path, capsys
):
    rc, out, stage = _demo(
        monkeypatch, tmp_path, capsys, status="interrupted", reason="received SIGTERM", step=8
    )
    assert rc == 75
    # nothing after the fine-tune: no export of the starting model, no "after" measurement
    assert stage.ran == ["export whisper-tiny.en", "measure before", "fit"]
    run_dir = tmp_path / "demo" / "train"
    assert f"asrforge train {run_dir / 'config.yaml'} --resume" in out
    assert "step None" not in out and "no checkpoint became best" in out


@pytest.mark.fast
def test_the_export_line_says_no_evaluation_ran_rather_than_that_the_guard_refused(
    monkeypatch, tmp_path, capsys
):
    rc, out, stage = _demo(monkeypatch, tmp_path, capsys, last_metrics={})
    assert rc == 99 and stage.ran[-2:] == ["export whisper-tiny.en", "measure after"]
    assert "refused each one evaluated" not in out
    assert "no evaluation ran" in out and "step None" not in out


@pytest.mark.fast
def test_the_guard_refusal_is_named_when_evaluations_ran(monkeypatch, tmp_path, capsys):
    metrics = {"wer": 0.2, "cer": 0.1, "loss": 1.0, "guard_wer": 0.5}
    rc, out, _ = _demo(monkeypatch, tmp_path, capsys, last_metrics=metrics)
    assert rc == 99 and "the forgetting guard refused each one evaluated" in out


SCRIPT = """
import sys
sys.path[:0] = {paths!r}
from tests.test_demo_signals import Stage
from asrforge.cli import main
Stage(dict(status="completed", reason="r", step=1, best_step=1, best={{}}),
      signal_in_before=True).install(setattr)
sys.exit(main(["demo", "--out", {out!r}]))
"""


def test_a_sigterm_outside_the_fine_tune_exits_130_like_ctrl_c(tmp_path):
    script = SCRIPT.format(paths=[str(ROOT)], out=str(tmp_path / "demo"))
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 130, done.stderr[-2000:]
    assert "asrforge: interrupted" in done.stderr and "Traceback" not in done.stderr
