"""Caching the frozen part of the encoder for partial fine-tuning.

How it works: docs/data.md, "The encoder cache (`data/cache/encoder.py`)".
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

from asrforge.data.cache.files import NewDataFile, SharedData, copy_rows, remove_unused
from asrforge.io.atomic import atomic_write_text
from asrforge.io.small_files import RECORDS_BYTES, read_json

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
        self.data = SharedData(self.directory / states, "npy")  # locked while this object reads

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def row(self, key: str) -> np.ndarray:
        return np.array(self.data.array[self.index[key]])  # a private, writable copy of the row

    def hold(self) -> EncoderCache:
        """Open and share-lock the rows' file now, so no other run's build removes it while this
        process (and its DataLoader workers) may read it."""
        self.data.array  # noqa: B018 - opens and locks
        return self

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
        try:
            meta = read_json(index_file, RECORDS_BYTES, error=ValueError)
        except FileNotFoundError:
            meta = {}
        except ValueError as e:
            log.warning("encoder cache %s unusable (%s): starting it afresh", directory, e)
            meta = {}
        have = None
        if isinstance(meta, dict) and meta.get("states"):
            try:
                have = cls(directory, meta["rows"], meta["states"]).hold()
            except (OSError, ValueError, KeyError) as e:
                log.warning("encoder cache %s unusable (%s): starting it afresh", directory, e)
        index: dict[str, int] = have.index if have is not None else {}
        wanted = {u.audio_key: i for i, u in enumerate(dataset.utts)}
        missing = [i for key, i in wanted.items() if key not in index]
        if not missing:
            log.info("encoder cache: all %d utterances cached in %s", len(wanted), directory)
            return have
        log.info("encoder cache: computing %d of %d utterances into %s", len(missing), len(wanted), directory)
        was_training = encoder.training
        encoder.eval()
        n_total = len(index) + len(missing)  # rows of clips that fail to decode stay unused
        new_index = dict(index)
        failed = 0
        try:
            with NewDataFile(directory, "states", "npy") as new, torch.no_grad():
                out, pos = None, len(index)
                for start in range(0, len(missing), batch_size):
                    items, keys = [], []
                    for i in missing[start : start + batch_size]:
                        try:
                            items.append(dataset.features_of(i))
                        except Exception:  # noqa: BLE001
                            # An undecodable or NaN clip stays uncached, and the data set drops and
                            # reports it.
                            failed += 1
                            continue
                        keys.append(dataset.utts[i].audio_key)
                    if not items:
                        continue
                    feats = torch.stack([torch.from_numpy(f) for f in items]).to(device)
                    with autocast() if autocast is not None else contextlib.nullcontext():
                        hidden = forward(feats).float().cpu().numpy()
                    # The row shape is known once the first batch is through, so the whole file is
                    # made then.
                    if out is None:
                        out = np.lib.format.open_memmap(
                            new.tmp, mode="w+", dtype=np.float32, shape=(n_total, *hidden.shape[1:])
                        )
                        if have is not None:
                            # used rows are 0..len(index)-1; an undecodable clip's tail row is not
                            copy_rows(out, have.data.array[: len(index)])
                    out[pos : pos + len(hidden)] = hidden
                    new_index.update({key: pos + k for k, key in enumerate(keys)})
                    pos += len(hidden)
                # With no clip decoded, the cache stays as it was.
                if out is None:
                    log.warning("encoder cache: none of %d clips could be decoded", len(missing))
                    return have
                out.flush()
                del out
                new.publish(index_file, {"states": new.name, "rows": new_index})
                cache = cls(directory, new_index, new.name).hold()  # before the writer's lock goes
        finally:
            encoder.train(was_training)
        if have is not None:
            have.data.close()
        remove_unused(directory, "states-*.npy", keep=cache.states)
        log.info("encoder cache: %d rows written in %.1f s%s", len(missing) - failed,
                 time.perf_counter() - t0, f" ({failed} clips not decodable)" if failed else "")
        return cache
