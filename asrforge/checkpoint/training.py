"""Training checkpoints: one directory with everything an exact resume needs.

Its files and how tied weights are kept: docs/training.md, "A checkpoint's files
(`checkpoint/training.py`)".
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from asrforge.checkpoint.manifest import PRUNED_KEY, sha256_file, verify, write_manifest
from asrforge.checkpoint.sharded import METADATA_FILE, SHARDED_OPTIMIZER_DIR
from asrforge.checkpoint.shards import (
    ALIASES_KEY,
    LazyWeights,
    has_weights,
    index_name,
    plan_shards,
    read_aliases,
    single_name,
    write_shards,
)
from asrforge.checkpoint.streaming import (
    FileDigest,
    can_stream,
    torch_save,
    write_safetensors,
    write_text,
)
from asrforge.config.yaml_limits import read_yaml_text
from asrforge.errors import CheckpointCorruptError, CheckpointError, CheckpointSaveError
from asrforge.io.atomic import atomic_directory, fsync_tree
from asrforge.io.small_files import RECORDS_BYTES, read_json
from asrforge.run_layout import TRAIN_STATE_FILE

MODEL_STEM, EMA_STEM = "model", "ema"
MODEL_FILE = single_name(MODEL_STEM)
EMA_FILE = single_name(EMA_STEM)
TORCH_FILES = ("optimizer", "scheduler", "scaler", "rng")
TOKENIZER_DIR = "tokenizer"
"""The tokenizer's folder in a checkpoint, and in the run directory of a run that trained it."""
TRAINING_ONLY_FILES = (
    EMA_FILE,
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
    "rng.pt",
    TRAIN_STATE_FILE,
    "callbacks.json",
)

# ---------------------------------------------------------------------------------------------
# Weights


