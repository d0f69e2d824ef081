"""Checkpoint averaging: the mean of the k best checkpoints' weights (ESPnet's ``ave_<k>best``).

Floating tensors are averaged in float64 and cast back; integer tensors (counters such as
BatchNorm's ``num_batches_tracked``) are summed, as ESPnet does; bool tensors are taken from the
first (best) checkpoint. The work is streamed: tensor by tensor, and a large tensor in blocks of
rows, over all inputs at once, read with ``pread`` (a memory map would keep every touched page of
k files resident). Sharded weights (:mod:`asrforge.checkpoint.shards`) are averaged shard by
shard, the output laid out as the best input is: memory holds one output shard (one file's
worth when unsharded), a float64 accumulator block of at most 16 MiB and one input block; never
a whole checkpoint of a sharded model, never several. The result is a directory with the
averaged weights, the best input's non-training files (``config.yaml``, ``tokenizer/``, ...)
and its own manifest.

CLI: ``asrforge average RUN_DIR --metric wer --k 5 [--mode min] [--out DIR]``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from asrforge.checkpoint.manifest import MANIFEST_NAME, read_manifest, verify, write_manifest
from asrforge.checkpoint.shards import (
    LazyWeights,
    TensorReader,
    has_weights,
    is_weights_file,
    read_header,
    read_metadata,
    weight_files,
    weight_map,
    write_shards,
)
from asrforge.checkpoint.training import (
    EMA_STEM,
    MODEL_FILE,
    MODEL_STEM,
    TRAINING_ONLY_FILES,
    weights_aliases,
)
from asrforge.errors import CheckpointError, CheckpointNotSupportedError, UserError
from asrforge.io.atomic import atomic_directory
from asrforge.model.lora import BASE_KEY as LORA_BASE_KEY
from asrforge.run_layout import BEST_UNGUARDED, RunLayout, step_of

log = logging.getLogger(__name__)

_HIGHER_IS_BETTER = ("acc", "bleu", "f1", "precision", "recall")


_BLOCK_BYTES = 16 << 20  # float64 accumulator block
_RowReader = TensorReader  # the reader of one input file (tests spy on its reads)

LORA_REASON = (
    "the mean of LoRA adapters' factors, mean(B) @ mean(A), is not the mean of their updates B @ A"
)
"""Why a LoRA run's checkpoints are never averaged, by ``asrforge average``, the
``average_checkpoints`` callback or ``export --weights average``."""


def weights_header(directory: Path, stem: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype code, shape)}`` of ``stem``'s weights in ``directory`` (every shard's
    header, validated by the library), in file order and by name within a file."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for fname in weight_files(directory, stem):
        header = read_header(directory / fname)
        for name in sorted(header):
            out[name] = (header[name]["dtype"], tuple(header[name]["shape"]))
    return out


def refuse_lora(manifest: Mapping[str, Any], where: Path | str, hint: str = "") -> None:
    """Refuse to average the checkpoint whose ``manifest`` this is when it holds LoRA adapters.

    Raises:
        CheckpointNotSupportedError: naming ``where``, :data:`LORA_REASON` and ``hint``.
    """
    if LORA_BASE_KEY in manifest:
        raise CheckpointNotSupportedError(f"{where}: holds LoRA adapters: {LORA_REASON}{hint}")


def check_same_parameters(headers: list[dict[str, Any]], where: list[Path]) -> list[str]:
    """Check that the inputs' :func:`weights_header` hold the same names, shapes and dtypes.

    Returns:
        The tensor names, in the first input's order.

    Raises:
        CheckpointNotSupportedError: naming the first mismatch and the two inputs.
    """
    ref = headers[0]
    for other, got in zip(where[1:], headers[1:], strict=True):
        missing = [n for n in ref if n not in got]
        extra = [n for n in got if n not in ref]
        if missing or extra:
            what = f"lacks {missing[0]!r}" if missing else f"has an extra tensor {extra[0]!r}"
            raise CheckpointNotSupportedError(
                f"cannot average: {other} {what} compared to {where[0]} "
                f"({len(missing)} missing, {len(extra)} extra)"
            )
        for name, (dtype, shape) in ref.items():
            if got[name] != (dtype, shape):
                raise CheckpointNotSupportedError(
                    f"cannot average: {name!r} is {got[name][0]}{list(got[name][1])} in {other} "
                    f"but {dtype}{list(shape)} in {where[0]}"
                )
    return list(ref)


def average_checkpoints(
    paths: list[Path],
    out: Path,
    *,
    weights: str | None = None,
    weights_file: str | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Average the weights of checkpoint directories into a new directory ``out`` (atomically).

    Args:
        paths: checkpoint directories, best first (the first one's non-weight files are copied).
            Each must verify against its manifest.
        out: the directory to write (replaced whole if it exists).
        weights: ``ema``: each checkpoint's weights with its EMA tensors over them, as a bundle
            exports them; ``raw``: the weights as trained; None: ``ema`` when every checkpoint
            has EMA weights, else ``raw``. Either way the output is ``model.safetensors`` in the
            raw weights' dtypes, and the manifest records ``weights``.
        weights_file: instead, one safetensors file averaged as it is (``ema.safetensors``: the
            EMA tensors alone); the output uses the same name.
        meta: extra manifest facts; ``averaged_from`` and ``k`` are always recorded.

    Returns:
        ``out``.

    Raises:
        UserError: ``weights`` is neither ``ema`` nor ``raw``, or ``ema`` for a checkpoint
            without EMA weights, or both ``weights`` and ``weights_file`` are given.
        CheckpointNotSupportedError: the parameter sets differ (first mismatch named), or the
            checkpoints hold LoRA adapters (:func:`refuse_lora`).
        CheckpointCorruptError: an input does not verify.
    """
    _one_weights_choice(weights, weights_file)
    paths = [Path(p) for p in paths]
    if not paths:
        raise UserError("average_checkpoints: no checkpoints given")
    stem = (weights_file or MODEL_FILE).removesuffix(".safetensors")
    for p in paths:
        refuse_lora(verify(p), p, "; export one checkpoint instead (its adapters are merged)")
        if not has_weights(p, stem):
            raise CheckpointError(f"{p}: has no {stem}.safetensors to average")
        weights_aliases(p / f"{stem}.safetensors")  # raises, naming a file that is not one
    if weights_file is None:
        weights = _which_weights(paths, weights)
    headers = [weights_header(p, stem) for p in paths]
    names = check_same_parameters(headers, [p / f"{stem}.safetensors" for p in paths])
    if weights == "ema":
        ema_files = [p / "ema.safetensors" for p in paths]
        check_same_parameters([weights_header(p, EMA_STEM) for p in paths], ema_files)
    sources = [_sources(p, stem, weights == "ema") for p in paths]
    # The output is laid out as the best input is: the same shards, the same names in each.
    best_map = weight_map(paths[0], stem)
    best_files = weight_files(paths[0], stem)
    plan = [[n for n in names if best_map[n] == f] for f in best_files]
    metadata = read_metadata(paths[0] / best_files[0])
    k = len(paths)
    with contextlib.ExitStack() as stack:
        readers = [
            {f: stack.enter_context(_RowReader(f)) for f in sorted({f for f, _, _ in src.values()})}
            for src in sources
        ]

        def averaged(name: str) -> torch.Tensor:
            parts = []
            for r, src in zip(readers, sources, strict=True):
                path, inner, cast = src[name]
                parts.append(_Part(r[path], inner, cast))
            return _average_one(parts, name)

        with atomic_directory(Path(out)) as tmp:
            # One output shard in memory at a time, each tensor computed as its shard is written
            digests = write_shards(tmp, stem, plan, averaged, metadata)
            skip = {MANIFEST_NAME, *TRAINING_ONLY_FILES}
            for rel in sorted(read_manifest(paths[0])["files"]):
                if rel in skip or any(is_weights_file(rel, s) for s in (MODEL_STEM, EMA_STEM)):
                    continue
                dst = tmp / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(paths[0] / rel, dst)
                except OSError:
                    shutil.copy2(paths[0] / rel, dst)
            info = {"kind": "average", "averaged_from": [str(p) for p in paths], "k": k}
            meta = {**info, **(meta or {}), "weights_file": f"{stem}.safetensors"}
            if weights_file is None:
                meta["weights"] = weights
            write_manifest(tmp, meta, known=digests)
    return Path(out)


