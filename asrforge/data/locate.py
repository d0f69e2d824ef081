"""Where the files of ``data.path`` are, and which split each holds."""

from __future__ import annotations

import re

SPLIT_WORDS = {
    "train": "train",
    "validation": "validation",
    "dev": "validation",
    "valid": "validation",
    "val": "validation",
    "test": "test",
}
"""The word a data file's name starts with -> its split."""


def split_of(name: str) -> str | None:
    """The split a file or folder name starts with (``dev_clean.jsonl`` -> ``validation``)."""
    word = re.match(r"[a-z]*", name.lower()).group()
    return SPLIT_WORDS.get(word)
