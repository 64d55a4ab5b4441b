"""The fault matrix (issue 14): every case is a test against real processes and real servers.

Fixtures: the real stores and fault proxies of tests/store/store_servers.py, and ``settings``
(``sgtest.criu_settings``: checkpoint settings under the test's tmp_path). Each test here is
one fault case (a parametrised test: one case per parameter set); at the end of the run the
terminal summary counts them — cases run, cases that held, known-open ones (xfail, each with
its reason) — and, when ``SPOTGUARD_FAULTS_REPORT`` names a file, writes the same as JSON
(docs/operations.md, "Fault table", records the figure).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sgtest import criu_settings, store_servers

_m = store_servers()
settings = criu_settings  # the ``settings`` fixture: CRIU-backed checkpoint settings per test
gcs_server = _m.gcs_server  # type: ignore[attr-defined]
gcs_bucket = _m.gcs_bucket  # type: ignore[attr-defined]
s3_bucket = _m.s3_bucket  # type: ignore[attr-defined]
fault_proxy = _m.fault_proxy  # type: ignore[attr-defined]
gcs_fault_proxy = _m.gcs_fault_proxy  # type: ignore[attr-defined]

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
