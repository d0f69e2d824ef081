"""Built-in callbacks and the registry that builds them from the config's ``callbacks:`` list.

A config names callbacks by registered name (``- name: early_stopping`` plus options). A class
named by dotted path (``_target_: pkg.mod.Class``) is imported only when the person running the
command allows it (``--allow-external-callbacks`` or ``ASRFORGE_ALLOW_EXTERNAL_CALLBACKS=1``):
importing code named in a config is code execution.
"""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from asrforge.callbacks.averaging import AverageCheckpoints
from asrforge.callbacks.early_stopping import EarlyStopping
from asrforge.callbacks.loggers import LRMonitor, MetricsJsonl, TensorBoardLogger
from asrforge.callbacks.monitor import SystemMonitor
from asrforge.callbacks.options import Options
from asrforge.callbacks.progress import ProgressBar
from asrforge.callbacks.trackers import MLflowLogger, WandbLogger
from asrforge.config import ALLOW_EXTERNAL_HINT, ConfigError, TrainConfig, format_errors
from asrforge.train.events import Callback, eval_metric_names, state_keys

REGISTRY: dict[str, type[Callback]] = {
    cls.name: cls
    for cls in (
        MetricsJsonl,
        TensorBoardLogger,
        LRMonitor,
        ProgressBar,
        EarlyStopping,
        AverageCheckpoints,
        WandbLogger,
        MLflowLogger,
        SystemMonitor,
    )
}
# Always on unless listed with `enabled: false`: every run dir has metrics.jsonl and TB events.
DEFAULTS = ("lr_monitor", "system_monitor", "metrics_jsonl", "tensorboard", "progress")
ENRICHERS = ("lr_monitor", "system_monitor")
"""Defaults that add keys to the step metrics: they run before the loggers that write them."""


def register(cls: type[Callback]) -> type[Callback]:
    """Class decorator: make a callback available by its ``name`` in configs."""
    REGISTRY[cls.name] = cls
    return cls


def build_callbacks(
    cfg: TrainConfig,
    *,
    allow_external: bool = False,
    source: str | Path | None = None,
) -> list[Callback]:
    """Instantiate the configured callbacks plus the defaults, in a stable order.

    Also checks every metric the config selects by (callbacks' ``monitor``/``metric`` options
    and ``checkpoint.keep_best``) against what evaluation produces: with the loop imported,
    the names come from the evaluation code itself.

    Args:
        allow_external: import ``_target_`` classes; the caller's
            :func:`asrforge.config.external_code_allowed`, never a file's say.
        source: the config file, named in the error.

    Raises:
        ConfigError: unknown names, bad options, metrics no evaluation produces, ``_target_``
            without permission, or one ``id`` twice, each with its YAML path
            (``callbacks.1.patience: ...``).
    """
    produced = eval_metric_names()
    problems: list[str] = cfg.checkpoint.unknown_metrics(produced)
    built: dict[int, Callback] = {}
    disabled: set[str] = set()
    ids: dict[str, int] = {}
    for i, spec in enumerate(cfg.callbacks):
        where = f"callbacks.{i}"
        opts = spec.options
        enabled = opts.pop("enabled", True)
        if spec.id is not None:
            if spec.id in ids:
                problems.append(
                    f"{where}.id: {spec.id!r} is already the id of callbacks.{ids[spec.id]}"
                )
            ids.setdefault(spec.id, i)
        if spec.target is not None:
            if not allow_external:
                problems.append(
                    f"{where}._target_: {spec.target!r} would import and run code named in the "
                    f"config; {ALLOW_EXTERNAL_HINT}"
                )
                continue
            try:
                cls = _import_target(spec.target)
            except (ImportError, AttributeError, ValueError) as e:
                problems.append(f"{where}._target_: cannot import {spec.target!r}: {e}")
                continue
        else:
            cls = REGISTRY.get(spec.name)
            if cls is None:
                close = difflib.get_close_matches(spec.name, list(REGISTRY), n=1)
                hint = (
                    f" — did you mean {close[0]}?"
                    if close
                    else f" (known: {', '.join(sorted(REGISTRY))})"
                )
                problems.append(f"{where}.name: unknown callback {spec.name!r}{hint}")
                continue
        if not enabled:
            disabled.add(getattr(cls, "name", spec.name or ""))
            continue
        try:
            cb = _instantiate(cls, opts, where, produced)
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        problems += [f"{where}: {problem}" for problem in cb.config_problems(cfg)]
        if spec.critical is not None:
            cb.critical = spec.critical
        if spec.id is not None:
            cb.id = spec.id
        built[i] = cb
    if problems:
        raise ConfigError(problems, _source(source))
    names = {cb.name for cb in built.values()}
    defaults = [REGISTRY[n]() for n in DEFAULTS if n not in names and n not in disabled]
    # Enrichers first (lr_monitor adds keys the loggers write), then configured, then the rest.
    head = [cb for cb in defaults if cb.name in ENRICHERS]
    tail = [cb for cb in defaults if cb.name not in ENRICHERS]
    callbacks = head + [built[i] for i in sorted(built)] + tail
    try:
        state_keys(callbacks)
    except ValueError as e:  # an id equal to another callback's name
        raise ConfigError([f"callbacks: {e}"], _source(source)) from None
    return callbacks


def _source(source: str | Path | None) -> str | None:
    return str(source) if source is not None else None


def _import_target(target: str) -> type:
    module, _, attr = target.rpartition(".")
    if not module:
        raise ValueError("must be a dotted path like package.module.Class")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise ValueError("is not a subclass of asrforge.train.events.Callback")
    return cls


def _instantiate(
    cls: type[Callback], opts: dict[str, Any], where: str, produced: tuple[str, ...]
) -> Callback:
    schema: type[BaseModel] | None = getattr(cls, "Options", None)
    # An external callback without a schema has its signature as the schema.
    if schema is None:
        try:
            return cls(**opts)
        except TypeError as e:
            raise ConfigError([f"{where}: bad options for {cls.__name__}: {e}"]) from None
    try:
        parsed = schema.model_validate(opts, context={"eval_metrics": produced})
    except ValidationError as e:
        raise ConfigError(format_errors(e, schema, prefix=where)) from None
    return cls(**parsed.model_dump())


__all__ = [
    "REGISTRY",
    "AverageCheckpoints",
    "Callback",
    "EarlyStopping",
    "LRMonitor",
    "MetricsJsonl",
    "Options",
    "ProgressBar",
    "TensorBoardLogger",
    "build_callbacks",
    "SystemMonitor",
    "register",
]
