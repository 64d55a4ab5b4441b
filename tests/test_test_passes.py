"""The test command's passes (``scripts/test-passes``, what ``make test`` and CI run): a
selection that only one pass has tests for runs that pass and skips the other; a selection
that neither has tests for fails; what PREPARE_SERIAL makes is waited for before the serial
pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PASSES = REPO / "scripts" / "test-passes"
ONE_TEST = "tests/test_foundation.py::test_every_module_has_at_most_500_lines"


def _passes(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SPOTGUARD_"))}
    pytest = str(Path(sys.executable).with_name("pytest"))
    return subprocess.run(
        [str(PASSES), *args],
        env={**base, "PYTEST": pytest, "MYPY": "", "TEST_WORKERS": "0", **env},
        capture_output=True, text=True, timeout=240, check=False, cwd=REPO,
    )  # fmt: skip


def test_a_selection_with_no_serial_test_runs_after_what_prepare_serial_makes(
    tmp_path: Path,
) -> None:
    mark = tmp_path / "made"
    run = _passes(ONE_TEST, PREPARE_SERIAL=f"sleep 1; echo preparing; touch {mark}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout
    assert "serial pass: no test selected" in run.stdout  # skipped, not failed
    assert "test-passes: ok" in run.stdout
    assert mark.exists()
    assert run.stdout.index("preparing") < run.stdout.index("2/2 serial tests")


def test_a_failed_prepare_serial_fails_the_run_and_says_why() -> None:
    run = _passes(ONE_TEST, PREPARE_SERIAL="echo cannot install; exit 3")
    assert run.returncode == 1
    assert "cannot install" in run.stdout
    assert "PREPARE_SERIAL (exit 3)" in run.stdout


def test_a_selection_of_nothing_fails() -> None:
    run = _passes("tests/test_foundation.py", "-k", "no_test_is_named_like_this")
    assert run.returncode == 1
    assert "FAILED: no pass ran a test" in run.stdout


def test_a_failing_pass_is_reported_as_failed_tests_not_as_no_test(tmp_path: Path) -> None:
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_fails() -> None:\n    assert False\n")
    run = _passes(str(failing), "-p", "no:cacheprovider", "--rootdir", str(REPO))
    assert run.returncode == 1
    assert "parallel pass (exit 1: tests failed)" in run.stdout
    assert "no pass ran a test" not in run.stdout


def test_the_serial_pass_start_is_signalled_for_work_beside_it(tmp_path: Path) -> None:
    """CI starts the dependency floors' tests beside the serial pass when this file appears:
    not before (PREPARE_SERIAL, beside the parallel pass, finds none), and even when the serial
    pass selects nothing."""
    started = tmp_path / "serial-started"
    run = _passes(
        ONE_TEST, PREPARE_SERIAL=f"test ! -e {started}", SPOTGUARD_SERIAL_STARTED=str(started)
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert started.exists()
