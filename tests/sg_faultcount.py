"""The fault matrix's count (tests/faults/: one fault case per test or parameter set): each
case's outcome recorded from its report, summed in the terminal summary — cases run, held,
known open (xfail) — and written as JSON where ``SPOTGUARD_FAULTS_REPORT`` names a file
(docs/operations.md, "Fault table"). Registered by tests/conftest.py, the root conftest, whose
hooks run in pytest-xdist's controller too (it receives every worker's reports)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

_PREFIX = "tests/faults/"
_OUTCOMES: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Record each fault case's outcome (a failed setup or teardown fails the case)."""
    path = report.nodeid.split("::")[0]
    if not path.startswith(_PREFIX) or path.endswith("test_faults_table.py"):
        return
    if report.when == "call" or report.outcome != "passed":
        outcome = "xfail" if hasattr(report, "wasxfail") else report.outcome
        if _OUTCOMES.get(report.nodeid) not in ("failed",):
            _OUTCOMES[report.nodeid] = outcome


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _OUTCOMES:
        return
    counts = {k: sum(1 for v in _OUTCOMES.values() if v == k) for k in set(_OUTCOMES.values())}
    held = counts.get("passed", 0)
    line = (
        f"fault cases: {len(_OUTCOMES)} run, {held} held, {counts.get('failed', 0)} failed, "
        f"{counts.get('xfail', 0)} known open (xfail), {counts.get('skipped', 0)} skipped"
    )
    terminalreporter.write_sep("-", line)
    out = os.environ.get("SPOTGUARD_FAULTS_REPORT")
    if out:
        Path(out).write_text(
            json.dumps({"cases": len(_OUTCOMES), "held": held, "outcomes": _OUTCOMES}, indent=1)
        )
