"""Agent test fixtures."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from agent_helpers import EventSink, Host, job_argv

from sgtest import store_servers
from spotguard.simulator import MetadataSim

_stores = store_servers()
s3_bucket = _stores.s3_bucket  # type: ignore[attr-defined]
fault_proxy = _stores.fault_proxy  # type: ignore[attr-defined]


@pytest.fixture
async def sim() -> AsyncIterator[MetadataSim]:
    """The metadata emulator, for an agent started as a process (``sim.env()``)."""
    async with MetadataSim() as s:
        yield s


@pytest.fixture
def sink() -> Iterator[EventSink]:
    s = EventSink().start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def reference_output() -> str:
    """What the sample job prints when nothing interrupts it."""
    return subprocess.run(job_argv(), capture_output=True, text=True, check=True).stdout


@pytest.fixture
def host(tmp_path: Path, criu_bin: str) -> Iterator[Host]:
    shm = Path("/dev/shm") / f"spotguard-test-{uuid.uuid4().hex[:8]}"
    h = Host(tmp_path / "state", shm, criu_bin)
    try:
        yield h
    finally:
        shutil.rmtree(shm, ignore_errors=True)
