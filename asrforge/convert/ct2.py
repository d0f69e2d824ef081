"""Import a CTranslate2 Whisper model (what faster-whisper runs) as a transformers Whisper directory.

How it works: docs/bundle.md, "Importing a CTranslate2 model (`convert/ct2.py`)".
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

from asrforge.errors import CheckpointNotSupportedError, UserError
from asrforge.hub import CT2_FILES, resolve
from asrforge.io.atomic import fsync_dir, fsync_file
from asrforge.io.small_files import (
    CONFIG_BYTES,
    TOKENIZER_BYTES,
    open_regular,
    read_json,
    read_text,
)
from asrforge.model.build import feature_extractor
from asrforge.model.frames import window_seconds
from asrforge.model.tokenizer import SpecialTokens

# The layout below is checked against ctranslate2's writer (specs/model_spec.py, `_serialize`)
# and reader (src/models/model.cc). Versions 4 and 5 share this layout in the reader, but no
# Whisper model was ever written with them (WhisperSpec arrived with binary version 6), so they
# are refused rather than guessed at.
SUPPORTED_BINARY_VERSIONS = (6,)
# The spec revision ctranslate2's WhisperModel::current_spec_revision() reports.
MAX_SPEC_REVISION = 3
# type id -> numpy dtype; bf16 (5) is read as raw u16 and widened by hand.
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: np.uint16}
# Scalars that change the computation: CTranslate2 value -> what transformers' Whisper does.
_EXPECTED_FLAGS = {
    "decoder/activation": 3,
    "decoder/pre_norm": 1,
    "decoder/scale_embeddings": 0,
    "decoder/alibi": 0,
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_LAYER = re.compile(r"^(encoder|decoder)/layer_(\d+)/")


def import_ct2(ct2_dir: str | Path, out_dir: Path, *, dtype: str = "float32") -> Path:
    """Turn a CTranslate2 Whisper directory into a transformers Whisper directory.

    Quantized weights (int8 with per-row scales, int16 with one scale) are dequantized; every
    tensor is written as ``dtype``. The output directory is built beside ``out_dir`` and renamed
    into place, so it is complete or absent.

    Args:
        ct2_dir: directory with ``model.bin``, ``config.json``, ``tokenizer.json`` and
            ``vocabulary.txt`` (or ``vocabulary.json``), or the Hugging Face Hub id of one
            (``Systran/faster-whisper-base``, :mod:`asrforge.hub`).
        out_dir: where to write; must not exist or be empty.
        dtype: ``float32`` (default, what fine-tuning wants), ``float16`` or ``bfloat16``.

    Returns:
        ``out_dir``.

    Raises:
        UserError: a file is missing or unreadable, ``model.bin`` is truncated, of an
            unsupported binary version or spec revision, or not a Whisper model.
        CheckpointNotSupportedError: the tensors do not form a transformers Whisper model.
    """
    ct2_dir = resolve(ct2_dir, field="CT2_DIR", patterns=CT2_FILES).path
    out_dir = Path(out_dir)
    if dtype not in DTYPES:
        raise UserError(f"dtype: must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not ct2_dir.is_dir():
        raise UserError(f"{ct2_dir}: not a directory (expected a CTranslate2 Whisper model)")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir}: already exists and is not an empty directory")
    ct2_config = _ct2_config(ct2_dir / "config.json")
    tokenizer_json = _read_json(ct2_dir / "tokenizer.json", TOKENIZER_BYTES)
    if not isinstance(tokenizer_json, dict):
        raise UserError(f"{ct2_dir / 'tokenizer.json'}: not a JSON object")
    vocabulary = _read_vocabulary(ct2_dir)

    variables = read_model_bin(ct2_dir / "model.bin")
    state, shape = _to_hf_state_dict(variables)
    if shape["vocab_size"] != len(vocabulary):
        raise UserError(
            f"{ct2_dir}: the vocabulary has {len(vocabulary)} tokens but the "
            f"embeddings have {shape['vocab_size']} rows"
        )
    tokenizer_json, specials = _complete_tokenizer(tokenizer_json, vocabulary, ct2_dir)
    ids = {tok: i for i, tok in enumerate(vocabulary)}

    config = WhisperConfig(
        **shape,
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
        decoder_start_token_id=ids["<|startoftranscript|>"],
        # Generation settings live in generation_config.json only: transformers warns when the
        # model config carries them too.
        suppress_tokens=None,
        begin_suppress_tokens=None,
        activation_function="gelu",
        scale_embedding=False,
        dtype=dtype,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    _check_against_model(config, state)
    torch_dtype = DTYPES[dtype]
    state = _unshared({k: v.to(torch_dtype).contiguous() for k, v in state.items()})

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        config.save_pretrained(tmp)
        _generation_config(config, ct2_config, ids).save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        feature_extractor(shape["num_mel_bins"], window_seconds(config)).save_pretrained(tmp)
        _write_tokenizer_files(tmp, tokenizer_json, specials, shape["max_target_positions"])
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors writes 0o600
            fsync_file(path)
        tmp.chmod(0o755)  # mkdtemp makes it 0o700
        fsync_dir(tmp)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_model_bin(path: Path) -> dict[str, torch.Tensor]:
    """Read a CTranslate2 ``model.bin`` of a Whisper model into float32 tensors.

    Layout (little endian): u32 binary version; spec name and u32 revision; u32 variable count;
    per variable a name, u8 rank, u32 per dimension, u8 type id, u32 byte count and the data;
    then u32 alias count and (alias, target) name pairs. A string is a u16 length counting its
    trailing NUL, the UTF-8 bytes, and the NUL. Aliases are resolved (so ``decoder/projection/
    weight`` appears when it shares the embeddings), int8/int16 weights are divided by their
    ``*_scale`` and dropped scales are not returned; scalars come back as 0-d tensors.

    Args:
        path: the ``model.bin`` file.

    Returns:
        name -> tensor: float32 for weights (shape as stored, e.g. ``(out, in)`` for a linear
        layer), int64 0-d tensors for integer scalars such as ``encoder/num_heads``.

    Raises:
        UserError: missing, truncated, not Whisper, or an unsupported version or revision.
    """
    raw, aliases = _read_raw(path)
    out: dict[str, torch.Tensor] = {}
    for name, (type_id, array) in raw.items():
        if name.endswith("_scale") and name[: -len("_scale")] in raw:
            continue
        if name.endswith("_zero") and name[: -len("_zero")] in raw:
            raise UserError(f"{path}: {name}: AWQ-quantized weights are not supported")
        out[name] = _dequantize(path, name, type_id, array, raw.get(name + "_scale"))
    # Aliases share the tensor object, so tied weights stay tied.
    for alias, target in aliases.items():
        if target not in out:
            raise UserError(f"{path}: alias {alias!r} points at a missing variable {target!r}")
        out[alias] = out[target]
    return out


def _read_raw(path: Path) -> tuple[dict[str, tuple[int, np.ndarray]], dict[str, str]]:
    # Returns name -> (type id, array as stored) and alias -> target.
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise UserError(
            f"{path}: missing (a CTranslate2 model directory has a model.bin)"
        ) from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except ValueError:  # an empty file cannot be mapped
        raise UserError(f"{path}: empty file, not a CTranslate2 model") from None
    finally:
        os.close(fd)
    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(buf):
            raise UserError(f"{path}: truncated at byte {pos} (file has {len(buf)} bytes)")
        values = struct.unpack_from(fmt, buf, pos)
        pos += size
        return values

    def take_string() -> str:
        nonlocal pos
        (size,) = take("<H")
        if size == 0 or pos + size > len(buf):
            raise UserError(f"{path}: truncated or corrupt string at byte {pos}")
        data = bytes(buf[pos : pos + size - 1])
        pos += size
        return data.decode("utf-8", errors="replace")

    (version,) = take("<I")
    if version not in SUPPORTED_BINARY_VERSIONS:
        raise UserError(
            f"{path}: CTranslate2 binary version {version} is not supported (supported: "
            f"{', '.join(map(str, SUPPORTED_BINARY_VERSIONS))}); re-convert the model with "
            "ctranslate2 >= 3 (ct2-transformers-converter)"
        )
    spec = take_string()
    (revision,) = take("<I")
    if spec != "WhisperSpec":
        raise UserError(f"{path}: a CTranslate2 {spec!r} model, not Whisper (WhisperSpec)")
    if not 1 <= revision <= MAX_SPEC_REVISION:
        raise UserError(
            f"{path}: WhisperSpec revision {revision} is not supported "
            f"(supported: 1..{MAX_SPEC_REVISION})"
        )
    raw: dict[str, tuple[int, np.ndarray]] = {}
    (count,) = take("<I")
    for _ in range(count):
        name = take_string()
        (rank,) = take("<B")
        dims = take(f"<{rank}I")
        type_id, nbytes = take("<BI")
        if type_id not in _DTYPES:
            raise UserError(f"{path}: {name}: unknown type id {type_id}")
        dt = np.dtype(_DTYPES[type_id]).newbyteorder("<")
        # Python ints, since numpy's int64 product wraps and huge dims could then match nbytes.
        if nbytes != math.prod(dims) * dt.itemsize:
            raise UserError(f"{path}: {name}: {nbytes} bytes do not fit shape {list(dims)}")
        if pos + nbytes > len(buf):
            raise UserError(
                f"{path}: truncated inside {name!r} (byte {pos}, file has {len(buf)} bytes)"
            )
        raw[name] = (type_id, np.frombuffer(buf, dt, nbytes // dt.itemsize, pos).reshape(dims))
        pos += nbytes
    (n_aliases,) = take("<I")
    aliases = {}
    for _ in range(n_aliases):
        alias = take_string()
        aliases[alias] = take_string()
    if pos != len(buf):
        raise UserError(f"{path}: {len(buf) - pos} unexpected bytes after the last alias")
    return raw, aliases


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor that overlaps another in memory copied.

    CTranslate2 stores equal tensors once under aliases (the zero biases and unit norms of a
    fresh model, the tied embeddings), and safetensors refuses to write tensors that share
    memory; these are separate weights of transformers' model, each saved under its own name.
    The tied output projection is left out before this (transformers ties it on loading).
    """
    taken: dict[int, list[tuple[int, int]]] = {}
    out = {}
    for name, tensor in state.items():
        start = tensor.storage_offset() * tensor.element_size()
        span = (start, start + tensor.numel() * tensor.element_size())
        spans = taken.setdefault(tensor.untyped_storage().data_ptr(), [])
        if any(a < span[1] and span[0] < b for a, b in spans):
            tensor = tensor.clone()
        else:
            spans.append(span)
        out[name] = tensor
    return out


