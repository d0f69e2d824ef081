"""Loading an inference bundle and transcribing with it, with no training code imported.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
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
from asrforge.checkpoint.shards import index_name, weight_files
from asrforge.data.audio import SAMPLE_RATE, audio_problem, decode_audio, resample
from asrforge.errors import CheckpointCorruptError, CheckpointNotSupportedError, UserError
from asrforge.lm.fusion import ShallowFusion
from asrforge.lm.ngram import read_arpa
from asrforge.model.fallback import Fallback
from asrforge.model.frames import window_seconds
from asrforge.model.longform import Segment, choose_chunking, transcribe_long
from asrforge.model.silence import segment
from asrforge.model.tokenizer import SpecialTokens, load_tokenizer
from asrforge.text.languages import find_language_code

try:  # transformers' configs validate their field types with it (huggingface_hub >= 0.34)
    from huggingface_hub.errors import StrictDataclassError
except ImportError:
    # Older versions raise TypeError or ValueError for a wrong type, if anything.
    StrictDataclassError = ValueError

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
GENERATION_CONFIG = "generation_config.json"
SEAL_KEY = "bundle_seal"
LM_WEIGHTS_KEY = "lm_weights"
"""Manifest key of the LM weights ``asrforge lm tune`` chose (``alpha``, ``beta``, how)."""
ALIASES_KEY = "asrforge_aliases"  # as written by asrforge.checkpoint.training.save_weights
UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
"""Files that may hold a pickle: a bundle with one is refused (none is ever opened)."""
_PICKLE_OR_ZIP = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")

Audio = str | Path | bytes | np.ndarray


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON, its seal left out: a damaged manifest (whose
    hashes would otherwise vouch for nothing) no longer matches its own seal."""
    body = {k: v for k, v in manifest.items() if k != SEAL_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def verify_bundle(path: Path) -> dict[str, Any]:
    """Check a bundle's files before anything in it is parsed beyond JSON.

    Returns:
        The manifest.

    Raises:
        CheckpointCorruptError: a file is missing, altered or unlisted, or the manifest is
            damaged; the message names the file.
        CheckpointNotSupportedError: a file that could hold a pickle is present.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such bundle directory")
    if not (path / MANIFEST_NAME).is_file() and (path / "checkpoints").is_dir():
        raise CheckpointNotSupportedError(
            f"{path}: a training run directory, not an inference bundle; export it first: "
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
    verify(path)
    if manifest["files"].get(INFERENCE_CONFIG) and manifest.get("format") == "ct2":
        raise CheckpointNotSupportedError(
            f"{path}: a CTranslate2 export; run it with ctranslate2/faster-whisper, or export "
            "again with --format hf for asrforge and transformers"
        )
    on_disk = list_files(path)
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
    try:
        aliases = json.loads(metadata.get(ALIASES_KEY, "{}"))
    except ValueError:
        raise CheckpointCorruptError(f"{path}: damaged {ALIASES_KEY} metadata") from None
    return shapes, aliases


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
        path: the bundle directory.
        device: where the model runs. Weights are used in float32 on the CPU.

    Raises:
        CheckpointCorruptError: a file is altered, missing, unlisted or unreadable (named).
        CheckpointNotSupportedError: a newer bundle version, a CTranslate2 export, a file that
            could hold a pickle, or tensors that do not fit the model config.
        UserError: ``path`` is not a directory.
    """
    path = Path(path)
    manifest = verify_bundle(path)
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
    config._attn_implementation = icfg.model.attn_implementation  # noqa: SLF001
    files = bundle_weight_files(path)
    shapes, aliases = {}, {}
    for fname in files:
        file_shapes, file_aliases = read_safetensors_header(path / fname)
        shapes.update(file_shapes)
        aliases.update(file_aliases)
    model = check_tensors(shapes, config, str(path / files[0]) if len(files) == 1 else where)
    state = {}
    # Loading shard by shard keeps one file's buffer in memory besides the model.
    for fname in files:
        state.update(load_file(str(path / fname)))
    for alias, kept in aliases.items():
        state[alias] = state[kept]
    model.load_state_dict(state, strict=False, assign=True)
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
    weights = manifest.get(LM_WEIGHTS_KEY) or {}
    bundle = Bundle(model, tokenizer, icfg, path=path, device=device, lm=lm, lm_weights=weights)
    # Bundle decodes with the inference config; transformers (from_pretrained, the ASR
    # pipeline) reads these two files instead, so they must say the same.
    check_preprocessor_config(path / PREPROCESSOR_CONFIG, icfg.features)
    check_generation_config(path / GENERATION_CONFIG, bundle.specials)
    return bundle


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
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{path}: not a JSON object")
    return data


@dataclass
class Transcript:
    """One recording's transcription."""

    text: str
    language: str
    seconds: float
    """Duration of the audio."""
    segments: list[Segment] = field(default_factory=list)
    """Stretches of the audio with their text, in order, times in seconds."""
    chunking: str = "timestamps"
    """How long audio was cut into windows: ``timestamps`` or ``silence``."""


class Bundle:
    """A model ready to transcribe: weights, tokenizer, log-mel front end and inference config.

    Args:
        model: a Whisper model (put in eval mode, moved to ``device``).
        tokenizer: its tokenizer.
        config: the bundle's ``InferenceConfig``.
        path: where it was loaded from, if anywhere.
        device: where the model runs.
        lm: the word n-gram LM (:class:`~asrforge.lm.ngram.NGramLM`) beam search fuses, if any.
        lm_weights: ``alpha`` and ``beta`` ``asrforge lm tune`` recorded (default: the inference
            config's ``lm.alpha``/``lm.beta``).
    """

    def __init__(
        self,
        model,
        tokenizer,
        config,
        *,
        path: Path | None = None,
        device="cpu",
        lm=None,
        lm_weights: dict[str, Any] | None = None,
    ):
        self.device = torch.device(device)
        if self.device.type == "cpu":
            model = model.float()
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.config = config
        self.path = path
        self.specials = SpecialTokens.from_tokenizer(
            tokenizer, config.multilingual, config.data.language_tokens
        )
        self.features = config.features.extractor()
        self.lm = lm
        self.lm_weights = dict(lm_weights or {})

    @property
    def version(self) -> str:
        return self.config.bundle_version

    @property
    def languages(self) -> list[str]:
        return list(self.config.languages)

    @property
    def window_seconds(self) -> float:
        """The encoder's window: longer audio is cut into windows (see ``model/longform.py``)."""
        return window_seconds(self.model.config)

    def __repr__(self) -> str:
        return (
            f"Bundle({self.path or '<memory>'}, version {self.version}, weights "
            f"{self.config.weights}, languages {self.languages})"
        )

    # -- audio and language -------------------------------------------------------------------
    def load_audio(self, audio: Audio, sampling_rate: int | None = None) -> np.ndarray:
        """A path (wav/flac/mp3/... at any rate), encoded bytes, or a float array ->
        (n_samples,) float32 at 16 kHz.

        Args:
            sampling_rate: an array's rate in Hz (resampled to 16 kHz); default 16 kHz. Files
                and bytes carry their own rate.

        Raises:
            UserError: a missing or unreadable file, an array that is not 1-D, or a rate <= 0.
        """
        if isinstance(audio, np.ndarray):
            if audio.ndim != 1:
                raise UserError(f"audio array must be 1-D (mono), got shape {audio.shape}")
            rate = SAMPLE_RATE if sampling_rate is None else sampling_rate
            if isinstance(rate, bool) or not isinstance(rate, int | np.integer) or rate <= 0:
                raise UserError(f"sampling_rate must be a positive integer (Hz), got {rate!r}")
            return resample(audio.astype(np.float32, copy=False), int(rate), SAMPLE_RATE)
        if isinstance(audio, bytes | bytearray):
            return decode_audio(bytes(audio), SAMPLE_RATE)
        if isinstance(audio, str | Path):
            if Path(audio).is_dir():
                raise UserError(f"{audio}: a directory, not an audio file")
            if not Path(audio).is_file():
                raise UserError(f"{audio}: no such audio file")
            return decode_audio(Path(audio), SAMPLE_RATE)
        raise UserError(f"audio must be a path, bytes or a numpy array, got {type(audio).__name__}")

    def resolve_language(self, audio: np.ndarray, language: str | None) -> str:
        """The language to transcribe ``audio`` in: ``language`` (checked), the bundle's only
        language, or the one detected among the bundle's languages."""
        if language is not None:  # a code, name or locale ("de", "German", "de-AT")
            code = find_language_code(language) or language.strip().lower()
            if not self.specials.multilingual:
                if code not in ("en", "english"):
                    raise UserError(f"language {language!r}: this bundle is English-only")
                return "en"
            if code not in self._language_ids():
                raise UserError(
                    f"unknown language {language!r}: this bundle transcribes "
                    f"{', '.join(sorted(self._language_ids()))}"
                )
            return code
        if not self.specials.multilingual:
            return "en"
        ids = self._language_ids()
        if len(ids) == 1:
            return next(iter(ids))
        return self.detect_language(audio)

    def _language_ids(self) -> dict[str, int]:
        langs = self.config.languages or list(self.specials.languages)
        return {c: self.specials.languages[c] for c in langs if c in self.specials.languages}

    @torch.no_grad()
    def detect_language(self, audio: Audio) -> str:
        """The most likely of the bundle's languages for the first window of ``audio`` (the
        decoder's distribution after ``<|startoftranscript|>``, as Whisper detects)."""
        wave = self.load_audio(audio)
        first = segment(wave, SAMPLE_RATE, self.window_seconds)[0]
        enc = self._encode([wave[first[0] : first[1]]])
        sot = torch.tensor([[self.specials.sot]], device=self.device)
        h = self.model.model.decoder(input_ids=sot, encoder_hidden_states=enc).last_hidden_state
        logits = self.model.proj_out(h[:, -1])[0]
        ids = self._language_ids()
        codes = list(ids)
        return codes[int(logits[[ids[c] for c in codes]].argmax())]

    # -- transcription ------------------------------------------------------------------------
    def transcribe(
        self,
        audio: Audio,
        language: str | None = None,
        *,
        max_new_tokens: int | None = None,
        chunking: str | None = None,
        sampling_rate: int | None = None,
        beam_size: int = 1,
    ) -> str:
        """Transcribe one recording of any length.

        Args:
            audio: a path, encoded bytes, or a (n_samples,) float32 array.
            language: ISO code; default: the bundle's only language, else detected.
            max_new_tokens: cap per window; default ``eval.max_new_tokens`` of the bundle.
            chunking, beam_size: see :meth:`recognize`.
            sampling_rate: an array's rate in Hz, resampled to 16 kHz; default 16 kHz.
        """
        return self.recognize(
            [audio],
            language,
            max_new_tokens=max_new_tokens,
            chunking=chunking,
            sampling_rate=sampling_rate,
            beam_size=beam_size,
        )[0].text

    def transcribe_many(
        self,
        audios: Sequence[Audio],
        language: str | Sequence[str | None] | None = None,
        *,
        batch_size: int = 8,
        max_new_tokens: int | None = None,
        chunking: str | None = None,
        sampling_rate: int | None = None,
        beam_size: int = 1,
    ) -> list[str]:
        """Transcribe several recordings; windows of all of them are decoded in batches.
        ``sampling_rate``: the arrays' rate in Hz (default 16 kHz)."""
        return [
            t.text
            for t in self.recognize(
                audios,
                language,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
                chunking=chunking,
                sampling_rate=sampling_rate,
                beam_size=beam_size,
            )
        ]

    def lm_alpha_beta(self) -> tuple[float, float]:
        """The LM weight and word bonus to decode with: tuned ones, else the recorded defaults."""
        info = self.config.lm
        return (
            float(self.lm_weights.get("alpha", info.alpha if info else 0.0)),
            float(self.lm_weights.get("beta", info.beta if info else 0.0)),
        )

    def fusion(self, alpha: float | None = None, beta: float | None = None):
        """A :class:`~asrforge.lm.fusion.ShallowFusion` of the bundle's LM for beam search
        (None when it has none); ``alpha``/``beta`` default to :meth:`lm_alpha_beta`."""
        if self.lm is None:
            return None

        tuned = self.lm_alpha_beta()
        return ShallowFusion(
            self.lm,
            self.tokenizer,
            self.specials.eot,
            tuned[0] if alpha is None else alpha,
            tuned[1] if beta is None else beta,
            language_of=self.language_of_prompt,
        )

    def language_of_prompt(self, prompt: Sequence[int]) -> str:
        """The language a decoder prompt asks for (``en`` for an English-only model); the LM's
        language when several share the prompt's token (``data.language_tokens``)."""
        if not self.specials.multilingual:
            return "en"
        ids = set(prompt)
        codes = [c for c, i in self.specials.languages.items() if i in ids]
        known = set(self.config.lm.languages) if self.config.lm else set()
        return next((c for c in codes if c in known), codes[0] if codes else "")

    def chunking_for(self, requested: str | None) -> tuple[str, str]:
        """``(chunking, why)`` for long audio (see :func:`asrforge.model.longform.choose_chunking`).

        Raises:
            UserError: an unknown chunking, or ``timestamps`` for a model without them.
        """
        return choose_chunking(self.tokenizer, self.model.config, requested)

    def recognize(
        self,
        audios: Sequence[Audio],
        language: str | Sequence[str | None] | None = None,
        *,
        batch_size: int = 8,
        max_new_tokens: int | None = None,
        chunking: str | None = None,
        condition_on_previous_text: bool = False,
        sampling_rate: int | None = None,
        beam_size: int = 1,
        temperature_fallback: bool = False,
        use_lm: bool = True,
        lm_alpha: float | None = None,
        lm_beta: float | None = None,
    ) -> list[Transcript]:
        """:meth:`transcribe_many` with the language, duration and timed segments of each.

        Args:
            chunking: how audio is decoded. ``timestamps`` (default when the model has
                timestamp tokens): windows in timestamp mode, each starting at the end of the
                last complete segment of the one before, as openai-whisper and faster-whisper
                transcribe (audio within one window is one window, its segments timed by the
                model). ``silence`` (default otherwise): cut at the quietest moments, pieces
                decoded without timestamps, one segment per piece.
            condition_on_previous_text: ``timestamps`` only: prompt each window with the text
                decoded before it (``<|startofprev|>``). Off by default: a window that went
                wrong (a repetition loop) then steers the next ones, and with greedy decoding
                there is no temperature fallback to recover; a model fine-tuned without such
                prompts has never seen them.
            beam_size: beams per window (:func:`asrforge.model.beam.beam_decode`); 1: greedy.
            temperature_fallback: decode a window whose text looks like a loop (it compresses
                too well, is unlikely, or repeats itself) again by seeded sampling at
                temperatures 0.2 ... 1.0, as openai-whisper (:mod:`asrforge.model.fallback`).
            use_lm: fuse the bundle's n-gram LM, when it has one, into beam search (then beam
                search runs even at ``beam_size`` 1); ``lm_alpha``/``lm_beta`` override the
                tuned or recorded weights (:meth:`lm_alpha_beta`).
        """
        if batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        if beam_size < 1:
            raise UserError(f"beam_size must be >= 1, got {beam_size}")
        mode, why = self.chunking_for(chunking)
        log.info("long audio: chunking %s (%s)", mode, why)
        langs = (
            [language] * len(audios)
            if language is None or isinstance(language, str)
            else list(language)
        )
        if len(langs) != len(audios):
            raise UserError(f"{len(langs)} languages for {len(audios)} recordings")
        cap = max_new_tokens or self.config.eval.max_new_tokens
        waves, codes, prompts = [], [], []
        # A None entry is decoded below, in this order.
        out: list[Transcript | None] = []
        for i, (audio, lang) in enumerate(zip(audios, langs, strict=True)):
            wave = self.load_audio(audio, sampling_rate)
            problem = audio_problem(wave)
            if problem is not None:  # decoding it would only make up "" or noise
                name = audio if isinstance(audio, str | Path) else f"recording {i}"
                log.warning("%s: %s; not transcribed (empty text)", name, problem)
                out.append(Transcript("", lang or "", wave.shape[0] / SAMPLE_RATE, [], mode))
                continue
            code = self.resolve_language(wave, lang)
            waves.append(wave)
            codes.append(code)
            prompts.append(self.specials.prompt(code, self.config.data.task))
            out.append(None)
        segments = (
            transcribe_long(
                self.model,
                self.tokenizer,
                self.features,
                waves,
                prompts,
                chunking=mode,
                no_timestamps=self.specials.no_timestamps,
                eot=self.specials.eot,
                max_new_tokens=cap,
                batch_size=batch_size,
                device=self.device,
                condition_on_previous_text=condition_on_previous_text,
                beam_size=beam_size,
                fallback=Fallback() if temperature_fallback else None,
                fusion=self.fusion(lm_alpha, lm_beta) if use_lm else None,
            )
            if waves
            else []
        )
        decoded = iter(
            Transcript(
                " ".join(s.text for s in segs), code, wave.shape[0] / SAMPLE_RATE, segs, mode
            )
            for wave, code, segs in zip(waves, codes, segments, strict=True)
        )
        return [t if t is not None else next(decoded) for t in out]

    @torch.no_grad()
    def _encode(self, windows: list[np.ndarray]) -> torch.Tensor:
        """(batch, frames, d_model) encoder output for windows of at most one chunk each."""
        feats = [
            self.features(w, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
            for w in windows
        ]
        x = torch.from_numpy(np.stack(feats).astype(np.float32)).to(self.device)
        return self.model.model.encoder(x).last_hidden_state
