"""An n-gram LM in a bundle: ``lm build``, ``export --lm``, verification, fusion in transcribe and
evaluate, ``lm tune``; transformers and CTranslate2 load such a bundle and ignore the LM."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from test_bundle import (  # noqa: F401  (one_thread: autouse)
    _reseal,
    cli_error,
    one_thread,
    train_tiny_run,
)

from asrforge.bundle.export import export_bundle
from asrforge.bundle.languages import language_of_prompt
from asrforge.bundle.load import ALIGNMENT_HEADS_KEY, LM_WEIGHTS_KEY, load_bundle
from asrforge.bundle.options import lm_alpha_beta
from asrforge.bundle.schema import INFERENCE_CONFIG
from asrforge.bundle.write import update_bundle_manifest
from asrforge.checkpoint.manifest import read_manifest
from asrforge.cli import main
from asrforge.data.audio import decode_audio
from asrforge.data.sources import load_arrow
from asrforge.errors import CheckpointCorruptError, UserError
from asrforge.lm.build import build_lm_file
from asrforge.lm.ngram import read_arpa


@pytest.fixture(scope="module")
def run(tmp_path_factory, tones_dir) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("lm-run"), tones_dir)


@pytest.fixture(scope="module")
def arpa(tmp_path_factory, tones_dir) -> Path:
    out = tmp_path_factory.mktemp("lm") / "tones.arpa"
    build_lm_file(out, 3, data=tones_dir)
    return out


@pytest.fixture(scope="module")
def lm_bundle_dir(run, arpa, tmp_path_factory) -> Path:
    return export_bundle(run, tmp_path_factory.mktemp("lm-bundles") / "tiny", lm=arpa)


@pytest.fixture(scope="module")
def waves(tones_dir) -> list[np.ndarray]:
    split = load_arrow(tones_dir)["validation"]
    return [decode_audio(split[i]["audio"]["bytes"]) for i in range(4)]


@pytest.mark.fast
def test_lm_build_cli_writes_an_arpa_file_of_the_normalized_text(tmp_path, capsys):
    text = tmp_path / "en.txt"
    text.write_text("Hello, World!\n\nhello there.\n", encoding="utf-8")
    out = tmp_path / "en.arpa"
    assert main(["lm", "build", "--text", str(text), "--language", "en", "--order", "2",
                 "--out", str(out)]) == 0  # fmt: skip
    lm = read_arpa(out)
    assert lm.order == 2 and lm.meta["normalizer"] == "english" and lm.meta["sentences"] == 2
    assert {g[0] for g in lm.probs[0]} == {"hello", "world", "there", "<s>", "</s>", "<unk>"}
    assert "wrote" in capsys.readouterr().err
    # the header a bundle carries names the text by its file's name, not this machine's path
    assert lm.meta["source"] == "en.txt" and str(tmp_path) not in out.read_text()


@pytest.mark.fast
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--text", "{tmp}/en.txt", "--out", "{tmp}/x.arpa"], "--text: give its --language"),
        (["--text", "{tmp}/nope.txt", "--language", "en", "--out", "{tmp}/x.arpa"],
         "--text {tmp}/nope.txt: no such file"),
        (["--text", "{tmp}/empty.txt", "--language", "en", "--out", "{tmp}/x.arpa"],
         "{tmp}/empty.txt: no words to learn from"),
        (["--text", "{tmp}/en.txt", "--language", "en", "--order", "0", "--out", "{tmp}/x.arpa"],
         "--order: must be between 1 and 6, got 0"),
        (["--text", "{tmp}/en.txt", "--language", "en", "--out", "{tmp}"], "a directory"),
        (["--text", "{tmp}/en.txt", "--language", "xx-nope", "--out", "{tmp}/x.arpa"],
         "unknown language 'xx-nope'"),
        (["--data", "{tmp}/nodata", "--out", "{tmp}/x.arpa"], "--data {tmp}/nodata: no such"),
        (["--text", "{tmp}/latin1.txt", "--language", "en", "--out", "{tmp}/x.arpa"],
         "not UTF-8"),
        (["--out", "{tmp}/x.arpa"], "give one of --text FILE or --data DIR"),
    ],
)  # fmt: skip
def test_lm_build_bad_input_exits_2_naming_it(tmp_path, capsys, argv, message):
    (tmp_path / "en.txt").write_text("a b c\n")
    (tmp_path / "empty.txt").write_text("...\n  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["lm", "build", *argv]) == 2
    assert message.replace("{tmp}", str(tmp_path)) in cli_error(capsys)
    assert not (tmp_path / "x.arpa").exists()


def test_a_bundle_with_an_lm_records_it_and_round_trips(lm_bundle_dir, arpa):
    manifest = read_manifest(lm_bundle_dir)
    entry = manifest["files"]["lm.arpa"]
    assert entry["sha256"] == hashlib.sha256((lm_bundle_dir / "lm.arpa").read_bytes()).hexdigest()
    assert (lm_bundle_dir / "lm.arpa").read_bytes() == arpa.read_bytes()
    info = json.loads((lm_bundle_dir / INFERENCE_CONFIG).read_text())["lm"]
    source = read_arpa(arpa)
    assert info["order"] == 3 and info["vocab_size"] == source.vocab_size
    assert info["normalizer"] == "by-language" and info["languages"] == ["en", "es"]
    bundle = load_bundle(lm_bundle_dir)
    assert bundle.lm.probs == source.probs and bundle.lm.backoffs == source.backoffs
    assert lm_alpha_beta(bundle) == (info["alpha"], info["beta"])
    assert language_of_prompt(bundle, bundle.specials.prompt("es")) == "es"


def test_transformers_and_ctranslate2_load_a_bundle_with_an_lm(
    lm_bundle_dir, run, arpa, waves, tmp_path
):
    from transformers import WhisperForConditionalGeneration

    hf = WhisperForConditionalGeneration.from_pretrained(lm_bundle_dir)
    ours = load_bundle(lm_bundle_dir).model.state_dict()
    assert all((hf.state_dict()[k] == t).all() for k, t in ours.items())
    ctranslate2 = pytest.importorskip("ctranslate2")
    out = export_bundle(run, tmp_path / "ct2", fmt="ct2", lm=arpa)
    assert "lm.arpa" in read_manifest(out)["files"]
    model = ctranslate2.models.Whisper(str(out), device="cpu", compute_type="float32")
    bundle = load_bundle(lm_bundle_dir)
    feats = bundle.features(waves[0], sampling_rate=16_000, return_tensors="np").input_features
    prompt = bundle.tokenizer.convert_ids_to_tokens(bundle.specials.prompt("en"))
    [result] = model.generate(
        ctranslate2.StorageView.from_array(np.ascontiguousarray(feats)), [prompt], max_length=8
    )
    assert result.sequences_ids[0]  # it decodes, the LM beside it ignored


def test_a_tampered_lm_byte_is_refused(lm_bundle_dir, tmp_path, capsys):
    copy = Path(shutil.copytree(lm_bundle_dir, tmp_path / "flip"))
    data = bytearray((copy / "lm.arpa").read_bytes())
    data[len(data) // 2] ^= 0x01
    (copy / "lm.arpa").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"lm\.arpa"):
        load_bundle(copy)
    wav = tmp_path / "x.wav"
    sf.write(wav, np.zeros(1600, dtype=np.float32), 16_000)
    assert main(["transcribe", str(copy), str(wav)]) == 2
    assert "lm.arpa" in cli_error(capsys)


def test_another_lm_under_a_resealed_manifest_is_refused(lm_bundle_dir, tmp_path):
    copy = Path(shutil.copytree(lm_bundle_dir, tmp_path / "swap"))
    build_lm_file(copy / "lm.arpa", 2, text=_text(tmp_path, "a b\n"), language="en")
    _reseal(copy)  # the checksums pass: the recorded order does not
    with pytest.raises(CheckpointCorruptError, match=r"lm\.arpa: order 2 \(.* says 3\)"):
        load_bundle(copy)


@pytest.mark.fast
@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"alpha": "x", "beta": 1.0}, "lm_weights.alpha must be a finite number, got 'x'"),
        ({"alpha": float("nan"), "beta": 0.0}, "lm_weights.alpha must be a finite number, got nan"),
        ({"alpha": 0.5, "beta": True}, "lm_weights.beta must be a finite number, got True"),
        ([1, 2], "lm_weights must be an object with alpha and beta, got \\[1, 2\\]"),
    ],
)
def test_lm_weights_that_are_not_finite_numbers_are_refused(
    lm_bundle_dir, tmp_path, weights, message
):
    """A NaN alpha scored every beam NaN and beam search kept garbage text."""
    copy = Path(shutil.copytree(lm_bundle_dir, tmp_path / "weights"))
    update_bundle_manifest(copy, {LM_WEIGHTS_KEY: weights})
    with pytest.raises(CheckpointCorruptError, match=f"manifest.json: {message}"):
        load_bundle(copy)


def _text(tmp_path: Path, content: str) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(content)
    return path


def test_export_refuses_an_lm_of_other_languages(run, tmp_path, capsys):
    de = tmp_path / "de.arpa"
    build_lm_file(de, 2, text=_text(tmp_path, "hallo welt\n"), language="de")
    best = str(run / "checkpoints" / "best")
    assert main(["export", best, "--out", str(tmp_path / "b"), "--lm", str(de)]) == 2
    assert "an LM of de; the bundle transcribes en, es" in cli_error(capsys)
    assert main(["export", str(run), "--out", str(tmp_path / "b"), "--lm", str(tmp_path)]) == 2
    assert "no such file" in cli_error(capsys)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("value", ["-nan", "nan", "inf", "-inf"])
def test_export_refuses_an_lm_whose_numbers_are_not_finite(run, arpa, tmp_path, capsys, value):
    """float() reads these, and beam search then scored every hypothesis NaN."""
    lines = arpa.read_text(encoding="utf-8").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("\\2-grams:")) + 1
    lines[at] = "\t".join([value, *lines[at].split("\t")[1:]])
    bad = tmp_path / "bad.arpa"
    bad.write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(CheckpointCorruptError, match=f"line {at + 1}: .* not a finite number"):
        read_arpa(bad)
    best = str(run / "checkpoints" / "best")
    assert main(["export", best, "--out", str(tmp_path / "b"), "--lm", str(bad)]) == 2
    assert f"{bad}: line {at + 1}" in cli_error(capsys)
    assert not (tmp_path / "b").exists()


def test_fusion_at_alpha_and_beta_zero_transcribes_as_without_the_lm(lm_bundle_dir, waves):
    bundle = load_bundle(lm_bundle_dir)
    plain = bundle.recognize(waves, "en", beam_size=3, use_lm=False)
    zero = bundle.recognize(waves, "en", beam_size=3, lm_alpha=0.0, lm_beta=0.0)
    assert [t.text for t in zero] == [t.text for t in plain]
    loud = bundle.recognize(waves, "en", beam_size=3, lm_alpha=0.0, lm_beta=-50.0)
    assert all(len(t.text.split()) <= 1 for t in loud)  # every extra word costs 50


def test_greedy_decoding_stays_greedy_with_an_lm_and_says_so_once(lm_bundle_dir, waves, caplog):
    bundle = load_bundle(lm_bundle_dir)
    plain = bundle.recognize(waves, "en", use_lm=False)
    with caplog.at_level("INFO", logger="asrforge.bundle.options"):
        default = bundle.recognize(waves, "en")
        again = bundle.recognize(waves, "en")
    assert [t.text for t in default] == [t.text for t in again] == [t.text for t in plain]
    # weights greedy decoding would not use are refused, as the CLI refuses its flags
    with pytest.raises(UserError, match="fused in beam search only; give beam_size > 1"):
        bundle.recognize(waves, "en", lm_alpha=0.0, lm_beta=-50.0)
    notes = [r.message for r in caplog.records if "fused in beam search only" in r.message]
    assert notes == [
        "the bundle's 3-gram LM is fused in beam search only; greedy decoding runs without it "
        "(beam_size N > 1 to use it)"
    ]


def test_transcribe_and_evaluate_at_beam_1_decode_without_the_lm(
    lm_bundle_dir, tones_dir, tmp_path, capsys
):
    split = load_arrow(tones_dir)["validation"]
    wav = tmp_path / "a.wav"
    sf.write(wav, decode_audio(split[0]["audio"]["bytes"]), 16000)
    assert main(["transcribe", str(lm_bundle_dir), str(wav)]) == 0
    greedy = capsys.readouterr()
    assert "fusing" not in greedy.err
    assert "3-gram LM is fused in beam search only" in greedy.err
    assert "(--beam-size N > 1 to use it)" in greedy.err
    assert main(["transcribe", str(lm_bundle_dir), str(wav), "--no-lm"]) == 0
    assert capsys.readouterr().out == greedy.out
    assert main(["transcribe", str(lm_bundle_dir), str(wav), "--lm-alpha", "1"]) == 2
    assert "fused in beam search only; add --beam-size" in cli_error(capsys)
    common = [str(lm_bundle_dir), "--data", str(tones_dir), "--max-samples", "6"]
    plain = _evaluate(capsys, *common, "--no-lm")
    default = _evaluate(capsys, *common)
    assert "fused in beam search only" in default.pop("stderr")
    plain.pop("stderr")
    assert default == plain
    assert main(["lm", "tune", str(lm_bundle_dir), "--data", str(tones_dir),
                 "--beam-size", "1"]) == 2  # fmt: skip
    assert "--beam-size: must be >= 2 (the LM is fused in beam search only)" in cli_error(capsys)


def _evaluate(capsys, *argv: str) -> dict:
    assert main(["evaluate", *argv, "--json"]) == 0
    out = capsys.readouterr()
    return {**json.loads(out.out.strip().splitlines()[-1]), "stderr": out.err}


def test_evaluate_with_the_lm_options(lm_bundle_dir, tones_dir, capsys):
    common = [str(lm_bundle_dir), "--data", str(tones_dir), "--max-samples", "6",
              "--beam-size", "2"]  # fmt: skip
    plain = _evaluate(capsys, *common, "--no-lm")
    zero = _evaluate(capsys, *common, "--lm-alpha", "0", "--lm-beta", "0")
    assert "fusing the bundle's 3-gram LM: alpha 0, beta 0" in zero.pop("stderr")
    plain.pop("stderr")
    assert zero == plain


def test_lm_tune_records_the_best_weights_atomically(lm_bundle_dir, tones_dir, tmp_path, capsys):
    copy = Path(shutil.copytree(lm_bundle_dir, tmp_path / "tune"))
    argv = ["lm", "tune", str(copy), "--data", str(tones_dir), "--max-samples", "6",
            "--beam-size", "2", "--alphas", "0.5", "--betas=-20,0",
            "--batch-size", "4"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "recorded alpha" in out.out
    # a line after each batch of 4: every point decoded the batch before the next is read
    progress = [x for x in out.err.splitlines() if x.startswith("asrforge: lm tune: ")]
    assert [x.split(" utterances")[0] for x in progress] == [
        "asrforge: lm tune: 4/6", "asrforge: lm tune: 6/6"
    ]  # fmt: skip
    assert all(re.search(r" at 3 grid points: best so far alpha .*: wer \d+\.\d\d % "
                         r"\(no LM \d+\.\d\d %\) \(\d+\.\d s\)$", x) for x in progress)  # fmt: skip
    # the last line's running counts give the rate the whole split's scoring records
    recorded = re.search(r"recorded alpha .*: wer (\d+\.\d\d) %", out.out).group(1)
    assert re.search(r"best so far .*: wer (\d+\.\d\d) %", progress[-1]).group(1) == recorded
    table = [x for x in out.out.splitlines() if x.startswith("alpha ")]
    assert [x.split(": ")[0] for x in table] == [
        "alpha 0, beta 0", "alpha 0.5, beta -20", "alpha 0.5, beta 0"
    ]  # fmt: skip
    assert all(re.search(r"^alpha .*: wer \d+\.\d\d % \(beam search \d+\.\d s\)$", x)
               for x in table)  # fmt: skip
    record = read_manifest(copy)[LM_WEIGHTS_KEY]
    assert (record["alpha"], record["beta"]) in {(0.0, 0.0), (0.5, -20.0), (0.5, 0.0)}
    assert record["value"] <= record["without_lm"] and record["n"] == 6
    bundle = load_bundle(copy)  # the resealed manifest verifies
    assert lm_alpha_beta(bundle) == (record["alpha"], record["beta"])
    assert bundle.config.model_dump() == load_bundle(lm_bundle_dir).config.model_dump()


def test_lm_tune_bad_input_exits_2(lm_bundle_dir, run, tones_dir, tmp_path, capsys):
    plain = export_bundle(run, tmp_path / "plain")
    assert main(["lm", "tune", str(plain), "--data", str(tones_dir)]) == 2
    assert "has no n-gram LM to tune" in cli_error(capsys)
    assert main(["lm", "tune", str(lm_bundle_dir), "--data", str(tones_dir),
                 "--alphas", "-1"]) == 2  # fmt: skip
    assert "--alphas: -1 must be a finite number >= 0" in cli_error(capsys)
    assert main(["lm", "tune", str(lm_bundle_dir), "--data", str(tmp_path / "none")]) == 2
    assert "no such file or directory" in cli_error(capsys)
    assert LM_WEIGHTS_KEY not in read_manifest(lm_bundle_dir)


LOCALES = {"en": "en-US", "es": "es-ES"}


def _manifest(tones_dir, split: str, root: Path, *, audio: bool) -> Path:
    """``split`` of the tones as a NeMo manifest under ``root`` (Common Voice's column names for
    the CSV beside it); the wav files are written only with ``audio``."""
    from asrforge.data.sources import read_split

    (root / "clips").mkdir(parents=True, exist_ok=True)
    rows = []
    for r in read_split(tones_dir, split):
        file = f"clips/{r['id']}.wav"
        if audio:
            (root / file).write_bytes(r["audio"]["bytes"])
        rows.append({"audio_filepath": file, "text": r["text"], "lang": r["language"]})
    (root / f"{split}.csv").write_text("path,sentence,locale\n" + "".join(
        f"{r['audio_filepath']},{r['text']},{LOCALES[r['lang']]}\n" for r in rows))  # fmt: skip
    manifest = root / f"{split}_manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def test_lm_build_reads_a_manifest_and_a_csv_as_the_saved_dataset(tones_dir, tmp_path, capsys):
    """The transcripts are read without the audio (the clips named do not exist here)."""
    manifest = _manifest(tones_dir, "train", tmp_path / "corpus", audio=False)
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    for data, language, options in (
        (tones_dir, "es", []),
        (manifest, "es", []),
        (manifest.with_name("train.csv"), "Spanish",
         ["data.columns.audio=path", "data.columns.text=sentence", "data.columns.language=locale"]),
    ):  # fmt: skip
        out = tmp_path / f"{Path(data).stem}.arpa"
        argv = ["lm", "build", "--data", str(data), "--language", language, "--order", "2"]
        assert main([*argv, "--out", str(out), *options, cache]) == 0, data
        capsys.readouterr()
    saved, *others = (
        read_arpa(tmp_path / f"{n}.arpa") for n in ("tones", "train_manifest", "train")
    )
    assert saved.meta["languages"] == ["es"] and saved.meta["sentences"] > 0
    assert saved.meta["source"] == f"{tones_dir.name} (train)"
    for lm in others:
        assert lm.probs == saved.probs and lm.meta["sentences"] == saved.meta["sentences"]
    # a split a single file does not have is the file; a directory's missing split is named
    assert main(["lm", "build", "--data", str(tones_dir), "--split", "dev",
                 "--out", str(tmp_path / "x.arpa")]) == 2  # fmt: skip
    assert f"--split 'dev': not in {tones_dir} (it has test, train, validation)" in cli_error(
        capsys
    )
    assert main(["lm", "build", "--data", str(manifest.with_name("train.csv")), "--out",
                 str(tmp_path / "x.arpa"), "data.columns.text=transcript", cache]) == 2  # fmt: skip
    assert "data.columns.text: column 'transcript' not in" in cli_error(capsys)
    assert main(["lm", "build", "--text", str(tmp_path / "x.txt"), "--language", "en",
                 "--out", str(tmp_path / "x.arpa"), "data.language=en"]) == 2  # fmt: skip
    assert "data.language=en: data options go with --data" in cli_error(capsys)
    assert not (tmp_path / "x.arpa").exists()


def test_lm_tune_on_a_manifest(lm_bundle_dir, tones_dir, tmp_path, capsys):
    copy = Path(shutil.copytree(lm_bundle_dir, tmp_path / "tune"))
    manifest = _manifest(tones_dir, "validation", tmp_path / "corpus", audio=True)
    argv = ["lm", "tune", str(copy), "--data", str(manifest), "--max-samples", "3",
            "--beam-size", "2", "--alphas", "0.5", "--betas", "0",
            f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    assert main(argv) == 0
    record = read_manifest(copy)[LM_WEIGHTS_KEY]
    assert record["data"] == str(manifest) and record["n"] == 3


@pytest.mark.fast
def test_lm_build_reads_transcripts_with_no_audio_column(tones_dir, tmp_path, capsys):
    """An LM needs transcripts only: a saved DatasetDict or a CSV of text and language alone
    builds the LM the tones' own data set gives (both were refused for lacking audio)."""
    import datasets

    train = load_arrow(tones_dir)["train"].select_columns(["text", "language"])
    datasets.DatasetDict({"train": train}).save_to_disk(str(tmp_path / "text-only"))
    train.to_csv(str(tmp_path / "train.csv"), index=False)
    for data in (tones_dir, tmp_path / "text-only", tmp_path / "train.csv"):
        out = tmp_path / f"{Path(data).stem}.arpa"
        argv = ["lm", "build", "--data", str(data), "--language", "es", "--order", "2"]
        assert main([*argv, "--out", str(out), f"data.cache_dir={tmp_path / 'cache'}"]) == 0
        capsys.readouterr()
    saved, *others = (read_arpa(tmp_path / f"{n}.arpa") for n in ("tones", "text-only", "train"))
    assert saved.meta["sentences"] > 0
    for lm in others:
        assert lm.probs == saved.probs and lm.meta["sentences"] == saved.meta["sentences"]


