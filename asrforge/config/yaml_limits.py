"""YAML as asrforge reads it from a file it may have been handed: UTF-8, at most
:data:`MAX_BYTES`, nested at most :data:`MAX_DEPTH` levels and at most :data:`MAX_VALUES` values
once its aliases are expanded (a kilobyte of nested aliases can stand for billions of values,
which every copy of the loaded tree would build), and no mapping holding a key twice (YAML
would keep the last silently, so a second ``train:`` section would drop the first). A Hub
card's header (:func:`load_front_matter`) is someone else's file, read as ``huggingface_hub``
reads it: within the same bounds, but a later key wins.

Each problem is a ``ValueError`` whose message says what is wrong; callers name the file.
Duplicate keys are a :class:`DuplicateKeys`, one line each in ``problems``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from asrforge.io.small_files import read_text

MAX_BYTES = 16 * 2**20
"""Largest YAML file read (a config is a few kilobytes)."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists, aliases expanded."""
MAX_VALUES = 100_000
"""Most values (mappings, lists, scalars and keys), aliases expanded."""
_MERGE_TAG = "tag:yaml.org,2002:merge"
_FRONT_MATTER = re.compile(r"^---\s*\n(.*?)\n---\s*(\n|$)", re.S)


class DuplicateKeys(ValueError):
    """Keys a mapping holds more than once: ``problems`` has one ``yaml.path: ...`` line each,
    naming the lines that set it."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader whose composer stops at :data:`MAX_DEPTH` before Python's own
    recursion limit does."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ValueError(
                    f"nested deeper than {MAX_DEPTH} levels (line "
                    f"{self.peek_event().start_mark.line + 1})"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expanded(root: yaml.Node) -> None:
    """Count the values and depth of ``root`` as its aliases expand, without expanding them
    (each node is measured once; a node that contains itself is refused)."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        kids = _children(node)
        if finished:
            size[key] = 1 + sum(size[id(kid)] for kid in kids)
            depth[key] = 1 + max((depth[id(kid)] for kid in kids), default=0)
            entered.discard(key)
            if size[key] > MAX_VALUES:
                raise ValueError(
                    f"more than {MAX_VALUES} values once its aliases (*name) are "
                    f"expanded (line {node.start_mark.line + 1})"
                )
            if depth[key] > MAX_DEPTH:
                raise ValueError(
                    f"nested deeper than {MAX_DEPTH} levels once its aliases "
                    f"(*name) are expanded (line {node.start_mark.line + 1})"
                )
            continue
        if key in size:
            continue
        if key in entered:
            raise ValueError(
                f"an alias inside the value it names (line {node.start_mark.line + 1})"
            )
        entered.add(key)
        stack.append((node, True))
        stack.extend((kid, False) for kid in kids if id(kid) not in size)


def _duplicate_keys(root: yaml.Node, where: str) -> list[str]:
    """One line per key that a mapping of ``root`` (at YAML path ``where``) holds more than once,
    with its YAML path and the lines that set it, in the order of the first of them. A merge
    (``<<: *name``) may be overridden: only the keys written in the mapping itself count."""
    found: list[tuple[int, str]] = []
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, where)]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:  # an alias's value is checked once, where it is defined
            continue
        seen.add(id(node))
        # children go on the stack last first, so nodes are visited in document order and an
        # anchored value is named where it is written, before any alias of it
        if isinstance(node, yaml.SequenceNode):
            kids = [(kid, f"{path}.{i}" if path else str(i)) for i, kid in enumerate(node.value)]
            stack.extend(reversed(kids))
            continue
        if not isinstance(node, yaml.MappingNode):
            continue
        lines: dict[tuple[str, str], list[int]] = {}
        kids = []
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:
                continue
            lines.setdefault((key.tag, key.value), []).append(key.start_mark.line + 1)
            kids.append((value, f"{path}.{key.value}" if path else key.value))
        stack.extend(reversed(kids))
        for (_, name), at in lines.items():
            if len(at) < 2:
                continue
            rows = sorted(set(at))
            listed = f"line {rows[0]}" if len(rows) == 1 else (
                f"lines {', '.join(map(str, rows[:-1]))} and {rows[-1]}")
            # an override's value is one line of a command, not lines of a file
            where_in_file = "" if where else f" ({listed})"
            found.append((at[0], f"{f'{path}.' if path else ''}{name}: given {len(at)} times"
                                 f"{where_in_file}; YAML would keep only the last: give it once"))
    return [line for _, line in sorted(found)]


def load_yaml(text: str, where: str = "", *, unique_keys: bool = True) -> Any:
    """``text`` as YAML's safe loader reads it (None for an empty document), within
    :data:`MAX_DEPTH` and :data:`MAX_VALUES`, each key of a mapping given once.

    Args:
        where: the YAML path of the document inside a larger one (an override's key), for the
            names of duplicate keys.
        unique_keys: False to let a later key win, as YAML's safe loader does.

    Raises:
        ValueError: not YAML, or beyond those bounds; :class:`DuplicateKeys` for keys given
            twice (every one).
    """
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded(node)
        if unique_keys and (duplicates := _duplicate_keys(node, where)):
            raise DuplicateKeys(duplicates)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML: {e}") from None
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    finally:
        loader.dispose()


def read_yaml_text(path: Path) -> str:
    """The text of the YAML file ``path``: a regular file, UTF-8, at most :data:`MAX_BYTES`.

    Raises:
        ValueError: not a regular file (a FIFO, a device), too large, or not UTF-8 (the first
            bad byte and its offset).
        OSError: it cannot be read.
    """
    return read_text(path, MAX_BYTES)


def load_front_matter(text: str) -> Any:
    """The YAML header of a Markdown text (a Hub card's ``README.md``: the lines between a
    first line ``---`` and the next), loaded as :func:`load_yaml` loads YAML but with a later
    key winning, as ``huggingface_hub`` reads a card (Trainer's cards give ``tags:`` twice);
    None when there is none.

    Raises:
        ValueError: as :func:`load_yaml` (never :class:`DuplicateKeys`), with line numbers
            counted in ``text``.
    """
    match = _FRONT_MATTER.match(text)
    if match is None:
        return None
    # blank lines in place of the opening ones keep the lines load_yaml names those of the text
    before = "\n" * text.count("\n", 0, match.start(1))
    return load_yaml(before + match.group(1), unique_keys=False)
