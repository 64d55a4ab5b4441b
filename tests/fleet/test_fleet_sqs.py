"""The fleet notice source against a real moto server: EventBridge rules (the same patterns the
Terraform module installs) deliver events into SQS, and SqsFleetSource turns them into notices."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from spotguard.notices import aws
from spotguard.notices.base import Cloud, Notice, NoticeKind, NoticeSource
from spotguard.notices.fleet import FleetSettings, SqsFleetSource

ACCOUNT = "123456789012"


def put(events: Any, source: str, detail_type: str, detail: dict[str, Any], **kw: Any) -> None:
    entry = {"Source": source, "DetailType": detail_type, "Detail": json.dumps(detail), **kw}
    answer = events.put_events(Entries=[entry])
    assert answer["FailedEntryCount"] == 0, answer


async def take(it: AsyncIterator[Notice], n: int, within: float = 30.0) -> list[Notice]:
    """The next ``n`` notices of one ``watch()`` iterator."""
    return [await asyncio.wait_for(anext(it), within) for _ in range(n)]


async def drained(it: AsyncIterator[Notice]) -> None:
    """Ask for one more notice: the source deletes the message it yielded last, polls the
    queue again and finds nothing (ends the iterator)."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(it), 2.5)


def queue_depth(url: str) -> int:
    import boto3

    attrs = boto3.client("sqs").get_queue_attributes(
        QueueUrl=url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    return int(attrs["ApproximateNumberOfMessages"]) + int(
        attrs["ApproximateNumberOfMessagesNotVisible"]
    )


async def test_spot_warning_through_eventbridge_becomes_preempt_notice(
    fleet_queue: tuple[str, Any],
) -> None:
    url, events = fleet_queue
    # a warning sent now: the VM's instance-action time (two minutes later) is in the future,
    # so the agent reads the same deadline (a past one would be "act now", notices/timefmt.py)
    when = datetime.now(UTC).replace(microsecond=0)
    put(
        events,
        "aws.ec2",
        "EC2 Spot Instance Interruption Warning",
        {"instance-id": "i-0123456789abcdef0", "instance-action": "stop"},
        Resources=[f"arn:aws:ec2:us-east-1:{ACCOUNT}:instance/i-0123456789abcdef0"],
        Time=when,
    )
    source = SqsFleetSource(url, wait_time=1)
    assert isinstance(source, NoticeSource)
    try:
        it = source.watch()
        (notice,) = await take(it, 1)
        # The message is deleted once the consumer asks for the next notice.
        await drained(it)
    finally:
        await source.aclose()
    assert notice.cloud is Cloud.FLEET
    assert notice.kind is NoticeKind.PREEMPT
    assert notice.action == "stop"
    assert notice.deadline == when + timedelta(seconds=120)
    assert notice.raw["instance-id"] == "i-0123456789abcdef0"
    assert notice.raw["region"] == "us-east-1"
    assert notice.raw["account"] == ACCOUNT
    # The agent on that VM would read this from IMDS; both must carry the same id.
    stop_at = (when + timedelta(seconds=120)).strftime("%Y-%m-%dT%H:%M:%SZ")
    on_vm = aws.instance_action({"action": "stop", "time": stop_at})
    assert (notice.id, notice.deadline, notice.action) == (on_vm.id, on_vm.deadline, on_vm.action)
    assert not notice.cancelled
    assert queue_depth(url) == 0


async def test_rebalance_and_unrelated_events(fleet_queue: tuple[str, Any]) -> None:
    url, events = fleet_queue
    when = datetime(2026, 11, 22, 11, 30, 0, tzinfo=UTC)
    # Not matched by any rule: never reaches the queue.
    put(events, "aws.ec2", "EC2 Instance State-change Notification", {"instance-id": "i-1"})
    put(
        events,
        "aws.ec2",
        "EC2 Instance Rebalance Recommendation",
        {"instance-id": "i-00000000000000abc"},
        Time=when,
    )
    source = SqsFleetSource(url, wait_time=1)
    try:
        it = source.watch()
        (notice,) = await take(it, 1)
        await drained(it)
    finally:
        await source.aclose()
    assert notice.kind is NoticeKind.REBALANCE
    assert notice.raw["instance-id"] == "i-00000000000000abc"
    on_vm = aws.rebalance({"noticeTime": "2026-11-22T11:30:00Z"})
    assert (notice.id, notice.deadline) == (on_vm.id, on_vm.deadline)


async def test_health_scheduled_change_yields_one_notice_per_instance(
    fleet_queue: tuple[str, Any],
) -> None:
    url, events = fleet_queue
    arn = (
        "arn:aws:health:us-east-1::event/EC2/AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED/"
        "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED_1"
    )
    detail = {
        "eventArn": arn,
        "service": "EC2",
        "eventTypeCode": "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED",
        "eventTypeCategory": "scheduledChange",
        "statusCode": "upcoming",
        "startTime": "Sun, 29 Nov 2026 06:00:00 GMT",
        "affectedEntities": [
            {"entityValue": "i-0aaaaaaaaaaaaaaa1"},
            {"entityValue": "i-0aaaaaaaaaaaaaaa2"},
        ],
    }
    # An EC2 *issue* (not a scheduled change) is filtered out by the rule's pattern.
    put(events, "aws.health", "AWS Health Event", {**detail, "eventTypeCategory": "issue"})
    put(events, "aws.health", "AWS Health Event", detail)
    put(events, "aws.health", "AWS Health Event", {**detail, "statusCode": "closed"})
    source = SqsFleetSource(url, wait_time=1)
    try:
        it = source.watch()
        notices = await take(it, 4)
        await drained(it)
    finally:
        await source.aclose()
    upcoming = [n for n in notices if not n.cancelled]
    closed = [n for n in notices if n.cancelled]
    assert sorted(n.raw["instance-id"] for n in upcoming) == [
        "i-0aaaaaaaaaaaaaaa1",
        "i-0aaaaaaaaaaaaaaa2",
    ]
    assert {n.kind for n in notices} == {NoticeKind.MAINTENANCE}
    assert {n.action for n in notices} == {"AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED"}
    assert {n.deadline for n in notices} == {datetime(2026, 11, 29, 6, 0, tzinfo=UTC)}
    # The closing event withdraws the same notices (same ids, cancelled).
    assert {n.id for n in closed} == {n.id for n in upcoming}
    assert len({n.id for n in upcoming}) == 2


async def test_garbage_messages_are_logged_and_deleted(
    fleet_queue: tuple[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    import boto3

    url, events = fleet_queue
    sqs = boto3.client("sqs")
    sqs.send_message(QueueUrl=url, MessageBody="this is not json")
    sqs.send_message(QueueUrl=url, MessageBody=json.dumps({"detail-type": "x", "detail": {}}))
    sqs.send_message(
        QueueUrl=url,
        MessageBody=json.dumps(
            {
                "source": "aws.ec2",
                "detail-type": "EC2 Spot Instance Interruption Warning",
                "time": "2026-11-22T10:00:00Z",
                "detail": {"instance-action": "terminate"},  # no instance id
            }
        ),
    )
    put(
        events,
        "aws.ec2",
        "EC2 Spot Instance Interruption Warning",
        {"instance-id": "i-0fedcba9876543210", "instance-action": "terminate"},
    )
    source = SqsFleetSource(url, wait_time=1)
    with caplog.at_level(logging.WARNING, logger="spotguard.notices.fleet"):
        try:
            it = source.watch()
            (notice,) = await take(it, 1)
            await drained(it)
        finally:
            await source.aclose()
    assert notice.raw["instance-id"] == "i-0fedcba9876543210"
    dropped = [r for r in caplog.records if "dropping" in r.getMessage()]
    assert len(dropped) == 3
    assert all(getattr(r, "message_id", None) for r in dropped)
    assert queue_depth(url) == 0


async def test_undelivered_notice_stays_in_queue_for_redelivery(
    fleet_queue: tuple[str, Any],
) -> None:
    url, events = fleet_queue
    put(
        events,
        "aws.ec2",
        "EC2 Spot Instance Interruption Warning",
        {"instance-id": "i-0123456789abcdef1", "instance-action": "terminate"},
    )
    first = SqsFleetSource(url, wait_time=1, visibility_timeout=1)
    try:
        it = first.watch()
        (a,) = await take(it, 1)  # the consumer stops before asking for more
        await it.aclose()  # type: ignore[attr-defined]
    finally:
        await first.aclose()
    second = SqsFleetSource(url, wait_time=2)
    try:
        it = second.watch()
        (b,) = await take(it, 1)
        await drained(it)
    finally:
        await second.aclose()
    assert a.id == b.id  # the redelivered copy dedups against the first
    assert queue_depth(url) == 0


async def test_missing_queue_is_a_typed_error(aws_env: str) -> None:
    from spotguard.errors import NoticeError

    source = SqsFleetSource(f"{aws_env}/{ACCOUNT}/no-such-queue", wait_time=0)
    try:
        with pytest.raises(NoticeError, match="no-such-queue"):
            await take(source.watch(), 1, within=20)
    finally:
        await source.aclose()


def test_settings_build_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    from spotguard import config

    assert SqsFleetSource.from_settings(config.load(FleetSettings, config_file=None)) is None
    url = "https://sqs.eu-west-1.amazonaws.com/123456789012/spotguard-events"
    monkeypatch.setenv("SPOTGUARD_FLEET_QUEUE_URL", url)
    monkeypatch.setenv("SPOTGUARD_FLEET_WAIT_TIME", "5")
    source = SqsFleetSource.from_settings(config.load(FleetSettings, config_file=None))
    assert source is not None
    assert (source.queue_url, source.region, source.wait_time) == (url, "eu-west-1", 5)
