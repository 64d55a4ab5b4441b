"""The GCP metadata source against the emulator over real HTTP (long-poll included)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from spotguard.errors import MetadataMalformed, MetadataUnavailable
from spotguard.notices.base import Cloud, Notice, NoticeKind
from spotguard.notices.gcp import MAINTENANCE_NOTICE, PREEMPT_NOTICE, GcpMetadataSource
from spotguard.simulator import MetadataSim, SimClient


@pytest.fixture
async def source(sim: MetadataSim) -> AsyncIterator[GcpMetadataSource]:
    src = GcpMetadataSource(timeout=1.0, long_poll=30)
    yield src
    await src.aclose()


async def _next(stream: AsyncIterator[Notice], within: float = 5.0) -> Notice:
    return await asyncio.wait_for(anext(stream), within)


async def _parked(client: SimClient, requests: int) -> None:
    """Wait until the source has made ``requests`` requests (its long-polls are held)."""
    for _ in range(200):
        if (await client.stats())["counters"].get("gcp.requests", 0) >= requests:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the source never reached its long-poll")


async def test_long_poll_returns_on_change(source: GcpMetadataSource, client: SimClient) -> None:
    stream = source.watch()
    try:
        first = asyncio.ensure_future(_next(stream))
        await _parked(client, 4)  # two plain reads, then two held long-polls
        await asyncio.sleep(0.1)
        assert not first.done()  # nothing yet: the long-polls are held (timeout_sec=30)
        await client.send("gcp", "preempt")
        notice = await first  # far sooner than the 30 s long-poll would time out
    finally:
        await stream.aclose()
    assert (notice.cloud, notice.kind) == (Cloud.GCP, NoticeKind.PREEMPT)
    left = (notice.deadline - notice.received_at).total_seconds()
    assert left == pytest.approx(PREEMPT_NOTICE.total_seconds(), abs=0.05)
    counters = (await client.stats())["counters"]
    assert counters["gcp.requests"] <= 6


async def test_preemption_raised_before_start_is_seen(
    source: GcpMetadataSource, client: SimClient
) -> None:
    await client.send("gcp", "preempt")
    stream = source.watch()
    try:
        notice = await _next(stream)
    finally:
        await stream.aclose()
    assert notice.kind is NoticeKind.PREEMPT and notice.action == "PREEMPTED"


@pytest.mark.parametrize("action", ["TERMINATE_ON_HOST_MAINTENANCE", "MIGRATE_ON_HOST_MAINTENANCE"])
async def test_maintenance_event_and_its_end(
    source: GcpMetadataSource, client: SimClient, action: str
) -> None:
    stream = source.watch()
    try:
        first = asyncio.ensure_future(_next(stream))
        await _parked(client, 4)
        sent = await client.send("gcp", "maintenance", action=action)
        notice = await first
        assert (notice.kind, notice.action) == (NoticeKind.MAINTENANCE, action)
        left = (notice.deadline - notice.received_at).total_seconds()
        assert left == pytest.approx(MAINTENANCE_NOTICE.total_seconds(), abs=0.05)
        await client.cancel(sent["id"])  # maintenance-event back to NONE
        over = await _next(stream)
        assert over.id == notice.id and over.cancelled
    finally:
        await stream.aclose()


async def test_long_poll_timeout_without_change_yields_nothing(
    sim: MetadataSim, client: SimClient
) -> None:
    src = GcpMetadataSource(timeout=1.0, long_poll=1)
    stream = src.watch()
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(stream), 2.5)
    finally:
        await stream.aclose()
        await src.aclose()
    # the long-polls ended by timeout_sec and were renewed
    assert (await client.stats())["counters"]["gcp.requests"] >= 4


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ({"mode": "garbage"}, MetadataMalformed),
        ({"mode": "garbage", "body": "MAYBE"}, MetadataMalformed),
        ({"mode": "error", "status": 503}, MetadataUnavailable),
        ({"mode": "hang", "hang_s": 5}, MetadataUnavailable),
    ],
)
async def test_failures_are_typed(
    source: GcpMetadataSource,
    client: SimClient,
    fault: dict[str, object],
    error: type[Exception],
) -> None:
    await client.fault(cloud="gcp", path="preempted", **fault)  # type: ignore[arg-type]
    stream = source.watch()
    try:
        with pytest.raises(error):
            await _next(stream)
    finally:
        await stream.aclose()


async def test_emulator_requires_the_metadata_flavor_header(sim: MetadataSim) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{sim.url}/computeMetadata/v1/instance/preempted") as resp:
            assert resp.status == 403
        headers = {"Metadata-Flavor": "Google"}
        async with http.get(f"{sim.url}/computeMetadata/v1/instance/id", headers=headers) as r:
            assert r.status == 200 and r.headers["Metadata-Flavor"] == "Google"
            assert r.headers["ETag"]
