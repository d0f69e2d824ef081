"""Fields of a JSON record read back from disk (a checkpoint's training state, its selection
state), each checked against its kind as strictly as a config is, so that a tampered or damaged
record is named field by field instead of failing as a ``TypeError`` deep inside a resume.

A kind is a :class:`Kind`: a test and the words for it in a message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kind:
    """What a field may hold: ``test(value)`` and its description (``"an integer >= 0"``)."""

    test: Callable[[Any], bool]
    words: str

    def __call__(self, value: Any) -> bool:
        return self.test(value)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    # NaN and inf stay numbers: a diverged run records them
    return _integer(v) or isinstance(v, float)


COUNT = Kind(lambda v: _integer(v) and v >= 0, "an integer >= 0")
INTEGER = Kind(_integer, "an integer")
NUMBER = Kind(_number, "a number")
TEXT = Kind(lambda v: isinstance(v, str), "a string")
BOOLEAN = Kind(lambda v: isinstance(v, bool), "true or false")
MAPPING = Kind(lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v), "an object")
SHA256 = Kind(
    lambda v: isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v),
    "a sha256 (64 hex digits)",
)


def optional(kind: Kind) -> Kind:
    """``kind`` or null."""
    return Kind(lambda v: v is None or kind(v), f"{kind.words} or null")


def either(*kinds: Kind) -> Kind:
    """Any of ``kinds``."""
    return Kind(lambda v: any(k(v) for k in kinds), " or ".join(k.words for k in kinds))


def mapping_of(kind: Kind) -> Kind:
    """An object whose every value is ``kind``."""
    return Kind(
        lambda v: MAPPING(v) and all(kind(x) for x in v.values()),
        f"an object of {kind.words} values",
    )


def list_of(kind: Kind) -> Kind:
    """A list whose every item is ``kind``."""
    return Kind(
        lambda v: isinstance(v, list) and all(kind(x) for x in v), f"a list of {kind.words}"
    )


def record_problems(
    record: Any, kinds: Mapping[str, Kind], where: str = "", required: tuple[str, ...] = ()
) -> list[str]:
    """One ``where.field: value is not <kind>`` line per field of ``record`` present in
    ``kinds`` whose value is not of its kind, and per ``required`` field missing; fields not in
    ``kinds`` are left to the caller."""
    if not MAPPING(record):
        return [f"{where or 'the record'}: {_short(record)} is not an object"]
    prefix = f"{where}." if where else ""
    problems = [f"{prefix}{name}: missing" for name in required if name not in record]
    for name, kind in kinds.items():
        if name in record and not kind(record[name]):
            problems.append(f"{prefix}{name}: {_short(record[name])} is not {kind.words}")
    return problems


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
