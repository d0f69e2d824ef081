"""Inference bundles: export -> load -> transcribe, transformers compatibility, refusals.

One tiny run (4 steps, EMA on, fp32) is trained per session and exported once; tests that
damage a bundle work on copies.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from asrforge.bundle.export import export_bundle
from asrforge.bundle.inference import Bundle
from asrforge.bundle.load import load_bundle
from asrforge.bundle.options import use_vad
from asrforge.bundle.schema import INFERENCE_CONFIG
from asrforge.bundle.write import write_bundle_manifest
from asrforge.checkpoint.manifest import read_manifest
from asrforge.checkpoint.shards import ALIASES_KEY
from asrforge.checkpoint.training import load_weights
from asrforge.cli import main
from asrforge.data.audio import decode_audio
from asrforge.data.sources import load_arrow
from asrforge.errors import CheckpointCorruptError, CheckpointNotSupportedError, UserError
from asrforge.model.encoding import encode_waves
from tests.conftest import tiny_config

_RUNS: dict[str, Path] = {}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, and none of the log handlers earlier runs in this process left behind.

    Decoding goes token by token: on a machine shared with other jobs, two OpenMP threads
    waiting on each other cost several times the CPU of one. A training run adds a stderr
    handler to the ``asrforge`` logger that outlives it (and the stream it holds)."""
    threads, logger = torch.get_num_threads(), logging.getLogger("asrforge")
    handlers = list(logger.handlers)
    torch.set_num_threads(1)
    logger.handlers = []
    yield
    torch.set_num_threads(threads)
    logger.handlers = handlers


def train_tiny_run(root: Path, data: Path) -> Path:
    """Train the shared tiny run once per session (also used by test_evaluate_cli.py)."""
    if "run" not in _RUNS:
        from accelerate.state import AcceleratorState

        from asrforge.train.loop import Trainer

        # fp32 so that the loop's evaluation and the bundle decode alike; accelerate keeps one
        # precision per process, so the state is reset around this run for the other tests.
        AcceleratorState._reset_state()
        cfg = tiny_config(
            root / "run",
            data,
            train={"max_steps": 4, "log_every": 2, "ema_decay": 0.5, "precision": "no"},
            eval={"eval_steps": 2, "max_new_tokens": 6},
            data={"max_eval_samples": 6},
        )
        try:
            Trainer(cfg, []).fit()
        finally:
            AcceleratorState._reset_state()
        _RUNS["run"] = root / "run"
    return _RUNS["run"]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, tones_dir) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("bundle-run"), tones_dir)


@pytest.fixture(scope="session")
def bundle_dir(trained_run, tmp_path_factory) -> Path:
    return export_bundle(trained_run, tmp_path_factory.mktemp("bundles") / "tiny")


@pytest.fixture(scope="session")
def bundle(bundle_dir) -> Bundle:
    return load_bundle(bundle_dir)


@pytest.fixture(scope="session")
def validation(tones_dir):
    return load_arrow(tones_dir)["validation"]


def cli_error(capsys) -> str:
    """The CLI's stderr after a failed command: one ``asrforge: error:`` line, no traceback.
    (Log lines of a run trained earlier in this process, whose handler may still write to the
    captured stderr, are left out.)"""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x for x in err.strip().splitlines() if not re.match(r"\d\d:\d\d:\d\d [A-Z]+ ", x)]
    assert len(lines) == 1 and lines[0].startswith("asrforge: error:"), err
    return lines[0]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _reseal(directory: Path) -> None:
    """What an attacker who rewrites the manifest would do: checksums and seal pass again."""
    meta = {
        k: v
        for k, v in read_manifest(directory).items()
        if k not in ("format_version", "files", "bundle_seal")
    }
    write_bundle_manifest(directory, meta)


# ---------------------------------------------------------------------------------------------
# Export and round trip


def test_export_writes_a_complete_bundle(trained_run, bundle_dir) -> None:
    names = {p.name for p in bundle_dir.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        INFERENCE_CONFIG,
        "manifest.json",
    } <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".yaml"))]
    manifest = read_manifest(bundle_dir)
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert manifest["bundle_seal"] and manifest["kind"] == "bundle"

    info = json.loads((bundle_dir / INFERENCE_CONFIG).read_text())
    best = trained_run / "checkpoints" / "best"
    assert info["bundle_version"] == "1.4.0" and info["weights"] == "ema"
    assert info["languages"] == ["en", "es"] and info["multilingual"] is True
    assert info["source"]["step"] == read_manifest(best)["step"]
    assert info["model"]["d_model"] == 32 and info["model"]["max_source_positions"] == 100
    assert info["data"] == {"task": "transcribe", "language_tokens": None}
    assert info["eval"] == {"max_new_tokens": 6}
    assert info["features"]["chunk_length"] == 2 and len(info["features"]["mean"]) == 80
    assert "optim" not in info and "output_dir" not in info

    pre = json.loads((bundle_dir / "preprocessor_config.json").read_text())
    assert (pre["feature_size"], pre["chunk_length"], pre["sampling_rate"]) == (80, 2, 16_000)
    gen = json.loads((bundle_dir / "generation_config.json").read_text())
    assert gen["is_multilingual"] and gen["task"] == "transcribe"
    assert set(gen["lang_to_id"]) == {"<|en|>", "<|es|>"} and set(gen["task_to_id"]) == {
        "transcribe",
        "translate",
    }

    # EMA by default: the EMA tensors over the raw ones (frozen positions come from the raw model)
    exported = load_weights(bundle_dir / "model.safetensors")
    ema, raw = load_weights(best / "ema.safetensors"), load_weights(best / "model.safetensors")
    assert exported["proj_out.weight"] is exported["model.decoder.embed_tokens.weight"]
    assert "model.encoder.embed_positions.weight" not in ema  # frozen: not averaged
    for name, t in exported.items():
        if name != "proj_out.weight":
            torch.testing.assert_close(t, ema.get(name, raw[name]), rtol=0, atol=0)


