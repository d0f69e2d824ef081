"""Every field of a config schema by YAML path, walked here rather than taken from
asrforge.config.reference, so the tests of the reference do not trust its own walk."""

from __future__ import annotations

import typing

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def schema_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """Every field of ``model`` and of every model reachable from it (through ``X | None``,
    ``list[X]``, ``dict[str, X]``, ``tuple``), by YAML path: ``checkpoint.keep_best[].metric``,
    ``selection.groups.<name>.policy``."""
    fields = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{info.alias or name}"
        fields.append((path, info))
        for section, below in _sections(info.annotation, path):
            fields += schema_fields(section, below)
    return fields


def _sections(annotation, path: str) -> list[tuple[type[BaseModel], str]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, path + ".")]
    origin = typing.get_origin(annotation)
    below = {list: path + "[]", dict: path + ".<name>"}.get(origin, path)
    return [s for arg in typing.get_args(annotation) for s in _sections(arg, below)]
