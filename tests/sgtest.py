"""Helpers shared by the whole suite (``tests/`` is on ``sys.path`` through the root
``conftest.py``): a free local port, polling until a condition holds, and ``spotguard`` run as
a console script with none of the caller's ``SPOTGUARD_*`` settings. Helpers of one area stay
in that area's ``*_helpers.py``; the ones several areas copied live here, once."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    cond: Callable[[], object], what: str, limit: float = 60.0, every: float = 0.05
) -> None:
    """Poll ``cond`` every ``every`` seconds until it is true; fail the test, naming ``what``,
    after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(every)


def line_count(path: Path) -> int:
    """How many complete lines ``path`` holds (0 while it does not exist)."""
    return path.read_text().count("\n") if path.exists() else 0


def wait_lines(path: Path, n: int, timeout: float = 30.0) -> None:
    """Wait until ``path`` holds at least ``n`` lines (a job's output grew)."""
    end = time.monotonic() + timeout
    while line_count(path) < n:
        assert time.monotonic() < end, f"{path} did not reach {n} lines"
        time.sleep(0.05)


def without_spotguard_settings(**extra: str) -> dict[str, str]:
    """This process's environment without any ``SPOTGUARD_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(extra)
    return env


def sg(
    *args: str, env: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """``spotguard ARGS`` as a user runs it (the console script), without the caller's
    ``SPOTGUARD_*`` settings; ``env`` adds to that environment."""
    return subprocess.run(
        ["spotguard", *args],
        capture_output=True,
        text=True,
        env=without_spotguard_settings(**(env or {})),
        timeout=timeout,
    )
