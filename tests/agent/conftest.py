"""Agent test fixtures."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import TOKEN, EventSink, job_argv

from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.notices.settings import NoticeSettings


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


@dataclass
class Host:
    """One simulated VM's local places: state dir, in-memory staging, CRIU."""

    state: Path
    shm: Path
    criu: str

    def checkpoint_settings(self) -> CheckpointSettings:
        return CheckpointSettings(state_dir=self.state, shm_dir=self.shm, criu=self.criu)


@pytest.fixture
def host(tmp_path: Path, criu_bin: str) -> Iterator[Host]:
    shm = Path("/dev/shm") / f"spotguard-test-{uuid.uuid4().hex[:8]}"
    h = Host(tmp_path / "state", shm, criu_bin)
    try:
        yield h
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@asynccontextmanager
async def running_agent(
    host: Host,
    sink: EventSink | None,
    *,
    cloud: str = "aws",
    **agent: Any,
) -> AsyncIterator[Agent]:
    """An :class:`Agent` running in this event loop until the block ends."""
    import asyncio

    agent.setdefault("api_listen", "127.0.0.1:0")
    agent.setdefault("assignment", host.state / "no-assignment.json")
    if sink is not None:
        agent.setdefault("controller_url", sink.url)
        agent.setdefault("controller_token", TOKEN)
    settings = AgentSettings(**agent)
    notices = NoticeSettings(cloud=cloud, poll_interval=0.2, long_poll=5, timeout=2.0)
    daemon = Agent(settings, host.checkpoint_settings(), notices)
    task = asyncio.create_task(daemon.run())
    try:
        yield daemon
    finally:
        daemon.request_stop()
        await asyncio.wait_for(task, 60)
