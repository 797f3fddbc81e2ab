"""The files the code, the README and the docs point a reader to exist (a newcomer's run: three places named
`docs/config-tenants-priority.md`, renamed long before)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_docs_file_named_exists() -> None:
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src").rglob("*.py")]
    sources += [*(ROOT / "examples").rglob("*"), *(ROOT / "deploy").rglob("*.yaml")]
    named = {
        (source.relative_to(ROOT), match)
        for source in sources
        if source.is_file()
        for match in re.findall(r"docs/[a-z0-9-]+\.md", source.read_text(errors="replace"))
    }
    assert named  # (the pattern finds the references there are)
    missing = sorted((str(source), name) for source, name in named if not (ROOT / name).is_file())
    assert missing == []
