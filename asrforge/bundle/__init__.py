"""Inference bundles: export a trained model, load it with no training code, transcribe.

Lazy: ``import asrforge.bundle`` (which the CLI does to register its commands) imports nothing
heavy; each name is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Bundle": "asrforge.bundle.load",
    "Transcript": "asrforge.bundle.load",
    "load_bundle": "asrforge.bundle.load",
    "verify_bundle": "asrforge.bundle.load",
    "export_bundle": "asrforge.bundle.export",
    "bundle_from_pretrained": "asrforge.bundle.export",
    "bundle_from_checkpoint": "asrforge.bundle.export",
    "InferenceConfig": "asrforge.bundle.schema",
    "BUNDLE_VERSION": "asrforge.bundle.schema",
}

__all__ = [
    "BUNDLE_VERSION",
    "Bundle",
    "InferenceConfig",
    "Transcript",
    "bundle_from_checkpoint",
    "bundle_from_pretrained",
    "export_bundle",
    "load_bundle",
    "verify_bundle",
]

if TYPE_CHECKING:
    from asrforge.bundle.export import bundle_from_checkpoint, bundle_from_pretrained, export_bundle
    from asrforge.bundle.load import Bundle, Transcript, load_bundle, verify_bundle
    from asrforge.bundle.schema import BUNDLE_VERSION, InferenceConfig


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'asrforge.bundle' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