def test_round_trip_transcribes_as_the_training_evaluation(trained_run, bundle, validation):
    best = trained_run / "checkpoints" / "best"
    step = read_manifest(best)["step"]
    records = [
        json.loads(line)
        for line in (trained_run / "eval" / f"step-{step:06d}.jsonl").read_text().splitlines()
    ]
    preds = {r["id"]: r for r in records if "id" in r}
    rows = {row["id"]: row for row in validation}
    assert len(preds) == 6
    for uid, pred in list(preds.items())[:2]:
        audio = rows[uid]["audio"]["bytes"]
        assert bundle.transcribe(audio, language=pred["language"]) == pred["hypothesis"], uid
    waves = [decode_audio(rows[uid]["audio"]["bytes"]) for uid in preds]
    langs = [p["language"] for p in preds.values()]
    hyps = [p["hypothesis"] for p in preds.values()]
    assert bundle.transcribe_many(waves, langs, batch_size=4) == hyps


def test_export_raw_and_average_weights(trained_run, tmp_path) -> None:
    best = trained_run / "checkpoints" / "best"
    raw = export_bundle(best, tmp_path / "raw", weights="raw")
    want = load_weights(best / "model.safetensors")
    for name, t in load_weights(raw / "model.safetensors").items():
        torch.testing.assert_close(t, want[name], rtol=0, atol=0)

    avg = export_bundle(trained_run, tmp_path / "avg", weights="average", average_k=2)
    info = json.loads((avg / INFERENCE_CONFIG).read_text())
    assert info["weights"] == "average" and sorted(info["source"]["averaged_steps"]) == [2, 4]
    # the run keeps EMA weights: the average is of them, as a bundle of one checkpoint takes them
    assert info["source"]["averaged_weights"] == "ema"
    # no step's figures are the mean's: the card names the steps averaged and claims no result
    assert "step" not in info["source"] and "metrics" not in info["source"]
    card = (avg / "README.md").read_text()
    ranked = zip(info["source"]["averaged_steps"], info["source"]["averaged_values"], strict=True)
    named = ", ".join(f"{step} (wer {value:.4g})" for step, value in ranked)
    assert f"steps {named}, the 2 best by `wer`" in card
    assert "model-index" not in card and "selection policy" not in card
    steps = [
        load_weights(trained_run / "checkpoints" / f"step-00000{s}" / "ema.safetensors")
        for s in (2, 4)
    ]
    got = load_weights(avg / "model.safetensors")
    name = "model.encoder.layers.0.fc1.weight"
    torch.testing.assert_close(got[name], (steps[0][name] + steps[1][name]) / 2)
    assert isinstance(load_bundle(avg), Bundle)


def test_export_refuses_bad_sources_and_targets(trained_run, bundle_dir, tmp_path) -> None:
    with pytest.raises(UserError, match="no such directory"):
        export_bundle(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a bundle"):
        export_bundle(trained_run, tmp_path / "busy")
    with pytest.raises(UserError, match="already an inference bundle .*--format ct2"):
        export_bundle(bundle_dir, tmp_path / "again")
    with pytest.raises(UserError, match="--weights raw: .* is a bundle"):
        export_bundle(bundle_dir, tmp_path / "again", "raw", fmt="ct2")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "again").exists()


def test_a_bundle_converts_to_ct2_with_its_lm_and_records(
    trained_run, bundle_dir, tmp_path, capsys
) -> None:
    pytest.importorskip("ctranslate2")
    from asrforge.bundle.load import ALIGNMENT_HEADS_KEY, LM_WEIGHTS_KEY
    from asrforge.bundle.write import update_bundle_manifest

    tuned = Path(shutil.copytree(bundle_dir, tmp_path / "tuned"))
    arpa = tmp_path / "lm.arpa"
    assert main(["lm", "build", "--text", str(_lm_text(tmp_path)), "--language", "es",
                 "--order", "2", "--out", str(arpa)]) == 0  # fmt: skip
    with_lm = export_bundle(trained_run, tmp_path / "with-lm", lm=arpa)
    heads = {"heads": [[0, 1], [1, 0]], "lag_s": 0.04}
    weights = {"alpha": 0.5, "beta": 1.0, "metric": "wer", "value": 0.5}
    update_bundle_manifest(with_lm, {ALIGNMENT_HEADS_KEY: heads, LM_WEIGHTS_KEY: weights})
    capsys.readouterr()

    assert main(["export", str(with_lm), "--format", "ct2", "--out", str(tmp_path / "c")]) == 0
    direct = export_bundle(trained_run, tmp_path / "direct", fmt="ct2")
    converted = tmp_path / "c"
    # the same weights, written the same way; the heads align-heads found for faster-whisper
    assert (converted / "model.bin").read_bytes() == (direct / "model.bin").read_bytes()
    assert json.loads((converted / "config.json").read_text())["alignment_heads"] == [
        [0, 1], [1, 0]
    ]  # fmt: skip
    manifest = read_manifest(converted)
    assert manifest[ALIGNMENT_HEADS_KEY] == heads and manifest[LM_WEIGHTS_KEY] == weights
    icfg = json.loads((converted / INFERENCE_CONFIG).read_text())
    assert icfg["format"] == "ct2" and icfg["lm"]["file"] == "lm.arpa"
    assert (converted / "lm.arpa").read_bytes() == arpa.read_bytes()
    # another LM: the weights tuned for the bundle's own are not carried
    other = export_bundle(with_lm, tmp_path / "other-lm", fmt="ct2", lm=arpa)
    manifest = read_manifest(other)
    assert LM_WEIGHTS_KEY not in manifest and ALIGNMENT_HEADS_KEY in manifest

    # heads the generation config names, which align-heads then found not to qualify, are not
    # passed on: CTranslate2 uses its default (every head of the decoder's second half)
    generation = json.loads((tuned / "generation_config.json").read_text())
    generation["alignment_heads"] = [[0, 0]]
    (tuned / "generation_config.json").write_text(json.dumps(generation))
    _reseal(tuned)
    update_bundle_manifest(tuned, {ALIGNMENT_HEADS_KEY: {"heads": []}})
    none = export_bundle(tuned, tmp_path / "none", fmt="ct2")
    assert json.loads((none / "config.json").read_text())["alignment_heads"] == [[1, 0], [1, 1]]


def _lm_text(tmp_path: Path) -> Path:
    text = tmp_path / "lm.txt"
    text.write_text("uno dos tres\ncuatro cinco seis\n", encoding="utf-8")
    return text


def test_ct2_export_needs_ctranslate2(trained_run, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "ctranslate2.converters", None)
    with pytest.raises(UserError, match="optional dependency ctranslate2"):
        export_bundle(trained_run, tmp_path / "ct2", fmt="ct2")
    assert not (tmp_path / "ct2").exists()