def _one_weights_choice(weights: str | None, weights_file: str | None) -> None:
    """Refuse ``weights`` with ``weights_file``: the file is averaged as it is, so the choice
    of weights would be ignored."""
    if weights is not None and weights_file is not None:
        raise UserError("weights and weights_file (--weights and --weights-file): give one of them")


def _which_weights(paths: list[Path], weights: str | None) -> str:
    """``weights``, checked, or by default what a bundle exports: EMA when every input has it."""
    with_ema = [has_weights(p, EMA_STEM) for p in paths]
    if weights is None:
        return "ema" if all(with_ema) else "raw"
    if weights not in ("ema", "raw"):
        raise UserError(f"weights: must be ema or raw, got {weights!r}")
    if weights == "ema" and not all(with_ema):
        lacking = paths[with_ema.index(False)]
        raise UserError(f"{lacking}: has no EMA weights (train.ema_decay was off); use raw")
    return weights


def _sources(directory: Path, stem: str, ema: bool) -> dict[str, tuple[Path, str, Any]]:
    """``{name: (file, name in it, dtype to cast to or None)}`` of one input's weights: with
    ``ema``, the EMA tensors in place of the raw ones (cast to the raw dtypes), as exported."""
    lazy = LazyWeights.open(directory, stem)
    if ema:
        try:
            lazy = lazy.overlaid(LazyWeights.open(directory, EMA_STEM))
        except CheckpointError as e:
            raise CheckpointError(f"{directory / 'ema.safetensors'}: {e}") from None
    return lazy.sources


