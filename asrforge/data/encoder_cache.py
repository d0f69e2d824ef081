"""Caching the frozen part of the encoder for partial fine-tuning.

When the encoder, or its lower part (``model.train_encoder_layers``, see
``asrforge.model.partial``), is frozen, its output for an utterance never changes, so it is
computed once, stored on disk as a memory-mapped ``.npy`` (one row per utterance) and read back
every epoch: training then costs only the trained part. The cache directory is keyed by a
description of what produced the rows (where the frozen part ends, the sha256 of its weights, the
precision), written next to them as ``producer.json``; each row is keyed by the sha256 of the
utterance's audio bytes. So a cache is reused across runs and configs exactly when it is valid,
and the caches of a frozen encoder and of a frozen lower part never collide.

A build writes the rows to a fresh ``states-<id>.npy`` and then replaces ``index.json``, which
names that file: a killed build leaves the previous cache intact, and runs sharing a cache never
pair one build's index with another build's rows (the last index written wins).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from asrforge.checkpoint.atomic import atomic_write_text, remove_stale
from asrforge.data.cache_files import copy_rows, new_data_file

log = logging.getLogger(__name__)


def producer_key(producer: Mapping[str, str]) -> str:
    """The cache directory's name: the first 20 hex digits of the sha256 of ``producer``."""
    return hashlib.sha256(json.dumps(dict(producer), sort_keys=True).encode()).hexdigest()[:20]


class EncoderCache:
    """Rows of the frozen part's output, ``(positions, d_model)`` float32 each, looked up by
    audio key."""

    def __init__(self, directory: Path, index: dict[str, int], states: str):
        self.directory = Path(directory)
        self.index = index
        self.states = states  # the rows' file in ``directory``, named by index.json
        self._states: np.ndarray | None = None  # opened lazily (once per DataLoader worker)

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def row(self, key: str) -> np.ndarray:
        if self._states is None:
            self._states = np.load(self.directory / self.states, mmap_mode="r")
        return np.array(self._states[self.index[key]])  # a private, writable copy of the row

    def __getstate__(self):  # DataLoader workers reopen the memmap themselves
        return {**self.__dict__, "_states": None}

    @classmethod
    def build(
        cls,
        root: Path,
        encoder: torch.nn.Module,
        dataset,
        *,
        forward: Callable[[torch.Tensor], torch.Tensor],
        producer: Mapping[str, str],
        batch_size: int,
        device: torch.device | str = "cpu",
        autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> EncoderCache:
        """Open the cache of ``producer`` under ``root``, computing the rows it lacks.

        Args:
            encoder: the module that holds the frozen part (in eval mode while rows are computed).
            dataset: a ``SpeechDataset`` whose utterances carry ``audio_key``.
            forward: the frozen part, log-mels (batch, n_mels, frames) -> states
                (batch, positions, d_model).
            producer: everything the rows depend on besides the audio (e.g.
                ``asrforge.model.partial.frozen_part_id`` plus the precision); it names the
                directory (:func:`producer_key`).
            autocast: the training loop's autocast, so cached states equal what the frozen part
                would compute inside a training step.
        """
        t0 = time.perf_counter()
        directory = Path(root) / producer_key(producer)
        directory.mkdir(parents=True, exist_ok=True)
        about = directory / "producer.json"
        if not about.is_file():
            atomic_write_text(about, json.dumps(dict(producer), indent=1, sort_keys=True) + "\n")
        index_file = directory / "index.json"
        meta = json.loads(index_file.read_text()) if index_file.is_file() else {}
        states: str | None = meta.get("states")
        index: dict[str, int] = meta.get("rows", {}) if states else {}
        wanted = {u.audio_key: i for i, u in enumerate(dataset.utts)}
        missing = [i for key, i in wanted.items() if key not in index]
        if not missing:
            log.info("encoder cache: all %d utterances cached in %s", len(wanted), directory)
            return cls(directory, index, states)
        log.info("encoder cache: computing %d of %d utterances into %s", len(missing), len(wanted), directory)
        was_training = encoder.training
        encoder.eval()
        old = np.load(directory / states, mmap_mode="r") if index else None
        n_total = len(index) + len(missing)
        try:
            with new_data_file(directory, "states", "npy") as (tmp, new_states), torch.no_grad():
                out, pos = None, len(index)
                for start in range(0, len(missing), batch_size):
                    items = [dataset.features_of(i) for i in missing[start : start + batch_size]]
                    feats = torch.stack([torch.from_numpy(f) for f in items]).to(device)
                    with autocast() if autocast is not None else contextlib.nullcontext():
                        hidden = forward(feats).float().cpu().numpy()
                    if out is None:  # the row shape is known now: the whole file at once
                        out = np.lib.format.open_memmap(
                            tmp, mode="w+", dtype=np.float32, shape=(n_total, *hidden.shape[1:])
                        )
                        if old is not None:
                            copy_rows(out, old)
                    out[pos : pos + len(hidden)] = hidden
                    pos += len(hidden)
                out.flush()
                del out
        finally:
            encoder.train(was_training)
            del old
        new_index = dict(index)
        for j, i in enumerate(missing):
            new_index[dataset.utts[i].audio_key] = len(index) + j
        atomic_write_text(index_file, json.dumps({"states": new_states, "rows": new_index}))
        remove_stale(directory, "states-*.npy", keep=new_states)
        log.info("encoder cache: %d rows written in %.1f s", len(missing), time.perf_counter() - t0)
        return cls(directory, new_index, new_states)
