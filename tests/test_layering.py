"""The layers of docs/architecture.md ("Layers and who may import whom") hold: every import of
every module of asrforge/ (at the top, inside functions, under TYPE_CHECKING, and the lazy
``_EXPORTS`` of packages) goes to its own layer or one the table allows. The table is the one
source of truth: the test reads it from the document."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Layers and who may import whom"
ALL = "*"


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. asrforge.bundle.load
    target: str  # the imported module, e.g. asrforge.model.longform
    line: int


def layer_table(doc: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """``(layer of each top-level name, what each layer may import)`` from the document's table.

    A row's first column names the layer's top-level modules or packages (the first is the
    layer's name); its last column the layers or dotted single modules it may import, ``all``,
    or ``nothing of ours``. Parenthesized text is commentary.
    """
    section = doc[doc.index(SECTION) :]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    layer_of: dict[str, str] = {}
    allowed: dict[str, set[str]] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0])
        may = re.sub(r"\([^)]*\)", "", cells[-1])
        for name in names:
            layer_of[name] = names[0]
        if may.strip() == "all":
            allowed[names[0]] = {ALL}
        else:
            allowed[names[0]] = set(re.findall(r"`([\w.]+)`", may))
    return layer_of, allowed


def module_name(root: Path, path: Path) -> str:
    """``asrforge/bundle/load.py`` -> ``asrforge.bundle.load`` (a package: its ``__init__``'s)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path, path: Path) -> list[Import]:
    """Every ``asrforge`` module ``path`` imports: import statements anywhere in the file
    (relative ones resolved), and the module strings of a lazy ``_EXPORTS`` table."""
    module = module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            # `from asrforge.model import lora` imports the module asrforge.model.lora
            targets = [f"{stem}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
        ):
            targets = [
                v.value for v in getattr(node.value, "values", []) if isinstance(v, ast.Constant)
            ]
        else:
            continue
        out += [Import(module, t, node.lineno) for t in targets if t.split(".")[0] == root.name]
    return out


def layer(name: str, layer_of: dict[str, str]) -> str | None:
    """The layer of a dotted ``asrforge...`` name (``asrforge`` alone: the package's)."""
    parts = name.split(".")
    return layer_of.get(parts[1] if len(parts) > 1 else parts[0])


def allows(layer_name: str, target: str, layer_of: dict[str, str], allowed: dict[str, set[str]]):
    may = allowed[layer_name]
    if ALL in may or layer(target, layer_of) in (layer_name, *may):
        return True
    dotted = target.split(".", 1)[1] if "." in target else target
    return any(dotted == m or dotted.startswith(m + ".") for m in may if "." in m)


def violations(root: Path, doc: str) -> list[str]:
    """One line per import the table forbids, and per module of a layer it does not list."""
    layer_of, allowed = layer_table(doc)
    problems = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(root, path)
        own = layer(module, layer_of)
        if own is None:
            problems.append(f"{module}: its layer is not in the table of {DOC.name}")
            continue
        for imp in imports_of(root, path):
            target = layer(imp.target, layer_of)
            if target is None:
                problems.append(f"{module}:{imp.line} imports {imp.target}, of no layer")
            elif not allows(own, imp.target, layer_of, allowed):
                problems.append(
                    f"{module}:{imp.line} imports {imp.target}: layer {own} may not import {target}"
                )
    return problems


@pytest.mark.fast
def test_every_import_in_asrforge_is_one_the_table_allows():
    assert violations(ROOT / "asrforge", DOC.read_text(encoding="utf-8")) == []


@pytest.mark.fast
def test_the_table_names_every_layer_once_and_only_layers():
    layer_of, allowed = layer_table(DOC.read_text(encoding="utf-8"))
    package = ROOT / "asrforge"
    tops = {p.stem for p in package.glob("*.py")} | {
        p.parent.name for p in package.glob("*/__init__.py")
    }
    assert tops - {"__init__"} | {"asrforge"} == set(layer_of), "a row per top-level module"
    for may in allowed.values():  # every name a row allows is a layer or a module of one
        for name in may - {ALL}:
            assert name.split(".")[0] in allowed, name
            if "." in name:
                path = ROOT / "asrforge" / name.replace(".", "/")
                assert path.with_suffix(".py").is_file() or path.is_dir(), name


@pytest.mark.fast
def test_the_inference_side_imports_no_training_code():
    """What the table says of them, read off it: a change here is a change of design."""
    _, allowed = layer_table(DOC.read_text(encoding="utf-8"))
    for name in ("bundle", "evaluation", "matrix", "model", "convert", "data", "checkpoint"):
        assert "train" not in allowed[name] and ALL not in allowed[name], name
    assert not any("recipes" in may for may in allowed.values())  # no layer imports a recipe


TABLE = """# doc
## Layers and who may import whom
| layer | what | may import |
|---|---|---|
| `errors` | errors | nothing of ours |
| `model` | models | `errors` |
| `data` | data (`synth.py`) | `errors` |
| `train` | the loop | `model`, `data` |
| `matrix` | plans | `data.synth` |
| `asrforge` | the package | all |
## Next section
| `ignored` | x | all |
"""


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "asrforge"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.fast
def test_the_checker_passes_allowed_imports_and_names_each_violation(tmp_path):
    layer_of, allowed = layer_table(TABLE)
    assert layer_of == {n: n for n in ("errors", "model", "data", "train", "matrix", "asrforge")}
    assert allowed["errors"] == set() and allowed["matrix"] == {"data.synth"}
    root = _package(
        tmp_path,
        {
            "errors.py": "",
            "model/__init__.py": "",
            "model/build.py": "from asrforge.errors import E\nfrom . import decode\n",
            "model/decode.py": "def f():\n    from asrforge.train import loop\n",
            "data/__init__.py": "",
            "data/synth.py": "import asrforge.errors\n",
            "data/dataset.py": "",
            "train/__init__.py": "_EXPORTS = {'Trainer': 'asrforge.train.loop'}\n",
            "train/loop.py": "from asrforge.model.build import x\nfrom ..data import synth\n",
            "matrix/__init__.py": "",
            "matrix/run.py": "from asrforge.data.synth import make\nfrom asrforge.data import dataset\n",
            "matrix/lazy.py": "_EXPORTS = {'Trainer': 'asrforge.train.loop'}\n",
            "matrix/typing_only.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from asrforge.model import build\n"
            ),
        },
    )
    assert violations(root, TABLE) == [
        "asrforge.matrix.lazy:1 imports asrforge.train.loop: layer matrix may not import train",
        "asrforge.matrix.run:2 imports asrforge.data.dataset: layer matrix may not import data",
        "asrforge.matrix.typing_only:3 imports asrforge.model.build: layer matrix may not import "
        "model",
        "asrforge.model.decode:2 imports asrforge.train.loop: layer model may not import train",
    ]


@pytest.mark.fast
def test_a_module_of_an_unlisted_layer_fails(tmp_path):
    root = _package(tmp_path, {"errors.py": "", "utils.py": "import os\n"})
    assert violations(root, TABLE) == [
        "asrforge.utils: its layer is not in the table of architecture.md"
    ]


@pytest.mark.fast
def test_the_real_document_parses_as_the_synthetic_one_does():
    """The real table uses the conventions the synthetic one exercises."""
    layer_of, allowed = layer_table(DOC.read_text(encoding="utf-8"))
    assert layer_of["config"] == "config" and layer_of["__main__"] == "cli"
    assert allowed["recipes"] == {ALL} and allowed["errors"] == set()
    assert (
        allowed["matrix"] >= {"data.synth", "checkpoint.disk"} and "data" not in allowed["matrix"]
    )
