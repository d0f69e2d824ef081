"""Encoder-output caching for partial fine-tuning.

When the encoder is frozen its output for an utterance never changes, so it is computed once,
stored on disk as a memory-mapped ``.npy`` (one row per utterance) and read back every epoch:
training then costs only the decoder. The cache directory is keyed by a hash of the encoder's
weights and each row by the sha256 of the utterance's audio bytes, so a cache is reused across
runs and configs exactly when it is valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from asrforge.checkpoint.atomic import atomic_write_text, fsync_dir

log = logging.getLogger(__name__)


def encoder_weights_hash(encoder: torch.nn.Module) -> str:
    """sha256 over the encoder's state dict (names, shapes, dtypes and bytes)."""
    h = hashlib.sha256()
    for name, t in sorted(encoder.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class EncoderCache:
    """Rows of encoder output, ``(frames, d_model)`` float32 each, looked up by audio key."""

    def __init__(self, directory: Path, index: dict[str, int]):
        self.directory = Path(directory)
        self.index = index
        self._states: np.ndarray | None = None  # opened lazily (once per DataLoader worker)

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def row(self, key: str) -> np.ndarray:
        if self._states is None:
            self._states = np.load(self.directory / "states.npy", mmap_mode="r")
        return np.array(self._states[self.index[key]])  # a private, writable copy of the row

    def __getstate__(self):  # DataLoader workers reopen the memmap themselves
        return {"directory": self.directory, "index": self.index, "_states": None}

    @classmethod
    def build(
        cls,
        root: Path,
        encoder: torch.nn.Module,
        dataset,
        *,
        batch_size: int,
        device: torch.device | str = "cpu",
        autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> EncoderCache:
        """Open the cache for ``encoder`` under ``root``, computing the rows it lacks.

        Args:
            dataset: a ``SpeechDataset`` whose utterances carry ``audio_key``.
            autocast: the training loop's autocast, so cached states equal what the encoder
                would compute inside a training step.
        """
        t0 = time.perf_counter()
        directory = Path(root) / encoder_weights_hash(encoder)[:20]
        directory.mkdir(parents=True, exist_ok=True)
        index_file = directory / "index.json"
        index: dict[str, int] = json.loads(index_file.read_text()) if index_file.is_file() else {}
        wanted = {u.audio_key: i for i, u in enumerate(dataset.utts)}
        missing = [i for key, i in wanted.items() if key not in index]
        if not missing:
            log.info("encoder cache: all %d utterances cached in %s", len(wanted), directory)
            return cls(directory, index)
        log.info("encoder cache: computing %d of %d utterances into %s", len(missing), len(wanted), directory)
        was_training = encoder.training
        encoder.eval()
        rows: list[np.ndarray] = []
        with torch.no_grad():
            for start in range(0, len(missing), batch_size):
                items = [dataset.features_of(i) for i in missing[start : start + batch_size]]
                feats = torch.stack([torch.from_numpy(f) for f in items]).to(device)
                with autocast() if autocast is not None else contextlib.nullcontext():
                    hidden = encoder(feats).last_hidden_state
                rows.extend(hidden.float().cpu().numpy())
        encoder.train(was_training)
        old = np.load(directory / "states.npy", mmap_mode="r") if index else None
        n_total = len(index) + len(rows)
        tmp = directory / f".states-{os.getpid()}.npy"
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n_total, *rows[0].shape))
        if old is not None:
            out[: len(index)] = old
        new_index = dict(index)
        for j, i in enumerate(missing):
            out[len(index) + j] = rows[j]
            new_index[dataset.utts[i].audio_key] = len(index) + j
        out.flush()
        del out, old
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, directory / "states.npy")
        fsync_dir(directory)
        atomic_write_text(index_file, json.dumps(new_index))
        log.info("encoder cache: %d rows written in %.1f s", len(rows), time.perf_counter() - t0)
        return cls(directory, new_index)
