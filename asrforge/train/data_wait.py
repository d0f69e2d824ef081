"""How long the loop waits for its data loader: the time spent in ``next()`` (and ``iter()``).

With ``data.num_workers: 0`` that is the loading itself; with workers, the time the main process
found no batch ready. The system monitor compares it with the step time (data-bound or not).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


class DataWaitClock:
    """Accumulates the seconds spent fetching items from the iterables it wraps."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield ``iterable``'s items, adding the time each fetch took to :attr:`seconds`."""
        t0 = time.perf_counter()
        it = iter(iterable)  # a DataLoader starts its workers here
        self.seconds += time.perf_counter() - t0
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                self.seconds += time.perf_counter() - t0
                return
            self.seconds += time.perf_counter() - t0
            yield item

    def take(self) -> float:
        """The seconds accumulated since the last call, and start again from zero."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
