"""docs/architecture.md's "Files" table lists every module of src/metadist/, and nothing else:
the map a newcomer reads stays the house."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "metadist"


def _listed() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Files"):text.index("\n## ", text.index("## Files") + 1)]
    return re.findall(r"^\| `([^`]+\.py)` \|", section, flags=re.M)


def test_the_files_table_lists_every_module_once() -> None:
    listed = _listed()
    present = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
    missing = sorted(set(present) - set(listed))
    gone = sorted(set(listed) - set(present))
    assert not missing and not gone and len(listed) == len(set(listed)), (
        f"docs/architecture.md's Files table: missing {missing}, no longer present {gone}; "
        "give each module one line (the first line of its docstring)")
