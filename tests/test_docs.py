"""The documents hold: docs/configuration.md is what ``asrforge config reference`` writes from
the schema now, and every relative link of README.md and docs/ names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asrforge.config.reference import render_markdown

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "bench" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]


def test_configuration_reference_is_generated_from_the_schema():
    written = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert written == render_markdown(), (
        "docs/configuration.md is stale: run `asrforge config reference > docs/configuration.md`"
    )


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_existing_files(doc):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8"))
    local = [t for t in targets if not re.match(r"[a-z]+:", t)]
    assert [t for t in local if not (doc.parent / t).exists()] == []
