"""Fixtures of the operator's-day tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real process for an agent to protect (by pid)."""
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)  # as `setsid sleep`
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
