"""The Azure Scheduled Events source against the emulator over real HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from spotguard.errors import MetadataMalformed, NoticeError
from spotguard.notices.azure import AzureEventsSource
from spotguard.notices.base import Cloud, NoticeKind
from spotguard.notices.timefmt import parse_time
from spotguard.simulator import MetadataSim, SimClient
from spotguard.testing import make_notice


@pytest.fixture
async def source(sim: MetadataSim) -> AsyncIterator[AzureEventsSource]:
    src = AzureEventsSource(poll_interval=0.05, timeout=1.0)
    yield src
    await src.aclose()


async def test_preempt_event(source: AzureEventsSource, client: SimClient) -> None:
    assert await source.poll() == []
    sent = await client.send("azure", "preempt", in_seconds=30)
    [notice] = await source.poll()
    assert (notice.id, notice.cloud, notice.kind) == (sent["id"], Cloud.AZURE, NoticeKind.PREEMPT)
    assert notice.action == "Preempt"
    assert notice.deadline == parse_time(sent["not_before"], "sim")


@pytest.mark.parametrize("action", ["Terminate", "Reboot", "Redeploy", "Freeze"])
async def test_maintenance_events(
    source: AzureEventsSource, client: SimClient, action: str
) -> None:
    sent = await client.send("azure", "maintenance", action=action, in_seconds=900)
    [notice] = await source.poll()
    assert (notice.id, notice.kind, notice.action) == (sent["id"], NoticeKind.MAINTENANCE, action)


async def test_event_leaving_the_document_is_withdrawn(
    source: AzureEventsSource, client: SimClient
) -> None:
    sent = await client.send("azure", "maintenance")
    [notice] = await source.poll()
    before = source.incarnation
    await client.cancel(sent["id"])
    [gone] = await source.poll()
    assert gone.id == notice.id and gone.cancelled
    assert source.incarnation == before + 1


async def test_unchanged_incarnation_yields_nothing(
    source: AzureEventsSource, client: SimClient
) -> None:
    await client.send("azure", "preempt")
    assert len(await source.poll()) == 1
    assert await source.poll() == []
    assert await source.poll() == []


async def test_acknowledge_starts_the_event(source: AzureEventsSource, client: SimClient) -> None:
    sent = await client.send("azure", "preempt")
    [notice] = await source.poll()
    await source.acknowledge(notice)
    stats = await client.stats()
    assert stats["acks"] == [sent["id"]]
    # the document changed (EventStatus Started) but the notice did not: nothing new
    assert await source.poll() == []
    with pytest.raises(NoticeError, match="cannot acknowledge"):
        await source.acknowledge(make_notice(cloud="aws"))


async def test_acknowledging_an_unknown_event_fails(source: AzureEventsSource) -> None:
    with pytest.raises(NoticeError, match="HTTP 400"):
        await source.acknowledge(make_notice(cloud="azure", notice_id="NOT-AN-EVENT"))


@pytest.mark.parametrize(
    "body",
    [
        None,
        '{"Events": []}',
        '{"DocumentIncarnation": 1, "Events": [{"EventId": "x", "EventType": "Explode"}]}',
    ],
)
async def test_garbage_and_wrong_content_are_malformed(
    source: AzureEventsSource, client: SimClient, body: str | None
) -> None:
    await client.fault("garbage", cloud="azure", body=body)
    with pytest.raises(MetadataMalformed):
        await source.poll()


async def test_emulator_requires_the_metadata_header(sim: MetadataSim) -> None:
    url = f"{sim.url}/metadata/scheduledevents?api-version=2020-07-01"
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as resp:
            assert resp.status == 400
        async with http.get(url, headers={"Metadata": "true"}) as resp:
            assert resp.status == 200
            assert (await resp.json())["Events"] == []
