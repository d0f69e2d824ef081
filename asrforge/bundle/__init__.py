"""Inference bundles: export a trained model, load it with no training code, transcribe.

Lazy: ``import asrforge.bundle`` (which the CLI does to register its commands) imports nothing
heavy; each name is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asrforge._lazy import lazy_exports

_EXPORTS = {
    "Bundle": "asrforge.bundle.inference",
    "Transcript": "asrforge.bundle.recognize",
    "Segment": "asrforge.model.longform",
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
    "Segment",
    "Transcript",
    "bundle_from_checkpoint",
    "bundle_from_pretrained",
    "export_bundle",
    "load_bundle",
    "verify_bundle",
]

if TYPE_CHECKING:
    from asrforge.bundle.export import bundle_from_checkpoint, bundle_from_pretrained, export_bundle
    from asrforge.bundle.inference import Bundle
    from asrforge.bundle.load import load_bundle, verify_bundle
    from asrforge.bundle.recognize import Transcript
    from asrforge.bundle.schema import BUNDLE_VERSION, InferenceConfig
    from asrforge.model.longform import Segment


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