def test_ct2_export_matches_the_bundle(trained_run, bundle, validation, tmp_path) -> None:
    ctranslate2 = pytest.importorskip("ctranslate2")
    out = export_bundle(trained_run, tmp_path / "ct2", fmt="ct2")
    assert (out / "model.bin").is_file() and (out / "manifest.json").is_file()
    assert json.loads((out / INFERENCE_CONFIG).read_text())["format"] == "ct2"
    with pytest.raises(CheckpointNotSupportedError, match="CTranslate2 export"):
        load_bundle(out)
    wave = decode_audio(validation[0]["audio"]["bytes"])
    feats = bundle.features(wave, sampling_rate=16_000, return_tensors="np").input_features
    model = ctranslate2.models.Whisper(str(out), device="cpu", compute_type="float32")
    prompt = bundle.tokenizer.convert_ids_to_tokens(bundle.specials.prompt("es"))
    result = model.generate(
        ctranslate2.StorageView.from_array(np.ascontiguousarray(feats)),
        [prompt],
        beam_size=1,
        max_length=10,
    )
    from asrforge.model.decoding import greedy_decode

    ours, _ = greedy_decode(
        bundle.model,
        encode_waves(bundle.model, bundle.features, [wave], bundle.device),
        torch.tensor([bundle.specials.prompt("es")]),
        bundle.specials.eot,
        6,
    )
    got = result[0].sequences_ids[0]
    assert got == ours[0][: len(got)] and got


# ---------------------------------------------------------------------------------------------
# transformers compatibility


def _generate(hf, feats: torch.Tensor, **kwargs) -> tuple[list[list[int]], list[int]]:
    """transformers' generate, and the decoder input of each of its decoder passes that fed a
    whole prompt (not one cached token)."""
    calls: list[list[int]] = []

    def record(_module, _args, kw):
        ids = kw.get("input_ids")
        if ids is not None and (ids.shape[1] > 1 or not calls):
            calls.append(ids[0].tolist())

    hook = hf.model.decoder.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            out = hf.generate(feats, **kwargs)[0].tolist()
    finally:
        hook.remove()
    return calls, out


def test_transformers_loads_and_decodes_the_bundle_as_we_do(bundle_dir, bundle, validation):
    from transformers import WhisperForConditionalGeneration, pipeline

    hf = WhisperForConditionalGeneration.from_pretrained(bundle_dir).eval()
    assert hf.proj_out.weight.data_ptr() == hf.model.decoder.embed_tokens.weight.data_ptr()
    for name, t in bundle.model.state_dict().items():
        torch.testing.assert_close(hf.state_dict()[name], t, rtol=0, atol=0)

    wave = decode_audio(validation[0]["audio"]["bytes"])
    feats = torch.from_numpy(
        bundle.features(wave, sampling_rate=16_000, return_tensors="np").input_features
    )
    from asrforge.model.decoding import greedy_decode

    enc = encode_waves(bundle.model, bundle.features, [wave], bundle.device)
    for language in ("en", "es", None):
        code = language or bundle.detect_language(wave)
        prompt = bundle.specials.prompt(code)
        ours, _ = greedy_decode(bundle.model, enc, torch.tensor([prompt]), bundle.specials.eot, 6)
        calls, out = _generate(hf, feats, language=language, max_new_tokens=6)
        # without a language, transformers first detects it (among the bundle's languages)
        assert calls[-1] == prompt, f"transformers built another decoder prompt for {language}"
        assert out[: len(ours[0])] == ours[0]

    asr = pipeline("automatic-speech-recognition", model=str(bundle_dir), device="cpu")
    for row in validation.select([0, 3]):  # an English and a Spanish utterance
        wave = decode_audio(row["audio"]["bytes"])
        text = asr(wave.copy(), generate_kwargs={"language": row["language"], "max_new_tokens": 6})
        assert text["text"].strip() == bundle.transcribe(wave, language=row["language"])


