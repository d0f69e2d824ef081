"""Writing bundle contents to a directory, as transformers files (``hf``), CTranslate2's
format (``ct2``) or whisper.cpp's model file (``ggml``), with the sealed manifest."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from asrforge.bundle.card import CARD_FILE
from asrforge.bundle.contents import BundleContents
from asrforge.bundle.load import SEAL_KEY, manifest_digest, verify_bundle
from asrforge.bundle.schema import (
    BUNDLE_VERSION,
    INFERENCE_CONFIG,
)
from asrforge.checkpoint.manifest import (
    MANIFEST_NAME,
    manifest_seal,
    write_manifest,
)
from asrforge.checkpoint.manifest import SEAL_KEY as FILES_SEAL
from asrforge.checkpoint.training import (
    MODEL_STEM,
    save_weights_sharded,
)
from asrforge.convert.ggml import write_ggml_model
from asrforge.errors import UserError
from asrforge.io.atomic import atomic_directory, atomic_write_text

log = logging.getLogger(__name__)

FORMATS = ("hf", "ct2", "ggml")
"""The formats a bundle is written in."""
GGML_FILE = "ggml-model.bin"
"""whisper.cpp's model file in a ggml bundle."""
GGML_QUANTIZATIONS = (None, "float16")
"""``--quantization`` of a ggml export: f16 matrices. An all-f32 file is what whisper.cpp's
converter writes without f16, but whisper.cpp 1.8's convolution asserts f16 kernels (measured
with pywhispercpp 1.5.1: it aborts), so it is not offered."""
CT2_QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16",
                     "float16", "bfloat16", "float32")  # fmt: skip
"""``--quantization`` of a ct2 export: CTranslate2's weight types."""


def readable_by_all(directory: Path) -> None:
    """Give the files of ``directory`` mode 0o644: safetensors writes 0o600, and a bundle is
    read by users and services other than the one that wrote it."""
    for p in directory.iterdir():
        p.chmod(0o644)


def write_bundle_manifest(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Write ``manifest.json`` (sha256 of every file) and seal it with its own digest."""
    manifest = write_manifest(directory, meta)
    manifest[SEAL_KEY] = manifest_digest(manifest)
    atomic_write_text(Path(directory) / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
    return manifest


def _write_hf_files(
    contents: BundleContents, directory: Path, max_shard_bytes: int | None = None
) -> None:
    save_weights_sharded(directory, MODEL_STEM, contents.state, max_shard_bytes=max_shard_bytes)
    # A bundle is Whisper's own classes: an auto_map a handed model named would point whoever
    # loads the bundle with trust_remote_code at code asrforge never ran.
    if hasattr(contents.config, "auto_map"):
        del contents.config.auto_map
    contents.tokenizer.init_kwargs.pop("auto_map", None)
    contents.config.save_pretrained(str(directory))
    contents.generation.save_pretrained(str(directory))
    # transformers ignores this cleanup for BPE tokenizers and warns on every decode when set
    contents.tokenizer.clean_up_tokenization_spaces = False
    contents.tokenizer.save_pretrained(str(directory))
    contents.inference.features.extractor().save_pretrained(str(directory))


def _write_inference_config(contents: BundleContents, directory: Path, fmt: str) -> None:
    icfg = contents.inference.model_copy(update={"format": fmt})
    text = json.dumps(icfg.model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n"
    (directory / INFERENCE_CONFIG).write_text(text, encoding="utf-8")


def _copy_lm(contents: BundleContents, directory: Path) -> None:
    if contents.lm is not None:
        shutil.copyfile(contents.lm, directory / contents.inference.lm.file)


def update_bundle_manifest(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Add ``meta`` to a bundle's manifest (the files unchanged) and seal it afresh, in one
    atomic rename: the bundle is verified first and is never left half-updated."""

    manifest = verify_bundle(directory)
    body = {k: v for k, v in manifest.items() if k not in (FILES_SEAL, SEAL_KEY)}
    body.update(meta)
    body[FILES_SEAL] = manifest_seal(body)
    body[SEAL_KEY] = manifest_digest(body)
    atomic_write_text(Path(directory) / MANIFEST_NAME, json.dumps(body, indent=2) + "\n")
    return body


def write_bundle(
    contents: BundleContents, out: Path, *, max_shard_bytes: int | None = 5 * 10**9
) -> Path:
    """Write ``contents`` as a transformers-format bundle at ``out``, atomically; weights past
    ``max_shard_bytes`` sharded."""
    with atomic_directory(out) as tmp:
        _write_hf_files(contents, tmp, max_shard_bytes)
        _write_inference_config(contents, tmp, "hf")
        _copy_lm(contents, tmp)
        if contents.card is not None:
            (tmp / CARD_FILE).write_text(contents.card, encoding="utf-8")
        readable_by_all(tmp)
        write_bundle_manifest(
            tmp, {"kind": "bundle", "bundle_version": BUNDLE_VERSION, **contents.records}
        )
    log.info("wrote the bundle %s (%s)", out, contents.note)
    return out


def ct2_converter() -> type:
    """CTranslate2's own converter class (an optional dependency)."""
    try:
        from ctranslate2.converters import TransformersConverter
    except ImportError:
        raise UserError(
            "--format ct2 needs the optional dependency ctranslate2 (pip install ctranslate2)"
        ) from None
    return TransformersConverter


def write_ct2(
    contents: BundleContents,
    out: Path,
    converter: type,
    quantization: str | None,
    max_shard_bytes: int | None = None,
) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".asrforge-hf-", dir=out.parent) as hf_dir:
        _write_hf_files(contents, Path(hf_dir), max_shard_bytes)
        with atomic_directory(out) as tmp:
            copy = [
                f
                for f in ("tokenizer.json", "preprocessor_config.json")
                if (Path(hf_dir) / f).is_file()
            ]
            converter(hf_dir, copy_files=copy, load_as_float16=False).convert(
                str(tmp), quantization=quantization, force=True
            )
            _write_inference_config(contents, tmp, "ct2")
            _copy_lm(contents, tmp)
            write_bundle_manifest(
                tmp,
                {"kind": "bundle", "bundle_version": BUNDLE_VERSION, "format": "ct2",
                 **contents.records},
            )  # fmt: skip
    log.info("wrote the CTranslate2 bundle %s (%s)", out, contents.note)
    return out


def write_ggml(contents: BundleContents, out: Path, quantization: str | None) -> Path:
    """Write ``contents`` as a bundle holding whisper.cpp's model file (:data:`GGML_FILE`),
    matrices in f16, atomically."""
    if quantization not in GGML_QUANTIZATIONS:
        raise UserError(f"--quantization {quantization}: --format ggml writes float16")
    mel_filters = contents.inference.features.extractor().mel_filters
    with atomic_directory(out) as tmp:
        write_ggml_model(
            tmp / GGML_FILE,
            contents.state,
            contents.config,
            contents.tokenizer,
            mel_filters,
        )
        _write_inference_config(contents, tmp, "ggml")
        _copy_lm(contents, tmp)
        readable_by_all(tmp)
        write_bundle_manifest(
            tmp,
            {"kind": "bundle", "bundle_version": BUNDLE_VERSION, "format": "ggml",
             **contents.records},
        )  # fmt: skip
    log.info("wrote the whisper.cpp bundle %s (%s)", out, contents.note)
    return out
