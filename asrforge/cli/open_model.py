"""Any model directory a command names opened as a :class:`~asrforge.bundle.Bundle`."""

from __future__ import annotations

import sys
from pathlib import Path

from asrforge.errors import UserError

# The bundle code loads torch and transformers: it is imported inside the function, so building
# the parser (`asrforge --help`) does not wait for it.


def open_model(model: str | Path, weights: str | None = None, *, option: str = "model"):
    """A :class:`~asrforge.bundle.Bundle` from a bundle (verified by ``load_bundle``), a training
    checkpoint or run (verified against its manifest), or a plain transformers Whisper
    directory, which has no manifest and is loaded unverified (said on stderr); each a local
    directory or a Hugging Face Hub id (``org/name[@revision]``, :mod:`asrforge.hub`).

    Args:
        option: the command's argument that names ``model``, as its messages name it.
    """
    from asrforge.bundle.export import bundle_from_checkpoint, resolve_source
    from asrforge.bundle.load import load_bundle
    from asrforge.bundle.schema import INFERENCE_CONFIG
    from asrforge.hub import resolve_model

    resolved = resolve_model(model, field=option)
    path = resolved.path
    if resolved.ref is not None and (path / INFERENCE_CONFIG).is_file():
        return load_bundle(model)  # the whole repository, every file verified
    if path.is_file():
        raise UserError(f"{path}: a file, not a bundle or model directory")
    if not path.is_dir():
        raise UserError(f"{path}: no such directory")
    if (path / INFERENCE_CONFIG).is_file():
        if weights is not None:
            raise UserError("--weights applies to checkpoints; a bundle has one set of weights")
        return load_bundle(path)
    kind, _resolved = resolve_source(path)
    if kind == "pretrained":
        print(
            f"asrforge: {model}: a transformers directory, not a bundle: loaded without "
            "verification (no manifest); `asrforge export` makes a verified bundle",
            file=sys.stderr,
        )
    return bundle_from_checkpoint(path, weights)
