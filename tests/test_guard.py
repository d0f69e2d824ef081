"""The forgetting guard: a save the policy would make is refused while the guard is outside its
tolerance (every policy), the guard's start survives a resume, and a real run measures it at
step 0 and at every evaluation and records it everywhere a user looks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import soundfile as sf

from asrforge.config import GuardConfig
from asrforge.errors import UserError
from asrforge.evaluation.guard import Guard
from asrforge.evaluation.guard_items import GuardItem, load_guard_items
from asrforge.selection.guard_gate import GuardGate
from asrforge.selection.policies import ByLoss, ByWer, CombinedGate
from asrforge.selection.selector import Selector

POLICIES = {"by_wer": ByWer, "by_loss": ByLoss, "combined_gate": CombinedGate}


def _selector(policy: str, tolerance: float = 0.02) -> Selector:
    gate = GuardGate(tolerance)
    gate.set_start(0.0, "drift", {"a": "hello world"})
    return Selector(POLICIES[policy](), patience=10, max_steps=None, guard=gate)


@pytest.mark.fast
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_rising_drift_blocks_a_save_the_policy_alone_would_make(policy):
    # Every evaluation improves both wer and loss: each policy alone saves every time.
    evals = [
        {"wer": 0.50, "loss": 1.00, "guard_wer": 0.00},
        {"wer": 0.40, "loss": 0.90, "guard_wer": 0.05},  # drift rose past 0 + 0.02
        {"wer": 0.45, "loss": 0.95, "guard_wer": 0.01},  # back within, and better than eval 1
    ]
    alone = Selector(POLICIES[policy](), patience=10, max_steps=None)
    assert [alone.update(m, step=i).save for i, m in enumerate(evals)] == [True, True, False]

    guarded = _selector(policy)
    decisions = [guarded.update(m, step=i) for i, m in enumerate(evals)]
    assert [d.save for d in decisions] == [True, False, True]
    assert "but guard drift 0.05 > start 0 + tolerance 0.02" in decisions[1].reason
    assert "guard drift 0.01 <= start 0 + tolerance 0.02" in decisions[2].reason
    # the refused evaluation moved no best: eval 3 saves because it beats eval 1, not eval 2
    assert guarded.best_step == 2
    assert guarded.evals_without_save == 0


@pytest.mark.fast
def test_drift_alone_does_not_run_out_patience_while_held_out_improves():
    # The demo's measured run: validation WER falls at every evaluation while the drift stays
    # just over the tolerance. The guard refuses each save, but the held-out metrics still
    # improve, so patience (here 2) must not stop the run.
    evals = [
        {"wer": 0.20, "loss": 0.40, "guard_wer": 0.024},
        {"wer": 0.10, "loss": 0.31, "guard_wer": 0.029},
        {"wer": 0.096, "loss": 0.30, "guard_wer": 0.021},
        {"wer": 0.09, "loss": 0.29, "guard_wer": 0.015},  # back within: saves
    ]
    sel = Selector(CombinedGate(), patience=2, max_steps=None, guard=_gate())
    decisions = [sel.update(m, step=25 * (i + 1)) for i, m in enumerate(evals)]
    assert [d.save for d in decisions] == [False, False, False, True]
    assert not any(d.should_stop for d in decisions)
    assert sel.best_step == 100


@pytest.mark.fast
def test_patience_judges_held_out_progress_against_refused_evaluations_too():
    # Eval 2 is refused but sets the held-out best (0.10); evals 3 and 4 beat the last saved
    # 0.30 yet not 0.10: no held-out progress, so patience 2 runs out at eval 4.
    evals = [
        {"wer": 0.30, "loss": 0.50, "guard_wer": 0.00},
        {"wer": 0.10, "loss": 0.30, "guard_wer": 0.05},
        {"wer": 0.20, "loss": 0.40, "guard_wer": 0.05},
        {"wer": 0.25, "loss": 0.45, "guard_wer": 0.05},
    ]
    sel = Selector(ByWer(), patience=2, max_steps=None, guard=_gate())
    decisions = [sel.update(m, step=i) for i, m in enumerate(evals)]
    assert [d.save for d in decisions] == [True, False, False, False]
    assert [d.should_stop for d in decisions] == [False, False, False, True]
    assert "held-out metrics did not improve in 2 evaluations" in decisions[3].stop_reason
    # the held-out bests ride in the checkpoint, so a resumed run counts the same
    state = json.loads(json.dumps(sel.state_dict()))
    resumed = Selector(ByWer(), patience=4, max_steps=None, guard=GuardGate(0.02))
    resumed.load_state_dict(state)
    assert resumed.held_out_state == sel.held_out_state
    assert not resumed.update({"wer": 0.15, "loss": 0.4, "guard_wer": 0.05}, step=4).should_stop
    assert resumed.evals_without_save == 3 and resumed.held_out_state["best_wer"] == 0.10


def _gate(tolerance: float = 0.02) -> GuardGate:
    gate = GuardGate(tolerance)
    gate.set_start(0.0, "drift", {"a": "hello world"})
    return gate


@pytest.mark.fast
def test_guard_on_its_tolerance_saves_and_a_nan_guard_never_does():
    sel = _selector("by_wer", tolerance=0.02)
    assert sel.update({"wer": 0.5, "loss": 1, "guard_wer": 0.02}).save  # exactly start + tol
    assert not sel.update({"wer": 0.4, "loss": 1, "guard_wer": math.nan}).save
    with pytest.raises(KeyError, match="guard_wer"):
        sel.update({"wer": 0.3, "loss": 1})


@pytest.mark.fast
def test_guard_start_rides_in_the_selector_state():
    sel = _selector("combined_gate")
    sel.update({"wer": 0.5, "loss": 1.0, "guard_wer": 0.0}, step=2)
    state = json.loads(json.dumps(sel.state_dict()))  # it goes to train_state.json

    resumed = Selector(CombinedGate(), patience=10, max_steps=None, guard=GuardGate(0.02))
    resumed.load_state_dict(state)
    assert resumed.guard.start == 0.0 and resumed.guard.kind == "drift"
    assert resumed.guard.start_transcripts == {"a": "hello world"}
    assert not resumed.update({"wer": 0.4, "loss": 0.9, "guard_wer": 0.5}).save

    unguarded = Selector(CombinedGate(), patience=10, max_steps=None)
    unguarded_state = unguarded.state_dict()
    with pytest.raises(UserError, match="without the forgetting guard"):
        Selector(
            CombinedGate(), patience=10, max_steps=None, guard=GuardGate(0.02)
        ).load_state_dict(unguarded_state)


def _items(*refs):
    return [GuardItem(f"u{i}", np.zeros(1600, np.float32), r, "en") for i, r in enumerate(refs)]


@pytest.mark.fast
def test_drift_is_scored_against_the_start_transcripts():
    guard = Guard(
        _items(None, None),
        mode="auto",
        features=None,
        tokenizer=None,
        prompt=lambda _: [],
        eot=0,
        batch_size=2,
        max_new_tokens=4,
    )
    assert guard.kind == "drift"
    gate = GuardGate(0.02)
    gate.set_start(0.0, "drift", {"u0": "the cat sat", "u1": "on the mat"})
    assert guard.score(["the cat sat", "on the mat"], gate) == 0.0
    assert guard.score(["the dog sat", "on the mat"], gate) == pytest.approx(1 / 6)
    with_refs = Guard(
        _items("a b", "c d"),
        mode="auto",
        features=None,
        tokenizer=None,
        prompt=lambda _: [],
        eot=0,
        batch_size=2,
        max_new_tokens=4,
    )
    assert with_refs.kind == "wer"
    assert with_refs.score(["a b", "c x"], gate) == pytest.approx(0.25)


@pytest.mark.fast
def test_unspaced_languages_are_guarded_by_cer_as_evaluation_judges_them():
    """A Chinese sentence is one "word": one wrong character made the old guard's WER 100%,
    so a barely changed model looked like it forgot everything. CER, as evaluation uses."""
    from asrforge.evaluation.guard import log_text

    def guard(language: str, refs: tuple[str, str] | None) -> Guard:
        items = [
            GuardItem(
                f"u{k}", np.zeros(1600, np.float32), None if refs is None else refs[k], language
            )
            for k in range(2)
        ]
        return Guard(
            items,
            mode="auto",
            features=None,
            tokenizer=None,
            prompt=lambda _: [],
            eot=0,
            batch_size=2,
            max_new_tokens=4,
        )

    zh = guard("zh", ("今天天气很好", "我们去公园散步"))
    assert zh.metric == "cer"
    gate = GuardGate(0.02)
    assert zh.score(["今天天气很好", "我们去公园散跑"], gate) == pytest.approx(1 / 13)
    metrics = zh.metrics(1 / 13, gate)
    assert metrics["guard_metric"] == "cer" and "guard cer 0.0769" in log_text(metrics)
    # drift against the start's transcripts: CER too, and said so
    drift = guard("ja", None)
    gate.set_start(0.0, "drift", {"u0": "今日は晴れです", "u1": "公園に行きます"})
    assert drift.score(["今日は晴れです", "公園に行きました"], gate) == pytest.approx(2 / 14)
    assert "guard drift (cer)" in log_text(drift.metrics(0.1, gate))
    # spaced languages keep WER
    en = guard("en", ("the cat sat", "on the mat"))
    assert en.metric == "wer"
    assert en.score(["the cat sat", "on the hat"], gate) == pytest.approx(1 / 6)


@pytest.mark.fast
def test_guard_audio_is_cut_into_windows_and_bad_paths_are_named(tmp_path):
    sr = 16000
    rng = np.random.default_rng(0)
    long = np.concatenate(
        [0.3 * rng.standard_normal(sr * 3), np.zeros(sr // 2), 0.3 * rng.standard_normal(sr * 2)]
    ).astype(np.float32)
    sf.write(tmp_path / "b-long.wav", long, sr)
    sf.write(tmp_path / "a-short.wav", long[:sr], sr)
    (tmp_path / "notes.txt").write_text("not audio")
    items = load_guard_items(GuardConfig(path=tmp_path, max_items=None), "en", window_seconds=4.0)
    assert [i.id for i in items] == ["a-short", "b-long#0", "b-long#1"]
    assert all(i.wave.shape[0] <= 4 * sr and i.reference is None for i in items)
    assert sum(i.wave.shape[0] for i in items[1:]) == long.shape[0]
    assert len(load_guard_items(GuardConfig(path=tmp_path, max_items=2), "en", 4.0)) == 2
    with pytest.raises(UserError, match="does not exist"):
        load_guard_items(GuardConfig(path=tmp_path / "nope"), "en", 4.0)
    with pytest.raises(UserError, match="mode: wer needs a reference"):
        load_guard_items(GuardConfig(path=tmp_path, mode="wer"), "en", 4.0)


def test_a_run_measures_the_guard_from_step_0_and_records_it(tones_dir, tmp_path):
    from conftest import tiny_config

    from asrforge.callbacks import build_callbacks
    from asrforge.train.loop import Trainer

    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        eval={
            "guard": {
                "path": str(tones_dir),
                "split": "validation",
                "mode": "drift",
                "max_items": 6,
                "tolerance": 10.0,
            }
        },
    )
    result = Trainer(cfg, build_callbacks(cfg)).fit()
    out = tmp_path / "run"
    start = [json.loads(line) for line in (out / "eval" / "guard-step-000000.jsonl").open()]
    assert len(start) == 6 and all(r["kind"] == "drift" for r in start)
    evals = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    evals = [e for e in evals if e.get("event") == "eval"]
    assert [e["step"] for e in evals] == [3, 6]
    assert all(e["guard_drift"] and e["guard_start"] == 0.0 and "guard_wer" in e for e in evals)
    summary = json.loads((out / "eval" / "step-000003.jsonl").read_text().splitlines()[-1])
    assert "guard_wer" in summary and "guard drift" in summary["reason"]
    assert "guard drift" in (out / "train.log").read_text()
    best = out / "checkpoints" / "best"
    manifest = json.loads((best / "manifest.json").read_text())
    assert manifest["guard"]["guard_drift"] is True
    state = json.loads((best / "train_state.json").read_text())
    assert len(state["selection"]["guard"]["start_transcripts"]) == 6
    assert result.best_step is not None


@pytest.mark.fast
def test_guard_data_in_any_source_form_gives_the_saved_datasets_items(tones_dir, tmp_path):
    """A NeMo manifest, a Common Voice CSV (columns mapped, audio beside it) and a CSV of paths
    alone (no text: drift) give the windows, references and languages of the same clips in a
    saved DatasetDict; a missing split and a bad column are named under eval.guard."""
    from asrforge.data.sources import read_split

    saved = load_guard_items(GuardConfig(path=tones_dir, max_items=None), "en", 4.0)
    root = tmp_path / "corpus"
    (root / "clips").mkdir(parents=True)
    rows = []
    for r in read_split(tones_dir, "validation"):
        (root / "clips" / f"{r['id']}.wav").write_bytes(r["audio"]["bytes"])
        rows.append((f"clips/{r['id']}.wav", r["text"], r["language"]))
    manifest = root / "guard.jsonl"
    manifest.write_text("".join(json.dumps({"audio_filepath": f, "text": t, "lang": lang}) + "\n"
                                for f, t, lang in rows))  # fmt: skip
    locales = {"en": "en-US", "es": "es-ES"}
    (root / "cv.csv").write_text("path,sentence,locale\n" + "".join(
        f"{f},{t},{locales[lang]}\n" for f, t, lang in rows))  # fmt: skip
    (root / "paths.csv").write_text("audio\n" + "".join(f"{f}\n" for f, _, _ in rows))
    cache = tmp_path / "cache"
    cv_columns = {"audio": "path", "text": "sentence", "language": "locale"}
    for path, columns in ((manifest, {}), (root / "cv.csv", cv_columns), (root, {})):
        if path == root:  # a directory of data files: its validation split
            (root / "validation.jsonl").write_text(manifest.read_text())
        cfg = GuardConfig(path=path, columns=columns, max_items=None)
        items = load_guard_items(cfg, "en", 4.0, cache)
        assert [i.id for i in items] == [f for f, _, _ in rows]
        assert [(i.reference, i.language) for i in items] == [
            (s.reference, s.language) for s in saved
        ]
        for item, expected in zip(items, saved, strict=True):
            np.testing.assert_array_equal(item.wave, expected.wave)
    drift = load_guard_items(GuardConfig(path=root / "paths.csv", max_items=3), "es", 4.0, cache)
    assert [(i.reference, i.language) for i in drift] == [(None, "es")] * 3
    with pytest.raises(UserError, match="mode: wer needs a reference"):
        load_guard_items(GuardConfig(path=root / "paths.csv", mode="wer"), "es", 4.0, cache)
    with pytest.raises(UserError) as e:
        load_guard_items(GuardConfig(path=root, split="test"), "en", 4.0, cache)
    assert str(e.value) == f"eval.guard.split 'test': not in {root} (it has validation)"
    with pytest.raises(UserError) as e:
        cfg = GuardConfig(path=root / "cv.csv", columns={"audio": "path", "text": "transcript"})
        load_guard_items(cfg, "en", 4.0, cache)
    assert str(e.value).startswith(
        f"eval.guard.columns.text: column 'transcript' not in {root / 'cv.csv'}"
    )


@pytest.mark.fast
def test_a_directory_of_recordings_with_a_sidecar_file_is_still_audio_files(tones_dir, tmp_path):
    """Recordings with a metadata.csv or a notes.json beside them (no split in their names, so
    data.path would not read the directory as data) are the audio-file guard they were before
    eval.guard.path read data files; a split-named file beside recordings makes it data."""
    from asrforge.data.sources import read_split

    guard = tmp_path / "recordings"
    guard.mkdir()
    rows = list(read_split(tones_dir, "validation"))[:3]
    for r in rows:
        (guard / f"{r['id']}.wav").write_bytes(r["audio"]["bytes"])
    (guard / "metadata.csv").write_text("file_name,speaker\nx.wav,a\n")
    (guard / "notes.json").write_text('{"recorded": "2026"}\n')
    items = load_guard_items(GuardConfig(path=guard, max_items=None), "en", 4.0)
    assert [i.id for i in items] == sorted(str(r["id"]) for r in rows)
    assert all(i.reference is None for i in items)
    lines = [{"audio": f"{r['id']}.wav", "text": r["text"]} for r in rows]
    (guard / "validation.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    items = load_guard_items(GuardConfig(path=guard, max_items=None), "en", 4.0, tmp_path / "c")
    assert [i.reference for i in items] == [r["text"] for r in rows]


@pytest.mark.fast
@pytest.mark.parametrize("bad", ['{"language": "en"', "[1, 2]", "\xff"])
def test_a_damaged_step_0_guard_record_is_named(tmp_path, bad):
    from asrforge.evaluation.guard import recorded_language

    assert recorded_language(tmp_path) is None
    (tmp_path / "eval").mkdir()
    path = tmp_path / "eval" / "guard-step-000000.jsonl"
    path.write_text('{"language": "de"}\n\n{"language": "de"}\n')
    assert recorded_language(tmp_path) == "de"
    if bad == "\xff":
        path.write_bytes(b'{"language": "de"}\n\xff\n')
    else:
        path.write_text(f'{{"language": "de"}}\n{bad}\n')
    with pytest.raises(UserError, match="guard-step-000000.jsonl"):
        recorded_language(tmp_path)
