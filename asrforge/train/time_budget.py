"""A run's wall-clock budget (``train.max_time``): the durations of its steps, evaluations and
saves, and whether the next step still leaves time to evaluate and save before the budget ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from time import monotonic

UNTIMED_SHARE = 0.05
"""An evaluation or a save not yet timed in this process is taken to last this share of the
budget."""


class TimeBudget:
    """Seconds this process may run, counted from its start, and what the end of the run
    needs: the longest optimizer step so far and the last evaluation's and save's durations.

    Args:
        seconds: the budget (``train.max_time`` in seconds).
        written: the budget as the config wrote it (``2h``), for messages.
        already: seconds this process ran before (the command's imports and config).
    """

    def __init__(self, seconds: float, written: int | float | str, already: float = 0.0):
        self.seconds = seconds
        self.written = written
        self.started = monotonic() - already
        self.longest_step = 0.0
        self.durations: dict[str, float] = {}
        """The last duration of each timed kind but steps (``evaluation``, ``save``)."""

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Time the body as a ``step`` (the longest is kept), an ``evaluation`` or a ``save``."""
        start = monotonic()
        yield
        seconds = monotonic() - start
        if kind == "step":
            self.longest_step = max(self.longest_step, seconds)
        else:
            self.durations[kind] = seconds

    def elapsed(self) -> float:
        return monotonic() - self.started

    def needs(self, *, evaluations: int, saves: int) -> float:
        """Seconds that many evaluations and saves take by the last ones timed."""
        untimed = UNTIMED_SHARE * self.seconds
        return evaluations * self.durations.get("evaluation", untimed) + saves * (
            self.durations.get("save", untimed)
        )

    def runs_out(self, *, evaluations: int, saves: int) -> bool:
        """Whether one more step, then that many evaluations and saves, would pass the budget."""
        needed = self.longest_step + self.needs(evaluations=evaluations, saves=saves)
        return self.elapsed() + needed > self.seconds

    def reason(self, next_step: int, *, evaluations: int) -> str:
        """The stop reason of a run that stops before ``next_step`` (``evaluations``: 1 when the
        end evaluates, else 0): the time left, and what would not fit in it."""
        elapsed = self.elapsed()
        left = self.seconds - elapsed
        left_text = f"{_seconds(left)} left" if left > 0 else "none left"
        # a step not yet timed (set-up used the budget up) has no length to name
        step = (
            f", up to {_seconds(self.longest_step)} as the longest step so far"
            if self.longest_step
            else ""
        )
        end = "the last evaluation and save" if evaluations else "the last save"
        needs = _seconds(self.needs(evaluations=evaluations, saves=1))
        return (
            f"reached max_time={self.written} (elapsed {_clock(elapsed)}, {left_text}: not "
            f"enough for step {next_step}{step}, and then {end}, {needs})"
        )


def _seconds(seconds: float) -> str:
    """``21 s``, ``1.5 s`` or ``under 0.1 s``: a short duration, never shown as 0."""
    if seconds >= 10:
        return f"{seconds:.0f} s"
    return f"{seconds:.1f} s" if seconds >= 0.1 else "under 0.1 s"


def _clock(seconds: float) -> str:
    """``1h02m03s``, ``2m03s`` or ``3s``."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
