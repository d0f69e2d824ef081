"""Every problem of a command line collected into one error, as config errors are."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asrforge.errors import UserError


def positive(name: str, value: int | None) -> str | None:
    """The problem with an option that must be >= 1 (None: unset), or None."""
    return f"{name}: must be >= 1, got {value}" if value is not None and value < 1 else None


def raise_problems(problems: list[str | None]) -> None:
    """One UserError listing every problem (as config errors do); nothing when all are None."""
    problems = [p for p in problems if p]
    if len(problems) == 1:
        raise UserError(problems[0])
    if problems:
        raise UserError(f"{len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems))


def attempt(load: Callable[[], Any], problems: list[str]) -> Any:
    """``load()``, or None with its UserError's message appended to ``problems``."""
    try:
        return load()
    except UserError as e:
        problems.append(str(e))
        return None
