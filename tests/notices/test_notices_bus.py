"""The notice bus: dedup, withdrawal, and survival of failing sources (real HTTP sources)."""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import timedelta

import pytest

from spotguard.errors import ConfigError, MetadataUnavailable
from spotguard.notices.aws import AwsImdsSource
from spotguard.notices.azure import AzureEventsSource
from spotguard.notices.backoff import Backoff
from spotguard.notices.base import Cloud, Notice, NoticeKind
from spotguard.notices.bus import NoticeBus
from spotguard.notices.gcp import GcpMetadataSource
from spotguard.notices.manual import ManualSource
from spotguard.simulator import MetadataSim, SimClient
from spotguard.testing import ScriptedSource, make_notice


async def _take(bus: NoticeBus, count: int, within: float = 10.0) -> list[Notice]:
    async def collect() -> list[Notice]:
        out: list[Notice] = []
        async for notice in bus:
            out.append(notice)
            if len(out) == count:
                break
        return out

    return await asyncio.wait_for(collect(), within)


def test_backoff_grows_caps_and_resets() -> None:
    b = Backoff(initial=0.5, cap=4.0, rng=random.Random(7))
    ceilings = [b.ceiling(n) for n in range(1, 7)]
    assert ceilings == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    delays = [b.next() for _ in range(6)]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert b.failures == 6
    b.reset()
    assert b.failures == 0 and b.next() <= 0.5
    with pytest.raises(ValueError):
        Backoff(initial=2.0, cap=1.0)


async def test_duplicates_from_two_sources_are_delivered_once(
    sim: MetadataSim, client: SimClient
) -> None:
    a = AwsImdsSource(poll_interval=0.05, name="aws-a")
    b = AwsImdsSource(poll_interval=0.05, name="aws-b")
    async with NoticeBus([a, b]) as bus:
        await client.send("aws", "preempt")
        await client.send("aws", "rebalance")
        got = await _take(bus, 2)
        # both sources saw both notices; several more polls bring no copy
        with pytest.raises(TimeoutError):
            await _take(bus, 1, within=0.3)
    assert sorted(n.kind.value for n in got) == ["preempt", "rebalance"]
    assert bus.health["aws-a"].notices >= 2 and bus.health["aws-b"].notices >= 2
    assert {n.id for n in bus.active()} == {n.id for n in got}


async def test_scripted_duplicates_updates_and_withdrawals() -> None:
    n = make_notice(NoticeKind.MAINTENANCE, cloud="aws", notice_id="ev-1", in_seconds=600)
    moved = Notice(n.id, n.cloud, n.kind, n.deadline + timedelta(seconds=60), n.action)
    stray = make_notice(cloud="aws", notice_id="never-seen", cancelled=True)
    script = [stray, n, n, moved, moved, moved.cancel(), moved.cancel()]
    bus = NoticeBus([ScriptedSource(script)])
    got = [x async for x in bus]
    assert [(x.id, x.deadline, x.cancelled) for x in got] == [
        ("ev-1", n.deadline, False),
        ("ev-1", moved.deadline, False),
        ("ev-1", moved.deadline, True),
    ]
    assert bus.active() == []
    await bus.aclose()


async def test_failing_source_is_restarted_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spotguard.notices")
    first, second = make_notice(notice_id="a"), make_notice(notice_id="b")
    flaky = ScriptedSource(
        [first, MetadataUnavailable("refused"), RuntimeError("bug"), second], name="flaky"
    )
    async with NoticeBus([flaky], backoff_initial=0.01, backoff_max=0.05) as bus:
        got = [x async for x in bus]
    assert [x.id for x in got] == ["a", "b"]
    assert flaky.watches == 3 and flaky.closed
    messages = [r.getMessage() for r in caplog.records]
    assert any("notice source flaky failed: refused; retrying in" in m for m in messages)
    assert any("notice source flaky failed: RuntimeError: bug" in m for m in messages)
    assert any("notice source flaky works again after 2 failure(s)" in m for m in messages)
    assert bus.health["flaky"].state == "finished"


async def test_garbage_timeouts_5xx_and_refusals_never_stop_the_bus(
    sim: MetadataSim, client: SimClient, closed_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="spotguard.notices")
    await client.fault("garbage", cloud="aws", count=3)
    await client.fault("error", cloud="gcp", status=503, count=3)
    await client.fault("hang", cloud="azure", count=2, hang_s=5)
    # only azure's hang needs a short timeout; the others answer at once, and a short timeout
    # on a loaded machine turned aws's garbage answers into timeouts (seen once in CI)
    sources = [
        AwsImdsSource(poll_interval=0.05, timeout=3.0),
        GcpMetadataSource(timeout=3.0, long_poll=5),
        AzureEventsSource(poll_interval=0.05, timeout=0.3),
        AwsImdsSource(closed_url, poll_interval=0.05, timeout=0.5, name="nowhere"),
    ]
    async with NoticeBus(sources, backoff_initial=0.05, backoff_max=0.2) as bus:
        for cloud in ("aws", "gcp", "azure"):
            await client.send(cloud, "preempt")
        got = await _take(bus, 3, within=15)
        assert {n.cloud for n in got} == {Cloud.AWS, Cloud.GCP, Cloud.AZURE}
        assert bus.health["nowhere"].state == "failing"
        assert "Connect" in (bus.health["nowhere"].last_error or "") or "refused" in (
            bus.health["nowhere"].last_error or ""
        )
    text = "\n".join(r.getMessage() for r in caplog.records)
    for name in ("aws", "gcp", "azure", "nowhere"):
        assert f"notice source {name} failed:" in text
    assert "not UTF-8 text" in text  # the garbage answer to the token request
    assert "HTTP 503" in text and "no answer within" in text
    assert "notice source aws works again" in text


async def test_acknowledge_routes_to_the_source_that_can(
    sim: MetadataSim, client: SimClient
) -> None:
    async with NoticeBus(
        [AzureEventsSource(poll_interval=0.05), AwsImdsSource(poll_interval=0.05)]
    ) as bus:
        sent = await client.send("azure", "maintenance", action="Freeze")
        await client.send("aws", "preempt")
        got = {n.cloud: n for n in await _take(bus, 2)}
        assert await bus.acknowledge(got[Cloud.AZURE]) is True
        assert await bus.acknowledge(got[Cloud.AWS]) is False
    assert (await client.stats())["acks"] == [sent["id"]]


async def test_manual_drain_and_cancel_through_the_bus() -> None:
    manual = ManualSource()
    async with NoticeBus([manual]) as bus:
        notice = await manual.drain("kernel upgrade", 90)
        assert notice.raw["reason"] == "kernel upgrade"
        assert (notice.cloud, notice.kind) == (Cloud.MANUAL, NoticeKind.DRAIN)
        assert notice.seconds_left() == pytest.approx(90, abs=1)
        cancelled = await manual.cancel(notice.id)
        assert cancelled is not None and await manual.cancel(notice.id) is None
        await manual.aclose()
        got = [x async for x in bus]
    assert [(x.id, x.cancelled) for x in got] == [(notice.id, False), (notice.id, True)]
    with pytest.raises(ConfigError):
        await ManualSource().drain("x", 0)


def test_source_names_must_differ() -> None:
    with pytest.raises(ValueError, match="distinct names"):
        NoticeBus([ScriptedSource([]), ScriptedSource([])])
