"""``export --format ggml``: whisper.cpp's model file, its names and bytes, vocabularies it
would misread refused, and tiny.en loaded by whisper.cpp (pywhispercpp) decoding as the bundle."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from audio_fixtures import synthesize
from conftest import save_english_only_model
from test_bundle import one_thread  # noqa: F401  (autouse: one torch thread)
from test_ct2_import import ct2_tiny_en, hf_tiny_en  # noqa: F401  (session fixtures)

from asrforge.bundle.export import export_bundle
from asrforge.convert.ggml import GGML_MAGIC, _byte_decoder, check_tied_projection, ggml_name
from asrforge.errors import UserError

SR = 16_000


@pytest.mark.fast
def test_weights_get_openai_whispers_names() -> None:
    assert ggml_name("model.encoder.layers.3.self_attn.k_proj.weight") == (
        "encoder.blocks.3.attn.key.weight"
    )
    assert ggml_name("model.decoder.layers.0.encoder_attn.k_proj.weight") == (
        "decoder.blocks.0.cross_attn.key.weight"
    )
    assert ggml_name("model.decoder.layers.1.fc2.bias") == "decoder.blocks.1.mlp.2.bias"
    assert ggml_name("model.decoder.layers.1.encoder_attn_layer_norm.weight") == (
        "decoder.blocks.1.cross_attn_ln.weight"
    )
    assert ggml_name("model.encoder.layer_norm.bias") == "encoder.ln_post.bias"
    assert ggml_name("model.encoder.embed_positions.weight") == "encoder.positional_embedding"
    assert ggml_name("model.decoder.embed_tokens.weight") == "decoder.token_embedding.weight"
    assert ggml_name("model.encoder.conv1.weight") == "encoder.conv1.weight"
    assert ggml_name("proj_out.weight") is None
    with pytest.raises(UserError, match="not a Whisper weight"):
        ggml_name("model.decoder.layers.0.adapter.weight")


@pytest.mark.fast
def test_the_byte_level_alphabet_covers_every_byte_once() -> None:
    decoder = _byte_decoder()
    assert sorted(decoder.values()) == list(range(256))
    assert decoder["Ġ"] == ord(" ") and decoder["a"] == ord("a") and decoder["Ċ"] == ord("\n")


@pytest.mark.fast
def test_a_vocabulary_whisper_cpp_would_misread_is_refused(tmp_path, tones_dir) -> None:
    model = save_english_only_model(tmp_path, tones_dir)  # a from-scratch BPE, EOT first
    out = tmp_path / "ggml"
    with pytest.raises(UserError, match="--format ggml: the vocabulary has"):
        export_bundle(model, out, fmt="ggml")
    assert not out.exists()
    with pytest.raises(UserError, match="--format ggml writes float16"):
        export_bundle(model, out, fmt="ggml", ct2_quantization="int8")


@pytest.mark.fast
def test_an_output_projection_of_its_own_is_refused() -> None:
    import torch

    embed = torch.randn(6, 4)
    check_tied_projection({"model.decoder.embed_tokens.weight": embed, "proj_out.weight": embed})
    same = {"model.decoder.embed_tokens.weight": embed, "proj_out.weight": embed.clone()}
    check_tied_projection(same)
    untied = {"model.decoder.embed_tokens.weight": embed, "proj_out.weight": embed + 1}
    with pytest.raises(UserError, match="not the token embedding"):
        check_tied_projection(untied)


def _read_header(path: Path) -> tuple[list[int], tuple[int, int], int]:
    with open(path, "rb") as f:
        magic, *hparams = struct.unpack("<12i", f.read(48))
        assert magic == GGML_MAGIC
        n_mels, n_freq = struct.unpack("<ii", f.read(8))
        f.seek(4 * n_mels * n_freq, 1)
        (n_tokens,) = struct.unpack("<i", f.read(4))
    return hparams, (n_mels, n_freq), n_tokens


def test_whisper_cpp_transcribes_the_ggml_export_as_the_bundle_does(
    hf_tiny_en: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    from asrforge.bundle.export import bundle_from_checkpoint
    from asrforge.bundle.load import load_bundle
    from asrforge.errors import CheckpointNotSupportedError

    out = export_bundle(hf_tiny_en, tmp_path / "tiny-ggml", fmt="ggml")
    model_file = out / "ggml-model.bin"
    hparams, filters, n_tokens = _read_header(model_file)
    assert hparams == [51864, 1500, 384, 6, 4, 448, 384, 6, 4, 80, 1]
    assert filters == (80, 201) and n_tokens == 50257
    with pytest.raises(CheckpointNotSupportedError, match="a whisper.cpp export"):
        load_bundle(out)
    # a bundle written earlier converts to the same file
    hf_bundle = export_bundle(hf_tiny_en, tmp_path / "tiny")
    converted = export_bundle(hf_bundle, tmp_path / "converted", fmt="ggml")
    assert (converted / "ggml-model.bin").read_bytes() == model_file.read_bytes()
    pywhispercpp = pytest.importorskip("pywhispercpp.model")
    whisper_cpp = pywhispercpp.Model(
        str(model_file), n_threads=1, print_progress=False, print_realtime=False
    )
    bundle = bundle_from_checkpoint(hf_tiny_en)
    texts = [
        "We will meet at the library tomorrow morning to discuss the project.",
        "It is a beautiful day and the children are playing in the park.",
        "The train to the city leaves every hour from platform two.",
        "The museum is closed on Mondays but open late on Fridays.",
    ]
    same = 0
    for text in texts:
        wave = synthesize(text).astype(np.float32)
        ours = " ".join(bundle.transcribe(wave).split())
        # greedy: one candidate, no temperature fallback (whisper.cpp's default falls back)
        segments = whisper_cpp.transcribe(wave, greedy={"best_of": 1}, temperature_inc=0.0)
        theirs = " ".join(" ".join(s.text for s in segments).split())
        same += theirs == ours
    # On the 24 sentences of bench/workload.py 23 decode alike; the other is not the f16 weights'
    # doing (the bundle's weights rounded to f16 decode as before), and whisper.cpp computes its
    # own log-mel and runs in f16.
    assert same >= len(texts) - 1
