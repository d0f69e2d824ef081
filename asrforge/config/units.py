"""Units a config writes as text: sizes (``5GB``, ``500MiB``) and durations (``90m``, ``01:30:00``).

Each parser raises a ``ValueError`` whose message shows the accepted forms.
"""

from __future__ import annotations

import math
import re
from typing import Any

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(value: int | str) -> int:
    """Bytes of a size as transformers' ``max_shard_size`` takes it: an int (bytes) or a number
    and a unit, ``"5GB"`` (10^9), ``"500MiB"`` (2^20), ``"1.5GB"``, ``"4096"``.

    Raises:
        ValueError: not a positive size (the message shows the accepted forms).
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 5GB, 500MB or a number of bytes, got {value!r}")
    if isinstance(value, int):
        number, unit = float(value), ""
    else:
        found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(value))
        if found is None or found.group(2).upper() not in _UNITS:
            raise ValueError(
                f"expected a size such as 5GB, 500MB, 2GiB or a number of bytes, got {value!r}"
            )
        number, unit = float(found.group(1)), found.group(2).upper()
    size = int(number * _UNITS[unit])
    if size < 1:
        raise ValueError(f"must be at least 1 byte, got {value!r}")
    return size


_DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_DURATION_FORMS = "3600 (seconds), 90m, 2h, 1d2h, 1h30m or 01:30:00"
MAX_DURATION_DAYS = 1000
"""Longest duration a config may give: beyond it a number is a typo, and timers overflow."""


def short_repr(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters (a 400-digit number stays readable)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 12]}...({len(text)} chars)"


def parse_duration(value: int | float | str) -> float:
    """Seconds of a duration: a number of seconds (``3600``), numbers with units ``d``, ``h``,
    ``m``, ``s`` in that order (``90m``, ``2h``, ``1d2h``, ``1.5h``), or a SLURM-style
    ``[D-]HH:MM:SS`` (``01:30:00``, ``1-00:00:00``).

    Raises:
        ValueError: not a positive duration (the message shows the accepted forms).
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as {_DURATION_FORMS}, got {value!r}")
    if isinstance(value, int) and abs(value) > MAX_DURATION_DAYS * 86400:
        # float() of a 400-digit integer overflows
        seconds = math.inf if value > 0 else -math.inf
    elif isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        units = re.fullmatch(
            r"(?:(\d+(?:\.\d*)?)d)?(?:(\d+(?:\.\d*)?)h)?(?:(\d+(?:\.\d*)?)m)?"
            r"(?:(\d+(?:\.\d*)?)s)?",
            # a bare number is seconds
            re.sub(r"^(\d+(?:\.\d*)?)$", r"\1s", text),
        )
        clock = re.fullmatch(r"(?:(\d+)-)?(\d+):([0-5]\d):([0-5]\d)", text)
        if text and units is not None:
            seconds = sum(
                float(n) * unit
                for n, unit in zip(units.groups(), _DURATION_UNITS.values(), strict=True)
                if n is not None
            )
        elif clock is not None:
            days, hours, minutes, secs = (int(n or 0) for n in clock.groups())
            seconds = float(((days * 24 + hours) * 60 + minutes) * 60 + secs)
        else:
            raise ValueError(
                f"expected a duration such as {_DURATION_FORMS}, got {short_repr(value)}"
            )
    if not seconds > 0:
        raise ValueError(f"must be a positive duration, got {short_repr(value)}")
    if seconds > MAX_DURATION_DAYS * 86400:
        raise ValueError(f"must be at most {MAX_DURATION_DAYS} days, got {short_repr(value)}")
    return seconds
