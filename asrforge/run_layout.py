"""The names of a run directory: where a run keeps its checkpoints, evaluation records, logs and
caches. Every reader and writer of a run directory asks :class:`RunLayout` (or, for a folder of
checkpoints alone, :class:`CheckpointsLayout`) instead of spelling a name.

A run directory::

    config.yaml  hub_commits.json  train.log  metrics.jsonl  eval_carve.json  cache/
    checkpoints/  step-000200/ ...  latest -> step-000200 (or latest.txt)  best/  best-unguarded/
    eval/  step-000200.jsonl  guard-step-000200.jsonl  longform-step-000200.jsonl

This module imports only ``io`` (a checkpoint's ``train_state.json`` and a run's records read
within bounds), so every layer above it may use it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asrforge.io.small_files import RECORDS_BYTES, parse_json, read_bytes, read_json

CHECKPOINTS = "checkpoints"
EVAL = "eval"
CONFIG_FILE = "config.yaml"
"""The run's resolved config, written by start-up over an earlier run's."""
HUB_COMMITS_FILE = "hub_commits.json"
"""The Hub commit of each model and data set the run read by id, beside ``config.yaml``."""
RUN_LOG = "train.log"
METRICS_FILE = "metrics.jsonl"
"""The ``metrics_jsonl`` callback's file, under its default name; which of its records stand
after a resume: :func:`current_metrics`."""
METRICS_REPLACED_FILE = "metrics.replaced.jsonl"
"""The records a later start took out of ``metrics.jsonl`` (steps it logs again), appended in
the order they were cut: an attempt set aside by ``--start-over`` or replayed by a resume
keeps its history."""
CARVE_FILE = "eval_carve.json"
CACHE = "cache"
BEST = "best"
BEST_UNGUARDED = "best-unguarded"
"""The best checkpoint the forgetting guard refused, kept beside ``best/``."""
LATEST = "latest"
LATEST_TXT = "latest.txt"
"""Where a filesystem without symbolic links records ``latest``."""
TRAIN_STATE_FILE = "train_state.json"
"""A checkpoint's training state: step, epoch, data position, the selector's state."""

_STEP_RE = re.compile(r"^step-(\d+)$")


def damaged_name(path: Path, stamp: str) -> Path:
    """Where ``path``, found damaged at ``stamp`` (a time), is kept for inspection beside it:
    ``<name>.damaged-<stamp>``, numbered when that is taken. Its name is no checkpoint's, so
    resume, rotation and pruning pass it by."""
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while aside.exists() or aside.is_symlink():
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    return aside


def step_dir_name(step: int) -> str:
    """``step-000200``: six digits, zero-padded (more digits past 999999)."""
    return f"step-{step:06d}"


def step_of(name: str) -> int | None:
    """The step a ``step-NNNNNN`` name holds; None for any other name."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def checkpoint_name(ckpt: Path) -> str:
    """Checkpoint ``ckpt`` named from its run down, as a bundle records where its weights came
    from: ``RUN/checkpoints/step-000200`` (a checkpoint elsewhere: its last component). A
    bundle travels (to a serving team, to the Hub), and the directories above a run are the
    machine's and its user's, not the model's; a local model is named by its last component
    alone, as the model card names it."""
    ckpt = Path(os.path.abspath(ckpt))
    if ckpt.parent.name == CHECKPOINTS and ckpt.parent.parent.name:
        return f"{ckpt.parent.parent.name}/{CHECKPOINTS}/{ckpt.name}"
    return ckpt.name


def recorded_selection(ckpt: Path) -> dict:
    """The selection state checkpoint ``ckpt`` recorded in its :data:`TRAIN_STATE_FILE`: the
    policy that decided (``policy``), the guard's start (``guard``) and the rest of the
    selector's state; {} when it records none.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: it cannot be read (a FIFO, too large, an OSError), is not JSON, its state
            or selection is not an object, or the fields its readers take are not of their
            kinds (the policy a string, the guard an object).
    """
    state = read_json(ckpt / TRAIN_STATE_FILE, RECORDS_BYTES, error=ValueError)
    selection = state.get("selection") if isinstance(state, dict) else None
    if not isinstance(state, dict) or not isinstance(selection, dict | None):
        raise ValueError(f"{TRAIN_STATE_FILE}: its selection state is not an object")
    selection = selection or {}
    for field, kind, words in (("policy", str, "a string"), ("guard", dict, "an object")):
        if not isinstance(selection.get(field), kind | None):
            raise ValueError(f"{TRAIN_STATE_FILE}: selection.{field} is not {words}")
    return selection


def has_step(record: dict) -> bool:
    """Whether a ``metrics.jsonl`` record has an integer ``step`` (what every record of a step
    has)."""
    step = record.get("step")
    return isinstance(step, int) and not isinstance(step, bool)


def step_record(line: str | bytes) -> dict[str, Any] | None:
    """The record a line of ``metrics.jsonl`` (or of an evaluation record) holds: a JSON object
    with an integer ``step``; None for a line of JSON that is no such record.

    Raises:
        ValueError: the line is not JSON, or is nested too deeply to walk.
    """
    record = parse_json(line)
    return record if isinstance(record, dict) and has_step(record) else None