def test_load_bundle_imports_no_training_code(bundle_dir, validation) -> None:
    """In a fresh interpreter, with accelerate made unimportable: load and transcribe."""
    wav = Path(bundle_dir).parent / "probe.wav"
    wav.write_bytes(validation[0]["audio"]["bytes"])
    code = f"""
import json, sys
sys.modules["accelerate"] = None  # not installed, as far as this process can tell
import asrforge
bundle = asrforge.load_bundle({str(bundle_dir)!r})
bundle.transcribe({str(wav)!r}, language="en")
print(json.dumps(sorted(sys.modules)))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "asrforge.bundle.load" in modules
    for banned in ("asrforge.train", "asrforge.callbacks", "asrforge.data.dataset", "datasets"):
        assert banned not in modules, f"load_bundle imported {banned}"


# ---------------------------------------------------------------------------------------------
# Audio input and the transcribe CLI


def test_transcribe_accepts_paths_bytes_and_arrays_at_any_rate(bundle, validation, tmp_path):
    blob = validation[1]["audio"]["bytes"]
    wave = decode_audio(blob)
    want = bundle.transcribe(wave, language="en")
    assert bundle.transcribe(blob, language="en") == want
    for name, rate in (("a.flac", 8_000), ("a.mp3", 44_100)):
        sf.write(tmp_path / name, decode_audio(blob, rate), rate)
        assert isinstance(bundle.transcribe(tmp_path / name, language="en"), str)
    with pytest.raises(UserError, match="no such audio file"):
        bundle.transcribe(tmp_path / "missing.wav")
    (tmp_path / "junk.wav").write_bytes(b"not audio at all")
    with pytest.raises(UserError, match="cannot read audio"):
        bundle.transcribe(tmp_path / "junk.wav")
    with pytest.raises(UserError, match="unknown language 'fr'"):
        bundle.transcribe(wave, language="fr")


def test_transcribe_resamples_an_array_given_its_sampling_rate(bundle, validation):
    blob = validation[1]["audio"]["bytes"]
    wave = decode_audio(blob)
    at_44k = decode_audio(blob, 44_100)
    back = bundle.load_audio(at_44k, sampling_rate=44_100)
    assert abs(back.shape[0] - wave.shape[0]) <= 1
    n = min(back.shape[0], wave.shape[0])
    assert np.abs(back[:n] - wave[:n]).max() < 0.05  # the same signal at 16 kHz
    got = bundle.recognize([at_44k], "en", sampling_rate=44_100)[0]
    assert got.seconds == pytest.approx(wave.shape[0] / 16_000, abs=1e-3)
    assert got.text == bundle.transcribe(back, language="en")
    assert bundle.transcribe(at_44k, language="en", sampling_rate=44_100) == got.text
    # without the rate an array is taken as 16 kHz: 2.76 times too long
    assert bundle.recognize([at_44k], "en")[0].seconds > 2.7 * got.seconds
    for bad in (0, -8_000):
        with pytest.raises(UserError, match="sampling_rate must be a positive integer"):
            bundle.transcribe(at_44k, language="en", sampling_rate=bad)
    for bad in (16_000.5, "16k"):  # the options refuse another kind first
        with pytest.raises(UserError, match=rf"sampling_rate: {bad!r} is not a whole number"):
            bundle.transcribe(at_44k, language="en", sampling_rate=bad)
    # integer PCM (scipy.io.wavfile's int16, 8-bit's unsigned bytes) is scaled to [-1, 1)
    pcm16 = np.round(np.clip(at_44k, -1, 1 - 2**-15) * 32768).astype(np.int16)
    from16 = bundle.load_audio(pcm16, sampling_rate=44_100)
    assert np.abs(from16 - back).max() < 1e-3
    assert bundle.transcribe(pcm16, language="en", sampling_rate=44_100) == got.text
    pcm8 = np.array([0, 128, 255], np.uint8)
    np.testing.assert_allclose(bundle.load_audio(pcm8), [-1, 0, 127 / 128], atol=1e-6)
    with pytest.raises(UserError, match="integer or float samples, got complex64"):
        bundle.load_audio(at_44k.astype(np.complex64))
    # a rate as a whole float (librosa's, soundfile's) and a torch tensor of samples are taken
    assert np.array_equal(bundle.load_audio(at_44k, sampling_rate=44_100.0), back)
    assert np.array_equal(bundle.load_audio(torch.from_numpy(at_44k), sampling_rate=44_100), back)
    half = torch.from_numpy(at_44k).bfloat16()
    as_float = bundle.load_audio(half.float().numpy(), sampling_rate=44_100)
    assert np.array_equal(bundle.load_audio(half, sampling_rate=44_100), as_float)
    with pytest.raises(UserError, match=r"must be 1-D \(mono\), got shape \(2, \d+\): average"):
        bundle.load_audio(np.stack([wave, wave]))


def test_audio_longer_than_the_window_is_cut_and_joined(bundle, validation):
    waves = [decode_audio(row["audio"]["bytes"]) for row in validation.select(range(6))]
    long = np.concatenate(waves)
    assert long.shape[0] > 2 * 16_000 * 2  # the tiny model's window is 2 s
    [result] = bundle.recognize([long], "en")
    assert result.chunking == "silence"  # a from-scratch BPE has no timestamp tokens
    assert result.seconds == pytest.approx(long.shape[0] / 16_000)
    from asrforge.model.silence import segment

    cuts = segment(long, 16_000, 2.0)
    assert len(cuts) >= 2
    texts = [bundle.transcribe(long[a:b], language="en") for a, b in cuts]
    assert result.text == " ".join(t for t in texts if t)
    assert [s.text for s in result.segments] == [t for t in texts if t]
    assert {(s.start, s.end) for s in result.segments} <= {
        (a / 16_000, b / 16_000) for a, b in cuts
    }


def test_a_recording_whose_language_is_detected_is_not_encoded_twice(bundle, validation):
    from asrforge.model.silence import segment

    waves = [decode_audio(row["audio"]["bytes"]) for row in validation.select(range(4))]
    recordings = [*waves, np.concatenate(waves)]
    pieces = sum(len(segment(w, 16_000, bundle.window_seconds)) for w in recordings)
    # decoding starts from the window detection read in a recording of one window only
    one_window = sum(w.shape[0] <= bundle.window_seconds * 16_000 for w in waves)
    assert one_window == len(waves)
    assert len(segment(recordings[-1], 16_000, bundle.window_seconds)) > 1
    rows = []
    hook = bundle.model.model.encoder.register_forward_hook(
        lambda _m, args, _out: rows.append(len(args[0]))
    )
    try:
        detected = bundle.recognize(recordings, batch_size=2, vad=False)
    finally:
        hook.remove()
    # detection encodes each recording's first window, and decoding all windows but those
    assert sum(rows) == len(recordings) + pieces - one_window
    assert {t.language for t in detected} <= {"en", "es"}
    assert [t.language for t in detected] == [bundle.detect_language(w) for w in recordings]
    given = bundle.recognize(recordings, [t.language for t in detected], batch_size=1, vad=False)
    assert [t.text for t in given] == [t.text for t in detected]


def test_vad_with_previous_text_conditioning_is_refused_naming_both(bundle, validation):
    wave = decode_audio(validation[0]["audio"]["bytes"])
    with pytest.raises(UserError, match=r"^vad and condition_on_previous_text: VAD chunks"):
        bundle.recognize([wave], vad=True, condition_on_previous_text=True)
    # left to the default, a long recording conditioned on previous text is not decoded by VAD
    long = np.zeros(round(bundle.window_seconds + 1) * 16_000, np.float32)
    assert not use_vad(bundle, None, long, previous_text=True)


def test_a_vad_recordings_language_is_heard_in_its_first_chunk(bundle, validation, monkeypatch):
    from asrforge.bundle import recognize as recognition
    from asrforge.model.vad import Chunk

    clips = [decode_audio(row["audio"]["bytes"]) for row in validation.select(range(3))]
    gap = np.zeros(16_000, np.float32)
    wave = np.concatenate([clips[0], gap, clips[1], gap, clips[2]])
    starts = np.cumsum([0, *(c.shape[0] + gap.shape[0] for c in clips[:2])])
    regions = [(int(a), int(a) + c.shape[0]) for a, c in zip(starts, clips, strict=True)]
    # the first two clips, the pause between them left out, then the third
    chunks = [Chunk(tuple(regions[:2])), Chunk((regions[2],))]
    assert all(c.audio(wave).shape[0] <= bundle.window_seconds * 16_000 for c in chunks)
    monkeypatch.setattr(recognition, "speech_chunks", lambda *a: chunks)
    rows = []
    hook = bundle.model.model.encoder.register_forward_hook(
        lambda _m, args, _out: rows.append(len(args[0]))
    )
    try:
        [t] = bundle.recognize([wave], vad=True, batch_size=2)
    finally:
        hook.remove()
    assert t.vad and t.language == bundle.detect_language(chunks[0].audio(wave))
    # detection encodes the first chunk, decoding the other one: each chunk once
    assert sum(rows) == len(chunks)


def test_decoding_takes_a_kept_encoding_in_its_windows_place(bundle, validation, monkeypatch):
    from asrforge.model import longform

    windows = [decode_audio(row["audio"]["bytes"]) for row in validation.select(range(3))]
    fresh = encode_waves(bundle.model, bundle.features, windows, bundle.device)
    kept = torch.full_like(fresh[1], 0.5)  # unlike any encoding: its place in the batch shows
    memo = longform.EncodedWindows()
    memo.add(windows[1], kept)
    seen = []

    def greedy(model, enc, ids, eot, cap, options):
        seen.append(enc)
        return [[] for _ in range(len(enc))], None

    monkeypatch.setattr(longform, "greedy_decode", greedy)
    prompt = bundle.specials.prompt("en")
    args = dict(eot=bundle.specials.eot, max_new_tokens=4, batch_size=3)
    longform.decode_windows(bundle.model, bundle.features, windows, [prompt] * 3, **args,
                            encoded=memo)  # fmt: skip
    [enc] = seen
    assert torch.equal(enc[1], kept)
    torch.testing.assert_close(enc[[0, 2]], fresh[[0, 2]])
    # handed out once: the same window decoded again is encoded afresh
    longform.decode_windows(bundle.model, bundle.features, windows[1:2], [prompt], **args,
                            encoded=memo)  # fmt: skip
    torch.testing.assert_close(seen[1][0], fresh[1])


def test_transcribe_cli_json_and_errors(bundle_dir, validation, tmp_path, capsys) -> None:
    paths = []
    for i, rate in enumerate((16_000, 22_050)):
        p = tmp_path / f"utt{i}.wav"
        sf.write(p, decode_audio(validation[i]["audio"]["bytes"], rate), rate)
        paths.append(str(p))
    assert main(["transcribe", str(bundle_dir), *paths, "--json", "--language", "en"]) == 0
    captured = capsys.readouterr()
    assert "no timestamp tokens: long audio is cut at silences" in captured.err  # the fallback
    lines = [json.loads(x) for x in captured.out.strip().splitlines()]
    assert [x["path"] for x in lines] == paths
    assert all({"text", "language", "seconds"} <= set(x) and x["language"] == "en" for x in lines)
    assert lines[0]["seconds"] == pytest.approx(len(decode_audio(paths[0])) / 16_000, abs=1e-3)

    for argv in (
        ["transcribe", str(bundle_dir), str(tmp_path / "missing.wav")],
        ["transcribe", str(bundle_dir), paths[0], "--language", "xx"],
        ["transcribe", str(tmp_path / "no-bundle"), paths[0]],
    ):
        assert main(argv) == 2, argv
        cli_error(capsys)


def test_export_cli_says_which_checkpoint(trained_run, tmp_path, capsys) -> None:
    assert main(["export", str(trained_run), "--out", str(tmp_path / "b"), "--weights", "raw"]) == 0
    captured = capsys.readouterr()
    assert "checkpoints/best" in captured.err and "raw weights of step" in captured.out
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "c")]) == 2


# ---------------------------------------------------------------------------------------------
# Refusals: tampering, pickles, versions, tensor schema


def test_a_flipped_byte_in_any_file_is_refused_by_name(bundle_dir, tmp_path, capsys) -> None:
    for name in sorted(p.name for p in bundle_dir.iterdir()):
        copy = _copy(bundle_dir, tmp_path / f"flip-{name}")
        data = bytearray((copy / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (copy / name).write_bytes(bytes(data))
        with pytest.raises(CheckpointCorruptError, match=name.replace(".", r"\.")):
            load_bundle(copy)
        if name == "model.safetensors":
            wav = tmp_path / "x.wav"
            sf.write(wav, np.zeros(1600, dtype=np.float32), 16_000)
            assert main(["transcribe", str(copy), str(wav)]) == 2
            assert "model.safetensors" in cli_error(capsys)


class _Payload:
    """Unpickling this runs a shell command that creates a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle-2", "pickle-0"])