def test_export_onto_a_bundle_is_refused_naming_what_it_holds_unless_overwrite(
    lm_bundle_dir, run, tmp_path, capsys
):
    copy = Path(shutil.copytree(lm_bundle_dir, tmp_path / "held"))
    update_bundle_manifest(copy, {LM_WEIGHTS_KEY: {"alpha": 0.5, "beta": 1.0},
                                  ALIGNMENT_HEADS_KEY: {"heads": [[0, 0]], "lag_s": 0.0}})  # fmt: skip
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    best = str(run / "checkpoints" / "best")
    for fmt in ("hf", "ggml"):
        assert main(["export", best, "--out", str(copy), "--format", fmt]) == 2
        assert cli_error(capsys) == (
            f"asrforge: error: --out {copy}: already holds an hf bundle, an align-heads record, "
            "an n-gram LM (lm.arpa with weights from lm tune); --overwrite "
            "replaces all of it, or choose another directory"
        )
    with pytest.raises(UserError, match="already holds an hf bundle, an align-heads record"):
        export_bundle(run, copy)
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
    assert main(["export", best, "--out", str(copy), "--overwrite"]) == 0
    capsys.readouterr()
    manifest = read_manifest(copy)
    assert ALIGNMENT_HEADS_KEY not in manifest and LM_WEIGHTS_KEY not in manifest
    assert not (copy / "lm.arpa").exists()
    load_bundle(copy)
