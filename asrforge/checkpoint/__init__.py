"""Checkpoints that survive anything: manifests, training checkpoints, the checkpoints directory
of a run (latest, best, top-k, rotation) and averaging. Their atomic writes are
``asrforge.io.atomic``; vocabulary resize is ``asrforge.model.resize``.

The training loop needs :class:`CheckpointManager` (save, ``latest_valid``, state),
:func:`load_training_checkpoint` and the RNG helpers; the rest is for tools and tests.

Lazy: importing one submodule does not import torch through this package; each name below is
imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asrforge._lazy import lazy_exports

_EXPORTS = {
    "average_checkpoints": "asrforge.checkpoint.average",
    "average_top_k": "asrforge.checkpoint.average",
    "CheckpointManager": "asrforge.checkpoint.manager",
    "FORMAT_VERSION": "asrforge.checkpoint.manifest",
    "read_manifest": "asrforge.checkpoint.manifest",
    "verify": "asrforge.checkpoint.manifest",
    "write_manifest": "asrforge.checkpoint.manifest",
    "CheckpointContents": "asrforge.checkpoint.training",
    "TrainingCheckpoint": "asrforge.checkpoint.training",
    "capture_rng_state": "asrforge.checkpoint.training",
    "load_training_checkpoint": "asrforge.checkpoint.training",
    "load_weights": "asrforge.checkpoint.training",
    "restore_rng_state": "asrforge.checkpoint.training",
    "save_training_checkpoint": "asrforge.checkpoint.training",
    "save_weights": "asrforge.checkpoint.training",
}

__all__ = [
    "FORMAT_VERSION",
    "CheckpointContents",
    "CheckpointManager",
    "TrainingCheckpoint",
    "average_checkpoints",
    "average_top_k",
    "capture_rng_state",
    "load_training_checkpoint",
    "load_weights",
    "read_manifest",
    "restore_rng_state",
    "save_training_checkpoint",
    "save_weights",
    "verify",
    "write_manifest",
]

if TYPE_CHECKING:
    from asrforge.checkpoint.average import average_checkpoints, average_top_k
    from asrforge.checkpoint.manager import CheckpointManager
    from asrforge.checkpoint.manifest import FORMAT_VERSION, read_manifest, verify, write_manifest
    from asrforge.checkpoint.training import (
        CheckpointContents,
        TrainingCheckpoint,
        capture_rng_state,
        load_training_checkpoint,
        load_weights,
        restore_rng_state,
        save_training_checkpoint,
        save_weights,
    )


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
