"""Each constant several layers need is defined once, in the module that owns it; a second copy
written anywhere else in asrforge/ fails here, naming the file and line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from asrforge.data.sample_rate import SAMPLE_RATE
from asrforge.errors import ExitCode
from asrforge.model.dtypes import PRECISION_DTYPES, is_full_precision, precision_dtype
from asrforge.text.languages import UNSPACED_LANGUAGES

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]

# (what, its owner, how a second copy would be spelled[, the folders that could write one])
COPIES = [
    ("the sample rate", "data/sample_rate.py", re.compile(r"\b16_?000\b")),
    ("the weights' alias key", "checkpoint/shards.py", re.compile(r"[\"']asrforge_aliases[\"']")),
    ("a precision's dtype", "model/dtypes.py", re.compile(r"[\"'](bf16|fp16|fp32|no)[\"']\s*:\s*torch\.")),
    ("the unspaced languages", "text/languages.py", re.compile(r"\{\s*[\"']zh[\"'],\s*[\"']ja[\"']")),
    ("a language value resolved", "text/languages.py", re.compile(r"find_language_code\([^)]*\)\s+or\b")),
    # an exit code is returned or compared by its name, never its number
    ("an exit code", "errors.py",
     re.compile(r"\breturn (1|2|75|130)\b|returncode == (2|75)\b|\bEXIT_INTERRUPTED\b"),
     ("cli/", "matrix/", "recipes/", "train/loop.py", "__main__.py")),
]  # fmt: skip


def python_lines(path: Path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        if code.strip():
            yield number, code


@pytest.mark.parametrize("copy", COPIES, ids=[c[0] for c in COPIES])
def test_a_constant_is_written_only_by_its_owner(copy):
    what, owner, spelling, *scope = copy
    package = ROOT / "asrforge"
    modules = [p.relative_to(package).as_posix() for p in sorted(package.rglob("*.py"))]
    copies = [
        f"asrforge/{module}:{n}: {line.strip()}"
        for module in modules
        if module != owner and (not scope or module.startswith(scope[0]))
        for n, line in python_lines(package / module)
        if spelling.search(line) and "return 1;" not in line  # the report's JavaScript
    ]
    assert not copies, f"{what} belongs to asrforge/{owner}:\n" + "\n".join(copies)


def test_each_owner_holds_what_the_others_read():
    assert SAMPLE_RATE == 16_000
    assert {"zh", "ja", "th"} <= UNSPACED_LANGUAGES
    assert precision_dtype("bf16") is torch.bfloat16 and precision_dtype("fp16") is torch.float16
    assert is_full_precision("no") and is_full_precision("fp32") and not is_full_precision("bf16")
    assert set(PRECISION_DTYPES) == {"no", "fp32", "bf16", "fp16"}
    assert [int(c) for c in ExitCode] == [0, 1, 2, 75, 130, 141]
    assert f"{ExitCode.INTERRUPTED:d}" == "75"


def test_the_spellings_catch_a_copy():
    planted = {
        "the sample rate": "SR = 16000",
        "the weights' alias key": 'KEY = "asrforge_aliases"',
        "a precision's dtype": 'MAP = {"bf16": torch.bfloat16}',
        "the unspaced languages": '_UNSPACED = {"zh", "ja"}',
        "a language value resolved": "code = find_language_code(x) or x",
        "an exit code": "        return 130",
    }
    for what, _owner, spelling, *_scope in COPIES:
        assert spelling.search(planted[what]), what
