"""Fixtures for the attacker tests: a real unprivileged user of the host (made with
``useradd`` for the test, removed with ``userdel`` after it), acting through ``runuser``, and
a directory it can reach (pytest's own tmp dirs are root-only)."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sec_helpers import Attacker, new_user


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("needs root, useradd and runuser")
    with new_user("sgatk") as user:
        yield user


@pytest.fixture
def world() -> Iterator[Path]:
    """A directory every user can reach (0755, root's), removed after the test."""
    d = Path(tempfile.mkdtemp(prefix="sg-sec-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_world() -> Iterator[Path]:
    """A name under /dev/shm (sticky, world-writable: where staging lives) for this test."""
    d = Path("/dev/shm") / f"sg-sec-{secrets.token_hex(4)}"
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
