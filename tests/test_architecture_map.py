"""docs/ARCHITECTURE.md names every module of src/spotguard: a newcomer's map with a module
missing sends them reading the tree instead.

A module counts as named when its path under ``src/spotguard`` (``agent/api.py``) appears
anywhere in the document, or its file name (``api.py``) appears in its package's row of the
table (the row that starts with ``| `agent/` |``; a top-level module's row starts with its own
name), as ``api.py``, as `` `api` `` (the notice sources, the providers) or in a brace group
(``{files,meta}.py``). Package ``__init__`` and ``__main__`` files are not modules to find
one's way by.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "spotguard"
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _rows(text: str) -> dict[str, str]:
    """Each table row of the map by its first cell (``agent/``, ``notify.py``)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"\| `([\w./]+)` \|", line)
        if m:
            out.setdefault(m.group(1), line)
    return out


def _named(rel: Path, text: str, rows: dict[str, str]) -> bool:
    if rel.as_posix() in text:
        return True
    row = rows.get(f"{rel.parts[0]}/") if len(rel.parts) > 1 else rows.get(rel.name)
    if row is None:
        return False
    name = re.escape(rel.stem)
    # api.py, `api.py`, `aws` (one module per source), or in a brace group: {files,meta}.py
    return bool(
        re.search(rf"(?<![\w/]){name}\.py", row)
        or re.search(rf"`{name}`", row)
        or re.search(rf"\{{(?:\w+,)*{name}(?:,\w+)*\}}\.py", row)
    )


def unnamed() -> list[str]:
    text = DOC.read_text()
    rows = _rows(text)
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.name in ("__init__.py", "__main__.py"):
            continue
        if not _named(rel, text, rows):
            out.append(rel.as_posix())
    return out


def test_every_module_is_named_in_the_architecture_map() -> None:
    missing = unnamed()
    assert missing == [], f"docs/ARCHITECTURE.md does not name: {', '.join(missing)}"


def test_the_rule_finds_names_in_their_row_only() -> None:
    rows = _rows("| `store/` | `base.py`, {file,gcs}.py |\n| `agent/` | `api.py` |\n")
    assert _named(Path("store/base.py"), "", rows)
    assert _named(Path("store/gcs.py"), "", rows)
    assert not _named(Path("store/api.py"), "", rows)  # named in another package's row
    assert not _named(Path("agent/iapi.py"), "", rows)
    assert _named(Path("demo/ui.py"), "see demo/ui.py", rows)
