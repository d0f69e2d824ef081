"""The fast tier (`make check`, the tests marked ``fast``) reaches every part of asrforge and
starts no process: a package without a fast test, or a fast test that runs a subprocess, fails
here. The tests are read as source, so this check itself costs nothing."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
# What starts another process: the fast tier has no time for a second interpreter's imports.
STARTS_A_PROCESS = re.compile(r"\bsubprocess\b|sys\.executable|torchrun|\bPopen\b|os\.fork\b")


def is_fast_mark(node: ast.expr) -> bool:
    return "mark.fast" in ast.unparse(node)


def imported_parts(node: ast.AST) -> set[str]:
    """The top-level names of asrforge (``train``, ``config``, ...) that ``node`` imports."""
    parts = set()
    for n in ast.walk(node):
        names = []
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            names = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
        for name in names:
            dotted = name.split(".")
            if dotted[0] == "asrforge" and len(dotted) > 1:
                parts.add(dotted[1])
    return parts


@dataclass
class FileOfTests:
    path: Path
    fast: list[ast.FunctionDef] = field(default_factory=list)
    imports: set[str] = field(default_factory=set)


def read_test_file(path: Path) -> FileOfTests:
    """The fast tests of one file and the parts of asrforge they import (the file's top-level
    imports count for each of its fast tests)."""
    tree = ast.parse(path.read_text())
    whole_file = any(
        isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
        and is_fast_mark(n.value)
        for n in tree.body
    )
    tests = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test")
    ]
    fast = [t for t in tests if whole_file or any(is_fast_mark(d) for d in t.decorator_list)]
    found = FileOfTests(path, fast)
    if fast:
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        found.imports = set().union(*(imported_parts(n) for n in top + fast))
    return found


def parts_of_asrforge() -> set[str]:
    """Every package and top-level module of asrforge a user or another layer can import."""
    package = ROOT / "asrforge"
    parts = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    parts |= {p.stem for p in package.glob("*.py") if not p.stem.startswith("_")}
    return parts


@cache
def all_test_files() -> list[FileOfTests]:
    return [read_test_file(p) for p in sorted((ROOT / "tests").glob("test_*.py"))]


def test_every_part_of_asrforge_has_a_fast_test():
    reached = set().union(*(f.imports for f in all_test_files()))
    missing = sorted(parts_of_asrforge() - reached)
    assert not missing, f"no fast test imports asrforge.{{{', '.join(missing)}}}: mark one fast"


def test_no_fast_test_starts_a_process():
    offenders = [
        f"{f.path.name}::{t.name}"
        for f in all_test_files()
        for t in f.fast
        if STARTS_A_PROCESS.search(ast.unparse(t))
    ]
    assert not offenders, f"fast tests that start a process: {offenders}"


def test_the_check_reads_marks_and_imports(tmp_path):
    """The reader above sees a whole-file mark, a single marked test, and imports in both places;
    an unmarked test's imports do not count."""
    whole = tmp_path / "test_whole.py"
    whole.write_text(
        "import pytest\nfrom asrforge.text import wer\npytestmark = pytest.mark.fast\n"
        "def test_a():\n    import asrforge.lm.ngram\n"
    )
    one = tmp_path / "test_one.py"
    one.write_text(
        "import pytest\n@pytest.mark.fast\ndef test_a():\n    from asrforge.bundle import load\n"
        "def test_b():\n    from asrforge.matrix import run\n"
    )
    none = tmp_path / "test_none.py"
    none.write_text("from asrforge.train import loop\ndef test_a():\n    pass\n")
    assert read_test_file(whole).imports == {"text", "lm"}
    assert read_test_file(one).imports == {"bundle"}
    assert [t.name for t in read_test_file(one).fast] == ["test_a"]
    assert read_test_file(none).imports == set()
