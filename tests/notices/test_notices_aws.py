"""The AWS IMDSv2 source against the emulator over real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from spotguard.errors import MetadataMalformed, MetadataUnavailable
from spotguard.notices.aws import REBALANCE_GRACE, AwsImdsSource
from spotguard.notices.base import Cloud, NoticeKind
from spotguard.notices.timefmt import parse_time
from spotguard.simulator import MetadataSim, SimClient


@pytest.fixture
async def source(sim: MetadataSim) -> AsyncIterator[AwsImdsSource]:
    src = AwsImdsSource(poll_interval=0.05, timeout=1.0)
    yield src
    await src.aclose()


async def test_no_event_is_404_and_not_an_error(source: AwsImdsSource, client: SimClient) -> None:
    assert await source.poll() == []
    assert await source.poll() == []
    stats = await client.stats()
    # three paths per poll, all answered (404 for the two single-event paths)
    assert stats["counters"]["aws.requests"] >= 6
    assert source.last_success is not None


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
async def test_spot_interruption_gives_preempt_with_deadline(
    source: AwsImdsSource, client: SimClient, action: str
) -> None:
    sent = await client.send("aws", "preempt", action=action, in_seconds=120)
    [notice] = await source.poll()
    assert (notice.cloud, notice.kind, notice.action) == (Cloud.AWS, NoticeKind.PREEMPT, action)
    assert notice.deadline == parse_time(sent["not_before"], "sim")
    assert not notice.cancelled
    assert await source.poll() == []  # seen once


async def test_rebalance_deadline_is_notice_time_plus_grace(
    source: AwsImdsSource, client: SimClient
) -> None:
    sent = await client.send("aws", "rebalance")
    [notice] = await source.poll()
    assert notice.kind is NoticeKind.REBALANCE
    assert notice.deadline == parse_time(sent["created"], "sim") + REBALANCE_GRACE
    assert timedelta(seconds=120) == REBALANCE_GRACE


async def test_scheduled_event_then_cancel_withdraws_it(
    source: AwsImdsSource, client: SimClient
) -> None:
    sent = await client.send("aws", "maintenance", action="instance-retirement", in_seconds=600)
    [notice] = await source.poll()
    assert notice.id == sent["id"] and notice.id.startswith("instance-event-")
    assert (notice.kind, notice.action) == (NoticeKind.MAINTENANCE, "instance-retirement")
    assert notice.deadline == parse_time(sent["not_before"], "sim")
    await client.cancel(sent["id"])
    [withdrawn] = await source.poll()
    assert withdrawn.id == notice.id and withdrawn.cancelled
    assert await source.poll() == []


async def test_completed_scheduled_event_is_ignored(
    source: AwsImdsSource, client: SimClient
) -> None:
    done = await client.send("aws", "maintenance")
    await client.update(done["id"], state="completed")
    assert await source.poll() == []


async def test_changed_instance_action_withdraws_the_old_notice(
    source: AwsImdsSource, client: SimClient
) -> None:
    sent = await client.send("aws", "preempt", action="stop", in_seconds=120)
    [first] = await source.poll()
    await client.update(sent["id"], action="terminate")
    withdrawn, second = await source.poll()
    assert (withdrawn.id, withdrawn.cancelled, withdrawn.action) == (first.id, True, "stop")
    assert (second.cancelled, second.action) == (False, "terminate")
    assert second.id != first.id


async def test_token_is_renewed_before_it_expires(sim: MetadataSim, client: SimClient) -> None:
    await client.configure(max_token_ttl=2)
    src = AwsImdsSource(poll_interval=0.1, token_ttl=60, timeout=1.0)
    try:
        for _ in range(25):
            await src.poll()
            await asyncio.sleep(0.1)
    finally:
        await src.aclose()
    counters = (await client.stats())["counters"]
    assert src.imds.tokens_fetched >= 2
    assert counters["aws.token_puts"] == src.imds.tokens_fetched
    assert counters.get("aws.unauthorized", 0) == 0


async def test_401_fetches_a_new_token_and_goes_on(
    source: AwsImdsSource, client: SimClient
) -> None:
    assert await source.poll() == []
    assert await client.revoke_tokens() == 1
    await client.send("aws", "preempt")
    [notice] = await source.poll()
    assert notice.kind is NoticeKind.PREEMPT
    counters = (await client.stats())["counters"]
    assert counters["aws.unauthorized"] == 1
    assert counters["aws.token_puts"] == 2


async def test_requests_without_token_are_refused_unless_imdsv1(
    sim: MetadataSim, client: SimClient
) -> None:
    await client.fault("error", path="/latest/api/token", status=403)
    strict = AwsImdsSource(timeout=1.0)
    relaxed = AwsImdsSource(timeout=1.0, imdsv1=True)
    try:
        with pytest.raises(MetadataUnavailable, match="token refused"):
            await strict.poll()
        with pytest.raises(MetadataUnavailable, match="401"):
            await relaxed.poll()  # the emulator enforces IMDSv2 by default
        await client.configure(imdsv1=True)
        await client.send("aws", "preempt")
        [notice] = await relaxed.poll()
        assert notice.kind is NoticeKind.PREEMPT
    finally:
        await strict.aclose()
        await relaxed.aclose()


@pytest.mark.parametrize(
    "body",
    [None, '{"action": "explode", "time": "2026-11-22T10:00:00Z"}', "[1]"],
)
async def test_garbage_and_wrong_content_are_malformed(
    source: AwsImdsSource, client: SimClient, body: str | None
) -> None:
    await client.fault("garbage", path="spot/instance-action", body=body)
    with pytest.raises(MetadataMalformed):
        await source.poll()


async def test_a_broken_path_does_not_hide_the_others(
    source: AwsImdsSource, client: SimClient
) -> None:
    await client.fault("error", path="events/recommendations/rebalance", status=500)
    await client.send("aws", "preempt")
    stream = source.watch()
    notice = await anext(stream)  # the spot interruption still gets through
    assert notice.kind is NoticeKind.PREEMPT
    with pytest.raises(MetadataUnavailable, match="HTTP 500"):
        await anext(stream)


async def test_polls_reuse_one_connection(source: AwsImdsSource, client: SimClient) -> None:
    for _ in range(10):
        await source.poll()
    stats = await client.stats()
    assert stats["counters"]["aws.requests"] >= 30
    assert stats["connections"]["aws"] == 1


async def test_unreachable_service_is_unavailable(closed_url: str) -> None:
    src = AwsImdsSource(closed_url, timeout=1.0)
    try:
        with pytest.raises(MetadataUnavailable, match="api/token"):
            await src.poll()
    finally:
        await src.aclose()