def test_a_pickle_named_safetensors_is_refused_unopened(bundle_dir, tmp_path, writer) -> None:
    marker = tmp_path / "pwned"
    state = {"model.encoder.conv1.weight": torch.zeros(1), "payload": _Payload(marker)}
    if writer == "torch.save":
        buf = io.BytesIO()
        torch.save(state, buf)
        blob = buf.getvalue()
    else:
        blob = pickle.dumps(state, protocol=int(writer[-1]))
    # the payload is live: unpickling it elsewhere does create the file
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(_Payload(live)))
    assert live.exists()

    copy = _copy(bundle_dir, tmp_path / "evil")
    (copy / "model.safetensors").write_bytes(blob)
    _reseal(copy)  # the checksums pass: only the safetensors check stands in the way
    with pytest.raises(CheckpointCorruptError, match=r"model\.safetensors: not a .*safetensors"):
        load_bundle(copy)
    assert not marker.exists(), "the pickle was unpickled"


def test_pickle_files_in_a_bundle_are_refused(bundle_dir, tmp_path) -> None:
    for resealed in (False, True):
        copy = _copy(bundle_dir, tmp_path / f"bin-{resealed}")
        torch.save({"w": torch.zeros(2)}, copy / "pytorch_model.bin")
        if resealed:
            _reseal(copy)
        with pytest.raises(
            CheckpointNotSupportedError, match=r"pytorch_model\.bin.*never unpickled"
        ):
            load_bundle(copy)


