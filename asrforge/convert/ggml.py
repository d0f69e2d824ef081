"""A transformers Whisper model written as whisper.cpp's ggml model file (``ggml-model.bin``).

The layout is whisper.cpp's ``models/convert-h5-to-ggml.py`` (what ``whisper_model_load``
reads), all little-endian:

* the magic ``0x67676d6c`` ("ggml"), then eleven int32 hyperparameters: ``n_vocab``,
  ``n_audio_ctx`` (``max_source_positions``), ``n_audio_state``, ``n_audio_head``,
  ``n_audio_layer``, ``n_text_ctx`` (``max_target_positions``), ``n_text_state``,
  ``n_text_head``, ``n_text_layer``, ``n_mels``, and ``ftype`` (1: f16 matrices, 0: all f32);
* the mel filters: int32 ``n_mels``, int32 ``n_fft / 2 + 1``, then that many float32 (row per
  mel channel; the feature extractor's Slaney filters, which are openai-whisper's);
* the vocabulary: int32 count, then per token in id order its int32 byte length and bytes
  (the byte-level BPE's bytes, not its printable stand-ins). Only the ids up to
  ``<|endoftext|>`` are written: whisper.cpp names the special and timestamp tokens after it
  itself, from ``n_vocab``;
* each tensor: int32 ``n_dims``, int32 name length, int32 type (0 f32, 1 f16), the dims from
  the last to the first, the name (openai-whisper's: ``encoder.blocks.0.attn.query.weight``),
  then the data. With ``ftype`` 1, matrices are f16 and vectors, the convolution biases
  (written as ``(n, 1)``) and the positional embeddings f32, as the converter does.
  ``proj_out`` is the token embedding (tied) and is not written.

whisper.cpp derives the special tokens' ids from ``n_vocab`` (51864 English-only, 51865
multilingual, 51866 with Cantonese): a vocabulary of another size or layout (extended, or a
from-scratch BPE) would be read wrong, so it is refused.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from asrforge.errors import UserError
from asrforge.io.atomic import fsync_file

GGML_MAGIC = 0x67676D6C
WHISPER_VOCAB_SIZES = (51864, 51865, 51866)
"""The vocabularies whisper.cpp lays its special tokens out for."""

_LAYER_NAMES = {
    "self_attn.q_proj": "attn.query",
    "self_attn.k_proj": "attn.key",
    "self_attn.v_proj": "attn.value",
    "self_attn.out_proj": "attn.out",
    "self_attn_layer_norm": "attn_ln",
    "encoder_attn.q_proj": "cross_attn.query",
    "encoder_attn.k_proj": "cross_attn.key",
    "encoder_attn.v_proj": "cross_attn.value",
    "encoder_attn.out_proj": "cross_attn.out",
    "encoder_attn_layer_norm": "cross_attn_ln",
    "fc1": "mlp.0",
    "fc2": "mlp.2",
    "final_layer_norm": "mlp_ln",
}
_TOP_NAMES = {
    "encoder.layer_norm": "encoder.ln_post",
    "decoder.layer_norm": "decoder.ln",
    "encoder.embed_positions": "encoder.positional_embedding",
    "decoder.embed_positions": "decoder.positional_embedding",
    "decoder.embed_tokens": "decoder.token_embedding",
}
_F32_ALWAYS = (
    "encoder.conv1.bias",
    "encoder.conv2.bias",
    "encoder.positional_embedding",
    "decoder.positional_embedding",
)


def ggml_name(hf_name: str) -> str | None:
    """openai-whisper's name of a transformers weight (what whisper.cpp looks up), or None for
    ``proj_out.weight`` (tied to the token embedding)."""
    if hf_name == "proj_out.weight":
        return None
    parts = hf_name.removeprefix("model.").split(".")
    if len(parts) > 3 and parts[1] == "layers":
        module = ".".join(parts[3:-1])
        if module not in _LAYER_NAMES:
            raise UserError(f"{hf_name}: not a Whisper weight whisper.cpp knows")
        return ".".join([parts[0], "blocks", parts[2], _LAYER_NAMES[module], parts[-1]])
    stem, leaf = ".".join(parts[:-1]), parts[-1]
    stem = _TOP_NAMES.get(stem, stem)
    if stem.endswith("positional_embedding"):
        return stem  # openai-whisper's positional embeddings are plain tensors
    return f"{stem}.{leaf}"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE: printable stand-in character -> byte."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    visible += range(ord("®"), ord("ÿ") + 1)
    chars, n = list(visible), 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


def vocabulary_bytes(tokenizer, eot: int) -> list[bytes]:
    """The bytes of every token id ``0 .. eot`` (whisper.cpp's ``vocab.id_to_token``)."""
    decoder = _byte_decoder()
    out = []
    for token in tokenizer.convert_ids_to_tokens(list(range(eot + 1))):
        if token == "<|endoftext|>":
            out.append(token.encode())
        else:
            out.append(bytes(decoder[c] for c in token))
    return out


def check_whisper_layout(config, tokenizer) -> int:
    """``<|endoftext|>``'s id, when the model's vocabulary is laid out as whisper.cpp assumes.

    Raises:
        UserError: another vocabulary size, or ``<|endoftext|>`` not right before
            ``<|startoftranscript|>``.
    """
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    sot = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    if config.vocab_size not in WHISPER_VOCAB_SIZES or sot != eot + 1:
        raise UserError(
            f"--format ggml: the vocabulary has {config.vocab_size} tokens "
            f"(<|endoftext|> {eot}, <|startoftranscript|> {sot}); whisper.cpp derives its "
            f"special tokens from Whisper's own layout ({', '.join(map(str, WHISPER_VOCAB_SIZES))} "
            "tokens) and would misread an extended or from-scratch vocabulary. Export --format "
            "hf and transcribe with asrforge"
        )
    return eot


def check_tied_projection(state: Mapping[str, torch.Tensor]) -> None:
    """Refuse weights whose output projection is not the token embedding: whisper.cpp projects
    onto the vocabulary with the embedding, so it would decode another model.

    Raises:
        UserError: ``proj_out.weight`` differs from ``model.decoder.embed_tokens.weight``.
    """
    proj = state.get("proj_out.weight")
    embed = state.get("model.decoder.embed_tokens.weight")
    if proj is None or embed is None or proj is embed or torch.equal(proj, embed):
        return
    raise UserError(
        "--format ggml: the output projection (proj_out.weight) is not the token embedding; "
        "whisper.cpp projects with the embedding and would decode another model. Export "
        "--format hf or ct2"
    )


def _write_tensor(f: BinaryIO, name: str, data: np.ndarray, f16: bool) -> None:
    if name in ("encoder.conv1.bias", "encoder.conv2.bias"):
        data = data.reshape(data.shape[0], 1)
    half = f16 and data.ndim >= 2 and name not in _F32_ALWAYS
    data = np.ascontiguousarray(data.astype(np.float16 if half else np.float32))
    raw = name.encode()
    f.write(struct.pack("<iii", data.ndim, len(raw), 1 if half else 0))
    f.write(struct.pack(f"<{data.ndim}i", *reversed(data.shape)))
    f.write(raw)
    f.write(data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes())


def write_ggml_model(
    path: Path,
    state: Mapping[str, torch.Tensor],
    config,
    tokenizer,
    mel_filters: np.ndarray,
    *,
    f16: bool = True,
) -> Path:
    """Write whisper.cpp's model file at ``path`` (see the module docstring).

    Args:
        state: the weights in transformers names.
        config: the ``WhisperConfig``.
        mel_filters: (n_fft / 2 + 1, n_mels) the feature extractor's ``mel_filters``.
        f16: matrices in f16 (whisper.cpp's usual models); False: everything f32.

    Raises:
        UserError: a vocabulary whisper.cpp would misread (:func:`check_whisper_layout`), or
            an output projection of its own (:func:`check_tied_projection`).
    """
    eot = check_whisper_layout(config, tokenizer)
    check_tied_projection(state)
    filters = np.asarray(mel_filters, dtype=np.float32).T
    if filters.shape[0] != config.num_mel_bins:
        raise UserError(
            f"--format ggml: {filters.shape[0]} mel filters for a model of "
            f"{config.num_mel_bins} mel bins"
        )
    hparams = (
        config.vocab_size,
        config.max_source_positions,
        config.d_model,
        config.encoder_attention_heads,
        config.encoder_layers,
        config.max_target_positions,
        config.d_model,
        config.decoder_attention_heads,
        config.decoder_layers,
        config.num_mel_bins,
        1 if f16 else 0,
    )
    with open(path, "wb") as f:
        f.write(struct.pack("<i", GGML_MAGIC))
        f.write(struct.pack("<11i", *hparams))
        f.write(struct.pack("<ii", *filters.shape))
        f.write(np.ascontiguousarray(filters).astype("<f4").tobytes())
        vocab = vocabulary_bytes(tokenizer, eot)
        f.write(struct.pack("<i", len(vocab)))
        for token in vocab:
            f.write(struct.pack("<i", len(token)))
            f.write(token)
        for hf_name in state:
            name = ggml_name(hf_name)
            if name is None:
                continue
            tensor = state[hf_name].detach().to("cpu", torch.float32)
            _write_tensor(f, name, tensor.numpy(), f16)
    fsync_file(path)
    return path
