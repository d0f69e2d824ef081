"""The problems of a matrix's jobs, collected over every job and told once each.

A job's config is its training file with the matrix's overrides on top, so a problem is told
where it was written: a line of the training file is named by that file (``configs/tiny.yaml:
optim.lr: must be > 0, got -1``), a value an override set by the matrix file's YAML path of that
override (``language_overrides.es: train.max_step: unknown field``), a value only some of a
search's draws give by ``search.space``. The same problem in many jobs is one line ending with
the jobs it holds for, as the matrix's dimensions describe them (``all 300 jobs``, ``3 jobs:
languages es, fr, th``).

How it works: docs/matrix.md, "Every problem once (`matrix/problems.py`)".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

Cell = tuple[str, str, int]
"""A job's language, config_id and seed."""

LISTED = 6
"""Values (languages, job ids, draws) a line names before it counts the rest."""


def origin(line: str, overrides: list[tuple[str, str]], config_file: str) -> str:
    """Where the value of ``line`` (``yaml.path: what is wrong``, a problem of a job's config)
    was written: the origin of the last override that set its path or a section around it,
    else ``config_file``.

    Args:
        overrides: each ``key=value`` of the job, in the order applied, with its origin (the
            matrix file's YAML path that holds it, or ``the command line``).
    """
    head = line.partition(": ")[0]
    key = re.sub(r"\[(\d+)\]", r".\1", head)
    for item, where in reversed(overrides):
        if line.startswith(f"{item}:"):  # an override that is not dotted.key=value
            return where
        name = item.partition("=")[0]
        if key == name or key.startswith(f"{name}.") or name.startswith(f"{key}."):
            return where
    return config_file


@dataclass
class JobProblems:
    """Problems of the jobs' configs, each told once with the jobs (and draws) it holds for."""

    cells: dict[str, Cell] = field(default_factory=dict)
    """Every job of the matrix, checked or not: what "all N jobs" means."""
    found: dict[tuple[str, str], tuple[str, list[str], list[str]]] = field(default_factory=dict)
    """(origin, problem or, of a draw, its YAML path) -> the problem as first found, the job ids
    it holds for and the search draws that give it."""

    def add(self, where: str, problem: str, job_id: str, draw: str | None = None) -> None:
        """``problem`` of job ``job_id``, written at ``where``; ``draw``: the search's values
        that give it (its wording holds them, ``must divide d_model=33``, so the draws that break
        one YAML path are one problem)."""
        key = (where, problem if draw is None else problem.partition(": ")[0])
        _, ids, draws = self.found.setdefault(key, (problem, [], []))
        if job_id not in ids:
            ids.append(job_id)
        if draw is not None and draw not in draws:
            draws.append(draw)

    def lines(self) -> list[str]:
        """One line per problem, in the order first found."""
        out = []
        for (where, _), (problem, ids, draws) in self.found.items():
            if draws:
                others = len(draws) - 1
                more = f" (or {others} other draw{'s' * (others > 1)})" if others else ""
                where = f"{where} draws {draws[0]}{more}"
            out.append(f"{where}: {problem} ({describe_jobs(ids, self.cells)})")
        return out


def describe_jobs(ids: list[str], cells: dict[str, Cell]) -> str:
    """``ids`` as the matrix's dimensions describe them: ``job en-a-s0``, ``all 300 jobs``,
    ``100 jobs: config a``, ``6 jobs: languages es, fr, th; seeds 0, 1``, or, when they are no
    block of the matrix, their ids."""
    if len(ids) == 1:
        return f"job {ids[0]}"
    if set(ids) >= set(cells):
        return f"all {len(cells)} jobs"
    known = [cells[i] for i in ids if i in cells]
    chosen = [list(dict.fromkeys(c[d] for c in known)) for d in range(3)]
    every = [list(dict.fromkeys(c[d] for c in cells.values())) for d in range(3)]
    if len(known) == len(ids) == math.prod(map(len, chosen)):
        parts = [
            _values(name, values, all_values)
            for name, values, all_values in zip(("language", "config", "seed"), chosen, every,
                                                strict=True)
            if len(values) < len(all_values)
        ]
        return f"{len(ids)} jobs: {'; '.join(parts)}"
    return f"{len(ids)} jobs: {_listed(ids)}"


def _values(name: str, values: list, every: list) -> str:
    if len(values) == 1:
        return f"{name} {values[0]}"
    left_out = [v for v in every if v not in values]
    if len(values) > LISTED and len(left_out) <= LISTED:
        return f"every {name} but {', '.join(map(str, left_out))}"
    return f"{name}s {_listed(values)}"


def _listed(values: list) -> str:
    shown = ", ".join(map(str, values[:LISTED]))
    return shown if len(values) <= LISTED else f"{shown} and {len(values) - LISTED} more"
