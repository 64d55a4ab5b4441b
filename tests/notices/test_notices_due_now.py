"""A termination notice whose time is missing or unreadable is acted on at once (deadline =
now), never dropped as malformed — for every cloud that sends a time (GCP sends none: its
deadline is always the documented 30 s from when the notice is seen)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest

from spotguard.notices.aws import AwsImdsSource
from spotguard.notices.azure import AzureEventsSource
from spotguard.notices.base import Cloud, NoticeKind
from spotguard.notices.fleet import SPOT_WARNING, parse_message
from spotguard.simulator import MetadataSim, SimClient


def _due_now(deadline: datetime, before: datetime) -> bool:
    return before <= deadline <= datetime.now(UTC)


@pytest.fixture
async def aws(sim: MetadataSim) -> AsyncIterator[AwsImdsSource]:
    src = AwsImdsSource(poll_interval=0.05, timeout=1.0)
    yield src
    await src.aclose()


@pytest.mark.parametrize(
    "body", ['{"action": "terminate"}', '{"action": "terminate", "time": "in a bit"}']
)
async def test_aws_spot_action_without_a_readable_time_is_due_now(
    aws: AwsImdsSource, client: SimClient, body: str
) -> None:
    await client.fault("garbage", path="spot/instance-action", body=body)
    before = datetime.now(UTC)
    [notice] = await aws.poll()
    assert (notice.kind, notice.action, notice.cancelled) == (
        NoticeKind.PREEMPT,
        "terminate",
        False,
    )
    assert _due_now(notice.deadline, before)
    assert await aws.poll() == []  # the same answer again is the same notice, not a new one


async def test_aws_scheduled_stop_without_a_readable_time_is_due_now(
    aws: AwsImdsSource, client: SimClient
) -> None:
    event = {"EventId": "instance-event-0abc", "Code": "instance-stop", "State": "active",
             "NotBefore": "soon"}  # fmt: skip
    await client.fault("garbage", path="maintenance/scheduled", body=json.dumps([event]))
    before = datetime.now(UTC)
    [notice] = await aws.poll()
    assert (notice.id, notice.kind, notice.action) == (
        "instance-event-0abc",
        NoticeKind.MAINTENANCE,
        "instance-stop",
    )
    assert _due_now(notice.deadline, before)
    assert await aws.poll() == []


async def test_azure_event_with_an_unreadable_not_before_is_due_now(
    sim: MetadataSim, client: SimClient
) -> None:
    doc = {"DocumentIncarnation": 7, "Events": [
        {"EventId": "E-1", "EventType": "Preempt", "ResourceType": "VirtualMachine",
         "Resources": ["vm"], "EventStatus": "Scheduled", "NotBefore": "Mon, 99 Foo"}]}  # fmt: skip
    await client.fault("garbage", path="scheduledevents", body=json.dumps(doc))
    source = AzureEventsSource(poll_interval=0.05, timeout=1.0)
    try:
        before = datetime.now(UTC)
        [notice] = await source.poll()
        assert (notice.cloud, notice.kind) == (Cloud.AZURE, NoticeKind.PREEMPT)
        assert _due_now(notice.deadline, before)
    finally:
        await source.aclose()


@pytest.mark.parametrize("time", [None, "not a time"])
def test_fleet_spot_warning_without_a_readable_time_is_due_now(time: str | None) -> None:
    detail = {"instance-id": "i-0123456789abcdef0", "instance-action": "terminate"}
    event = {"version": "0", "id": "x", "detail-type": SPOT_WARNING, "source": "aws.ec2",
             "region": "us-east-1", "resources": [], "detail": detail}  # fmt: skip
    if time is not None:
        event["time"] = time
    before = datetime.now(UTC)
    [notice] = parse_message(json.dumps(event))
    assert (notice.cloud, notice.kind, notice.action) == (
        Cloud.FLEET,
        NoticeKind.PREEMPT,
        "terminate",
    )
    assert _due_now(notice.deadline, before)
