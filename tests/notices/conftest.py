"""Fixtures for the notice tests: a real metadata emulator on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sgtest import free_port
from spotguard.simulator import MetadataSim, SimClient


@pytest.fixture
async def sim(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MetadataSim]:
    """The emulator, with the endpoint variables of every cloud pointing at it."""
    async with MetadataSim() as server:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        yield server


@pytest.fixture
async def client(sim: MetadataSim) -> AsyncIterator[SimClient]:
    """A control-API client of :func:`sim` (over HTTP, as users drive it)."""
    async with SimClient(sim.url) as c:
        yield c


@pytest.fixture
def closed_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"