def test_a_newer_major_version_is_refused_naming_the_version(bundle_dir, tmp_path, capsys):
    copy = _copy(bundle_dir, tmp_path / "v2")
    info = json.loads((copy / INFERENCE_CONFIG).read_text())
    info.update(bundle_version="2.0.0", asrforge_version="3.1.0", new_field={"x": 1})
    (copy / INFERENCE_CONFIG).write_text(json.dumps(info))
    _reseal(copy)
    with pytest.raises(CheckpointNotSupportedError, match=r"2\.0\.0.*1\.x.*asrforge >= 3\.1\.0"):
        load_bundle(copy)

    info.update(bundle_version="1.7.0")  # newer minor: unknown optional fields are dropped
    (copy / INFERENCE_CONFIG).write_text(json.dumps(info))
    _reseal(copy)
    assert load_bundle(copy).version == "1.7.0"


def test_tensors_that_do_not_fit_the_config_are_named(bundle_dir, tmp_path) -> None:
    cases = {
        "shape": (
            "model.decoder.layers.1.fc1.weight",
            lambda s, n: s.update({n: s[n][:10]}),
            r"model\.decoder\.layers\.1\.fc1\.weight: expected shape \[64, 32\], got \[10, 32\]",
        ),
        "missing": (
            "model.encoder.layer_norm.bias",
            lambda s, n: s.pop(n),
            r"missing model\.encoder\.layer_norm\.bias",
        ),
        "unexpected": (
            "model.encoder.adapter.weight",
            lambda s, n: s.update({n: torch.zeros(3)}),
            r"unexpected model\.encoder\.adapter\.weight",
        ),
    }
    for case, (name, edit, message) in cases.items():
        copy = _copy(bundle_dir, tmp_path / case)
        state = load_file(str(copy / "model.safetensors"))
        edit(state, name)
        save_file({k: v.contiguous() for k, v in state.items()}, str(copy / "model.safetensors"))
        _reseal(copy)
        with pytest.raises(CheckpointNotSupportedError, match=message):
            load_bundle(copy)


# ---------------------------------------------------------------------------------------------
# The CLI reports every problem at once, and write failures in one line