def read_step_records(path: Path, *, last: bool = False) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of the JSON-lines file ``path`` (:func:`step_record`), read whole within
    :data:`~asrforge.io.small_files.RECORDS_BYTES`, and the numbers (from 1) of its lines that
    hold none; with ``last``, of its last line alone (an evaluation record's summary).

    A last line that is not JSON, of a whole file, was cut by a crash: it is left out and not
    counted.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a regular file (a FIFO is never waited on), or larger than the limit.
        OSError: it cannot be read.
    """
    text = read_bytes(path, RECORDS_BYTES).decode("utf-8", errors="replace")
    lines = text.rstrip("\n").split("\n") if text.strip() else []
    first = len(lines) - 1 if last and lines else 0
    records, left_out = [], []
    for number, line in enumerate(lines[first:], first + 1):
        try:
            record = step_record(line)
        except ValueError:
            if line.strip() and (last or number < len(lines)):
                left_out.append(number)
            continue
        if record is not None:
            records.append(record)
        elif line.strip():
            left_out.append(number)
    return records, left_out


def metrics_relogged(record: dict, begin: dict) -> bool:
    """Whether the start ``begin`` (a ``train_begin`` record of ``metrics.jsonl``) logs the step of
    the earlier ``record`` again: any later step, and at its own step, when it starts afresh
    (``resumed`` false: no checkpoint to continue), the evaluation and the save. A
    ``train_begin`` that does not say (written before ``resumed`` was) is taken as a resume."""
    if not has_step(record):
        return False
    step, at = begin["step"], record["step"]
    afresh = begin.get("resumed") is False
    return at > step or (at == step and afresh and record.get("event") in ("eval", "save"))


def current_metrics(records: list[dict]) -> list[dict]:
    """The records of ``metrics.jsonl`` that describe the run its checkpoints continue, in
    order: each ``train_begin`` drops the earlier records whose steps it logs again
    (:func:`metrics_relogged`), so that each step has one record of each event.

    The ``metrics_jsonl`` callback cuts its file so when a run starts; a file that a resume
    appended to before it did still holds those records, so its readers ask this too.
    """
    kept: list[dict] = []
    for record in records:
        if record.get("event") == "train_begin" and has_step(record):
            kept = [r for r in kept if not metrics_relogged(r, record)]
        kept.append(record)
    return kept


@dataclass(frozen=True)
class CheckpointsLayout:
    """A folder of checkpoints: ``step-NNNNNN/``, ``latest``, ``best/``, ``best-unguarded/``."""

    root: Path

    def step(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    @property
    def best(self) -> Path:
        return self.root / BEST

    @property
    def best_unguarded(self) -> Path:
        return self.root / BEST_UNGUARDED

    @property
    def latest_link(self) -> Path:
        return self.root / LATEST

    @property
    def latest_txt(self) -> Path:
        return self.root / LATEST_TXT

    def steps(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every ``step-*`` directory (not a link to one), oldest first."""
        if not self.root.is_dir():
            return []
        found = [(step_of(p.name), p) for p in self.root.iterdir()]
        return sorted((s, p) for s, p in found if s is not None and p.is_dir() and not p.is_symlink())

    def latest(self) -> Path | None:
        """Where ``latest`` points (nothing verified); None before the first save."""
        if self.latest_link.is_symlink():
            return self.root / os.readlink(self.latest_link)
        if self.latest_txt.is_file():
            return self.root / self.latest_txt.read_text().strip()
        return None


@dataclass(frozen=True)
class RunLayout:
    """One run directory's places."""

    root: Path

    @property
    def checkpoints(self) -> CheckpointsLayout:
        return CheckpointsLayout(self.root / CHECKPOINTS)

    @property
    def eval_dir(self) -> Path:
        return self.root / EVAL

    def eval_record(self, step: int) -> Path:
        """``eval/step-NNNNNN.jsonl``: each evaluated utterance and the summary."""
        return self.eval_dir / f"{step_dir_name(step)}.jsonl"

    def guard_record(self, step: int) -> Path:
        """``eval/guard-step-NNNNNN.jsonl``: the forgetting guard's transcripts."""
        return self.eval_dir / f"guard-{step_dir_name(step)}.jsonl"

    def longform_record(self, step: int) -> Path:
        """``eval/longform-step-NNNNNN.jsonl``: the long recordings' transcripts."""
        return self.eval_dir / f"longform-{step_dir_name(step)}.jsonl"

    def eval_records(self) -> list[Path]:
        """Every ``eval/step-*.jsonl``, in step order."""
        return sorted(self.eval_dir.glob("step-*.jsonl"))

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def hub_commits(self) -> Path:
        return self.root / HUB_COMMITS_FILE

    @property
    def log(self) -> Path:
        return self.root / RUN_LOG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def carve(self) -> Path:
        """``eval_carve.json``: the rows ``data.eval_carve`` held out of the training split."""
        return self.root / CARVE_FILE

    @property
    def cache(self) -> Path:
        return self.root / CACHE
