"""Park tests drive the ``spotguard`` command line as a user would: real jobs, real CRIU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from park_helpers import Sg

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import list_jobs
from spotguard.park import record


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def config(tmp_path: Path, state_dir: Path, criu_bin: str) -> Path:
    cfg = tmp_path / "spotguard.toml"
    cfg.write_text(
        f'[checkpoint]\nstate_dir = "{state_dir}"\ncriu = "{criu_bin}"\n'
        f'shm_dir = "{tmp_path / "shm"}"\ncriu_timeout = 60\n'
        f'[park]\nmemory_dir = "{tmp_path / "shm" / "parked"}"\n'
    )
    return cfg


@pytest.fixture
def sg(config: Path) -> Sg:
    """Run ``spotguard --config <test config> ARGS``; never raises on a non-zero exit."""

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "spotguard", "--config", str(config), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    return run


@pytest.fixture(autouse=True)
def _cleanup(state_dir: Path) -> Iterator[None]:
    """Kill whatever the test left running: jobs (their namespaces) and wake listeners."""
    yield
    for rec in record.all_records(state_dir):
        if rec.waker_pid and proctree.alive(rec.waker_pid):
            os.kill(rec.waker_pid, signal.SIGKILL)
    for job in list_jobs(state_dir):
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], signal.SIGKILL)
