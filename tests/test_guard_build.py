"""``asrforge guard build``: clips joined into recordings of one language that fit a window,
each clip once, written as data the training run's guard reads (references from a file or the
starting model, or none: drift); bad inputs exit 2 naming the input."""

from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import Path

import pytest

from asrforge.cli import main
from asrforge.config import GuardConfig
from asrforge.data.guard_set import MANIFEST
from asrforge.evaluation.guard_items import load_guard_items
from tests.conftest import tiny_config


def manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]


def by_language(tmp_path: Path, clips: list[dict]) -> dict[str, Path]:
    """The clips in a directory per language (``tmp_path/<lang>``)."""
    dirs = {}
    for c in clips:
        d = dirs.setdefault(c["language"], tmp_path / c["language"])
        d.mkdir(exist_ok=True)
        (d / Path(c["file"]).name).write_bytes((tmp_path / "corpus" / c["file"]).read_bytes())
    return dirs


@pytest.mark.fast
def test_windows_fit_hold_one_language_and_cover_every_clip_once(tmp_path, clips, capsys):
    dirs = by_language(tmp_path, clips)
    out = tmp_path / "guard es-en"
    argv = ["guard", "build", str(dirs["en"]), str(dirs["es"]), "--out", str(out)]
    assert main([*argv, "--language", "en", "--language", "es"]) == 0
    printed = capsys.readouterr().out
    assert "0 with references (the guard measures drift" in printed
    # the override it suggests pastes into a shell whole, though the path has a space
    suggestion = printed.splitlines()[-1].removeprefix("use it with ")
    assert shlex.split(suggestion) == [f"eval.guard.path={out}"]
    rows = manifest(out)
    joined = Counter(Path(c).name for r in rows for c in r["clips"])
    assert joined == Counter(Path(c["file"]).name for c in clips)  # every clip, once
    assert all(0 < r["duration"] <= 28.0 for r in rows) and len(rows) < len(clips) / 5
    for r in rows:
        lang = {c["language"] for c in clips if Path(c["file"]).name in map(_name, r["clips"])}
        assert lang == {r["language"]} and "text" not in r  # no references: drift
        assert r["id"].startswith(f"guard-{r['language']}-") and (out / r["audio"]).is_file()
    assert main([*argv, "--language", "en"]) == 2  # --out is not empty
    assert "--out" in capsys.readouterr().err


def _name(path: str) -> str:
    return Path(path).name


@pytest.mark.fast
def test_references_and_their_languages_come_from_a_file_and_reach_the_guard(tmp_path, clips):
    refs = tmp_path / "corpus" / "refs.jsonl"
    refs.write_text("".join(
        json.dumps({"path": c["file"], "text": c["text"], "language": c["language"]}) + "\n"
        for c in clips))  # fmt: skip
    out = tmp_path / "guard"
    argv = ["guard", "build", str(tmp_path / "corpus" / "clips"), "--references", str(refs),
            "--window-seconds", "1.9", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = {Path(c["file"]).name: c["text"] for c in clips}
    rows = manifest(out)
    for r in rows:
        assert r["duration"] <= 1.9 and r["text"] == " ".join(text[_name(c)] for c in r["clips"])
    # the guard reads them as recordings of one window each, with their references
    items = load_guard_items(GuardConfig(path=out, max_items=None), "en", 2.0)
    assert [(i.id, i.reference, i.language) for i in items] == [
        (r["id"], r["text"], r["language"]) for r in rows
    ]


@pytest.mark.fast
def test_two_inputs_sharing_a_file_name_get_a_reference_by_path_only(tmp_path, clips, capsys):
    """By name, both would get one clip's text: the guard would score one against the other's."""
    src = tmp_path / "corpus" / clips[0]["file"]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "take1.wav").write_bytes(src.read_bytes())
    refs = tmp_path / "refs.tsv"
    argv = ["guard", "build", str(tmp_path / "a"), str(tmp_path / "b"), "--language", "en",
            "--references", str(refs)]  # fmt: skip
    refs.write_text("take1.wav\tthe text of a\n")
    assert main([*argv, "--out", str(tmp_path / "g1")]) == 2
    err = capsys.readouterr().err
    assert "no reference for" in err and "its file name is another input's too" in err
    refs.write_text(f"{tmp_path / 'a' / 'take1.wav'}\tthe text of a\n"
                    f"{tmp_path / 'b' / 'take1.wav'}\tthe text of b\n")  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "g2")]) == 0
    assert " ".join(r["text"] for r in manifest(tmp_path / "g2")) == "the text of a the text of b"


