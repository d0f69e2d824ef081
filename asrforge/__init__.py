"""asrforge: fine-tune Whisper-family speech recognition models; evaluate, select, export.

The public surface is the names in ``__all__``; everything else may change. Imports are lazy
(PEP 562 ``__getattr__``): ``import asrforge`` costs nothing, and ``asrforge.load_bundle``
imports the inference side only, never the training loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asrforge._lazy import lazy_exports

_EXPORTS = {
    "load_config": "asrforge.config",
    "TrainConfig": "asrforge.config",
    "Trainer": "asrforge.train.loop",
    "build_callbacks": "asrforge.callbacks",
    "Callback": "asrforge.train.events",
    "load_bundle": "asrforge.bundle.load",
    "Bundle": "asrforge.bundle.inference",
    "export_bundle": "asrforge.bundle.export",
    "wer": "asrforge.text",
    "cer": "asrforge.text",
    "normalize": "asrforge.text",
    "import_ct2": "asrforge.convert.ct2",
    "average_checkpoints": "asrforge.checkpoint.average",
}

__all__ = [
    "Bundle",
    "Callback",
    "TrainConfig",
    "Trainer",
    "average_checkpoints",
    "build_callbacks",
    "cer",
    "export_bundle",
    "import_ct2",
    "load_bundle",
    "load_config",
    "normalize",
    "wer",
]

if TYPE_CHECKING:
    from asrforge.bundle.export import export_bundle
    from asrforge.bundle.inference import Bundle
    from asrforge.bundle.load import load_bundle
    from asrforge.callbacks import build_callbacks
    from asrforge.checkpoint.average import average_checkpoints
    from asrforge.config import TrainConfig, load_config
    from asrforge.convert.ct2 import import_ct2
    from asrforge.text import cer, normalize, wer
    from asrforge.train.events import Callback
    from asrforge.train.loop import Trainer


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
