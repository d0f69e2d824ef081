"""``asrforge transcribe`` of several files: inputs and output targets checked before decoding,
each group's audio read just before it is decoded and its outputs written as soon as it is, and
warnings that name the file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from asrforge.bundle import inference
from asrforge.bundle import recognize as recognition
from asrforge.cli import main
from asrforge.data import audio
from tests.test_data_hardening import save_random_whisper

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory) -> Path:
    """A random 1-layer English-only bundle: its text is noise, decoded in a moment."""
    return random_english_bundle(tmp_path_factory.mktemp("tiny"))


def random_english_bundle(root: Path) -> Path:
    """:func:`save_random_whisper`'s model, English-only, exported as ``root/bundle``."""
    from asrforge.bundle import export_bundle

    hf = root / "hf"
    save_random_whisper(hf)
    gen = hf / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "is_multilingual": False}))
    return export_bundle(hf, root / "bundle")


def clip(path: Path, seconds: float = 1.0) -> str:
    rng = np.random.default_rng(0)
    sf.write(path, (0.1 * rng.standard_normal(int(16_000 * seconds))).astype(np.float32), 16_000,
             format="WAV")  # fmt: skip
    return str(path)


def test_a_target_that_cannot_be_written_stops_the_run_before_decoding(
    tiny_bundle, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(inference.Bundle, "recognize", lambda *a, **k: pytest.fail("decoded"))
    long = "x" * 253
    # a 255-byte audio name whose output name has a byte too many
    paths = [clip(tmp_path / n) for n in ("clip0.wav", "clip1.wav", f"{long}.w")]
    out = tmp_path / "out"
    (out / "clip1.txt").mkdir(parents=True)
    assert main(["transcribe", str(tiny_bundle), *paths, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--output-dir {out / 'clip1.txt'}: a directory" in err
    assert f"--output-dir {out / (long + '.txt')}: its name is longer than 255 bytes" in err
    assert sorted(p.name for p in out.iterdir()) == ["clip1.txt"]


def test_each_group_is_written_as_soon_as_it_is_decoded(tiny_bundle, tmp_path, monkeypatch):
    paths = [clip(tmp_path / f"clip{i}.wav") for i in range(3)]
    groups = []
    recognize = inference.Bundle.recognize

    def interrupted_after_one(self, waves, *a, **k):
        groups.append(k["names"])
        if len(groups) == 2:
            raise KeyboardInterrupt
        return recognize(self, waves, *a, **k)

    monkeypatch.setattr(inference.Bundle, "recognize", interrupted_after_one)
    out = tmp_path / "out"
    argv = [str(tiny_bundle), *paths, "--output-dir", str(out), "--batch-size", "2", "--json"]
    assert main(["transcribe", *argv]) == 130
    assert groups == [paths[:2], paths[2:]]
    assert sorted(p.name for p in out.iterdir()) == ["clip0.json", "clip1.json"]
    assert json.loads((out / "clip1.json").read_text())["path"] == paths[1]


def test_each_group_is_read_just_before_it_is_decoded(tiny_bundle, tmp_path, monkeypatch):
    paths = [clip(tmp_path / f"clip{i}.wav") for i in range(3)]
    events = []
    read, recognize = audio.read_audio_file, inference.Bundle.recognize

    def spied_read(path):
        events.append(("read", str(path)))
        return read(path)

    def spied_recognize(self, waves, *a, **k):
        events.append(("decode", k["names"]))
        return recognize(self, waves, *a, **k)

    monkeypatch.setattr(audio, "read_audio_file", spied_read)
    monkeypatch.setattr(inference.Bundle, "recognize", spied_recognize)
    argv = [str(tiny_bundle), *paths, "--output-dir", str(tmp_path / "out"), "--batch-size", "2"]
    assert main(["transcribe", *argv]) == 0
    assert events == [
        ("read", paths[0]), ("read", paths[1]), ("decode", paths[:2]),
        ("read", paths[2]), ("decode", paths[2:]),
    ]  # fmt: skip


def test_every_bad_file_is_refused_before_any_is_read(tiny_bundle, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(audio, "read_audio_file", lambda path: pytest.fail(f"read {path}"))
    monkeypatch.setattr(inference.Bundle, "recognize", lambda *a, **k: pytest.fail("decoded"))
    good = clip(tmp_path / "good.wav")
    (tmp_path / "talk.m4a").write_bytes(b"\0\0\0 ftypM4A " + bytes(100))
    argv = [str(tiny_bundle), good, str(tmp_path / "missing.wav"), str(tmp_path / "talk.m4a")]
    assert main(["transcribe", *argv, "--batch-size", "1"]) == 2
    err = capsys.readouterr().err
    assert "2 problems:" in err
    assert f"{tmp_path / 'missing.wav'}: no such audio file" in err
    assert f"cannot read audio {tmp_path / 'talk.m4a'}:" in err


def test_output_names_that_collide_are_listed(tiny_bundle, tmp_path, capsys):
    (tmp_path / "a").mkdir()
    paths = [clip(tmp_path / "clip.wav"), clip(tmp_path / "a" / "clip.flac")]
    argv = [str(tiny_bundle), *paths, "--output-dir", str(tmp_path / "out")]
    assert main(["transcribe", *argv]) == 2
    assert (f"several audio files are named 'clip': {paths[0]}, {paths[1]}"
            in capsys.readouterr().err)  # fmt: skip


def test_damaged_audio_is_named_by_its_path(tiny_bundle, tmp_path, capsys, caplog):
    header_only = tmp_path / "header_only.wav"
    sf.write(header_only, np.zeros(0, np.float32), 16_000)
    full = Path(clip(tmp_path / "full.wav", 3.0)).read_bytes()
    truncated = tmp_path / "truncated.wav"
    truncated.write_bytes(full[: len(full) // 3])
    with caplog.at_level(logging.WARNING):
        assert main(["transcribe", str(tiny_bundle), str(header_only), str(truncated)]) == 0
    said = caplog.text + capsys.readouterr().err
    assert f"{header_only}: empty audio (0 samples)" in said
    assert "recording 0" not in said
    assert f"{truncated}: the audio data ends before the length its header gives" in said


def test_unreadable_files_say_why(tiny_bundle, tmp_path, capsys):
    (tmp_path / "zero.wav").write_bytes(b"")
    (tmp_path / "talk.m4a").write_bytes(b"\0\0\0 ftypM4A " + bytes(100))
    argv = [str(tiny_bundle), str(tmp_path / "zero.wav"), str(tmp_path / "talk.m4a")]
    assert main(["transcribe", *argv]) == 2
    err = capsys.readouterr().err
    assert f"cannot read audio {tmp_path / 'zero.wav'}: empty file (0 bytes)" in err
    assert "readable: wav, flac, ogg (vorbis, opus), mp3" in err and "ffmpeg" in err


def test_argument_mistakes_are_named_for_what_they_are(tiny_bundle, tmp_path, capsys):
    wav = clip(tmp_path / "a.wav")
    assert main(["transcribe", str(tiny_bundle), wav, "--language", "xx"]) == 2
    assert "unknown language 'xx': this bundle is English-only" in capsys.readouterr().err
    assert main(["transcribe", str(tiny_bundle), wav, "--language", "fr"]) == 2
    assert "language 'fr': this bundle is English-only" in capsys.readouterr().err
    assert main(["transcribe", wav, wav]) == 2
    assert f"{wav}: a file, not a bundle or model directory" in capsys.readouterr().err


def test_word_timestamps_are_refused_with_text_output(tiny_bundle, tmp_path, capsys):
    wav = clip(tmp_path / "a.wav")
    assert main(["transcribe", str(tiny_bundle), wav, "--word-timestamps"]) == 2
    err = capsys.readouterr().err
    assert "--word-timestamps with --format text: give --format json, srt or vtt" in err
    assert main(["transcribe", str(tiny_bundle), wav, "--word-timestamps", "--json"]) == 0


def test_a_window_stopped_at_the_token_cap_is_said_once(tiny_bundle, tmp_path, monkeypatch):
    recognition._say_capped.cache_clear()
    said = []
    monkeypatch.setattr(recognition.log, "warning", lambda msg, *args: said.append(msg % args))
    paths = [clip(tmp_path / f"c{i}.wav") for i in range(3)]
    argv = [str(tiny_bundle), *paths, "--max-new-tokens", "1", "--batch-size", "1"]
    assert main(["transcribe", *argv]) == 0
    assert [s for s in said if "cap" in s] == [
        "a window stopped at the cap of 1 new tokens (max_new_tokens): its text is cut"
    ]


def test_an_output_dir_that_is_a_symlink_is_refused_before_decoding(
    tiny_bundle, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(inference.Bundle, "recognize", lambda *a, **k: pytest.fail("decoded"))
    victim = tmp_path / "victim"
    victim.mkdir()
    link = tmp_path / "out"
    link.symlink_to("victim")
    argv = [str(tiny_bundle), clip(tmp_path / "clip.wav"), "--output-dir", str(link)]
    assert main(["transcribe", *argv]) == 2
    err = capsys.readouterr().err
    assert f"--output-dir {link}: a symlink (to victim); give the real path ({victim})" in err
    assert not any(victim.iterdir())


def test_a_link_put_where_the_output_dir_is_made_is_not_written_through(
    tiny_bundle, tmp_path, capsys, monkeypatch
):
    victim = tmp_path / "victim"
    victim.mkdir()
    recognize = inference.Bundle.recognize

    def planting_a_link(self, *a, **k):
        (tmp_path / "new").symlink_to(victim)
        return recognize(self, *a, **k)

    monkeypatch.setattr(inference.Bundle, "recognize", planting_a_link)
    out = tmp_path / "new" / "out"
    argv = [str(tiny_bundle), clip(tmp_path / "clip.wav"), "--output-dir", str(out)]
    assert main(["transcribe", *argv]) == 2
    assert f"{tmp_path / 'new'}: a symlink (to {victim})" in capsys.readouterr().err
    assert not any(victim.iterdir())
