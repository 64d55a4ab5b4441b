"""docs/operations.md's fault table stays true: every test it names exists (not a fault case
itself; the conftest leaves it out of the count)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent.parent


def test_every_test_named_in_the_fault_table_exists() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text.split("## Fault table", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)", table)
    assert len(named) >= 10, named
    for path, name in named:
        source = (ROOT / path).read_text()
        assert re.search(rf"^(async )?def {name}\(", source, re.MULTILINE), f"{path}::{name}"
    # the shorter `::name` references after a full one point into the same file
    for row in table.splitlines():
        full = re.findall(r"`(tests/[\w/]+\.py)::\w+", row)
        for short in re.findall(r"`::(\w+)`", row):
            source = (ROOT / full[0]).read_text()
            assert re.search(rf"^(async )?def {short}\(", source, re.MULTILINE), short
