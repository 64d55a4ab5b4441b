"""Fixtures for the freeze engine's tests: real CRIU, real jobs started by ``start_job``."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ckpt_helpers import Launch

from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu, has_external_pages
from spotguard.checkpoint.engine import Engine
from spotguard.checkpoint.jobs import JobInfo, list_jobs, start_job
from spotguard.checkpoint.settings import CheckpointSettings


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def settings(state_dir: Path, tmp_path: Path, criu_bin: str) -> CheckpointSettings:
    return CheckpointSettings(
        state_dir=state_dir, criu=criu_bin, shm_dir=tmp_path / "shm", criu_timeout=60
    )


@pytest.fixture
def patched(criu_bin: str) -> str:
    """``criu_bin``, which must have spotguard's ``--external-pages`` (patch 0004): a CRIU
    without it fails the test (a stale or unpatched install)."""
    if not has_external_pages(criu_bin):
        pytest.fail(f"{criu_bin} has no --external-pages: run scripts/install-criu")
    return criu_bin


@pytest.fixture
def engine(settings: CheckpointSettings, criu_bin: str) -> Engine:
    return Engine(Criu(criu_bin), settings=settings)


@pytest.fixture
async def launch(state_dir: Path) -> AsyncIterator[Launch]:
    """Start jobs; whatever is still alive at the end is killed (its namespace with it)."""

    async def _launch(argv: list[str], name: str, cwd: Path | None = None) -> JobInfo:
        return await start_job(argv, name, state_dir=state_dir, cwd=cwd)

    yield _launch
    for job in list_jobs(state_dir):
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], signal.SIGKILL)
