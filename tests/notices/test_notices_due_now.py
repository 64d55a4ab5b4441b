"""Interruption documents read as the clouds document them (issue 31, item 8): a termination
notice whose time is missing, unreadable or already past is acted on at once with the
longest budget that cloud documents (AWS: 2 minutes; Azure Preempt: 30 s), never a zero
budget that kills the attempt, and never dropped as malformed — for every cloud that sends a
time (GCP sends none: its deadline is always the documented 30 s from when the notice is
seen). Actions and event types are matched without regard to case (``"Terminate"``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from spotguard.notices.aws import AwsImdsSource
from spotguard.notices.azure import AzureEventsSource
from spotguard.notices.base import Cloud, NoticeKind
from spotguard.notices.fleet import SPOT_WARNING, parse_message
from spotguard.simulator import MetadataSim, SimClient

AWS_BUDGET = timedelta(seconds=120)
AZURE_BUDGET = timedelta(seconds=30)


def _acts_now(deadline: datetime, before: datetime, budget: timedelta = AWS_BUDGET) -> bool:
    """The notice is due now, with ``budget`` to act in (read between ``before`` and now)."""
    return before + budget <= deadline <= datetime.now(UTC) + budget


@pytest.fixture
async def aws(sim: MetadataSim) -> AsyncIterator[AwsImdsSource]:
    src = AwsImdsSource(poll_interval=0.05, timeout=1.0)
    yield src
    await src.aclose()


@pytest.mark.parametrize(
    "body",
    [
        '{"action": "terminate"}',
        '{"action": "terminate", "time": "in a bit"}',
        '{"action": "Terminate", "time": null}',
        '{"action": "TERMINATE", "time": "2001-01-01T00:00:00Z"}',  # long past: a skewed clock
    ],
)
async def test_aws_spot_action_without_a_readable_time_acts_now_with_two_minutes(
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
    assert _acts_now(notice.deadline, before)
    assert await aws.poll() == []  # the same answer again is the same notice, not a new one


async def test_aws_spot_action_in_another_case_is_a_preempt_notice(
    aws: AwsImdsSource, client: SimClient
) -> None:
    """``{"action": "Terminate", "time": ...}`` was dropped as an unknown action and the poll
    retried for ever: no notice, no checkpoint."""
    at = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=90)
    body = json.dumps({"action": "Terminate", "time": at.strftime("%Y-%m-%dT%H:%M:%SZ")})
    await client.fault("garbage", path="spot/instance-action", body=body)
    [notice] = await aws.poll()
    assert (notice.kind, notice.action, notice.deadline) == (NoticeKind.PREEMPT, "terminate", at)


async def test_aws_scheduled_stop_without_a_readable_time_acts_now(
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
    assert _acts_now(notice.deadline, before)
    assert await aws.poll() == []


@pytest.mark.parametrize(
    ("event_type", "not_before"),
    [("Preempt", "Mon, 99 Foo"), ("preempt", ""), ("PREEMPT", None)],
)
async def test_azure_event_with_an_unreadable_not_before_acts_now_with_30_seconds(
    sim: MetadataSim, client: SimClient, event_type: str, not_before: str | None
) -> None:
    doc = {"DocumentIncarnation": 7, "Events": [
        {"EventId": "E-1", "EventType": event_type, "ResourceType": "VirtualMachine",
         "Resources": ["vm"], "EventStatus": "Scheduled", "NotBefore": not_before}]}  # fmt: skip
    await client.fault("garbage", path="scheduledevents", body=json.dumps(doc))
    source = AzureEventsSource(poll_interval=0.05, timeout=1.0)
    try:
        before = datetime.now(UTC)
        [notice] = await source.poll()
        assert (notice.cloud, notice.kind) == (Cloud.AZURE, NoticeKind.PREEMPT)
        assert _acts_now(notice.deadline, before, AZURE_BUDGET)
    finally:
        await source.aclose()


@pytest.mark.parametrize("time", [None, "not a time"])
def test_fleet_spot_warning_without_a_readable_time_acts_now_with_two_minutes(
    time: str | None,
) -> None:
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
    assert _acts_now(notice.deadline, before)
