"""What every section of the run's schema is built from: :class:`Section` (unknown fields are
errors, each field's docstring is its documentation) and the field type of a path or Hub id."""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


def _as_written(value: Any) -> Any:
    """A path given as a ``Path`` kept as text, so ``./name`` stays a path, never a Hub id."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


PathOrHubId = Annotated[str, BeforeValidator(_as_written)]
"""A local path or a Hugging Face Hub id (``org/name``, ``org/name@revision``), kept as written:
an existing path wins, and ``./name`` is always a path (asrforge.hub)."""


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )
