"""Fleet notices: EC2 interruption events routed by EventBridge into an SQS queue.

The on-VM sources (:mod:`spotguard.notices.aws`) only see a notice while the agent is alive.
The controller also watches the whole fleet through the queue that ``terraform/aws`` creates:
EventBridge rules forward

* ``aws.ec2`` / ``EC2 Spot Instance Interruption Warning``  → :attr:`NoticeKind.PREEMPT`
  (deadline = event time + 120 s; ``action`` = ``detail["instance-action"]``),
* ``aws.ec2`` / ``EC2 Instance Rebalance Recommendation``   → :attr:`NoticeKind.REBALANCE`,
* ``aws.health`` / ``AWS Health Event`` with ``service = EC2`` and
  ``eventTypeCategory = scheduledChange``                      → :attr:`NoticeKind.MAINTENANCE`
  (one notice per affected instance; deadline = the event's ``startTime``; a ``closed`` event
  is yielded as a cancellation),

so a job is recovered even when its agent died with the VM.

Message handling: a message is deleted once every notice it holds has been taken by the
consumer (the ``async for`` asked for the next one). A consumer that stops earlier leaves the
message in the queue; SQS delivers it again after the visibility timeout, with the same notice
ids, which the consumer drops as duplicates; after ``maxReceiveCount`` deliveries the queue's
redrive policy moves it to the dead-letter queue. A message that can never become a notice
(not JSON, not an EventBridge envelope, an event type this source does not handle, no instance
id) is logged and deleted at once: redelivering it would only repeat the same log line.

Notice ids follow one rule shared with the on-VM AWS source so that an agent's report and the
fleet's copy of the same interruption dedup: :func:`spot_notice_id` and
:func:`rebalance_notice_id` hash the very payload the instance metadata service shows the agent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from spotguard.config import Settings
from spotguard.errors import MetadataMalformed, MetadataUnavailable, NoticeError
from spotguard.notices.aws import REBALANCE_GRACE
from spotguard.notices.base import Cloud, Notice, NoticeKind, stable_id
from spotguard.notices.timefmt import due_time

log = logging.getLogger(__name__)

SPOT_WARNING = "EC2 Spot Instance Interruption Warning"
REBALANCE = "EC2 Instance Rebalance Recommendation"
HEALTH = "AWS Health Event"
#: The EventBridge patterns the Terraform module installs (terraform/aws/modules/spotguard/
#: events.tf); tests create the same rules in moto.
EVENT_PATTERNS: dict[str, dict[str, Any]] = {
    "spot-interruption": {"source": ["aws.ec2"], "detail-type": [SPOT_WARNING]},
    "rebalance": {"source": ["aws.ec2"], "detail-type": [REBALANCE]},
    "health-scheduled": {
        "source": ["aws.health"],
        "detail-type": [HEALTH],
        "detail": {"service": ["EC2"], "eventTypeCategory": ["scheduledChange"]},
    },
}
SPOT_WARNING_LEAD = timedelta(seconds=120)
#: Deadline given to a rebalance recommendation (AWS gives none): the on-VM source's grace.
_REBALANCE_WINDOW = REBALANCE_GRACE.total_seconds()
_INSTANCE_RE = re.compile(r"\bi-[0-9a-f]{8,17}\b")
_QUEUE_URL_RE = re.compile(r"^https://sqs[.-]([a-z0-9-]+)\.amazonaws\.com")
_THROTTLE_CODES = {"ThrottlingException", "RequestThrottled", "OverLimit", "ServiceUnavailable"}
_PERMANENT_CODES = {
    "AWS.SimpleQueueService.NonExistentQueue",
    "QueueDoesNotExist",
    "AccessDenied",
    "AccessDeniedException",
    "InvalidAddress",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "KMS.AccessDeniedException",
}


class FleetSettings(Settings):
    """Where the controller reads fleet notices (``[fleet]`` / ``SPOTGUARD_FLEET_*``)."""

    section: ClassVar[str] = "fleet"
    model_config = SettingsConfigDict(
        env_prefix="SPOTGUARD_FLEET_", extra="forbid", frozen=True, validate_default=True
    )

    queue_url: str | None = Field(
        None, description="SQS queue fed by the EventBridge rules (terraform output queue_url)"
    )
    region: str | None = Field(None, description="AWS region of the queue (default: from URL)")
    wait_time: int = Field(20, ge=0, le=20, description="SQS long-poll time in seconds")
    rebalance_window: float = Field(
        _REBALANCE_WINDOW,
        gt=0,
        description="Planning horizon in seconds given to rebalance notices",
    )


def spot_notice_id(action: str, deadline: datetime) -> str:
    """The id the on-VM AWS source gives the same spot warning.

    The agent hashes the IMDS ``spot/instance-action`` answer ``{"action", "time"}``; the time
    there is the termination time, which the EventBridge event announces as event time + 120 s,
    written as RFC 3339 seconds with ``Z``. The id holds no instance id (the agent's answer has
    none), so a consumer dedups per instance: ``(raw["instance-id"], id)``.
    """
    return stable_id(Cloud.AWS, NoticeKind.PREEMPT, {"action": action, "time": _iso(deadline)})


def rebalance_notice_id(notice_time: datetime) -> str:
    """The id the on-VM AWS source gives the same rebalance recommendation (IMDS answer
    ``{"noticeTime"}`` = the event time)."""
    return stable_id(Cloud.AWS, NoticeKind.REBALANCE, {"noticeTime": _iso(notice_time)})


def health_notice_id(instance_id: str, event_arn: str) -> str:
    """The id of a Health scheduled change for one instance. IMDS shows the same change under
    an ``EventId`` that the Health event does not carry, so these two cannot share an id."""
    return stable_id(
        Cloud.FLEET, NoticeKind.MAINTENANCE, {"instance-id": instance_id, "eventArn": event_arn}
    )


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _instance_ids(candidates: list[Any]) -> list[str]:
    """EC2 instance ids named in Health ``affectedEntities`` values or resource ARNs."""
    found = {m.group(0) for c in candidates if isinstance(c, str) and (m := _INSTANCE_RE.search(c))}
    return sorted(found)


def _account_from_arns(resources: Any) -> str | None:
    """The account id of the first resource ARN (``arn:aws:ec2:region:ACCOUNT:...``)."""
    for arn in resources if isinstance(resources, list) else []:
        parts = arn.split(":") if isinstance(arn, str) else []
        if len(parts) > 4 and parts[4].isdigit():
            return parts[4]
    return None


def _envelope_facts(event: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "event-id": event.get("id"),
        "detail-type": event.get("detail-type"),
        "source": event.get("source"),
        "region": event.get("region"),
        "account": event.get("account") or _account_from_arns(event.get("resources")),
        "time": event.get("time"),
    }


def parse_event(event: Any, *, rebalance_window: float = _REBALANCE_WINDOW) -> list[Notice]:
    """Turn one EventBridge envelope into notices. Raises :class:`MetadataMalformed` for
    anything that is not one of the three events of :data:`EVENT_PATTERNS`."""
    if not isinstance(event, dict) or not isinstance(event.get("detail"), dict):
        raise MetadataMalformed("not an EventBridge event (no detail object)")
    detail: dict[str, Any] = event["detail"]
    dtype = event.get("detail-type")
    facts = _envelope_facts(event)
    if dtype in (SPOT_WARNING, REBALANCE) and event.get("source") == "aws.ec2":
        iid = detail.get("instance-id")
        if not isinstance(iid, str) or not _INSTANCE_RE.fullmatch(iid):
            raise MetadataMalformed(f"{dtype} without a valid instance-id: {iid!r}")
        now = datetime.now(UTC)
        at = due_time(event.get("time"), f"{dtype} time", now=now)
        raw = {**facts, "instance-id": iid, "detail": detail}
        if dtype == SPOT_WARNING:
            # an unreadable event time reads as now: act at once, with AWS's two minutes
            deadline = at + SPOT_WARNING_LEAD
            action = detail.get("instance-action")
            if not isinstance(action, str) or not action:
                action = "terminate"
            return [
                Notice(
                    id=spot_notice_id(action, deadline),
                    cloud=Cloud.FLEET,
                    kind=NoticeKind.PREEMPT,
                    deadline=deadline,
                    action=action,
                    raw=raw,
                )
            ]
        return [
            Notice(
                id=rebalance_notice_id(at),
                cloud=Cloud.FLEET,
                kind=NoticeKind.REBALANCE,
                deadline=at + timedelta(seconds=rebalance_window),
                action="rebalance",
                raw=raw,
            )
        ]
    if dtype == HEALTH and event.get("source") == "aws.health":
        if detail.get("service") != "EC2" or detail.get("eventTypeCategory") != "scheduledChange":
            raise MetadataMalformed(
                f"health event {detail.get('service')}/{detail.get('eventTypeCategory')} "
                "is not an EC2 scheduled change"
            )
        arn = detail.get("eventArn")
        if not isinstance(arn, str) or not arn:
            raise MetadataMalformed("health event without eventArn")
        start = detail.get("startTime") or event.get("time")
        deadline = due_time(start, f"health event {arn} startTime")
        entities = [
            e.get("entityValue")
            for e in detail.get("affectedEntities") or []
            if isinstance(e, dict)
        ]
        ids = _instance_ids([*entities, *(event.get("resources") or [])])
        if not ids:
            raise MetadataMalformed(f"health event {arn} names no EC2 instance")
        closed = detail.get("statusCode") == "closed"
        action = detail.get("eventTypeCode")
        return [
            Notice(
                id=health_notice_id(iid, arn),
                cloud=Cloud.FLEET,
                kind=NoticeKind.MAINTENANCE,
                deadline=deadline,
                action=action if isinstance(action, str) else None,
                cancelled=closed,
                raw={**facts, "instance-id": iid, "instance-ids": ids, "detail": detail},
            )
            for iid in ids
        ]
    raise MetadataMalformed(f"unhandled event {event.get('source')!r} / {dtype!r}")


def parse_message(body: str, *, rebalance_window: float = _REBALANCE_WINDOW) -> list[Notice]:
    """Parse an SQS message body holding an EventBridge envelope (raw JSON, or wrapped in an
    SNS notification's ``Message`` when the queue is fed through a topic)."""
    try:
        event = json.loads(body)
        if isinstance(event, dict) and event.get("Type") == "Notification" and "Message" in event:
            event = json.loads(event["Message"])
    except (json.JSONDecodeError, TypeError) as exc:
        raise MetadataMalformed(f"message body is not JSON: {exc}") from exc
    return parse_event(event, rebalance_window=rebalance_window)


def _region_from_url(queue_url: str) -> str | None:
    m = _QUEUE_URL_RE.match(queue_url)
    return m.group(1) if m else None


class SqsFleetSource:
    """A :class:`~spotguard.notices.base.NoticeSource` long-polling the fleet event queue.

    ``region`` defaults to the one in ``queue_url`` (else the SDK's default);
    ``endpoint_url`` defaults to the SDK's (``AWS_ENDPOINT_URL`` is honoured).
    ``wait_time`` is the SQS long-poll in seconds (0-20); ``idle_sleep`` the pause after an
    empty answer when ``wait_time`` is 0. boto3 runs in a worker thread.
    """

    name = "aws-fleet-sqs"
    cloud = Cloud.FLEET

    def __init__(
        self,
        queue_url: str,
        *,
        region: str | None = None,
        wait_time: int = 20,
        endpoint_url: str | None = None,
        max_messages: int = 10,
        visibility_timeout: int | None = None,
        rebalance_window: float = _REBALANCE_WINDOW,
        idle_sleep: float = 1.0,
    ) -> None:
        if not 0 <= wait_time <= 20:
            raise ValueError("wait_time must be 0..20 seconds (SQS long-poll limit)")
        self.queue_url = queue_url
        self.region = region or _region_from_url(queue_url)
        self.wait_time = wait_time
        self.endpoint_url = endpoint_url
        self.max_messages = max(1, min(10, max_messages))
        self.visibility_timeout = visibility_timeout
        self.rebalance_window = rebalance_window
        self.idle_sleep = idle_sleep
        self._client: Any = None
        self._closed = False

    @classmethod
    def from_settings(cls, settings: FleetSettings) -> SqsFleetSource | None:
        """The source the settings ask for, or ``None`` when no queue is configured."""
        if not settings.queue_url:
            return None
        return cls(
            settings.queue_url,
            region=settings.region,
            wait_time=settings.wait_time,
            rebalance_window=settings.rebalance_window,
        )

    def _sqs(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            cfg = Config(
                read_timeout=self.wait_time + 15,
                connect_timeout=5,
                retries={"max_attempts": 3, "mode": "standard"},
            )
            self._client = boto3.session.Session().client(
                "sqs", region_name=self.region, endpoint_url=self.endpoint_url, config=cfg
            )
        return self._client

    def _call(self, op: str, **kwargs: Any) -> Any:
        """One SQS call, with the SDK's errors mapped to spotguard's (in the worker thread)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self._sqs(), op)(QueueUrl=self.queue_url, **kwargs)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            msg = f"SQS {op} on {self.queue_url} failed: {code or status}: {exc}"
            transient = code in _THROTTLE_CODES or status >= 500 or status == 0
            if code in _PERMANENT_CODES or not transient:
                raise NoticeError(msg) from exc
            raise MetadataUnavailable(msg) from exc
        except BotoCoreError as exc:
            raise MetadataUnavailable(f"SQS {op} on {self.queue_url} failed: {exc}") from exc

    async def _receive(self) -> list[dict[str, Any]]:
        kwargs: dict[str, Any] = {
            "MaxNumberOfMessages": self.max_messages,
            "WaitTimeSeconds": self.wait_time,
            "AttributeNames": ["ApproximateReceiveCount"],
        }
        if self.visibility_timeout is not None:
            kwargs["VisibilityTimeout"] = self.visibility_timeout
        answer = await asyncio.to_thread(self._call, "receive_message", **kwargs)
        messages = answer.get("Messages") or []
        return [m for m in messages if isinstance(m, dict)]

    async def _delete(self, receipt: str) -> None:
        await asyncio.to_thread(self._call, "delete_message", ReceiptHandle=receipt)

    async def watch(self) -> AsyncIterator[Notice]:
        """Yield each notice found in the queue; runs until :meth:`aclose` or cancellation."""
        while not self._closed:
            messages = await self._receive()
            if not messages and self.wait_time == 0:
                await asyncio.sleep(self.idle_sleep)
            for msg in messages:
                mid = msg.get("MessageId")
                try:
                    notices = parse_message(
                        str(msg.get("Body", "")), rebalance_window=self.rebalance_window
                    )
                except MetadataMalformed as exc:
                    log.warning(
                        "fleet queue: dropping a message that is no interruption event",
                        extra={"source": self.name, "message_id": mid, "error": str(exc)},
                    )
                    notices = []
                for notice in notices:
                    log.info(
                        "fleet notice",
                        extra={
                            "source": self.name,
                            "message_id": mid,
                            "notice": notice.id,
                            "kind": notice.kind.value,
                            "instance_id": notice.raw.get("instance-id"),
                            "cancelled": notice.cancelled,
                        },
                    )
                    yield notice
                if msg.get("ReceiptHandle"):
                    await self._delete(str(msg["ReceiptHandle"]))

    async def aclose(self) -> None:
        """Stop after the current poll and release the SDK client."""
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.close)


__all__ = [
    "EVENT_PATTERNS",
    "FleetSettings",
    "SqsFleetSource",
    "health_notice_id",
    "parse_event",
    "parse_message",
    "rebalance_notice_id",
    "spot_notice_id",
]