def _dequantize(
    path: Path, name: str, type_id: int, array: np.ndarray, scale: tuple[int, np.ndarray] | None
) -> torch.Tensor:
    # bfloat16 is the high half of a float32.
    if type_id == 5:
        return torch.from_numpy((array.astype(np.uint32) << 16).view(np.float32))
    if type_id in (0, 4):
        return torch.from_numpy(array.astype(np.float32))
    if scale is None:
        if type_id in (1, 2) and array.ndim > 0:
            raise UserError(f"{path}: {name} is quantized but has no {name}_scale")
        # Scalars such as num_heads and flags are integers.
        return torch.from_numpy(array.astype(np.int64))
    if type_id not in (1, 2):
        raise UserError(f"{path}: {name}: a scale on a type-{type_id} variable")
    # CTranslate2 stores round(w * scale): per output row for int8, one number for int16.
    factor = _dequantize(path, name + "_scale", scale[0], scale[1], None).float()
    if factor.ndim == 1:
        factor = factor.reshape(-1, *([1] * (array.ndim - 1)))
    return torch.from_numpy(array.astype(np.float32)) / factor


def _to_hf_state_dict(v: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """CTranslate2 variables -> transformers state dict and the config's shape fields."""
    for name in [*_EXPECTED_FLAGS, "encoder/num_heads", "decoder/num_heads"]:
        if name in v and v[name].numel() != 1:
            raise UserError(
                f"model.bin: {name} holds {tuple(v[name].shape)} values, not one number"
            )
    for name, expected in _EXPECTED_FLAGS.items():
        if name in v and int(v[name]) != expected:
            raise CheckpointNotSupportedError(
                f"{name} = {int(v[name])}: transformers' Whisper needs {expected}"
            )
    for name in ("encoder/num_heads", "decoder/num_heads"):
        if name not in v:
            raise UserError(f"model.bin has no {name}; re-convert with a current ctranslate2")
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        if name not in v:
            raise CheckpointNotSupportedError(f"model.bin has no variable {name!r}")
        used.add(name)
        return v[name]

    state: dict[str, torch.Tensor] = {}

    def linear(src: str, dst: str) -> None:
        state[f"{dst}.weight"] = get(f"{src}/weight")
        state[f"{dst}.bias"] = get(f"{src}/bias")

    def norm(src: str, dst: str) -> None:
        state[f"{dst}.weight"] = get(f"{src}/gamma")
        state[f"{dst}.bias"] = get(f"{src}/beta")

    def split(src: str, dst: str, parts: tuple[str, ...]) -> None:
        weight, bias = get(f"{src}/weight"), get(f"{src}/bias")
        if weight.shape[0] % len(parts):
            raise CheckpointNotSupportedError(
                f"{src}/weight: {tuple(weight.shape)} does not split into {len(parts)} projections"
            )
        for part, w, b in zip(parts, weight.chunk(len(parts)), bias.chunk(len(parts)), strict=True):
            state[f"{dst}.{part}_proj.weight"] = w
            # transformers' k_proj has no bias, and none is needed: q.(k + b) shifts every
            # score of a query by the same q.b, which softmax cancels.
            if part != "k":
                state[f"{dst}.{part}_proj.bias"] = b

    n_layers = {"encoder": 0, "decoder": 0}
    for name in v:
        match = _LAYER.match(name)
        if match:
            side = match.group(1)
            n_layers[side] = max(n_layers[side], int(match.group(2)) + 1)
    for side in ("encoder", "decoder"):
        hf = f"model.{side}"
        state[f"{hf}.embed_positions.weight"] = get(f"{side}/position_encodings/encodings")
        norm(f"{side}/layer_norm", f"{hf}.layer_norm")
        for i in range(n_layers[side]):
            src, dst = f"{side}/layer_{i}", f"{hf}.layers.{i}"
            split(f"{src}/self_attention/linear_0", f"{dst}.self_attn", ("q", "k", "v"))
            linear(f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
            norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
            if side == "decoder":
                linear(f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
                split(f"{src}/attention/linear_1", f"{dst}.encoder_attn", ("k", "v"))
                linear(f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")
                norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
            linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
            linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
            norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")
    for conv in ("conv1", "conv2"):
        linear(f"encoder/{conv}", f"model.encoder.{conv}")
    embeddings = get("decoder/embeddings/weight")
    state["model.decoder.embed_tokens.weight"] = embeddings
    projection = get("decoder/projection/weight") if "decoder/projection/weight" in v else None
    tied = projection is None or projection is embeddings or torch.equal(projection, embeddings)
    if not tied:
        state["proj_out.weight"] = projection
    if "decoder/projection/bias" in v and bool(get("decoder/projection/bias").any()):
        raise CheckpointNotSupportedError(
            "decoder/projection/bias is not zero; transformers' Whisper has no output bias"
        )
    unused = sorted(n for n, t in v.items() if t.ndim > 0 and n not in used)
    if unused:
        raise CheckpointNotSupportedError(
            f"model.bin has variables with no transformers counterpart: {', '.join(unused[:8])}"
        )
    shape = {
        "vocab_size": embeddings.shape[0],
        "d_model": embeddings.shape[1],
        "num_mel_bins": state["model.encoder.conv1.weight"].shape[1],
        "encoder_layers": n_layers["encoder"],
        "decoder_layers": n_layers["decoder"],
        "encoder_attention_heads": int(v["encoder/num_heads"]),
        "decoder_attention_heads": int(v["decoder/num_heads"]),
        "encoder_ffn_dim": get("encoder/layer_0/ffn/linear_0/weight").shape[0],
        "decoder_ffn_dim": get("decoder/layer_0/ffn/linear_0/weight").shape[0],
        "max_source_positions": state["model.encoder.embed_positions.weight"].shape[0],
        "max_target_positions": state["model.decoder.embed_positions.weight"].shape[0],
        "tie_word_embeddings": tied,
    }
    return state, shape


def _check_against_model(config: WhisperConfig, state: dict[str, torch.Tensor]) -> None:
    """Compare names and shapes with the model ``config`` builds (on the meta device: no memory)."""
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("proj_out.weight", None)
    got = {k: tuple(t.shape) for k, t in state.items()}
    problems = [f"missing {k}" for k in sorted(expected.keys() - got.keys())]
    problems += [f"unexpected {k}" for k in sorted(got.keys() - expected.keys())]
    problems += [
        f"{k}: {got[k]} != {expected[k]}"
        for k in sorted(got.keys() & expected.keys())
        if got[k] != expected[k]
    ]
    if problems:
        raise CheckpointNotSupportedError(
            "the CTranslate2 weights do not form a transformers "
            "Whisper model: " + "; ".join(problems[:8])
        )


def _generation_config(config: WhisperConfig, ct2: dict, ids: dict[str, int]) -> GenerationConfig:
    """The fields openai/whisper-* repos ship in ``generation_config.json``."""
    specials = _special_tokens(config, ct2, ids)
    fields = {
        **specials.generation_fields(),
        "bos_token_id": specials.eot,
        "suppress_tokens": list(ct2.get("suppress_ids", [])),
        "begin_suppress_tokens": list(ct2.get("suppress_ids_begin", [])),
        "prev_sot_token_id": ids.get("<|startofprev|>"),
        "max_initial_timestamp_index": 50,  # openai's 1.0 s at 0.02 s per timestamp token
        "max_length": config.max_target_positions,
        "return_timestamps": False,
    }
    if ct2.get("alignment_heads"):
        fields["alignment_heads"] = [list(pair) for pair in ct2["alignment_heads"]]
    if specials.multilingual:
        # Detect the language, then transcribe, as openai/whisper-* do. transformers calls this
        # field deprecated but, without it (and no task= at generate time), emits no task token.
        fields["forced_decoder_ids"] = [[1, None], [2, ids["<|transcribe|>"]]]
    # English-only models need none: generate() appends <|notimestamps|> by itself.
    return GenerationConfig(**{k: val for k, val in fields.items() if val is not None})


def _special_tokens(config: WhisperConfig, ct2: dict, ids: dict[str, int]) -> SpecialTokens:
    """The special tokens of openai's id layout (``ids``: token -> id), the languages those
    CTranslate2 lists (``lang_ids``) or else every token between ``<|startoftranscript|>`` and
    ``<|translate|>``."""
    multilingual = config.vocab_size >= 51865  # transformers' and openai's rule
    languages, tasks = {}, {}
    if multilingual:
        tokens = {i: tok for tok, i in ids.items()}
        lang_ids = ct2.get("lang_ids") or [
            i for i in range(ids["<|startoftranscript|>"] + 1, ids["<|translate|>"])
        ]
        languages = {tokens[i][2:-2]: i for i in lang_ids if i in tokens}  # <|en|> -> en
        tasks = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    return SpecialTokens(
        sot=ids["<|startoftranscript|>"],
        eot=ids["<|endoftext|>"],
        no_timestamps=ids["<|notimestamps|>"],
        tasks=tasks,
        languages=languages,
        multilingual=multilingual,
    )


def _read_json(path: Path, limit: int = CONFIG_BYTES) -> Any:
    try:
        return read_json(path, limit)
    except FileNotFoundError:
        raise UserError(
            f"{path}: missing (a CTranslate2 Whisper directory has config.json and "
            "tokenizer.json; copy tokenizer.json from the original model if absent)"
        ) from None


_ID_LISTS = ("suppress_ids", "suppress_ids_begin", "lang_ids")


def _ct2_config(path: Path) -> dict:
    """CTranslate2's ``config.json``: an object whose token id lists are lists of integers and
    whose ``alignment_heads`` are ``[layer, head]`` pairs.

    Raises:
        UserError: naming the file and each field of the wrong kind.
    """
    config = _read_json(path)
    if not isinstance(config, dict):
        raise UserError(f"{path}: not a JSON object")

    def ints(value: Any, n: int | None = None) -> bool:
        return (
            isinstance(value, list)
            and (n is None or len(value) == n)
            and all(type(x) is int for x in value)
        )

    wrong = [
        f"{name} must be a list of token ids, got {config[name]!r:.40}"
        for name in _ID_LISTS
        if config.get(name) is not None and not ints(config[name])
    ]
    heads = config.get("alignment_heads")
    if heads is not None and not (isinstance(heads, list) and all(ints(h, 2) for h in heads)):
        wrong.append(f"alignment_heads must be a list of [layer, head] pairs, got {heads!r:.40}")
    if wrong:
        raise UserError(f"{path}: " + "; ".join(wrong))
    return config


def _read_vocabulary(ct2_dir: Path) -> list[str]:
    """Tokens in id order from ``vocabulary.json`` (newer ctranslate2) or ``vocabulary.txt``."""
    # A FIFO or a device here is refused by name rather than passed over as absent.
    if (ct2_dir / "vocabulary.json").exists():
        tokens = _read_json(ct2_dir / "vocabulary.json", TOKENIZER_BYTES)
        if not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)):
            raise UserError(f"{ct2_dir / 'vocabulary.json'}: expected a list of tokens")
        return tokens
    path = ct2_dir / "vocabulary.txt"
    if not path.exists():
        raise UserError(f"{ct2_dir}: has neither vocabulary.txt nor vocabulary.json")
    try:
        text = read_text(path, TOKENIZER_BYTES)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: {getattr(e, 'strerror', None) or e}") from None
    # One token per line; byte-level BPE tokens never contain a newline.
    return text.removesuffix("\n").split("\n")


def _complete_tokenizer(tok: dict, vocabulary: list[str], where: Path) -> tuple[dict, list[str]]:
    """Check ``tokenizer.json`` against the vocabulary; add the tokens it lacks (timestamps).

    Returns:
        The completed ``tokenizer.json`` content and the special tokens other than
        ``<|endoftext|>``, in id order (the tokenizer's ``additional_special_tokens``).
    """
    model = tok.get("model", {})
    if (
        not isinstance(model, dict)
        or model.get("type") != "BPE"
        or not isinstance(model.get("vocab"), dict)
        or not all(type(i) is int for i in model["vocab"].values())
    ):
        raise UserError(f"{where / 'tokenizer.json'}: not a byte-level BPE (Whisper) tokenizer")
    added = tok.get("added_tokens", [])
    if not (
        isinstance(added, list)
        and all(
            isinstance(a, dict) and type(a.get("id")) is int and isinstance(a.get("content"), str)
            for a in added
        )
    ):
        raise UserError(
            f"{where / 'tokenizer.json'}: added_tokens must be a list of objects with an integer "
            "id and a string content"
        )
    by_id = {i: t for t, i in model["vocab"].items()}
    by_id.update({a["id"]: a["content"] for a in tok.get("added_tokens", [])})
    for i, token in sorted(by_id.items()):
        if i >= len(vocabulary) or vocabulary[i] != token:
            found = vocabulary[i] if i < len(vocabulary) else "nothing"
            raise UserError(
                f"{where}: tokenizer.json has {token!r} at id {i} but the vocabulary "
                f"file has {found!r}"
            )
    for name in ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"):
        if name not in vocabulary:
            raise UserError(f"{where}: the vocabulary has no {name}, not a Whisper tokenizer")
    tok = dict(tok, added_tokens=list(tok.get("added_tokens", [])))
    for i in range(len(vocabulary)):
        # As in the openai/whisper-* tokenizers, these are plain added tokens.
        if i not in by_id:
            tok["added_tokens"].append(
                {
                    "id": i,
                    "content": vocabulary[i],
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": False,
                }
            )
    specials = [
        a["content"]
        for a in sorted(tok["added_tokens"], key=lambda a: a["id"])
        if a.get("special") and a["content"] != "<|endoftext|>"
    ]
    return tok, specials


def _write_tokenizer_files(out: Path, tok: dict, specials: list[str], max_length: int) -> None:
    """Write ``tokenizer.json`` and the slow-tokenizer files derived from it."""
    model = tok["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    eot = "<|endoftext|>"
    files = {
        "tokenizer.json": tok,
        "vocab.json": model["vocab"],
        "added_tokens.json": {
            a["content"]: a["id"] for a in tok["added_tokens"] if a["content"] not in model["vocab"]
        },
        "special_tokens_map.json": {
            "bos_token": eot,
            "eos_token": eot,
            "unk_token": eot,
            "pad_token": eot,
            "additional_special_tokens": specials,
        },
        "tokenizer_config.json": {
            "tokenizer_class": "WhisperTokenizer",
            "bos_token": eot,
            "eos_token": eot,
            "unk_token": eot,
            "pad_token": eot,
            "add_prefix_space": False,
            "errors": "replace",
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": True,
            "additional_special_tokens": specials,
        },
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, ensure_ascii=False, indent=1), "utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", "utf-8")