def cli_problems(capsys) -> list[str]:
    """The problems of a failed command's one error message (no traceback), in order."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x for x in err.strip().splitlines() if not re.match(r"\d\d:\d\d:\d\d [A-Z]+ ", x)]
    errors = [i for i, x in enumerate(lines) if x.startswith("asrforge: error:")]
    assert len(errors) == 1, err
    lines = lines[errors[0] :]  # after what the command said it was doing
    if len(lines) == 1:
        return [lines[0].removeprefix("asrforge: error: ")]
    assert lines[0] == f"asrforge: error: {len(lines) - 1} problems:", err
    return [x.strip() for x in lines[1:]]


@pytest.mark.fast
def test_transcribe_reports_the_model_and_every_audio_problem_at_once(tmp_path, capsys):
    (tmp_path / "clips").mkdir()
    argv = [str(tmp_path / "no-bundle"), str(tmp_path / "missing.wav"), str(tmp_path / "clips")]
    assert main(["transcribe", *argv, "--batch-size", "0"]) == 2
    assert cli_problems(capsys) == [
        "--batch-size: must be >= 1, got 0",
        f"{tmp_path / 'no-bundle'}: no such directory",
        f"{tmp_path / 'missing.wav'}: no such audio file",
        f"{tmp_path / 'clips'}: a directory, not an audio file",
    ]


def test_transcribe_names_every_file_that_does_not_decode_in_one_message(bundle_dir, tmp_path,
                                                                         capsys):  # fmt: skip
    (tmp_path / "notes.wav").write_text("not audio")
    (tmp_path / "empty.flac").write_bytes(b"")
    argv = [str(bundle_dir), str(tmp_path / "missing.wav"), str(tmp_path / "notes.wav"),
            str(tmp_path / "empty.flac")]  # fmt: skip
    assert main(["transcribe", *argv]) == 2
    missing, notes, empty = cli_problems(capsys)
    assert missing == f"{tmp_path / 'missing.wav'}: no such audio file"
    assert notes.startswith(f"cannot read audio {tmp_path / 'notes.wav'}")
    assert str(tmp_path / "empty.flac") in empty


def test_a_directory_given_as_audio_is_named_a_directory(bundle, bundle_dir, tmp_path, capsys):
    assert main(["transcribe", str(bundle_dir), str(tmp_path)]) == 2
    assert cli_problems(capsys) == [f"{tmp_path}: a directory, not an audio file"]
    with pytest.raises(UserError, match="a directory, not an audio file"):
        bundle.transcribe(tmp_path)


@pytest.mark.fast
def test_export_reports_the_source_and_the_target_at_once(tmp_path, capsys) -> None:
    (tmp_path / "a-file").write_text("mine")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    argv = ["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "a-file" / "b")]
    assert main([*argv, "--weights", "average", "--k", "0"]) == 2
    assert cli_problems(capsys) == [
        "--k: must be >= 1, got 0",
        f"{tmp_path / 'nothing'}: no such directory",
        f"--out {tmp_path / 'a-file' / 'b'}: a parent of it is a file, not a directory",
    ]
    for out, problem in (("a-file", "exists and is not a directory"), ("loop", "a symlink loop")):
        assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / out)]) == 2
        assert problem in cli_problems(capsys)[1]
    assert (tmp_path / "a-file").read_text() == "mine"


def _no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_export_and_average_on_a_full_disk_fail_in_one_line(trained_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert main(["export", str(trained_run), "--out", str(out / "kept")]) == 0
    kept = read_manifest(out / "kept")
    capsys.readouterr()
    commands = {
        "export-new": ["export", str(trained_run), "--out", str(out / "bundle")],
        "export-over": ["export", str(trained_run), "--overwrite", "--out", str(out / "kept")],
        "average": ["average", str(trained_run), "--k", "2", "--out", str(out / "avg")],
    }
    for name, argv in commands.items():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("asrforge.io.atomic.fsync_file", _no_space)
            assert main(argv) == 1, name  # the disk, not the input, is at fault
        (message,) = cli_problems(capsys)
        assert f"could not write {argv[-1]}: No space left on device (errno 28)" in message
    # nothing half-written, and the bundle that was there is whole
    assert sorted(p.name for p in out.iterdir()) == ["kept"]
    assert read_manifest(out / "kept") == kept and load_bundle(out / "kept")


def test_average_onto_a_file_is_an_input_error(trained_run, tmp_path, capsys):
    (tmp_path / "a-file").write_text("mine")
    assert main(["average", str(trained_run), "--k", "2", "--out", str(tmp_path / "a-file")]) == 2
    assert str(tmp_path / "a-file") in cli_problems(capsys)[0]
    assert (tmp_path / "a-file").read_text() == "mine" and len(list(tmp_path.iterdir())) == 1


def test_checkpoint_weights_that_are_not_safetensors_are_named(
    trained_run, tones_dir, tmp_path, capsys
):
    """A checkpoint built wrong (its manifest rewritten to match): export, evaluate and average
    name the file instead of a safetensors traceback."""
    from asrforge.checkpoint.manifest import write_manifest

    run = _copy(trained_run, tmp_path / "run")
    for ckpt in (run / "checkpoints").glob("step-*"):
        (ckpt / "model.safetensors").write_bytes(b"not safetensors" * 16)
        meta = {
            k: v for k, v in read_manifest(ckpt).items() if k not in ("format_version", "files")
        }
        write_manifest(ckpt, meta)
    ckpt = run / "checkpoints" / "step-000004"
    for argv in (
        ["export", str(ckpt), "--out", str(tmp_path / "b"), "--weights", "raw"],
        ["export", str(ckpt), "--out", str(tmp_path / "b")],  # EMA over the raw weights
        ["evaluate", str(ckpt), "--data", str(tones_dir)],
        ["average", str(run), "--k", "2", "--metric", "loss"],
    ):
        assert main(argv) == 2, argv
        (message,) = cli_problems(capsys)
        assert re.search(r"step-00000\d/model\.safetensors: not a readable safetensors", message)
    assert not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------------------------
# Files that pass the manifest (a bundle built wrong) but are malformed: named, exit 2


def _edit_json(name: str, edit):
    def apply(directory: Path) -> None:
        path = directory / name
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))

    return apply


def _write(name: str, content: bytes):
    return lambda directory: (directory / name).write_bytes(content)


def _aliases(record: str):
    """Store the weights again under the alias record ``record`` (tied names -> kept names)."""

    def apply(directory: Path) -> None:
        path = str(directory / "model.safetensors")
        save_file(load_file(path), path, metadata={ALIASES_KEY: record})

    return apply


def _features(**fields):
    """Set ``fields`` of the features in both files that record them, as they must agree."""

    def apply(directory: Path) -> None:
        _edit_json(INFERENCE_CONFIG, lambda c: {**c, "features": {**c["features"], **fields}})(
            directory
        )
        _edit_json("preprocessor_config.json", lambda c: {**c, **fields})(directory)

    return apply


MALFORMED = {
    **{
        f"tokenizer-side-{name}": (
            _write(name, b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
            rf"{re.escape(name)}: not valid JSON \(nested deeper than",
        )
        for name in ("tokenizer_config.json", "added_tokens.json", "special_tokens_map.json")
    },
    "tokenizer-side-list": (
        _write("added_tokens.json", b"[1]"),
        r"added_tokens\.json: not a JSON object",
    ),
    "alias-missing": (
        _aliases(json.dumps({"proj_out.weight": "no.such.tensor"})),
        r"model\.safetensors: alias 'proj_out\.weight' names no tensor 'no\.such\.tensor'",
    ),
    "alias-deep": (
        _aliases("[" * 200_000 + "]" * 200_000),
        r"model\.safetensors: damaged asrforge_aliases metadata: not valid JSON \(nested deeper",
    ),
    "alias-stored": (
        _aliases(json.dumps({"model.decoder.embed_tokens.weight": "model.encoder.conv1.bias"})),
        r"alias 'model\.decoder\.embed_tokens\.weight' \(of 'model\.encoder\.conv1\.bias'\) is "
        r"the name of a stored tensor",
    ),
    "alias-shape": (
        _aliases(json.dumps({"proj_out.weight": "model.encoder.conv1.bias"})),
        r"model\.safetensors: the tensors do not fit .*proj_out\.weight: expected shape "
        r"\[\d+, 32\], got \[32\]",
    ),
    # a window of a million seconds would be padded to 16 billion samples before any check
    "features-window": (
        _features(chunk_length=10**6),
        r"inference_config\.json: features\.chunk_length: 1000000 s of 160-sample hops at 16000 Hz "
        r"is not the 200 frames the model's encoder takes \(2 x config\.json max_source_positions "
        r"100\): that is 2 s",
    ),
    "features-hop": (
        _features(hop_length=0),
        r"inference_config\.json does not fit the schema: features\.hop_length: must be > 0, got 0",
    ),
    "features-rate": (
        _features(sampling_rate=-5),
        r"features\.sampling_rate: must be one of 16000, got -5",
    ),
    "features-fft": (_features(n_fft=10**9), r"features\.n_fft: must be <= 2048, got 1000000000"),
    "features-mels": (
        _features(feature_size=10**6),
        r"features\.feature_size: 1000000 log-mel channels, but the model takes 80",
    ),
    "config-type": (
        _edit_json("config.json", lambda c: {**c, "encoder_layers": "two"}),
        r"config\.json: encoder_layers must be int, got 'two'",
    ),
    "config-bool": (
        _edit_json("config.json", lambda c: {**c, "scale_embedding": "yes"}),
        r"config\.json: scale_embedding must be bool, got 'yes'",
    ),
    "config-deep": (
        _write("config.json", b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        r"config\.json: not valid JSON \(nested deeper than",
    ),
    "tokenizer-list": (_write("tokenizer.json", b"[1, 2]"), r"tokenizer\.json: not a tokenizers"),
    "tokenizer-deep": (
        _edit_json("tokenizer.json", lambda t: {**t, "x": json.loads("[" * 100 + "]" * 100)}),
        r"tokenizer\.json: not valid JSON \(nested deeper than",
    ),
    "tokenizer-no-model": (
        _edit_json("tokenizer.json", lambda t: {k: v for k, v in t.items() if k != "model"}),
        r"tokenizer\.json: not a tokenizers file",
    ),
    "tokenizer-vocab": (
        _edit_json("tokenizer.json", lambda t: {**t, "model": {**t["model"], "vocab": [1]}}),
        r"tokenizer\.json: not a tokenizers file: invalid type",
    ),
    "preprocessor-garbage": (
        _write("preprocessor_config.json", b"\x00\x01 garbage"),
        r"preprocessor_config\.json: not valid JSON",
    ),
    "preprocessor-mels": (
        _edit_json("preprocessor_config.json", lambda c: {**c, "feature_size": 3}),
        r"preprocessor_config\.json: feature_size 3 \(the inference_config\.json features say 80\)",
    ),
    "generation-garbage": (
        _write("generation_config.json", b"garbage"),
        r"generation_config\.json: not valid JSON",
    ),
    "generation-list": (_write("generation_config.json", b"[1]"), r"not a JSON object"),
    "generation-prompt": (
        _edit_json("generation_config.json", lambda c: {**c, "decoder_start_token_id": 7}),
        r"generation_config\.json: decoder_start_token_id 7 \(the tokenizer's: \d+\)",
    ),
    "generation-type": (
        _edit_json("generation_config.json", lambda c: {**c, "max_length": "long"}),
        r"generation_config\.json: max_length must be int, got 'long'",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_file_that_passes_the_manifest_is_named(bundle_dir, tmp_path, capsys, case):
    edit, message = MALFORMED[case]
    copy = _copy(bundle_dir, tmp_path / "bundle")
    edit(copy)
    _reseal(copy)  # built wrong, not tampered with: the checksums pass
    with pytest.raises(UserError, match=message):
        load_bundle(copy)
    wav = tmp_path / "x.wav"
    sf.write(wav, np.zeros(1600, dtype=np.float32), 16_000)
    assert main(["transcribe", str(copy), str(wav)]) == 2
    (problem,) = cli_problems(capsys)
    assert re.search(message, problem), problem


def test_a_checkpoint_run_or_model_given_as_a_bundle_says_how_to_export(trained_run, tmp_path):
    best = trained_run / "checkpoints" / "best"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for path, what in ((best, "a training checkpoint"), (trained_run, "a training run directory"),
                       (model, "a transformers model directory")):  # fmt: skip
        with pytest.raises(CheckpointNotSupportedError) as e:
            load_bundle(path)
        assert str(e.value) == (
            f"{path}: {what}, not an inference bundle; export it first: "
            f"asrforge export {path} --out BUNDLE_DIR"
        )


def test_a_newer_bundle_from_a_writer_no_newer_than_us_names_both_versions(bundle_dir, tmp_path):
    from asrforge.bundle.schema import BUNDLE_VERSION, asrforge_version

    copy = _copy(bundle_dir, tmp_path / "v2")
    info = json.loads((copy / INFERENCE_CONFIG).read_text())
    info.update(bundle_version="2.0.0", asrforge_version=asrforge_version())
    (copy / INFERENCE_CONFIG).write_text(json.dumps(info))
    _reseal(copy)
    with pytest.raises(CheckpointNotSupportedError) as e:
        load_bundle(copy)
    message = str(e.value)
    assert "bundle_version 2.0.0 is newer than this asrforge supports" in message
    assert (
        f"asrforge {asrforge_version()} reads bundle format 1.x (up to {BUNDLE_VERSION})" in message
    )
    assert "asrforge >=" not in message  # the writer's version is no minimum to upgrade to


def test_the_card_of_local_data_publishes_no_local_path(bundle_dir, tones_dir) -> None:
    from huggingface_hub import ModelCard

    text = (bundle_dir / "README.md").read_text()
    results = ModelCard(text).data.to_dict()["model-index"][0]["results"]
    assert {r["dataset"]["type"] for r in results} == {"local"}
    assert {r["dataset"]["name"].split(" (")[0] for r in results} == {tones_dir.name}
    assert str(tones_dir.parent) not in text  # a home directory would be published


@pytest.mark.fast
@pytest.mark.parametrize(
    "last", ["[1, 2]", "[" * 100_000 + "]" * 100_000, '{"summary": true, "per_language": [1]}']
)
def test_an_eval_record_that_is_no_summary_leaves_the_card_without_figures(
    tmp_path, caplog, last
) -> None:
    """An eval record ending in a list or deep JSON stopped the export with a traceback."""
    from asrforge.bundle.card import _eval_summary
    from asrforge.run_layout import RunLayout

    run = RunLayout(tmp_path)
    run.eval_dir.mkdir()
    summary = {"summary": True, "step": 4, "wer": 0.5, "per_language": {}}
    run.eval_record(4).write_text(json.dumps(summary) + "\n")
    assert _eval_summary(run, 4) == summary
    run.eval_record(4).write_text('{"id": "u1"}\n' + last + "\n")
    assert _eval_summary(run, 4) == {}
    assert "step-000004.jsonl: not a readable evaluation record" in caplog.text
    assert "the model card has no figures" in caplog.text


@pytest.mark.fast
def test_the_card_says_what_the_forgetting_guard_measured_in_sentences() -> None:
    from asrforge.bundle.card import _guard_text

    guard = {"guard_wer": 0.31, "guard_start": 0.3, "guard_tolerance": 0.02, "guard_within": True,
             "guard_drift": False, "guard_lid": 0.9, "guard_lid_start": 1.0,
             "guard_lid_tolerance": 0.05}  # fmt: skip
    assert _guard_text(guard) == (
        "Forgetting guard: its WER on the guard set is 31 %, against 30 % for the starting model "
        "(allowed: up to 2 points more): within the guard. Language identification on the guard "
        "set is right 90 % of the time, against 100 % for the starting model (allowed: up to 5 "
        "points less)."
    )
    drift = _guard_text({**guard, "guard_drift": True, "guard_wer": 0.05, "guard_start": 0.0,
                         "guard_within": False, "guard_lid": None})  # fmt: skip
    assert drift == (
        "Forgetting guard: its drift (WER against the starting model's own transcripts) is 5 %, "
        "against 0 % for the starting model (allowed: up to 2 points more): outside the guard."
    )


def test_one_recording_given_for_a_list_is_refused_by_name(bundle, validation) -> None:
    wave = decode_audio(validation[0]["audio"]["bytes"])
    for one in ("talk.wav", Path("talk.wav"), b"RIFF", wave, torch.from_numpy(wave)):
        with pytest.raises(UserError, match=r"take a list of recordings, got one \w+: pass \["):
            bundle.recognize(one)
        with pytest.raises(UserError, match="take a list of recordings"):
            bundle.transcribe_many(one)
    # a 2-D array is a batch of recordings, one a row
    assert len(bundle.transcribe_many(np.stack([wave, wave]), max_new_tokens=2)) == 2
