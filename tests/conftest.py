"""Shared fixtures. Every test talks to real processes and real local servers."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REQUIRE_CRIU = os.environ.get("SPOTGUARD_REQUIRE_CRIU") == "1"
MIN_TESTS = 1


def pytest_collection_finish(session: pytest.Session) -> None:
    """Never let "nothing collected" pass: an empty selection is a failure."""
    if len(session.items) < MIN_TESTS and not session.config.option.collectonly:
        raise pytest.UsageError("no tests collected: refusing to report success")


def find_criu() -> str | None:
    """A working CRIU >= 4.0, as scripts/install-criu installs it."""
    for cand in (
        os.environ.get("SPOTGUARD_CRIU"),
        "/opt/spotguard/criu/bin/criu",
        shutil.which("criu"),
    ):
        if cand and os.access(cand, os.X_OK):
            out = subprocess.run([cand, "--version"], capture_output=True, text=True).stdout
            if "Version: 4" in out or "Version: 5" in out:
                return cand
    return None


@pytest.fixture(scope="session")
def criu_bin() -> str:
    """Path of CRIU; skips (or fails in CI, where SPOTGUARD_REQUIRE_CRIU=1) when absent."""
    path = find_criu()
    if path is None or os.geteuid() != 0:
        msg = "needs root and CRIU >= 4.0 (run scripts/install-criu)"
        if REQUIRE_CRIU:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
