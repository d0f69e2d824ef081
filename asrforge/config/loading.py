"""A run's config loaded from YAML plus ``key=value`` overrides.

:func:`load_config` collects every problem and raises one :class:`ConfigError` that names each
by its YAML path, e.g. ``optim.lr: must be > 0, got -1``.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from asrforge.config.hf_names import hf_hint
from asrforge.config.schema import TrainConfig
from asrforge.config.units import short_repr
from asrforge.config.yaml_limits import DuplicateKeys, load_yaml, read_yaml_text
from asrforge.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem the user must fix. ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        head = f"invalid config {source}" if source else "invalid config"
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in problems))


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    data: dict[str, Any] | None = None,
) -> TrainConfig:
    """Load a YAML file (or a dict) and apply ``dotted.key=value`` overrides.

    Raises:
        ConfigError: listing every problem with its YAML path.
    """
    source = str(path) if path is not None else None
    if isinstance(overrides, str | dict):  # a str would be applied one character at a time
        raise ConfigError(
            [f"overrides: a list of 'dotted.key=value' strings, got a {type(overrides).__name__}"
             f" (e.g. [{'optim.lr=2e-5'!r}])"], source,
        )  # fmt: skip
    if data is None:
        if path is None:
            raise ConfigError(["no config file given"])
        data = read_yaml_mapping(path)
        data.setdefault("config_id", Path(path).stem)
    data = json.loads(json.dumps(data, default=str))  # a private deep copy
    problems = []
    for item in overrides or []:
        try:
            apply_override(data, item)
        except DuplicateKeys as e:
            problems += e.problems
        except ValueError as e:
            problems.append(str(e))
    problems += huge_integers(data)
    if problems:
        raise ConfigError(problems, source)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e, TrainConfig), source) from None


MAX_INTEGER = 2**63 - 1
"""Largest integer a config may hold (int64: what torch, numpy and the OS take)."""


def huge_integers(data: Any, path: str = "") -> list[str]:
    """One ``yaml.path: ... larger than 2^63 - 1`` line per integer of ``data`` (a config tree)
    beyond :data:`MAX_INTEGER`: converted to a float or a tensor, it overflows."""
    if isinstance(data, dict):
        return [line for k, v in data.items() for line in huge_integers(v, f"{path}{k}.")]
    if isinstance(data, list):
        return [line for i, v in enumerate(data) for line in huge_integers(v, f"{path}{i}.")]
    if isinstance(data, int) and not isinstance(data, bool) and abs(data) > MAX_INTEGER:
        return [f"{path.rstrip('.')}: {short_repr(data)} is larger than 2^63 - 1"]
    return []


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping.

    Raises:
        ConfigError: the file is missing or a directory, not UTF-8, not YAML (or beyond the
            bounds of :mod:`asrforge.config.yaml_limits`), or not a mapping.
    """
    p, source = Path(path), str(path)
    if p.is_dir():
        raise ConfigError([f"{p}: is a directory, not a config file"], source)
    if not p.is_file():
        raise ConfigError([f"{p}: {_missing_file(p)}"], source)
    try:
        data = load_yaml(read_yaml_text(p)) or {}
    except DuplicateKeys as e:
        raise ConfigError(e.problems, source) from None
    except ValueError as e:
        raise ConfigError([str(e)], source) from None
    except OSError as e:
        raise ConfigError([f"cannot be read: {e.strerror}"], source) from None
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping, got {type(data).__name__}"], source)
    return data


def _missing_file(p: Path) -> str:
    """Why ``p``, which is no file or directory, cannot be read: a symlink that leads nowhere
    is named as one, since "no such file" beside a listed link misleads."""
    try:
        os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        if p.is_symlink():
            return f"a broken symlink (to {os.readlink(p)})"
        if e.errno != errno.ENOENT:
            return f"cannot be read: {e.strerror}"
    else:
        return "not a regular file"
    return "no such file"


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set ``item`` (``dotted.key=value``, the value read as YAML) in the config tree ``data``.

    Raises:
        ValueError: ``item`` is not ``dotted.key=value``, or its path crosses a value or a
            missing list item; :class:`DuplicateKeys` for a mapping value with a key twice.
    """
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"{item}: an override must look like dotted.key=value")
    try:
        value = load_yaml(raw, key) if raw != "" else ""
    except DuplicateKeys:
        raise
    except ValueError:
        value = raw
    if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
        # YAML 1.1 reads yes/no/on/off as booleans, but on a command line they are words.
        value = raw
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"{'.'.join(parts[: i + 1])}: no list item {part}")
            node = node[int(part)]
        else:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            node = nxt
        if not isinstance(node, dict | list):
            raise ValueError(f"{'.'.join(parts[: i + 1])}: is a value, not a section")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ValueError(f"{key}: no list item {last}")
        node[int(last)] = value
    else:
        node[last] = value


_OPS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}


def format_errors(err: ValidationError, root: type[BaseModel], prefix: str = "") -> list[str]:
    """Turn pydantic errors into ``yaml.path: what is wrong`` lines (``prefix``: the YAML path
    of ``root`` inside the whole config)."""
    lines = []
    pre = prefix.split(".") if prefix else []
    for e in err.errors():
        rel = [str(x) for x in e["loc"]]
        loc = pre + rel
        path = ".".join(loc) or "(top level)"
        kind, ctx = e["type"], e.get("ctx") or {}
        got = e.get("input")
        if kind == "extra_forbidden":
            msg = "unknown field"
            parent = _model_at(root, rel[:-1])
            # a TrainingArguments name in a run's config: say where it lives here (not in
            # other schemas that reuse this formatter, such as the matrix's)
            if _in_run_schema(root) and (hint := hf_hint(loc[-1])):
                msg += f" — {hint}"
            elif parent is not None:
                names = [f.alias or n for n, f in parent.model_fields.items()]
                close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
                if close:
                    msg += f" — did you mean {'.'.join(loc[:-1] + [close[0]])}?"
            lines.append(f"{path}: {msg}")
        elif kind in _OPS:
            bound = next(iter(ctx.values()))
            if isinstance(bound, float) and bound.is_integer():
                bound = int(bound)
            lines.append(f"{path}: must be {_OPS[kind]} {bound}, got {got!r}")
        elif kind == "missing":
            lines.append(f"{path}: required field is missing")
        elif kind == "literal_error":
            lines.append(f"{path}: must be one of {ctx.get('expected')}, got {got!r}")
        elif kind == "value_error":
            # Cross-field validators report "field: problem; field: problem" under their section.
            for piece in str(ctx.get("error", e["msg"])).split("; "):
                head, sep, rest = piece.partition(": ")
                if sep and all(part.isidentifier() for part in head.split(".")):
                    lines.append(f"{'.'.join(loc + [head])}: {rest}")
                else:
                    lines.append(f"{path}: {piece}")
        else:
            line = f"{path}: {e['msg'][0].lower() + e['msg'][1:]}, got {got!r}"
            # a TrainingArguments name that is a section here (optim=adamw_torch): say so
            hf_value = _in_run_schema(root) and len(loc) == 1 and isinstance(got, str)
            if hf_value and (hint := hf_hint(loc[0])):
                line += f" — {hint}"
            lines.append(line)
    return lines


def _in_run_schema(model: type[BaseModel]) -> bool:
    """Whether ``model`` is a section of the run's schema, whose modules are this package's."""
    return model.__module__.startswith(f"{__package__}.")


def _model_at(root: type[BaseModel], loc: list[str]) -> type[BaseModel] | None:
    model: Any = root
    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        candidates = [ann, *args]
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if model is None:
            return None
    return model
