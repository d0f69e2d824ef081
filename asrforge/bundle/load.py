"""Loading an inference bundle and checking every file of it, with no training code imported; the
loaded :class:`~asrforge.bundle.inference.Bundle` transcribes.

:func:`load_bundle` checks, in this order, before any weight is read: that the directory is not a
training checkpoint or run (which must be exported first), every file against the manifest's
sha256 (and the manifest against its own seal), that no file could hold a pickle (``.bin``,
``.pt``, ...) and every file is listed, the bundle version, the ``inference_config.json`` schema,
``config.json``'s field types and its shape against the inference config, and the safetensors
header's tensor names and shapes against the model ``config.json`` describes (built on the meta
device). After the weights: ``tokenizer.json`` (readable by tokenizers), and
``preprocessor_config.json`` and ``generation_config.json``, which transformers reads instead of
the inference config, against it and the tokenizer; an optional n-gram LM (``lm.arpa``, text,
checksummed like every file) against the order and vocabulary the inference config records. A
file that passes the manifest but is malformed is named with what is wrong. Weights are read with safetensors only: nothing in a
bundle is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from transformers import WhisperConfig, WhisperForConditionalGeneration

from asrforge.bundle.schema import (
    INFERENCE_CONFIG,
    MODEL_SHAPE,
    check_version,
    parse_inference_config,
)
from asrforge.checkpoint.manifest import MANIFEST_NAME, list_files, read_manifest, verify
from asrforge.checkpoint.shards import aliases_in, check_aliases, index_name, weight_files
from asrforge.errors import CheckpointCorruptError, CheckpointNotSupportedError, UserError
from asrforge.hub import resolve, verified_copy
from asrforge.io.directories import hidden
from asrforge.io.small_files import CONFIG_BYTES, read_json_object
from asrforge.lm.ngram import read_arpa
from asrforge.model.head_timing import LAG_LIMIT
from asrforge.model.tokenizer import SpecialTokens, load_tokenizer
from asrforge.run_layout import RunLayout

try:  # transformers' configs validate their field types with it (huggingface_hub >= 0.34)
    from huggingface_hub.errors import StrictDataclassError
except ImportError:
    # Older versions raise TypeError or ValueError for a wrong type, if anything.
    StrictDataclassError = ValueError
from asrforge.bundle.inference import Bundle

log = logging.getLogger(__name__)


MODEL_FILE = "model.safetensors"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
GENERATION_CONFIG = "generation_config.json"
SEAL_KEY = "bundle_seal"
LM_WEIGHTS_KEY = "lm_weights"
"""Manifest key of the LM weights ``asrforge lm tune`` chose (``alpha``, ``beta``, how)."""
ALIGNMENT_HEADS_KEY = "alignment_heads"
"""Manifest key of the heads ``asrforge align-heads`` found (``heads``, how they were found)."""
UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
"""Files that may hold a pickle: a bundle with one is refused (none is ever opened)."""
_PICKLE_OR_ZIP = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON, its seal left out: a damaged manifest (whose
    hashes would otherwise vouch for nothing) no longer matches its own seal."""
    body = {k: v for k, v in manifest.items() if k != SEAL_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_bundle_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the bundle at ``path``, checked against its seal; no other file is read.

    Raises:
        CheckpointCorruptError: the manifest is missing or damaged.
        CheckpointNotSupportedError: ``path`` is a training checkpoint or run, or a transformers
            model directory, which must be exported first.
        UserError: ``path`` is not a directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such bundle directory")
    if not (path / MANIFEST_NAME).is_file():
        kind = (
            "a training run directory" if RunLayout(path).checkpoints.root.is_dir()
            # a bundle that lost its manifest is damaged, not a model to export
            else "a transformers model directory"
            if (path / "config.json").is_file() and not (path / INFERENCE_CONFIG).exists()
            else None
        )  # fmt: skip
        if kind is not None:
            raise CheckpointNotSupportedError(
                f"{path}: {kind}, not an inference bundle; export it first: "
                f"asrforge export {path} --out BUNDLE_DIR"
            )
    manifest = read_manifest(path)
    if INFERENCE_CONFIG not in manifest["files"] and "config.yaml" in manifest["files"]:
        raise CheckpointNotSupportedError(
            f"{path}: a training checkpoint, not an inference bundle; export it first: "
            f"asrforge export {path} --out BUNDLE_DIR"
        )
    seal = manifest.get(SEAL_KEY)
    if seal != manifest_digest(manifest):
        raise CheckpointCorruptError(
            f"{path / MANIFEST_NAME}: does not match its own seal (the manifest was altered or "
            "damaged)"
        )
    return manifest


def check_format(manifest: dict[str, Any], path: Path) -> None:
    """Refuse a bundle whose manifest says it is not the transformers format this module loads.

    Raises:
        CheckpointNotSupportedError: a CTranslate2 or whisper.cpp export, or another format,
            naming what runs it.
    """
    fmt = manifest.get("format", "hf")
    if not manifest["files"].get(INFERENCE_CONFIG) or fmt == "hf":
        return
    if fmt == "ct2":
        raise CheckpointNotSupportedError(
            f"{path}: a CTranslate2 export; run it with ctranslate2/faster-whisper, or export "
            "again with --format hf for asrforge and transformers"
        )
    if fmt == "ggml":
        raise CheckpointNotSupportedError(
            f"{path}: a whisper.cpp export (ggml-model.bin); run it with whisper.cpp, or "
            "export again with --format hf for asrforge and transformers"
        )
    raise CheckpointNotSupportedError(f"{path}: a {fmt!r:.40} bundle, not 'hf'")


def bundle_file_sizes(path: Path) -> dict[str, int]:
    """The size of each file the manifest of the bundle at ``path`` lists, the manifest's own
    included: what a copy of a Hub snapshot of it may hold (:func:`~asrforge.hub.materialize`).
    A bundle of a format :func:`load_bundle` cannot load is refused here, before its files (a
    CTranslate2 or whisper.cpp model of gigabytes) are copied.

    Raises:
        CheckpointCorruptError: as :func:`read_bundle_manifest`, or a listed size that is no
            count of bytes.
        CheckpointNotSupportedError: as :func:`read_bundle_manifest` and :func:`check_format`.
    """
    manifest = read_bundle_manifest(path)
    check_format(manifest, Path(path))
    sizes = {MANIFEST_NAME: (Path(path) / MANIFEST_NAME).stat().st_size}
    for rel, entry in manifest["files"].items():
        size = entry.get("size")
        if type(size) is not int or size < 0:
            raise CheckpointCorruptError(
                f"{Path(path) / MANIFEST_NAME}: the size of {rel!r} is {size!r:.40}, not a count "
                "of bytes"
            )
        sizes[rel] = size
    return sizes


def verify_bundle(path: Path) -> dict[str, Any]:
    """Check a bundle's files before anything in it is parsed beyond JSON.

    Returns:
        The manifest.

    Raises:
        CheckpointCorruptError: a file is missing, altered or unlisted, or the manifest is
            damaged; the message names the file.
        CheckpointNotSupportedError: a file that could hold a pickle is present, or ``path``
            is no bundle (:func:`read_bundle_manifest`).
    """
    manifest = read_bundle_manifest(path)
    path = Path(path)
    verify(path)
    check_format(manifest, path)
    # what tools leave in a directory (.git/, .DS_Store) is never read, so never refused
    on_disk = [rel for rel in list_files(path) if not hidden(rel)]
    for rel in on_disk:
        if rel.lower().endswith(UNSAFE_SUFFIXES):
            raise CheckpointNotSupportedError(
                f"{path / rel}: a bundle may hold only safetensors and JSON/text files, and is "
                f"never unpickled; refusing a bundle with a {Path(rel).suffix} file"
            )
    unlisted = [rel for rel in on_disk if rel not in manifest["files"]]
    if unlisted:
        raise CheckpointCorruptError(
            f"{path / unlisted[0]}: not listed in {MANIFEST_NAME} (a file was added to the bundle)"
        )
    return manifest


def read_safetensors_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Tensor names and shapes of a safetensors file, and its ``{alias: kept name}`` record,
    from the header only.

    Raises:
        CheckpointCorruptError: the file is not safetensors (a pickle or zip is named as such).
    """
    if not Path(path).is_file():
        raise CheckpointCorruptError(f"{path}: missing")
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(_PICKLE_OR_ZIP):
        raise CheckpointCorruptError(
            f"{path}: not a safetensors file (it looks like a pickle or a torch.save archive); "
            "bundles are never unpickled"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{path}: not a readable safetensors file: {e}") from None
    return shapes, aliases_in(metadata, path)


def bundle_weight_files(path: Path) -> list[str]:
    """The bundle's weights files: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names (transformers' layout).

    Raises:
        CheckpointCorruptError: neither is there, or the index is damaged.
    """
    if (Path(path) / MODEL_FILE).is_file():
        return [MODEL_FILE]
    if not (Path(path) / index_name("model")).is_file():
        raise CheckpointCorruptError(f"{path / MODEL_FILE}: missing")
    return weight_files(path, "model")


def check_tensors(
    shapes: dict[str, tuple[int, ...]], config: WhisperConfig, where: str
) -> WhisperForConditionalGeneration:
    """Compare tensor names and shapes with the model ``config`` describes (built on the meta
    device, so this costs no memory); returns that meta model.

    Raises:
        CheckpointNotSupportedError: naming the first offending tensors (missing, unexpected,
            shape expected vs got).
    """
    try:
        with torch.device("meta"):
            model = WhisperForConditionalGeneration(config)
    except (ValueError, TypeError) as e:
        raise CheckpointNotSupportedError(
            f"{where}: config.json does not build a model: {e}"
        ) from None
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    optional = {"proj_out.weight"} if config.tie_word_embeddings else set()
    problems = [f"missing {k}" for k in expected if k not in shapes and k not in optional]
    problems += [f"unexpected {k}" for k in shapes if k not in expected]
    problems += [
        f"{k}: expected shape {list(expected[k])}, got {list(s)}"
        for k, s in shapes.items()
        if k in expected and s != expected[k]
    ]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointNotSupportedError(
            f"{where}: the tensors do not fit the model config.json describes: "
            + "; ".join(problems[:5])
            + more
        )
    return model


def load_bundle(path: str | Path, *, device: str | torch.device = "cpu") -> Bundle:
    """Load an inference bundle written by ``asrforge export``.

    Args:
        path: the bundle directory, or a Hugging Face Hub id (``org/name[@revision]``) of a
            bundle pushed there (``asrforge export --push-to-hub``): its files are copied out of
            the cache as regular files and verified the same way (a copy refused is made again
            once, :func:`~asrforge.hub.verified_copy`).
        device: where the model runs. Weights are used in float32 on the CPU.

    Raises:
        CheckpointCorruptError: a file is altered, missing, unlisted or unreadable (named).
        CheckpointNotSupportedError: a newer bundle version, a CTranslate2 export, a file that
            could hold a pickle, or tensors that do not fit the model config.
        UserError: ``path`` is not a directory.
    """
    resolved = resolve(path, field="bundle", patterns=None)
    path, manifest = verified_copy(resolved, bundle_file_sizes, verify_bundle)
    where = str(path)
    if INFERENCE_CONFIG not in manifest["files"]:
        raise CheckpointNotSupportedError(
            f"{path}: not an inference bundle (no {INFERENCE_CONFIG})"
        )
    raw = _read_json(path / INFERENCE_CONFIG)
    check_version(raw, where)
    if raw.get("format", "hf") != "hf":
        raise CheckpointNotSupportedError(f"{path}: a {raw.get('format')!r} bundle, not 'hf'")
    icfg = parse_inference_config(raw, where)
    hf_config = _read_json(path / "config.json")
    if hf_config.get("model_type") != "whisper":
        raise CheckpointNotSupportedError(
            f"{path / 'config.json'}: model_type {hf_config.get('model_type')!r}, not 'whisper'"
        )
    config = _whisper_config(hf_config, path / "config.json")
    mismatched = [
        f"{name}: config.json {getattr(config, name)} != {INFERENCE_CONFIG} "
        f"{getattr(icfg.model, name)}"
        for name in MODEL_SHAPE
        if getattr(icfg.model, name) is not None
        and getattr(config, name) != getattr(icfg.model, name)
    ]
    if mismatched:
        raise CheckpointNotSupportedError(
            f"{path}: config files disagree: " + "; ".join(mismatched)
        )
    if problems := icfg.features.problems_with(config.num_mel_bins, config.max_source_positions):
        raise CheckpointNotSupportedError(f"{path / INFERENCE_CONFIG}: " + "; ".join(problems))
    config._attn_implementation = icfg.model.attn_implementation  # noqa: SLF001
    files = bundle_weight_files(path)
    shapes, aliases = bundle_tensors(path)
    # an alias loads as its kept tensor, so that tensor's shape must fit the alias's place too
    shapes.update({alias: shapes[kept] for alias, kept in aliases.items()})
    model = check_tensors(shapes, config, str(path / files[0]) if len(files) == 1 else where)
    model.load_state_dict(read_bundle_weights(path), strict=False, assign=True)
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointNotSupportedError(f"{path / MODEL_FILE}: no weights for {left[:3]}")
    tokenizer = load_tokenizer(path)
    if len(tokenizer) != config.vocab_size:
        raise CheckpointNotSupportedError(
            f"{path}: the tokenizer has {len(tokenizer)} tokens, the model {config.vocab_size}"
        )
    lm = _read_lm(path, icfg, manifest)
    weights = _lm_weights(manifest.get(LM_WEIGHTS_KEY), path / MANIFEST_NAME)
    specials = SpecialTokens.from_tokenizer(tokenizer, icfg.multilingual, icfg.data.language_tokens)
    # Bundle decodes with the inference config; transformers (from_pretrained, the ASR
    # pipeline) reads these two files instead, so they must say the same.
    check_preprocessor_config(path / PREPROCESSOR_CONFIG, icfg.features)
    check_generation_config(path / GENERATION_CONFIG, specials)
    # the heads align-heads found, else the ones the generation config ships
    found = manifest.get(ALIGNMENT_HEADS_KEY)
    if found is None and _read_json(path / GENERATION_CONFIG).get("alignment_heads"):
        found = {"heads": _read_json(path / GENERATION_CONFIG)["alignment_heads"]}
    where = path / (MANIFEST_NAME if ALIGNMENT_HEADS_KEY in manifest else GENERATION_CONFIG)
    return Bundle(
        model, tokenizer, icfg, path=path, device=device, lm=lm, lm_weights=weights,
        alignment_heads=None if found is None else _alignment_heads(found, where, model.config),
        word_lag=0.0 if found is None else _word_lag(found, where),
    )  # fmt: skip


def bundle_tensors(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The names and shapes of the tensors the bundle's weights files store, from their headers
    only, and its ``{alias: kept name}`` record (of every file), checked against those names.

    Raises:
        CheckpointCorruptError: a file is not safetensors, or an alias record is damaged,
            names no stored tensor or names one as an alias
            (:func:`~asrforge.checkpoint.shards.check_aliases`).
    """
    files = bundle_weight_files(path)
    shapes: dict[str, tuple[int, ...]] = {}
    aliases: dict[str, str] = {}
    for fname in files:
        stored, recorded = read_safetensors_header(path / fname)
        shapes.update(stored)
        aliases.update(recorded)
    check_aliases(aliases, shapes, path / files[0] if len(files) == 1 else path)
    return shapes, aliases