def test_a_training_run_guards_with_the_built_set(tmp_path, clips, tones_dir):
    from asrforge.callbacks import build_callbacks
    from asrforge.train.loop import Trainer

    dirs = by_language(tmp_path, clips)
    out = tmp_path / "guard"
    assert main(["guard", "build", str(dirs["en"]), str(dirs["es"]), "--language", "en",
                 "--language", "es", "--out", str(out)]) == 0  # fmt: skip
    guard = {"path": str(out), "max_items": 4, "tolerance": 10.0}
    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 3}, eval={"guard": guard})
    Trainer(cfg, build_callbacks(cfg)).fit()
    start = [json.loads(line) for line in (tmp_path / "run/eval/guard-step-000000.jsonl").open()]
    assert len(start) == 4 and all(r["kind"] == "drift" for r in start)
    assert all(r["id"].startswith("guard-en-000#") for r in start)  # cut at pauses: 2 s model
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [e["guard_drift"] for e in evals if e.get("event") == "eval"] == [True]


@pytest.mark.parametrize("named", ["directory", "hub id"])
def test_the_starting_model_s_transcripts_become_the_references(
    tmp_path, clips, tones_dir, monkeypatch, named
):
    from asrforge.model.build import build_model, build_tokenizer

    base = tiny_config(tmp_path / "base", tones_dir)
    tokenizer = build_tokenizer(base.model, ["la la tone beep boop"] * 20)
    model = tmp_path / "tiny"
    build_model(base.model, tokenizer, 0).model.save_pretrained(str(model))
    tokenizer.save_pretrained(str(model))
    if named == "hub id":  # from a Hugging Face cache built here, offline
        from tests.hub_cache import add_repo

        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        add_repo(tmp_path / "hf", "org/tiny", {"": model})
        model = "org/tiny"
    dirs = by_language(tmp_path, clips[:12])
    out = tmp_path / "guard"
    argv = ["guard", "build", str(dirs["en"]), "--language", "en", "--model", str(model),
            "--window-seconds", "1.9", "--max-new-tokens", "6", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = manifest(out)
    assert rows and all(r.get("text") for r in rows)
    assert main([*argv[:-1], str(tmp_path / "g2"), "--window-seconds", "29"]) == 2


@pytest.mark.fast
@pytest.mark.parametrize("bad", ["missing", "not audio", "empty dir", "languages", "reference"])
def test_bad_inputs_exit_2_naming_the_input(tmp_path, clips, capsys, bad):
    clip = tmp_path / "corpus" / clips[0]["file"]
    text = tmp_path / "notes.wav"
    text.write_text("not audio at all\n")
    (tmp_path / "empty").mkdir()
    refs = tmp_path / "refs.tsv"
    refs.write_text("path\tsentence\nsomething-else.wav\thello\n")
    argv, named = {
        "missing": ([str(tmp_path / "nope.wav")], "nope.wav"),
        "not audio": ([str(clip), str(text)], "notes.wav"),
        "empty dir": ([str(tmp_path / "empty")], "empty"),
        "languages": (
            [str(clip), str(clip), str(clip), "--language", "en", "--language", "es"],
            "--language",
        ),
        "reference": ([str(clip), "--references", str(refs)], clip.name),
    }[bad]
    assert main(["guard", "build", *argv, "--out", str(tmp_path / "guard")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asrforge: error:") and named in err
    assert not (tmp_path / "guard").exists()


@pytest.mark.fast
def test_out_through_a_symlink_names_the_real_path(tmp_path, clips, capsys):
    """The link's own entry would be replaced: "Not a directory (errno 20)" after the work."""
    clip = tmp_path / "corpus" / clips[0]["file"]
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    assert main(["guard", "build", str(clip), "--out", str(tmp_path / "link")]) == 2
    err = capsys.readouterr().err
    real = tmp_path / "real"
    assert f"--out {tmp_path / 'link'}: a symlink (to real); give the real path ({real})" in err
    assert not any(real.iterdir())


@pytest.mark.fast
def test_model_references_are_refused_unless_every_recording_gets_one(monkeypatch):
    """A recording longer than the model's window, or one it transcribes as nothing, gets no
    reference; a guard with references on only some recordings would silently measure drift
    (``mode: auto``) or be refused by training (``mode: wer``), so the build refuses."""
    import types

    import numpy as np

    from asrforge.data.guard_set import GuardClip, GuardWindow
    from asrforge.errors import UserError
    from asrforge.evaluation import guard as guard_module

    def window(name: str, seconds: float) -> GuardWindow:
        clip = GuardClip(Path(f"/clips/{name}.wav"), seconds, "en", None)
        return GuardWindow(f"guard-en-{name}", "en", [clip], np.zeros(int(seconds * 16000)))

    said = {"guard-en-ok": "hello", "guard-en-quiet": "  "}
    monkeypatch.setattr(guard_module, "bundle_transcripts",
                        lambda bundle, items, *_: [said[i.id] for i in items])  # fmt: skip
    bundle = types.SimpleNamespace(window_seconds=2.0,
                                   specials=types.SimpleNamespace(multilingual=False))  # fmt: skip
    windows = [window("ok", 1.0), window("quiet", 1.0), window("long", 3.0)]
    with pytest.raises(UserError, match="no reference to 2 of 3 recordings") as e:
        guard_module.attach_model_references(bundle, windows, 4, 8)
    assert "guard-en-quiet" in str(e.value) and "long.wav" in str(e.value)
    assert "guard-en-ok" not in str(e.value)
    windows = [window("ok", 1.0)]
    guard_module.attach_model_references(bundle, windows, 4, 8)
    assert windows[0].text == "hello"


@pytest.mark.parametrize("gap", ["nan", "inf", "1e12", "-0.5", "30", "8"])
def test_a_gap_no_window_can_hold_exits_2_naming_it(tmp_path, clips, capsys, gap):
    clip = tmp_path / "corpus" / clips[0]["file"]
    argv = ["guard", "build", str(clip), "--window-seconds", "8", "--gap-seconds", gap,
            "--out", str(tmp_path / "guard")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("asrforge: error: --gap-seconds: must be >= 0 and below the window")
    assert "Traceback" not in err and not (tmp_path / "guard").exists()


def test_clip_paths_are_relative_to_the_manifest_whatever_directory_built_it(
    tmp_path, clips, monkeypatch
):
    dirs = by_language(tmp_path, clips)
    (tmp_path / "elsewhere" / "deeper").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "elsewhere" / "deeper")
    english = Path("../..") / dirs["en"].relative_to(tmp_path)  # as given, from here
    assert main(["guard", "build", str(english), "--language", "en", "--out", "../guard"]) == 0
    out = tmp_path / "elsewhere" / "guard"
    monkeypatch.chdir(tmp_path)  # read from another directory
    named = [out / clip for row in manifest(out) for clip in row["clips"]]
    assert sorted(p.resolve() for p in named) == sorted(p.resolve() for p in dirs["en"].iterdir())


def build_mixed_guard(tmp_path, clips, tones_dir) -> tuple[Path, Path]:
    """``guard build`` over English and Spanish clips, the English with references from a file
    ("spoken words K") and the Spanish transcribed by a tiny model; returns (the model, the
    guard)."""
    from asrforge.model.build import build_model, build_tokenizer

    base = tiny_config(tmp_path / "base", tones_dir)
    tokenizer = build_tokenizer(base.model, ["la la tone beep boop"] * 20)
    model = tmp_path / "tiny"
    build_model(base.model, tokenizer, 0).model.save_pretrained(str(model))
    tokenizer.save_pretrained(str(model))
    dirs = by_language(tmp_path, clips[:16])
    refs = tmp_path / "english.tsv"
    english = sorted(dirs["en"].iterdir())
    refs.write_text("".join(f"{p}\tspoken words {k}\ten\n" for k, p in enumerate(english)))
    out = tmp_path / "guard"
    argv = ["guard", "build", str(dirs["en"]), str(dirs["es"]), "--language", "en",
            "--language", "es", "--references", str(refs), "--model", str(model),
            "--window-seconds", "1.9", "--max-new-tokens", "6", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return model, out


def test_references_for_one_language_and_the_model_s_transcripts_for_another_mix(
    tmp_path, clips, tones_dir, capsys
):
    _, out = build_mixed_guard(tmp_path, clips, tones_dir)
    rows = manifest(out)
    given = [r for r in rows if r["language"] == "en"]
    heard = [r for r in rows if r["language"] == "es"]
    assert given and heard and all(r.get("text") for r in rows)
    assert all(r["text"].startswith("spoken words") for r in given)  # the file's, kept
    assert not any("spoken words" in r["text"] for r in heard)  # the model's
    assert f"({len(given)} from --references, {len(heard)} from --model)" in capsys.readouterr().out


def test_a_guard_of_given_and_heard_references_judges_each_language_against_its_own(
    tmp_path, clips, tones_dir
):
    from asrforge.cli.open_model import open_model
    from asrforge.evaluation.guard import Guard
    from asrforge.selection.guard_gate import GuardGate

    model, out = build_mixed_guard(tmp_path, clips, tones_dir)
    bundle = open_model(str(model))
    items = load_guard_items(GuardConfig(path=out), "en", bundle.window_seconds)
    guard = Guard(
        items, mode="auto", features=bundle.features, tokenizer=bundle.tokenizer,
        prompt=lambda code: bundle.specials.prompt(code, "transcribe"), eot=bundle.specials.eot,
        batch_size=8, max_new_tokens=6,
    )  # fmt: skip
    assert guard.kind == "wer" and guard.languages == ["en", "es"]
    metrics = guard.measure_start(bundle.model, GuardGate(0.02), device="cpu")
    starts = {lang: f["start"] for lang, f in metrics["guard_languages"].items()}
    # Spanish against the model's own transcripts: no error; English against the file's words,
    # which the untrained model never says: every word wrong.
    assert starts["es"] == 0.0 and starts["en"] >= 1.0
