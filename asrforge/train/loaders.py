"""The run's data during training: the training batches of an epoch from a data position on
(text-only ones interleaved), and the evaluation batches, each process's share of them."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from asrforge.config import TrainConfig
from asrforge.data.dataset import (
    Batches,
    Collator,
    JoinedBatches,
    SpeechDataset,
    epoch_batches,
    eval_batches,
    worker_pieces,
)
from asrforge.data.packing import Packing
from asrforge.data.sampling import LanguageSampling
from asrforge.data.stream import StreamedSplit
from asrforge.data.text_only import TextBatches, interleave
from asrforge.data.workers import StopSignalLoader, ignore_stop_signals, worker_count
from asrforge.evaluation.batch_size import eval_batch_size


@dataclass
class RunLoaders:
    """Serves a built run's data sets as DataLoaders (see ``asrforge.train.setup``)."""

    cfg: TrainConfig
    accelerator: Any
    train_set: SpeechDataset | StreamedSplit
    eval_set: SpeechDataset
    collator: Collator
    text: TextBatches | None = None
    packing: Packing | None = None
    sampling: LanguageSampling | None = None
    """``data.sampling``: each epoch's utterances drawn by language."""
    _eval_loaders: dict[int, JoinedBatches] = field(default_factory=dict, repr=False)

    @property
    def loader_workers(self) -> int:
        """DataLoader workers per process: ``data.num_workers``, ``auto`` resolved for this
        device and the training processes on this machine (torchrun's ``LOCAL_WORLD_SIZE``)."""
        here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return worker_count(self.cfg.data.num_workers, self.accelerator.device.type, here)

    @property
    def pin_memory(self) -> bool:
        """Batches in page-locked memory, so copies to a GPU run while it computes."""
        return self.accelerator.device.type == "cuda"

    def train_loader(
        self, epoch: int, start_batch: int, micro_batch: int = 0, text_position: dict | None = None
    ) -> Iterable[dict]:
        """The batches of ``epoch`` from ``start_batch`` on (resume skips by index, no I/O).

        With text-only batches, they are interleaved (see ``asrforge.data.text_only``):
        ``micro_batch`` is the run-wide index of the next micro-batch, ``text_position`` where
        the text stream stands (``TrainState.text_position``).
        """
        acc = self.accelerator
        if isinstance(self.train_set, StreamedSplit):
            loader = self.train_set.loader(
                epoch,
                start_batch,
                rank=acc.process_index,
                world=acc.num_processes,
                workers=self.loader_workers,
                pin_memory=self.pin_memory,
            )
            return self._with_text(loader, micro_batch, text_position)
        # packed: the epoch's windows (a pure function of seed and epoch) are what is batched
        self.train_set.epoch = epoch  # augmentation draws (each epoch's loader is new)
        train_set = self.packing.dataset(epoch) if self.packing is not None else self.train_set
        if self.sampling is not None and self.packing is None:  # drawn by language (packed:
            # the draw is what the windows hold)
            order = self.sampling.order(epoch)
            batches = Batches(order, self.cfg.data.batch_size)[
                acc.process_index :: acc.num_processes
            ]
        else:
            batches = epoch_batches(
                len(train_set),
                self.cfg.data.batch_size,
                self.cfg.seed,
                epoch,
                acc.process_index,
                acc.num_processes,
            )
        loader = self._loader(train_set, batches[start_batch:], seed=self.cfg.seed * 7919 + epoch)
        return self._with_text(loader, micro_batch, text_position)

    def _with_text(self, loader: Iterable[dict], micro_batch: int, text_position: dict | None):
        """``loader``'s speech batches, with text-only ones interleaved when there are some."""
        if self.text is None:
            return loader
        return interleave(
            loader,
            self.text.batches(text_position),
            seed=self.cfg.seed,
            asr_ratio=self.cfg.data.asr_ratio,
            start=micro_batch,
        )

    @property
    def batches_per_epoch(self) -> int:
        """Speech micro-batches of one epoch on this process (as :meth:`train_loader` cuts them).
        Packed, the windows of the epoch :meth:`train_loader` last composed are batched, not the
        utterances (about a ninth as many batches for 3 s clips in 30 s windows). Streamed, the
        epoch :meth:`train_loader` last served (with ``data.sampling`` each has its length)."""
        acc = self.accelerator
        if isinstance(self.train_set, StreamedSplit):  # rows (skipped ones too) make batches
            return self.train_set.batches_per_epoch(acc.process_index, acc.num_processes)
        items = len(self.train_set) if self.packing is None else len(self.packing.current_windows())
        n_batches = -(-items // self.cfg.data.batch_size)
        return len(range(acc.process_index, n_batches, acc.num_processes))

    def eval_loader(self, batch_size: int | None = None) -> JoinedBatches:
        """The evaluation split's batches of ``batch_size`` (default ``data.eval_batch_size``
        without probing: ``auto`` is ``data.batch_size``), each read by the loader's workers
        together, a piece each (:func:`worker_pieces`). One loader per batch size serves every
        evaluation of the run, its workers kept between them (:meth:`close` ends them)."""
        acc = self.accelerator
        data = self.cfg.data
        bs = batch_size or eval_batch_size(data.eval_batch_size, data.batch_size)
        if bs not in self._eval_loaders:
            batches = eval_batches(self.eval_set.utts, bs)[acc.process_index :: acc.num_processes]
            pieces, counts = worker_pieces(batches, self.loader_workers)
            # A new loader would start (fork) its workers at every evaluation, which a GPU
            # evaluation of a few batches mostly waits on.
            # Joined batches are new tensors, pinned after the join; whole ones the loader pins.
            joined = any(k > 1 for k in counts)
            pin = self.pin_memory and not joined
            loader = self._loader(self.eval_set, pieces, persistent=True, pin=pin)
            self._eval_loaders[bs] = JoinedBatches(
                loader, counts, self.collator, self.pin_memory and joined
            )
        return self._eval_loaders[bs]

    def close(self) -> None:
        """End the evaluation loaders' workers (a dropped loader shuts its workers down)."""
        self._eval_loaders.clear()

    def _loader(
        self, ds, batches, seed: int = 0, persistent: bool = False, pin: bool | None = None
    ) -> DataLoader:
        """A DataLoader of ``batches`` of ``ds``; ``pin``: into page-locked memory (default:
        :attr:`pin_memory`)."""
        workers = self.loader_workers
        # A private generator: creating the loader's iterator must not draw from the global RNG
        # (dropout's), or a resumed run would see different dropout masks.
        return StopSignalLoader(
            ds,
            batch_sampler=batches,
            collate_fn=self.collator,
            num_workers=workers,
            persistent_workers=persistent and workers > 0,
            prefetch_factor=4 if workers else None,
            pin_memory=self.pin_memory if pin is None else pin,
            generator=torch.Generator().manual_seed(seed),
            worker_init_fn=ignore_stop_signals,  # a SIGTERM is the training process's to handle
        )