def read_bundle_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weights of the bundle at ``path`` as its files store them (dtype included), tied
    names sharing one tensor; read shard by shard, so one file's buffer is in memory besides
    what was read. It checks no sums: verify the bundle first (:func:`load_bundle`)."""
    _shapes, aliases = bundle_tensors(path)
    state: dict[str, torch.Tensor] = {}
    for fname in bundle_weight_files(path):
        state.update(load_file(str(path / fname)))
    for alias, kept in aliases.items():
        state[alias] = state[kept]
    return state


def _alignment_heads(found: Any, where: Path, config) -> list[tuple[int, int]]:
    """The ``(layer, head)`` pairs of ``found["heads"]`` (what ``asrforge align-heads``
    recorded in ``where``, or the generation config's), checked against the model.

    Raises:
        CheckpointCorruptError: a record that is not a list of pairs of the model's heads.
    """
    heads = found.get("heads") if isinstance(found, dict) else None
    ok = isinstance(heads, list) and all(
        isinstance(h, list) and len(h) == 2 and all(type(x) is int for x in h)
        and 0 <= h[0] < config.decoder_layers and 0 <= h[1] < config.decoder_attention_heads
        for h in heads
    )  # fmt: skip
    if not ok:
        raise CheckpointCorruptError(
            f"{where}: {ALIGNMENT_HEADS_KEY} must hold heads as [layer, head] "
            f"pairs of this model's {config.decoder_layers} layers x "
            f"{config.decoder_attention_heads} heads"
        )
    return [(h[0], h[1]) for h in heads]


def _word_lag(found: dict[str, Any], where: Path) -> float:
    """The seconds ``asrforge align-heads`` measured its heads place words late (0 when it
    measured none), within what it records (:data:`LAG_LIMIT`).

    Raises:
        CheckpointCorruptError: a lag that is not a number of seconds from 0 to
            :data:`LAG_LIMIT` (a negative one would move words later, a longer one would pull
            every word to its window's start).
    """
    lag = found.get("lag_s", 0.0)
    if type(lag) not in (int, float) or not 0 <= lag <= LAG_LIMIT:
        raise CheckpointCorruptError(
            f"{where}: {ALIGNMENT_HEADS_KEY}.lag_s must be seconds from 0 to {LAG_LIMIT:g} "
            f"(what align-heads records), got {lag!r}"
        )
    return float(lag)


def _lm_weights(found: Any, where: Path) -> dict[str, Any]:
    """The record ``asrforge lm tune`` left in ``where`` ({} when there is none).

    Raises:
        CheckpointCorruptError: not an object, or an ``alpha`` or ``beta`` that is not a finite
            number (a NaN weight scores every beam NaN, and beam search then keeps garbage).
    """
    if found is None:
        return {}
    if not isinstance(found, dict):
        raise CheckpointCorruptError(
            f"{where}: {LM_WEIGHTS_KEY} must be an object with alpha and beta, got {found!r:.60}"
        )
    wrong = [
        f"{LM_WEIGHTS_KEY}.{name} must be a finite number, got {found[name]!r:.60}"
        for name in ("alpha", "beta")
        if name in found
        and not (type(found[name]) in (int, float) and math.isfinite(found[name]))
    ]
    if wrong:
        raise CheckpointCorruptError(f"{where}: " + "; ".join(wrong))
    return found


def _read_lm(path: Path, icfg, manifest: dict[str, Any]):
    """The bundle's n-gram LM (None when it has none), checked against what the inference
    config records of it.

    Raises:
        CheckpointCorruptError: the file is not listed in the manifest (so never verified), not
            ARPA, or of another order or vocabulary size than recorded.
    """
    info = icfg.lm
    if info is None:
        return None

    if info.file not in manifest["files"]:
        raise CheckpointCorruptError(
            f"{path}: {INFERENCE_CONFIG} names the LM {info.file!r}, which {MANIFEST_NAME} "
            "does not list"
        )
    lm = read_arpa(path / info.file)
    differ = [
        f"{name} {getattr(lm, name)} (the {INFERENCE_CONFIG} says {getattr(info, name)})"
        for name in ("order", "vocab_size")
        if getattr(lm, name) != getattr(info, name)
    ]
    if differ:
        raise CheckpointCorruptError(f"{path / info.file}: " + "; ".join(differ))
    return lm


def _whisper_config(data: dict[str, Any], where: Path) -> WhisperConfig:
    """``config.json`` as a WhisperConfig; a field of the wrong type is named."""
    defaults = WhisperConfig().to_dict()
    check_field_types(data, {k: type(v) for k, v in defaults.items() if v is not None}, where)
    try:
        return WhisperConfig.from_dict(data)
    except (TypeError, ValueError, StrictDataclassError) as e:
        reason = " ".join(str(e).split())  # one line
        raise CheckpointCorruptError(f"{where}: not a valid Whisper config: {reason}") from None


def check_field_types(data: dict[str, Any], types: dict[str, type], where: Path) -> None:
    """Each field of ``data`` named in ``types`` must be of that type (or None); an int where a
    float is due is fine, a bool where an int is due is not.

    Raises:
        CheckpointCorruptError: naming every field of the wrong type, with its value.
    """
    wrong = []
    for key, value in data.items():
        want = types.get(key)
        if want is None or value is None:
            continue
        allowed = (int, float) if want is float else (want,)
        if not isinstance(value, allowed) or (isinstance(value, bool) and want is not bool):
            wrong.append(f"{key} must be {want.__name__}, got {value!r}")
    if wrong:
        raise CheckpointCorruptError(f"{where}: " + "; ".join(wrong))


GENERATION_TYPES = {
    **dict.fromkeys(("decoder_start_token_id", "no_timestamps_token_id", "max_length"), int),
    **dict.fromkeys(("bos_token_id", "pad_token_id", "max_initial_timestamp_index"), int),
    **dict.fromkeys(("suppress_tokens", "begin_suppress_tokens", "alignment_heads"), list),
    **dict.fromkeys(("lang_to_id", "task_to_id"), dict),
    "is_multilingual": bool,
    "return_timestamps": bool,
}
"""Types of the fields transformers' Whisper ``generate`` reads (most defaults are None, so
they cannot be read off ``GenerationConfig()``)."""


def check_preprocessor_config(path: Path, features: Any) -> None:
    """``preprocessor_config.json`` must describe the front end the inference config records.

    Raises:
        CheckpointCorruptError: not a JSON object, not a WhisperFeatureExtractor, or a setting
            that differs (named, with both values).
    """
    data = _read_json(path)
    kind = data.get("feature_extractor_type")
    if kind != "WhisperFeatureExtractor":
        raise CheckpointCorruptError(
            f"{path}: feature_extractor_type {kind!r}, not 'WhisperFeatureExtractor'"
        )
    differ = [
        f"{name} {data.get(name)!r} (the {INFERENCE_CONFIG} features say {getattr(features, name)})"
        for name in ("feature_size", "sampling_rate", "hop_length", "n_fft", "chunk_length")
        if data.get(name) != getattr(features, name)
    ]
    if differ:
        raise CheckpointCorruptError(f"{path}: " + "; ".join(differ))


def check_generation_config(path: Path, specials: SpecialTokens) -> None:
    """``generation_config.json`` must prompt and stop with the tokenizer's special tokens.

    Raises:
        CheckpointCorruptError: not a JSON object transformers accepts, or a token id that is
            not the tokenizer's (named, with both values).
    """
    from transformers import GenerationConfig

    data = _read_json(path)
    check_field_types(data, GENERATION_TYPES, path)
    try:
        GenerationConfig.from_dict(dict(data))
    except (TypeError, ValueError) as e:
        raise CheckpointCorruptError(f"{path}: not a valid generation config: {e}") from None
    eos = data.get("eos_token_id")
    want: dict[str, Any] = {
        "decoder_start_token_id": specials.sot,
        "no_timestamps_token_id": specials.no_timestamps,
        "eos_token_id": eos if isinstance(eos, list) and specials.eot in eos else specials.eot,
        "is_multilingual": specials.multilingual,
    }
    if specials.multilingual:
        want["lang_to_id"] = {
            token: specials.languages.get(token.strip("<|>"))
            for token in data.get("lang_to_id") or {}
        }
        want["task_to_id"] = dict(specials.tasks)
    differ = [
        f"{key} {data.get(key)!r} (the tokenizer's: {value!r})"
        for key, value in want.items()
        if data.get(key) != value
    ]
    if differ:
        raise CheckpointCorruptError(f"{path}: " + "; ".join(differ))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(path, CONFIG_BYTES, error=CheckpointCorruptError)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: missing") from None