def save_weights(
    path: Path, state: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> dict[str, str]:
    """Write a state dict as safetensors; exact aliases are dropped and recorded (see module doc).

    Args:
        path: the ``.safetensors`` file to write (plainly: atomicity is the caller's directory).
        state: name -> tensor, any device (copied to the CPU for the write).
        metadata: extra string metadata for the header.

    Returns:
        The dropped aliases, ``{alias: kept name}``.
    """
    tensors, aliases = _distinct_tensors(path, state)
    meta = _weights_metadata(aliases, metadata)
    try:
        save_file(tensors, str(path), metadata=meta)
    except SafetensorError as e:
        raise library_write_error(e, Path(path)) from e
    # safetensors writes through a private 0600 temp file; give the usual umask-based mode so a
    # shared run directory stays readable by the group, like every other file of the checkpoint.
    os.chmod(path, 0o666 & ~_umask(path.parent))
    return aliases


def save_weights_hashed(
    path: Path, state: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> FileDigest:
    """:func:`save_weights` in one pass: the file's sha256 computed while it is written
    (:mod:`asrforge.checkpoint.streaming`), fsynced."""
    tensors, aliases = _distinct_tensors(path, state)
    meta = _weights_metadata(aliases, metadata)
    # A dtype the streaming writer does not name goes through the safetensors library.
    if not can_stream(tensors):
        save_weights(path, state, metadata)
        return FileDigest(sha256_file(path), Path(path).stat().st_size)
    return write_safetensors(path, tensors, meta)


def save_weights_sharded(
    directory: Path,
    stem: str,
    state: Mapping[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    max_shard_bytes: int | None = None,
) -> dict[str, FileDigest]:
    """Write ``stem``'s weights into ``directory``: ``<stem>.safetensors``, or shards and an
    index past ``max_shard_bytes`` (:mod:`asrforge.checkpoint.shards`), each file hashed and
    fsynced as it is written. One shard's tensors are in memory at a time when ``state`` is a
    :class:`~asrforge.checkpoint.shards.LazyWeights` (read from disk).

    Returns:
        ``{file name: digest}``.
    """
    directory = Path(directory)
    if isinstance(state, LazyWeights):
        names = state.stored()
        sizes = {name: state.nbytes(name) for name in names}
        aliases, get = state.aliases, state.__getitem__
    else:
        tensors, aliases = _distinct_tensors(directory / single_name(stem), state)
        sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
        get = tensors.__getitem__
    plan = plan_shards(sizes, max_shard_bytes)
    return write_shards(directory, stem, plan, get, _weights_metadata(aliases, metadata))


def _weights_metadata(aliases: dict[str, str], metadata: dict[str, str] | None) -> dict[str, str]:
    meta = {"format": "pt", **(metadata or {})}
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    return meta


def _distinct_tensors(
    path: Path, state: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors safetensors accepts (exact aliases dropped, views cloned, contiguous) and
    the dropped aliases, ``{alias: kept name}``."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    by_storage: dict[tuple, list[str]] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointSaveError(
                f"{path.name}: {name!r} is a {type(t).__name__}, not a tensor"
            )
        t = t.detach()
        if t.numel() == 0:
            tensors[name] = t
            continue
        storage = (t.device, t.untyped_storage().data_ptr())
        key = (*storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t
        by_storage.setdefault(storage, []).append(name)
    for names in by_storage.values():
        # Views into one buffer (a split fused weight, ...) each get their own storage.
        if len(names) > 1:
            for name in names:
                tensors[name] = tensors[name].clone()
    for name, t in tensors.items():
        if not t.is_contiguous():
            tensors[name] = t.contiguous()
    return tensors, aliases


def library_write_error(e: Exception, path: Path) -> Exception:
    """safetensors (a SafetensorError) and the tokenizers library (a bare Exception) report a
    failed write (a full disk, ...) as ``... os error N``; the atomic writers around every save
    turn an OSError into a one-line CheckpointSaveError and remove what was half-written, so the
    OS error is given back its errno and the file's name."""
    found = re.search(r"os error (\d+)", str(e))
    if found is None:
        library = "safetensors" if isinstance(e, SafetensorError) else type(e).__name__
        return CheckpointSaveError(f"{path}: {library} could not write it: {e}")
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """``tokenizer.save_pretrained(directory)``, a failed write raised as the OSError it is
    (see :func:`library_write_error`), so the atomic writer around it reports it in one line.

    Raises:
        OSError: the write failed.
        CheckpointSaveError: it failed with no OS error to give back.
    """
    try:
        tokenizer.save_pretrained(str(directory))
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers' write errors have no type of their own
        raise library_write_error(e, Path(directory)) from e


def _umask(directory: Path) -> int:
    """The process umask, read without changing it (``os.umask`` would race other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    probe = directory / f".umask-probe-{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return 0o666 & ~os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        os.unlink(probe)


def _sharded_stem(path: Path) -> str | None:
    """``model`` for ``dir/model.safetensors`` when the directory holds that stem sharded."""
    path = Path(path)
    stem = path.name.removesuffix(".safetensors")
    if path.name.endswith(".safetensors") and not path.exists():
        if (path.parent / index_name(stem)).is_file():
            return stem
    return None


def load_weights(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file written by :func:`save_weights`, re-creating tied aliases.

    ``dir/model.safetensors`` of a directory that holds the model sharded (only
    ``model.safetensors.index.json`` and its shards) reads every shard.

    Raises:
        CheckpointCorruptError: the file is not safetensors (named), or its alias record is
            damaged.
    """
    stem = _sharded_stem(path)
    if stem is not None:
        state = LazyWeights.open(Path(path).parent, stem).materialize()
        return {k: v.to(device) for k, v in state.items()} if str(device) != "cpu" else state
    try:
        state = load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as e:
        raise CheckpointCorruptError(f"{path}: not a readable safetensors file: {e}") from None
    for alias, kept in weights_aliases(path).items():
        if kept not in state:
            raise CheckpointCorruptError(f"{path}: alias {alias!r} names no tensor {kept!r}")
        state[alias] = state[kept]
    return state


def weights_aliases(path: Path) -> dict[str, str]:
    """The ``{alias: kept name}`` record of a safetensors file (empty when none).

    Raises:
        CheckpointCorruptError: the file is not safetensors, or the record is damaged.
    """
    stem = _sharded_stem(path)
    if stem is not None:
        return LazyWeights.open(Path(path).parent, stem).aliases
    return read_aliases(path)


# ---------------------------------------------------------------------------------------------
# RNG state


def capture_rng_state() -> dict[str, Any]:
    """The state of every global RNG: python ``random``, numpy's legacy global, torch CPU and
    each CUDA device. Plain ints, lists and tensors, so ``torch.load(weights_only=True)`` reads
    it back."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "bit_generator": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned. CUDA states are restored for the devices
    present (a checkpoint from 8 GPUs resumed on 4 restores the first 4)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = state["numpy"]
    keys = npst["keys"].numpy().astype(np.uint32)
    np.random.set_state(
        (npst["bit_generator"], keys, npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)


# ---------------------------------------------------------------------------------------------
# Save and load

_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray)
_TORCH_PLAIN = (torch.Size, torch.dtype, torch.device)


def check_weights_only(obj: Any, where: str) -> None:
    """Raise if ``obj`` holds something ``torch.load(weights_only=True)`` would refuse.

    Checked at save time, so a checkpoint that could not be resumed is never written.
    """
    t = type(obj)
    if t in (dict, OrderedDict):
        for k, v in obj.items():
            check_weights_only(k, f"{where} (a key)")
            check_weights_only(v, f"{where}[{k!r}]")
    elif t in (list, tuple, set):
        for i, v in enumerate(obj):
            check_weights_only(v, f"{where}[{i}]")
    elif isinstance(obj, torch.Tensor) or t in _PLAIN or t in _TORCH_PLAIN:
        return
    else:
        raise CheckpointSaveError(
            f"{where} is a {t.__module__}.{t.__qualname__}, which torch.load(weights_only=True) "
            "refuses; only tensors, numbers, strings, lists, tuples, dicts and None can be saved"
        )


@dataclass
class CheckpointContents:
    """What a training checkpoint holds: everything an exact resume needs.

    Attributes:
        model: the model's state dict (tied weights are handled, see the module doc).
        optimizer: ``optimizer.state_dict()``.
        scheduler: ``lr_scheduler.state_dict()``.
        rng: :func:`capture_rng_state` (per process; the caller picks rank zero's).
        train_state: JSON-able loop state (step, epoch, data position, best metrics, ...).
        config_yaml: the resolved config as YAML text.
        ema: the EMA weights, or None when EMA is off.
        scaler: ``GradScaler.state_dict()``, or None without loss scaling.
        callbacks: JSON-able ``{callback name: state_dict}``.
        tokenizer_save: called with ``path/tokenizer`` (an existing empty directory); the run's
            is :func:`save_tokenizer`.
        meta: JSON-able facts for the manifest (step, metrics, config_id, seed, ...).
        max_shard_bytes: weights (and EMA weights) larger than this are written as shards with
            an index, as transformers does; None: one file each.
        optimizer_dir: instead of ``optimizer``, the optimizer state sharded across processes
            (:mod:`asrforge.checkpoint.sharded`): a staging directory every process wrote its
            shard into, moved into the checkpoint as ``optimizer/``.
    """

    model: Mapping[str, torch.Tensor]
    optimizer: dict | None
    scheduler: dict
    rng: dict
    train_state: dict
    config_yaml: str
    ema: Mapping[str, torch.Tensor] | None = None
    scaler: dict | None = None
    callbacks: dict[str, dict] | None = None
    tokenizer_save: Callable[[Path], None] | None = None
    meta: dict[str, Any] | None = None
    max_shard_bytes: int | None = None
    optimizer_dir: Path | None = None


def write_training_files(directory: Path, contents: CheckpointContents) -> dict[str, FileDigest]:
    """Write the files of a training checkpoint into an existing (temporary) ``directory``.

    No manifest, no atomicity: :func:`save_training_checkpoint` adds both. Each file is
    hashed and fsynced as it is written; returns ``{file name: digest}`` (the tokenizer's files,
    written by the tokenizer, are not in it). Weights past ``max_shard_bytes`` are sharded.

    Raises:
        CheckpointSaveError: a value cannot be saved safely, or a library reported a write error.
        OSError: a plain write failed (the atomic wrapper turns it into CheckpointSaveError).
    """
    directory = Path(directory)
    c = contents
    torch_objs = {
        "optimizer": c.optimizer,
        "scheduler": c.scheduler,
        "scaler": c.scaler,
        "rng": c.rng,
    }
    for name, obj in torch_objs.items():
        if obj is not None:
            check_weights_only(obj, f"{name}.pt: {name}")
    json_texts = {}
    for file, obj in ((TRAIN_STATE_FILE, c.train_state), ("callbacks.json", c.callbacks or {})):
        try:
            json_texts[file] = json.dumps(obj, indent=2) + "\n"
        except (TypeError, ValueError) as e:
            raise CheckpointSaveError(f"{file}: not JSON-serializable: {e}") from e

    # Independent files, written at once: hashing and os.write release the GIL, so the big
    # ones (weights, EMA, optimizer state) overlap on the CPU and the disk.
    # Each job returns {file name: digest}: the weights may be several files (shards).
    jobs: dict[str, Callable[[], dict[str, FileDigest]]] = {}
    for stem, state in ((MODEL_STEM, c.model), (EMA_STEM, c.ema)):
        if state is not None:
            jobs[single_name(stem)] = functools.partial(
                save_weights_sharded, directory, stem, state, max_shard_bytes=c.max_shard_bytes
            )
    for name, obj in torch_objs.items():
        if obj is not None:
            path = directory / f"{name}.pt"
            jobs[path.name] = _one_file(path, functools.partial(torch_save, obj, path))
    texts = {**json_texts, "config.yaml": c.config_yaml}
    for fname, text in texts.items():
        jobs[fname] = _one_file(
            directory / fname, functools.partial(write_text, directory / fname, text)
        )
    with ThreadPoolExecutor(max_workers=min(4, len(jobs))) as pool:
        futures = {fname: pool.submit(job) for fname, job in jobs.items()}
        digests = {}
        for fname, future in futures.items():
            try:
                digests.update(future.result())
            except SafetensorError as e:
                raise CheckpointSaveError(f"{fname}: safetensors could not write it: {e}") from e
    if c.tokenizer_save is not None:
        (directory / TOKENIZER_DIR).mkdir()
        c.tokenizer_save(directory / TOKENIZER_DIR)
    if c.optimizer_dir is not None:
        # A rename on the same file system: the shards every process wrote join the checkpoint
        # before its manifest hashes them.
        os.replace(c.optimizer_dir, directory / SHARDED_OPTIMIZER_DIR)
    return digests


def _one_file(path: Path, write: Callable[[], FileDigest]) -> Callable[[], dict[str, FileDigest]]:
    """A writer job of one file, returning ``{its name: digest}`` like the weights' jobs."""
    return lambda: {path.name: write()}


def save_training_checkpoint(path: Path, contents: CheckpointContents) -> Path:
    """Write a complete training checkpoint directory at ``path``, atomically.

    Args:
        path: the directory to create (an existing one is replaced whole).
        contents: what it holds; ``contents.meta`` goes into the manifest.

    Returns:
        ``path``.

    Raises:
        CheckpointSaveError: nothing was written at ``path`` (a previous version is intact).
    """
    path = Path(path)
    # The files fsync themselves as they are written; the tokenizer's and the optimizer
    # shards' are fsynced below.
    with atomic_directory(path, fsync_files=False) as tmp:
        digests = write_training_files(tmp, contents)
        for sub in (TOKENIZER_DIR, SHARDED_OPTIMIZER_DIR):
            if (tmp / sub).is_dir():
                fsync_tree(tmp / sub)
        write_manifest(tmp, {"kind": "training", **(contents.meta or {})}, known=digests)
    return path


@dataclass
class TrainingCheckpoint:
    """What :func:`load_training_checkpoint` read; fields as in :class:`CheckpointContents`."""

    path: Path
    manifest: dict[str, Any]
    model: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None
    optimizer: dict
    scheduler: dict
    scaler: dict | None
    rng: dict
    train_state: dict
    callbacks: dict[str, dict]
    config_yaml: str
    tokenizer_dir: Path | None
    """``path/tokenizer`` when the checkpoint has one."""
    optimizer_dir: Path | None = None
    """``path/optimizer``, the optimizer state sharded across processes, when the checkpoint
    holds that instead of ``optimizer.pt`` (``optimizer`` is then None)."""

    @property
    def step(self) -> int | None:
        return self.manifest.get("step")

    @property
    def metrics(self) -> dict[str, Any]:
        return self.manifest.get("metrics") or {}


def load_training_checkpoint(
    path: Path, map_location: str | torch.device = "cpu", *, check_hashes: bool = True
) -> TrainingCheckpoint:
    """Verify the manifest, then read a training checkpoint. Nothing but safetensors and
    ``torch.load(weights_only=True)`` is deserialized.

    Args:
        path: a directory written by :func:`save_training_checkpoint`.
        map_location: device for tensors (weights and optimizer state).
        check_hashes: False checks file sizes only (faster for huge checkpoints).

    Raises:
        CheckpointCorruptError: a file is missing, truncated or altered.
        CheckpointError: a file verifies but cannot be read (e.g. written with unsafe objects).
    """
    path = Path(path)
    manifest = verify(path, check_hashes=check_hashes)
    files = manifest["files"]
    if manifest.get(PRUNED_KEY):
        raise CheckpointError(
            f"{path}: its {', '.join(manifest[PRUNED_KEY])} were deleted when the run ended "
            "(checkpoint.after_run: best): it can be exported, not resumed. Set "
            "checkpoint.after_run: all for runs you may want to extend"
        )
    if not has_weights(files, MODEL_STEM):
        raise CheckpointCorruptError(f"{path}: not a training checkpoint ({MODEL_FILE} missing)")
    sharded_optimizer = f"{SHARDED_OPTIMIZER_DIR}/{METADATA_FILE}" in files
    for required in ("optimizer.pt", "scheduler.pt", "rng.pt", TRAIN_STATE_FILE):
        if required == "optimizer.pt" and sharded_optimizer:
            continue
        if required not in files:
            raise CheckpointCorruptError(f"{path}: not a training checkpoint ({required} missing)")

    def torch_file(name: str) -> Any:
        fname = f"{name}.pt"
        if fname not in files:
            return None
        try:
            return torch.load(path / fname, map_location=map_location, weights_only=True)
        except Exception as e:
            # An UnpicklingError or RuntimeError message names the object that was refused.
            raise CheckpointError(f"{path / fname}: cannot be loaded safely: {e}") from None

    def json_file(name: str) -> Any:
        return read_json(path / name, RECORDS_BYTES, error=CheckpointCorruptError)

    def config_text() -> str:
        try:
            return read_yaml_text(path / "config.yaml")
        except ValueError as e:
            raise CheckpointCorruptError(f"{path / 'config.yaml'}: {e}") from None

    def weights(name: str) -> dict[str, torch.Tensor] | None:
        if not has_weights(files, name.removesuffix(".safetensors")):
            return None
        try:
            return load_weights(path / name, device=map_location)
        except SafetensorError as e:
            raise CheckpointCorruptError(
                f"{path / name}: not a readable safetensors file: {e}"
            ) from None

    objs = {name: torch_file(name) for name in TORCH_FILES}
    has_tokenizer = (
        any(f.startswith("tokenizer/") for f in files) or (path / TOKENIZER_DIR).is_dir()
    )
    return TrainingCheckpoint(
        path=path,
        manifest=manifest,
        model=weights(MODEL_FILE),
        ema=weights(EMA_FILE),
        optimizer=objs["optimizer"],
        scheduler=objs["scheduler"],
        scaler=objs["scaler"],
        rng=objs["rng"],
        train_state=json_file(TRAIN_STATE_FILE),
        callbacks=json_file("callbacks.json") if "callbacks.json" in files else {},
        config_yaml=config_text() if "config.yaml" in files else "",
        tokenizer_dir=path / TOKENIZER_DIR if has_tokenizer else None,
        optimizer_dir=path / SHARDED_OPTIMIZER_DIR if sharded_optimizer else None,
    )
