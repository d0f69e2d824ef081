"""The local paths a run's config names, checked before any model or data loads: each that
does not exist, and data that the run directory is, holds or lies in."""

from __future__ import annotations

import os
from pathlib import Path

from asrforge.config import DataConfig
from asrforge.data.locate import data_ref, is_url
from asrforge.data.sources import missing_data_path
from asrforge.errors import UserError


def local_path_problems(cfg) -> list[str]:
    """What is wrong with the local paths the config names, all found before any model or data
    loads: each that does not exist, and data that is ``output_dir``, holds it or lies in it
    (the run would write among the data, or undoing a start would reach it)."""
    problems = []

    def local(data: DataConfig, section: str) -> bool:  # no Hub id or URL: data_ref's rule
        try:
            return not is_url(data.path) and data_ref(data, section) is None
        except UserError as e:  # an id that names no repository
            problems.append(str(e))
            return False

    reads = {}  # the local data the run reads, by config section
    if local(cfg.data, "data"):
        reads["data"] = Path(cfg.data.path)
    replay = cfg.data.replay
    if replay is not None and local(DataConfig(path=replay.path), "data.replay"):
        reads["data.replay"] = Path(replay.path)
    if cfg.eval.guard is not None:
        reads["eval.guard"] = cfg.eval.guard.path
    out = Path(os.path.realpath(cfg.output_dir))
    for section, path in reads.items():
        made_here = section == "data" and cfg.data.generate is not None
        if not path.exists() and not made_here:
            problems.append(missing_data_path(path, section))
            continue
        where = Path(os.path.realpath(path))
        if out == where or where in out.parents or out in where.parents:
            relation = "is" if out == where else "lies in" if where in out.parents else "holds"
            problems.append(
                f"output_dir: {cfg.output_dir} {relation} {section}.path {path}: keep the run "
                "directory, where the run writes its checkpoints, logs and caches, and the "
                "data apart"
            )
    if cfg.data.text_path is not None and not cfg.data.text_path.is_file():
        problems.append(f"data.text_path: {cfg.data.text_path}: no such file")
    tokenizer = cfg.model.tokenizer
    if tokenizer is not None and not tokenizer.is_dir():
        problems.append(f"model.tokenizer: {tokenizer}: no such tokenizer directory")
    return problems
