"""Export: a training checkpoint, a run, or a pretrained transformers directory -> inference bundle.

How it works: docs/bundle.md, "How an export is written (`bundle/export.py`)".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from asrforge.bundle.card import model_card
from asrforge.bundle.contents import (
    BundleContents,
    Weights,
    bundle_contents,
    checkpoint_contents,
    ema_weights,
    in_memory,
    pinned_to_recorded_commits,
    pretrained_contents,
    read_pretrained_weights,
    read_run_config,
    read_train_config,
    tensor_shapes,
    with_lm,
)
from asrforge.bundle.inference import Bundle
from asrforge.bundle.load import (
    ALIGNMENT_HEADS_KEY,
    LM_WEIGHTS_KEY,
    MODEL_FILE,
    check_tensors,
)
from asrforge.bundle.schema import (
    INFERENCE_CONFIG,
)
from asrforge.bundle.write import (
    FORMATS,
    ct2_converter,
    readable_by_all,
    write_bundle,
    write_bundle_manifest,
    write_ct2,
    write_ggml,
)
from asrforge.checkpoint.manifest import (
    MANIFEST_NAME,
    read_manifest,
    verify,
)
from asrforge.checkpoint.shards import LazyWeights, has_weights
from asrforge.checkpoint.training import (
    EMA_STEM,
    MODEL_STEM,
)
from asrforge.config import (
    parse_size,
)
from asrforge.errors import UserError
from asrforge.hub import hub_ref, model_dir_if_any, resolve_model
from asrforge.io.atomic import atomic_directory
from asrforge.io.small_files import MANIFEST_BYTES, read_json
from asrforge.model import lora
from asrforge.model.vocab import ids_read_as_timestamps
from asrforge.run_layout import (
    BEST,
    BEST_UNGUARDED,
    CHECKPOINTS,
    LATEST,
    CheckpointsLayout,
    RunLayout,
    checkpoint_name,
)

log = logging.getLogger(__name__)


def export_bundle(
    source: str | Path,
    out: str | Path,
    weights: Weights | None = None,
    fmt: Literal["hf", "ct2", "ggml"] = "hf",
    *,
    average_k: int = 5,
    average_metric: str = "wer",
    stats_utterances: int = 16,
    ct2_quantization: str | None = None,
    lm: str | Path | None = None,
    max_shard_size: int | str | None = "5GB",
    repo_id: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an inference bundle; one from a training checkpoint has a model card as its
    ``README.md`` (``asrforge.bundle.card``).

    Args:
        source: a training checkpoint directory (``manifest.json`` + ``model.safetensors``), a run
            directory (its ``checkpoints/best``, else ``checkpoints/latest``), a pretrained
            transformers Whisper directory (safetensors weights), or, for ``fmt`` ``ct2`` or
            ``ggml``, a transformers-format bundle (:func:`bundle_contents`: its LM and records
            come along).
        out: the bundle directory to write; an existing bundle there is refused (a
            ``UserError`` naming what it holds) unless ``overwrite``, which replaces all of it.
        weights: ``ema`` (default when the checkpoint has EMA weights), ``raw``, or ``average``
            (mean of the run's ``average_k`` best checkpoints by ``average_metric``, as in
            ``asrforge average``: their EMA weights when they have them, else the raw ones).
        fmt: ``hf`` (transformers safetensors, loadable by ``load_bundle``), ``ct2``
            (CTranslate2, for faster-whisper) or ``ggml`` (whisper.cpp's model file).
        stats_utterances: training utterances whose log-mel statistics are recorded (0: none).
        ct2_quantization: CTranslate2 weight type for ``fmt="ct2"`` (e.g. ``int8``); default as
            is. ``fmt="ggml"`` writes matrices in f16 (``float16``, its only one).
        lm: an ARPA file from ``asrforge lm build`` to carry for beam search (``lm.arpa``).
        max_shard_size: weights larger than this are written as transformers' shards and index
            (bytes, or ``"5GB"``, ``"500MB"``, ...); None: one file.
        repo_id: the Hub id the bundle will be pushed to, named in its card's usage.
        overwrite: replace a bundle at ``out`` (its align-heads record, LM and format with it).

    Returns:
        ``out``.

    Raises:
        UserError: a bad source, out, or option; CheckpointCorruptError: the source does not
            verify; CheckpointNotSupportedError: weights that do not fit the model config.
    """
    source, out = Path(source), Path(out)
    if fmt not in FORMATS:
        raise UserError(f"format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    try:
        shard_bytes = None if max_shard_size is None else parse_size(max_shard_size)
    except ValueError as e:
        raise UserError(f"max_shard_size: {e}") from None
    _check_out(out, source, overwrite)
    converter = ct2_converter() if fmt == "ct2" else None
    kind, path = resolve_source(source, bundle_ok=fmt != "hf", lm=None if lm is None else Path(lm))
    if kind == "bundle":
        if weights is not None:
            raise UserError(
                f"--weights {weights}: {source} is a bundle, whose weights were chosen when it "
                "was exported"
            )
        contents = bundle_contents(source)
    elif kind == "pretrained":
        if weights not in (None, "raw"):
            raise UserError(
                f"{source}: a pretrained directory has one set of weights, not {weights}"
            )
        ref = hub_ref(source) if not source.is_dir() else None
        contents = pretrained_contents(
            path,
            name=ref.repo_id.split("/")[-1] if ref else None,
            # within a command's pins, the commit resolve_source read, with no request
            hub=resolve_model(source, field="source").record() if ref else None,
        )
    else:
        contents = checkpoint_contents(
            path,
            weights,
            average_k=average_k,
            average_metric=average_metric,
            stats_utterances=stats_utterances,
        )
        run_cfg = read_run_config(path)
        extended = bool(ids_read_as_timestamps(contents.tokenizer))
        card = model_card(path, run_cfg, contents.inference.languages, repo_id,
                          contents.inference.source, name=out.name,
                          extended_vocabulary=extended)  # fmt: skip
        contents = dataclasses.replace(contents, card=card)
    if lm is not None:
        contents = with_lm(contents, Path(lm))
    return _export_contents(contents, out, fmt, converter, ct2_quantization, shard_bytes)


def _export_contents(
    contents: BundleContents,
    out: Path,
    fmt: str,
    converter: type | None,
    quantization: str | None,
    shard_bytes: int | None,
) -> Path:
    """Write ``contents`` at ``out`` in ``fmt`` (ct2 with CTranslate2's ``converter``)."""
    log.info("exporting %s", contents.note)
    _check_timestamp_reading(contents.tokenizer, fmt)
    if fmt == "ggml":
        return write_ggml(contents, out, quantization)
    if converter is not None:
        return write_ct2(contents, out, converter, quantization, shard_bytes)
    return write_bundle(contents, out, max_shard_bytes=shard_bytes)


def export_interpolated(
    contents: BundleContents,
    state: Mapping[str, torch.Tensor],
    facts: dict[str, Any],
    metrics: dict[str, Any],
    out: str | Path,
    fmt: Literal["hf", "ct2", "ggml"] = "hf",
    *,
    ct2_quantization: str | None = None,
    max_shard_size: int | str | None = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write a bundle of ``contents`` with the weights ``state`` in place of its own (the
    fine-tuned weights interpolated with the starting ones), ``facts`` (the share chosen, the
    guard's figures) recorded in ``inference_config.json`` as ``source.within_guard``, and
    ``metrics`` (what was measured of ``state``) as ``source.metrics``: the fine-tuned step's own
    figures, which describe other weights, move to ``source.finetuned_metrics``. A bundle at
    ``out`` is replaced only with ``overwrite``, as in :func:`export_bundle`."""
    out = Path(out)
    if (problem := out_problem(out, overwrite=overwrite)) is not None:
        raise UserError(problem)
    try:
        shard_bytes = None if max_shard_size is None else parse_size(max_shard_size)
    except ValueError as e:
        raise UserError(f"max_shard_size: {e}") from None
    converter = ct2_converter() if fmt == "ct2" else None
    source = {
        **contents.inference.source,
        "metrics": metrics,
        "finetuned_metrics": contents.inference.source.get("metrics") or {},
        "within_guard": facts,
    }
    contents = dataclasses.replace(
        contents,
        state=state,
        inference=contents.inference.model_copy(update={"source": source}),
        note=f"{contents.note}, {facts['share']:g} of it over the starting model's",
    )
    return _export_contents(contents, out, fmt, converter, ct2_quantization, shard_bytes)


def finetuned_checkpoint(source: Path) -> Path:
    """The checkpoint an export within the guard interpolates: a run's
    ``checkpoints/best-unguarded`` when it has one, else what :func:`resolve_source` takes.

    Raises:
        UserError: ``source`` is no checkpoint or run (a pretrained model has no start), or
            what it resolves to holds the starting weights (step 0).
    """
    unguarded = RunLayout(source).checkpoints.best_unguarded
    if (unguarded / MANIFEST_NAME).is_file():
        log.info("%s: using %s/%s", source, CHECKPOINTS, BEST_UNGUARDED)
        return unguarded
    kind, path = resolve_source(source)
    if kind != "checkpoint":
        raise UserError(f"--within-guard: {source} is not a training run or checkpoint")
    # Interpolating the start with itself would export the start as "fine-tuned" weights.
    if read_manifest(path).get("step") == 0:
        raise UserError(
            f"--within-guard: {path} holds the starting weights (step 0) and {source} has no "
            f"{CHECKPOINTS}/{BEST_UNGUARDED}/: no fine-tuned weights are there to bring within the "
            "guard; name a fine-tuned checkpoint (checkpoints/step-N) instead"
        )
    return path


def check_same_start(
    finetuned: Mapping[str, torch.Tensor],
    start: Mapping[str, torch.Tensor],
    start_from: str,
    ckpt: Path,
) -> dict[str, torch.Tensor]:
    """The fine-tuned weights as a dict of tensors of their own (ties kept as one object),
    once every one of them is in ``start`` with the same shape.

    Raises:
        UserError: a tensor the start lacks or has in another shape (``start_from`` named, and
            why ``ckpt``'s run has no step-0 checkpoint).
    """
    copies: dict[int, torch.Tensor] = {}
    own = {}
    for name, tensor in in_memory(finetuned).items():
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.clone()
        own[name] = copies[id(tensor)]
    lacking = [n for n in own if n not in start and not n.startswith("proj_out.")]
    differ = [
        f"{n} {list(own[n].shape)} fine-tuned, {list(start[n].shape)} there"
        for n in own
        if n in start and tuple(start[n].shape) != tuple(own[n].shape)
    ]
    if lacking or differ:
        what = f"it lacks {lacking[0]}" if lacking else differ[0]
        raise UserError(
            f"--within-guard: the starting weights {start_from} are not the fine-tuned model's "
            f"start ({what}); a run with a resized vocabulary needs its step-0 checkpoint, "
            f"{no_step_zero(ckpt)}"
        )
    return own


def start_weights(ckpt: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The weights ``ckpt``'s run started from, and where they were read: its step-0
    checkpoint (``step-000000/``, or ``best/`` while it holds step 0), else the run's
    ``model.pretrained``.

    Raises:
        UserError: neither is there, named.
    """
    root = ckpt.parent
    for candidate in (CheckpointsLayout(root).step(0), CheckpointsLayout(root).best):
        if (candidate / MANIFEST_NAME).is_file() and read_manifest(candidate).get("step") == 0:
            contents = checkpoint_contents(candidate, "raw", stats_utterances=0, scan_data=False)
            return in_memory(contents.state), checkpoint_name(candidate)
    cfg = pinned_to_recorded_commits(read_train_config(ckpt / "config.yaml"), read_manifest(ckpt))
    pretrained = cfg.model.pretrained
    here = model_dir_if_any(pretrained)
    if here is not None and (here / "config.json").is_file():
        # a Hub id names itself, a local model its directory (as the card names it)
        named = str(pretrained) if hub_ref(pretrained) is not None else here.name
        return read_pretrained_weights(here), named
    gone = (
        f"model.pretrained {pretrained} is not there"
        if pretrained is not None
        else "the run was trained from scratch (no model.pretrained)"
    )
    raise UserError(
        f"--within-guard: the starting weights of {ckpt} are missing: {gone}, and the run has "
        f"no step-0 checkpoint ({CheckpointsLayout(root).step(0)}, or "
        f"{CheckpointsLayout(root).best} at step 0): {no_step_zero(ckpt)}"
    )


def no_step_zero(ckpt: Path) -> str:
    """Why the run of ``ckpt`` (a checkpoint that is not step 0) has no step-0 checkpoint."""
    if not read_run_config(ckpt).evaluates_at_start:
        return "which only eval.at_start saves, and this run trained with it off"
    return (
        "which this run saved at eval.at_start and deleted since (checkpoint rotation and "
        "checkpoint.after_run: best keep it only in a run with eval.guard whose start is not "
        "model.pretrained as stored)"
    )


def export_adapter(
    source: str | Path,
    out: str | Path,
    weights: Weights | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Write a LoRA checkpoint's adapters alone, as peft writes them (``adapter_model.safetensors``
    + ``adapter_config.json``, with a sha256 manifest), for ``PeftModel.from_pretrained`` on the
    base model it was trained on.

    Args:
        source: a training checkpoint or run directory of a run with ``model.lora``.
        weights: ``ema`` (default when the checkpoint has EMA weights) or ``raw``.
        overwrite: replace a bundle at ``out``.

    Raises:
        UserError: the source is not a LoRA checkpoint, or ``weights`` is ``average``.
    """
    source, out = Path(source), Path(out)
    _check_out(out, source, overwrite)
    kind, ckpt = resolve_source(source)
    manifest = verify(ckpt) if kind == "checkpoint" else {}
    if lora.BASE_KEY not in manifest:
        raise UserError(f"{source}: --adapter-only needs a checkpoint of a run with model.lora")
    has_ema = has_weights(manifest["files"], EMA_STEM)
    chosen = weights or ("ema" if has_ema else "raw")
    if chosen not in ("ema", "raw"):
        raise UserError(f"--adapter-only: --weights must be ema or raw, got {chosen!r}")
    if chosen == "ema" and not has_ema:
        raise UserError(f"{ckpt}: has no EMA weights (train.ema_decay was off); use --weights raw")
    cfg = read_train_config(ckpt / "config.yaml")
    adapters = (
        ema_weights(ckpt) if chosen == "ema" else LazyWeights.open(ckpt, MODEL_STEM)
    ).materialize()
    base = str(cfg.model.pretrained) if cfg.model.pretrained is not None else None
    with atomic_directory(out) as tmp:
        lora.write_adapter(tmp, adapters, cfg.model.lora, base)
        readable_by_all(tmp)
        write_bundle_manifest(
            tmp,
            {
                "kind": "lora_adapter",
                "weights": chosen,
                "step": manifest.get("step"),
                "checkpoint": str(ckpt),
                lora.BASE_KEY: manifest[lora.BASE_KEY],
            },
        )
    log.info("wrote the LoRA adapters of %s (%s weights) to %s", ckpt, chosen, out)
    return out


def bundle_from_pretrained(hf_dir: str | Path, out: str | Path) -> Path:
    """Export a pretrained transformers Whisper directory (e.g. from ``asrforge import-ct2``)."""
    return export_bundle(hf_dir, out)


def bundle_from_checkpoint(
    path: str | Path, weights: Weights | None = None, *, device: str = "cpu"
) -> Bundle:
    """A :class:`Bundle` straight from a training checkpoint, in memory (what ``asrforge
    evaluate`` uses): the same weights and settings an export of it would hold."""
    kind, ckpt = resolve_source(Path(path))
    if kind == "pretrained":
        contents = pretrained_contents(ckpt)
    else:
        contents = checkpoint_contents(ckpt, weights, stats_utterances=0, scan_data=False)
    log.info("loaded %s", contents.note)
    return contents_to_bundle(contents, device=device)


def contents_to_bundle(contents: BundleContents, *, device: str = "cpu") -> Bundle:
    model = check_tensors(tensor_shapes(contents.state), contents.config, "weights")
    model.load_state_dict(in_memory(contents.state), strict=False, assign=True)
    model.tie_weights()
    model.generation_config = contents.generation
    return Bundle(model, contents.tokenizer, contents.inference, device=device)


def resolve_source(
    source: Path, *, bundle_ok: bool = False, lm: Path | None = None
) -> tuple[str, Path]:
    """``("checkpoint" | "pretrained" | "bundle", directory)`` for what the user named; a run
    directory resolves to ``checkpoints/best``, else ``checkpoints/latest`` (logged). A bundle
    (a directory, or a Hub id of a pushed one) is taken only with ``bundle_ok`` (an export to
    another format); else it is refused, saying what does take it, or with ``lm`` (the LM to
    carry) how a bundle gets one."""
    if not source.is_dir() and hub_ref(source) is not None:
        # a Hub model id reads as the transformers directory it resolves to, as train takes it
        resolved = resolve_model(source, field="source").path
        if (resolved / INFERENCE_CONFIG).is_file():
            if bundle_ok:
                return "bundle", resolved
            if lm is not None:
                raise UserError(_lm_after_export(source, lm))
            raise UserError(
                f"{source}: already an inference bundle (a pushed one); --format ct2 or ggml "
                "converts it"
            )
        return "pretrained", resolved
    if not source.is_dir():
        raise UserError(f"{source}: no such directory")
    if (source / INFERENCE_CONFIG).is_file():
        if bundle_ok:
            return "bundle", source
        if lm is not None:
            raise UserError(_lm_after_export(source, lm))
        raise UserError(
            f"{source}: already an inference bundle (`asrforge export {source} --format ct2` "
            f"or `--format ggml` converts it; `asrforge export {source} --push-to-hub "
            "ORG/NAME` uploads it as it is)"
        )
    if (source / MANIFEST_NAME).is_file() and has_weights(source, MODEL_STEM):
        return "checkpoint", source
    checkpoints = RunLayout(source).checkpoints
    if checkpoints.root.is_dir():
        for name, path in ((BEST, checkpoints.best), (LATEST, checkpoints.latest())):
            if path is not None and (path / MANIFEST_NAME).is_file():
                step = read_manifest(path).get("step")
                log.info("%s: using %s/%s (step %s)", source, CHECKPOINTS, name, step)
                return "checkpoint", path
        raise UserError(
            f"{source}: has no {CHECKPOINTS}/{BEST} or {CHECKPOINTS}/{LATEST} to export"
        )
    if (source / "config.json").is_file():
        return "pretrained", source
    raise UserError(
        f"{source}: not a checkpoint (no {MANIFEST_NAME} + {MODEL_FILE}), a run directory "
        "(no checkpoints/) or a transformers model directory (no config.json)"
    )


def _lm_after_export(bundle: Path, lm: Path) -> str:
    """Why ``lm`` cannot be put in the bundle ``bundle``: an LM is written with the bundle, so
    the way to one is an export of the bundle's own source."""
    return (
        f"{bundle}: already an inference bundle, and a bundle's LM cannot be added or replaced "
        f"afterwards: export what it was exported from (a run, checkpoint or model) again with "
        f"--lm {lm}"
    )


def out_problem(
    out: Path,
    source: Path | None = None,
    *,
    overwrite: bool = False,
    names: tuple[str, str] = ("out", "overwrite=True"),
) -> str | None:
    """Why ``out`` cannot take an export of ``source``, or None: it is inside the source, a
    directory that is not a bundle, or a bundle and ``overwrite`` is off (what it holds named,
    since replacing it drops an align-heads record or an LM that no re-export brings back).

    Args:
        names: how the caller names ``out`` and turning ``overwrite`` on: the Python keywords,
            or the command's flags (``("--out", "--overwrite")``).
    """
    out_name, overwrite_name = names
    if source is not None and (
        out.resolve() == source.resolve() or source.resolve() in out.resolve().parents
    ):
        return f"{out_name} {out}: must not be inside the source {source}"
    if not out.exists():
        return None
    if not out.is_dir() or (any(out.iterdir()) and not (out / INFERENCE_CONFIG).is_file()):
        return f"{out_name} {out}: exists and is not a bundle; choose another directory"
    if (out / INFERENCE_CONFIG).is_file() and not overwrite:
        return (
            f"{out_name} {out}: already holds {bundle_holdings(out)}; {overwrite_name} replaces "
            "all of it, or choose another directory"
        )
    return None


def bundle_holdings(directory: Path) -> str:
    """What the bundle at ``directory`` holds, in words: its format, and the records and files
    added to it after its export (``align-heads``, an LM and its ``lm tune`` weights). Read
    without verifying: a damaged file only drops a detail from the description."""

    def read(name: str) -> dict[str, Any]:
        try:
            found = read_json(directory / name, MANIFEST_BYTES, error=ValueError)
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    manifest, info = read(MANIFEST_NAME), read(INFERENCE_CONFIG)
    fmt = info.get("format", "hf")
    held = [f"{'an' if fmt == 'hf' else 'a'} {fmt} bundle"]
    if ALIGNMENT_HEADS_KEY in manifest:
        held.append("an align-heads record")
    lm = info.get("lm")
    if isinstance(lm, dict):
        tuned = " with weights from lm tune" if LM_WEIGHTS_KEY in manifest else ""
        held.append(f"an n-gram LM ({lm.get('file', 'lm.arpa')}{tuned})")
    return ", ".join(held)


def _check_out(out: Path, source: Path, overwrite: bool) -> None:
    if (problem := out_problem(out, source, overwrite=overwrite)) is not None:
        raise UserError(problem)


def _check_timestamp_reading(tokenizer, fmt: str) -> None:
    """An extended vocabulary's new tokens follow the timestamps, and Whisper code outside
    asrforge reads them as timestamps: faster-whisper's text drops every id past
    ``<|endoftext|>`` (so a ct2 export would lose each new token, silently: refused), and
    transformers' ASR pipeline drops them too (the hf bundle is fine for asrforge and for
    ``generate`` + ``decode``: warned)."""
    misread = ids_read_as_timestamps(tokenizer)
    if not misread or fmt == "ggml":  # the ggml writer refuses any vocabulary but Whisper's
        return
    what = (
        f"the vocabulary has {len(misread)} token(s) after its timestamp tokens (ids "
        f"{misread.start}..{misread.stop - 1}, an extended vocabulary)"
    )
    if fmt == "ct2":
        raise UserError(
            f"--format ct2: {what}; faster-whisper reads every id past <|notimestamps|> as a "
            "timestamp and leaves those tokens out of its text. Export --format hf and "
            "transcribe with asrforge"
        )
    log.warning(
        "%s: transformers' ASR pipeline and its timestamp decoding (output_offsets, "
        "return_timestamps) read them as timestamps and drop them from the text; transcribe "
        "with asrforge, or model.generate() + tokenizer.decode() (docs/decoding.md, Extended "
        "vocabularies)",
        what,
    )