class _Part:
    """One input's share of a tensor: its reader, the tensor's name there, the output dtype."""

    def __init__(self, reader: _RowReader, inner: str, cast: torch.dtype | None):
        self.reader, self.inner = reader, inner
        self.dtype = cast or reader.dtype(inner)

    def shape(self) -> list[int]:
        return self.reader.shape(self.inner)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.reader.rows(self.inner, start, stop)


def _average_one(parts: list[_Part], name: str) -> torch.Tensor:
    """Mean (floats) or sum (integers) of one tensor over the inputs, a block of rows at a time,
    in the first input's (output) dtype."""
    shape, dtype = parts[0].shape(), parts[0].dtype
    for part in parts[1:]:
        if part.shape() != shape:
            raise CheckpointNotSupportedError(
                f"cannot average: {name!r} is {part.shape()} in {part.reader.path} but {shape} "
                f"in {parts[0].reader.path}"
            )
    out = torch.empty(shape, dtype=dtype)
    if out.numel() == 0:
        return out
    # The rows are a view, so filling them fills `out`.
    rows = out.reshape(shape[0] if shape else 1, -1)
    # Masks and flags are taken from the best checkpoint.
    if dtype == torch.bool:
        rows[:] = parts[0].rows(0, rows.shape[0]).reshape(rows.shape)
        return out
    if dtype.is_complex:
        wide = torch.complex128
    elif dtype.is_floating_point:
        wide = torch.float64
    else:
        wide = torch.int64
    block = max(1, _BLOCK_BYTES // (16 * rows.shape[1]))
    for start in range(0, rows.shape[0], block):
        stop = min(start + block, rows.shape[0])
        acc = None
        for source in parts:
            part = source.rows(start, stop).reshape(stop - start, -1)
            if acc is None:
                acc = part.to(wide, copy=True)
            else:
                acc += part
            del part
        if wide != torch.int64:
            acc /= len(parts)
        rows[start:stop] = acc.to(dtype)
    return out


def interpolate_weights(
    start: Mapping[str, torch.Tensor], finetuned: Mapping[str, torch.Tensor], share: float
) -> dict[str, torch.Tensor]:
    """``(1 - share) * start + share * finetuned`` of every floating tensor (WiSE-FT), in float64
    and cast to the fine-tuned dtype; other tensors are the fine-tuned ones. Tied names (one
    tensor object under several names) stay one tensor; a tied name the start lacks (a
    ``proj_out.weight`` saved only as the embedding) takes its partner's.

    Raises:
        CheckpointNotSupportedError: a tensor the start lacks under every name, or of another
            shape there.
    """
    names_of: dict[int, list[str]] = {}
    for name, tensor in finetuned.items():
        names_of.setdefault(id(tensor), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for names in names_of.values():
        tuned = finetuned[names[0]]
        present = [n for n in names if n in start]
        if not present:
            raise CheckpointNotSupportedError(
                f"cannot interpolate: {names[0]!r} is in the fine-tuned weights, not the start's"
            )
        begin = start[present[0]]
        if tuple(begin.shape) != tuple(tuned.shape):
            raise CheckpointNotSupportedError(
                f"cannot interpolate: {present[0]!r} is {list(tuned.shape)} fine-tuned but "
                f"{list(begin.shape)} at the start"
            )
        mixed = tuned
        if tuned.dtype.is_floating_point:
            wide = begin.to(torch.float64) * (1.0 - share) + tuned.to(torch.float64) * share
            mixed = wide.to(tuned.dtype)
        for name in names:
            out[name] = mixed
    return out


def checkpoints_root(run_dir: Path) -> Path:
    """``run_dir/checkpoints`` when it exists, else ``run_dir`` itself."""
    run_dir = Path(run_dir)
    checkpoints = RunLayout(run_dir).checkpoints.root
    return checkpoints if checkpoints.is_dir() else run_dir


def default_mode(metric: str) -> str:
    """``max`` for accuracy-like names (acc, bleu, f1, precision, recall), else ``min``."""
    return "max" if any(h in metric.lower() for h in _HIGHER_IS_BETTER) else "min"


def rank_checkpoints(root: Path, metric: str, mode: str) -> list[tuple[float, int, Path]]:
    """``(value, step, dir)`` of each distinct step under ``root`` whose manifest has a finite
    ``metrics[metric]``, best first (a ``step-*`` directory preferred over a ``best*`` copy).
    Step 0 is left out: it is the starting model (``eval.at_start``), not a trained checkpoint,
    and an average of fine-tuned weights must not take it in (it often ties with or beats the
    first trained steps). Every step the forgetting guard refused is left out too (its
    manifest's ``metrics.guard_within`` is false; ``best-unguarded/`` holds the best of them):
    averaging it in would route round the guard.

    Raises:
        CheckpointCorruptError: a manifest is damaged or does not match its seal (an edited step
            or metric would change the ranking: it is refused, not skipped).
    """
    return _ranked(root, metric, mode)[0]


def _ranked(root: Path, metric: str, mode: str) -> tuple[list[tuple[float, int, Path]], list[int]]:
    """:func:`rank_checkpoints`, and the steps with the metric that the guard refused."""
    by_step: dict[int, tuple[float, int, Path]] = {}
    refused: set[int] = set()
    for d in sorted(Path(root).iterdir()):
        if d.name.startswith(".") or d.is_symlink() or not (d / MANIFEST_NAME).is_file():
            continue
        manifest = read_manifest(d)
        step = manifest.get("step")
        if manifest.get("kind") == "average" or not isinstance(step, int) or step == 0:
            continue  # step 0: the starting weights, before any optimizer step
        metrics = manifest.get("metrics") if isinstance(manifest.get("metrics"), dict) else {}
        value = metrics.get(metric, manifest.get(metric))
        if not isinstance(value, int | float) or not math.isfinite(value):
            continue
        if d.name == BEST_UNGUARDED or metrics.get("guard_within") is False:
            refused.add(step)
            continue
        if step not in by_step or step_of(d.name) is not None:
            by_step[step] = (float(value), step, d)
    for step in refused:
        by_step.pop(step, None)
    sign = 1.0 if mode == "min" else -1.0
    return sorted(by_step.values(), key=lambda e: (sign * e[0], e[1])), sorted(refused)


def average_top_k(
    run_dir_or_ckpt_root: Path,
    metric: str,
    k: int,
    out: Path | None = None,
    *,
    mode: str | None = None,
    weights: str | None = None,
    weights_file: str | None = None,
) -> Path:
    """Average the ``k`` best checkpoints of a run by ``metric`` (as named in the manifests).

    Args:
        run_dir_or_ckpt_root: the run directory or its ``checkpoints/``.
        metric: a key of the manifests' ``metrics`` (``wer``, ``cer``, ``loss``, ...).
        k: how many; fewer are averaged (with a warning) when fewer have the metric.
        out: the output directory; default ``<checkpoints>/<metric>.ave_<k>best``.
        mode: ``min`` or ``max``; default :func:`default_mode` of the metric.
        weights: ``ema``, ``raw``, or None: EMA when the checkpoints have it, as a bundle
            exports (see :func:`average_checkpoints`).
        weights_file: instead, one safetensors file averaged as it is.

    Raises:
        CheckpointError: no checkpoint has the metric.
    """
    root = checkpoints_root(Path(run_dir_or_ckpt_root))
    if not root.is_dir():
        raise UserError(f"{run_dir_or_ckpt_root}: no such directory")
    if k < 1:
        raise UserError(f"k: must be >= 1, got {k}")
    _one_weights_choice(weights, weights_file)
    mode = mode or default_mode(metric)
    ranked, refused = _ranked(root, metric, mode)
    guarded = (
        f"; the forgetting guard refused step(s) {', '.join(map(str, refused))}, never averaged"
        if refused
        else ""
    )
    if not ranked:
        raise CheckpointError(
            f"no checkpoint under {root} has the metric {metric!r} in its manifest (the "
            f"starting model, step 0, is never averaged){guarded}"
        )
    chosen = ranked[:k]
    if len(chosen) < k:
        many = len(chosen) > 1
        log.warning(
            "average: only %d %s %r%s; averaging %s",
            len(chosen),
            "checkpoints have" if many else "checkpoint has",
            metric,
            guarded,
            "those" if many else "it",
        )
    out = Path(out) if out is not None else root / f"{metric}.ave_{k}best"
    meta = {
        "metric": metric,
        "mode": mode,
        "steps": [step for _v, step, _d in chosen],
        "values": [v for v, _s, _d in chosen],
        "guard_refused": refused,
    }
    return average_checkpoints(
        [d for _v, _s, d in chosen], out, weights=weights, weights_file=weights_file, meta=meta
    )
