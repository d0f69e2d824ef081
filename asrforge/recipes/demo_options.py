"""What ``asrforge demo`` is asked for: its options and its configs' names."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG = "demo.yaml"
MULTI_CONFIG = "demo-multilingual.yaml"
"""``asrforge demo --matrix``: a from-scratch tiny model per language through the matrix."""
BASE_CONFIG = "demo-base.yaml"
"""``asrforge demo --multilingual``: Whisper base taught two languages under a guard of five."""
LANGUAGE_CONFIGS = {"es": "demo-es.yaml"}
"""``asrforge demo --language``: the languages tiny.en can be taught, and the config of each."""


@dataclass(frozen=True)
class DemoOptions:
    """What a demo run was asked for (``asrforge demo``'s options)."""

    quick: bool = False
    """A CI-sized run of the same steps."""
    steps: int | None = None
    """Fine-tuning steps (``train.max_steps``); None: the config's."""
    config: Path | None = None
    """The training config; None: the demo's own."""
    out: Path | None = None
    """The demo directory; None: the config's output_dir plus a time stamp."""
    workers: int | None = None
    """espeak-ng processes; None: one per CPU."""
    overrides: tuple[str, ...] = ()
    """``dotted.key=value`` overrides of the training config."""
    language: str = "en"
    """The language tiny.en is fine-tuned on: ``en``, or one of :data:`LANGUAGE_CONFIGS` (a new
    language, under a guard on English)."""
