"""Checkpoints that survive anything: atomic writes, manifests, training checkpoints, the
checkpoints directory of a run (latest, best, top-k, rotation), averaging and vocabulary resize.

The training loop needs :class:`CheckpointManager` (save, ``latest_valid``, state),
:func:`load_training_checkpoint` and the RNG helpers; the rest is for tools and tests.
"""

from asrforge.checkpoint.atomic import (
    atomic_directory,
    atomic_write_bytes,
    atomic_write_text,
    fsync_dir,
    recover_interrupted,
)
from asrforge.checkpoint.average import average_checkpoints, average_top_k
from asrforge.checkpoint.manager import CheckpointManager
from asrforge.checkpoint.manifest import FORMAT_VERSION, read_manifest, verify, write_manifest
from asrforge.checkpoint.resize import adapt_state_dict
from asrforge.checkpoint.training import (
    TrainingCheckpoint,
    capture_rng_state,
    load_training_checkpoint,
    load_weights,
    restore_rng_state,
    save_training_checkpoint,
    save_weights,
)

__all__ = [
    "FORMAT_VERSION",
    "CheckpointManager",
    "TrainingCheckpoint",
    "adapt_state_dict",
    "atomic_directory",
    "atomic_write_bytes",
    "atomic_write_text",
    "average_checkpoints",
    "average_top_k",
    "capture_rng_state",
    "fsync_dir",
    "load_training_checkpoint",
    "load_weights",
    "read_manifest",
    "recover_interrupted",
    "restore_rng_state",
    "save_training_checkpoint",
    "save_weights",
    "verify",
    "write_manifest",
]
