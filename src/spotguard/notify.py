"""Notifications: webhooks told what happens to a job, as node-termination handlers do.

Events (:class:`NotifyEvent`): ``notice``, ``frozen``, ``durable``, ``relaunched``,
``restored``, ``failed``, ``parked``, ``unparked``. Agents send the first three, ``restored``
and ``failed`` of their jobs; the controller sends ``relaunched``, ``restored`` and ``failed``
(its job states); park sends ``parked`` and ``unparked`` — each through
:meth:`Notifier.notify`, the one entry point any feature calls.

Settings (``[notify]``, ``SPOTGUARD_*``): ``webhook_url`` (a list: each gets the
:class:`Notification` as a JSON POST), ``slack_webhook_url`` (a list: each gets a Slack
``{"text": ...}`` message — Mattermost and Teams incoming webhooks take the same shape),
``notify_events`` (which events to send; default all) and ``webhook_timeout_s``.

Delivery never blocks or fails the caller: :meth:`Notifier.notify` queues a task; a failed POST
is retried (3 attempts, 1 s then 2 s apart) and then logged (``step: notify``) and counted. A
job's notifications go out one after the other in the order they happened (``durable`` is
never posted before its ``frozen`` is delivered or given up); other jobs' do not wait. A
notification is a courtesy, not the record: the controller's history and the agent's reports
are. :meth:`Notifier.aclose` lets queued notifications go out before a daemon exits.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar, Protocol

import aiohttp
from pydantic import BaseModel, Field

from spotguard import retry as retries
from spotguard.config import Settings
from spotguard.contracts import AnyEvent, EventKind

__all__ = [
    "Notification",
    "Notifier",
    "NotifyEvent",
    "NotifySettings",
    "from_agent_event",
    "from_transition",
    "slack_message",
]

log = logging.getLogger(__name__)

ATTEMPTS = 3
#: a webhook is tried :data:`ATTEMPTS` times, 1 s then 2 s apart (a redirect only once)
WEBHOOK_RETRY = retries.RetryPolicy(
    attempts=ATTEMPTS, initial=1.0, maximum=2.0**ATTEMPTS, jitter=0.0
)


class NotifyEvent(StrEnum):
    """What a notification is about."""

    NOTICE = "notice"  # an interruption notice (or a drain) arrived for the job's VM
    FROZEN = "frozen"  # the job's state is in host memory
    DURABLE = "durable"  # its image is complete in the store
    RELAUNCHED = "relaunched"  # the controller launched a matching instance for it
    RESTORED = "restored"  # it runs again (on the new instance)
    FAILED = "failed"  # a checkpoint or restore failed, or the controller gave up
    PARKED = "parked"  # its GPU and CPU were freed, its state kept
    UNPARKED = "unparked"  # it runs again after a park


class NotifySettings(Settings):
    """``[notify]``: where notifications go and which ones."""

    section: ClassVar[str] = "notify"
    webhook_url: list[str] = Field(
        default_factory=list, description="URLs that get each notification as a JSON POST"
    )
    slack_webhook_url: list[str] = Field(
        default_factory=list,
        description="Slack-compatible incoming webhooks (a {'text': ...} message each)",
    )
    notify_events: list[NotifyEvent] = Field(
        default_factory=lambda: list(NotifyEvent),
        description="Events to send (default: all)",
    )
    webhook_timeout_s: float = Field(5.0, gt=0, description="Seconds one webhook POST may take")


class Notification(BaseModel):
    """The JSON body a generic webhook receives."""

    schema_version: int = 1
    event: NotifyEvent
    job: str
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    source: str = Field(description="agent, controller or park")
    host: str = Field(default_factory=socket.gethostname)
    instance_id: str | None = None
    cloud: str | None = None
    image_url: str | None = None
    reason: str | None = Field(default=None, description="notice kind, error or why, in words")
    state: str | None = Field(default=None, description="the controller's job state, if from it")


_AGENT_EVENTS = {
    EventKind.NOTICE: NotifyEvent.NOTICE,
    EventKind.FROZEN: NotifyEvent.FROZEN,
    EventKind.DURABLE: NotifyEvent.DURABLE,
    EventKind.RESTORED: NotifyEvent.RESTORED,
    EventKind.CHECKPOINT_FAILED: NotifyEvent.FAILED,
    EventKind.RESTORE_FAILED: NotifyEvent.FAILED,
}

_VERBS = {
    NotifyEvent.NOTICE: "got an interruption notice",
    NotifyEvent.FROZEN: "is frozen (state in host memory)",
    NotifyEvent.DURABLE: "has a complete image",
    NotifyEvent.RELAUNCHED: "is being restored on a new instance",
    NotifyEvent.RESTORED: "runs again",
    NotifyEvent.FAILED: "FAILED",
    NotifyEvent.PARKED: "is parked",
    NotifyEvent.UNPARKED: "is unparked and runs again",
}


def _reason(ev: AnyEvent) -> str | None:
    error = getattr(ev, "error", None)
    if error is not None:
        return str(error.message)
    notice = getattr(ev, "notice", None)
    if notice is not None:
        return f"{notice.cloud} {notice.kind} notice" if notice.kind else None
    return None


def from_agent_event(ev: AnyEvent) -> Notification | None:
    """The notification for an agent report (None for kinds nobody is told about)."""
    event = _AGENT_EVENTS.get(ev.kind)
    if event is None:
        return None
    iid, cloud = ev.instance.instance_id, ev.instance.provider
    return Notification(
        event=event,
        job=ev.job,
        at=ev.at,
        source="agent",
        instance_id=str(iid) if iid else None,
        cloud=str(cloud) if cloud else None,
        image_url=getattr(ev, "image_url", None),
        reason=_reason(ev),
    )


class JobView(Protocol):
    """What a controller job record shows a notification (controller.state.JobRecord)."""

    name: str
    reason: str
    image_url: str | None
    instance: dict[str, Any]

    @property
    def state(self) -> StrEnum: ...


def from_transition(before: StrEnum | None, rec: JobView) -> Notification | None:
    """The notification for a controller job changing state (None for other moves):
    → ``restoring`` is ``relaunched``, ``restoring`` → ``protected`` is ``restored``,
    → ``failed`` is ``failed``."""
    now = rec.state.value
    was = before.value if before is not None else None
    if now == "restoring":
        event = NotifyEvent.RELAUNCHED
    elif now == "protected" and was == "restoring":
        event = NotifyEvent.RESTORED
    elif now == "failed":
        event = NotifyEvent.FAILED
    else:
        return None
    iid, cloud = rec.instance.get("instance_id"), rec.instance.get("cloud")
    return Notification(
        event=event,
        job=rec.name,
        source="controller",
        instance_id=str(iid) if iid else None,
        cloud=str(cloud) if cloud else None,
        image_url=rec.image_url,
        reason=rec.reason or None,
        state=now,
    )


def slack_message(n: Notification) -> dict[str, str]:
    """The Slack-compatible body: one line of text (mrkdwn)."""
    where = n.instance_id or n.host
    text = f"spotguard: job `{n.job}` {_VERBS[n.event]} on {where}"
    if n.reason:
        text += f": {n.reason}"
    if n.image_url:
        text += f" (image {n.image_url})"
    return {"text": text}


class Notifier:
    """Sends :class:`Notification` s to the configured webhooks, in the background."""

    def __init__(self, settings: NotifySettings) -> None:
        self.settings = settings
        self.sent = 0
        self.failed = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._last: dict[str, asyncio.Task[None]] = {}  # per job: the newest, to queue behind
        self._session: aiohttp.ClientSession | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.settings.webhook_url or self.settings.slack_webhook_url)

    def notify(self, n: Notification) -> None:
        """Queue ``n`` for every webhook, if its event is wanted. Never blocks, never raises;
        needs a running event loop (the daemons' own)."""
        if not self.enabled or n.event not in self.settings.notify_events:
            return
        before = self._last.get(n.job)
        task = asyncio.get_running_loop().create_task(
            self._deliver(n, after=before), name=f"notify-{n.event}"
        )
        self._tasks.add(task)
        self._last[n.job] = task
        task.add_done_callback(lambda t: self._done(n.job, t))

    def _done(self, job: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._last.get(job) is task:
            del self._last[job]

    def controller_transition(self, before: StrEnum | None, rec: JobView) -> None:
        """:meth:`notify` for a controller job's state change (the state DB calls this)."""
        n = from_transition(before, rec)
        if n is not None:
            self.notify(n)

    def agent_event(self, ev: AnyEvent) -> None:
        """:meth:`notify` for an agent report (the agent's reporter calls this)."""
        n = from_agent_event(ev)
        if n is not None:
            self.notify(n)

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Let queued notifications go out (at most ``timeout_s``), then close; those still
        pending are dropped with one log line saying how many."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        if self._tasks:
            log.warning(
                "webhook deliveries still pending at shutdown were dropped",
                extra={"step": "stop", "pending": len(self._tasks), "seconds": timeout_s},
            )
        for task in list(self._tasks):
            task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _deliver(self, n: Notification, after: asyncio.Task[None] | None = None) -> None:
        if after is not None:  # the job's previous notification first (delivered or given up)
            await asyncio.wait([after])
        body = n.model_dump(mode="json")
        posts = [(url, body) for url in self.settings.webhook_url]
        posts += [(url, slack_message(n)) for url in self.settings.slack_webhook_url]
        await asyncio.gather(*(self._post(url, data, n) for url, data in posts))

    async def _post(self, url: str, data: object, n: Notification) -> None:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.settings.webhook_timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout)
        session = self._session

        async def attempt() -> None:
            try:
                # never a redirect: a webhook answering 30x must not send the job's events (or
                # the POST itself) on to another host, e.g. the instance metadata endpoint
                async with session.post(url, json=data, allow_redirects=False) as resp:
                    if resp.status < 300:
                        return
                    if 300 <= resp.status < 400:
                        error = f"HTTP {resp.status} (a redirect: webhooks never follow one)"
                        raise _NotDelivered(error, again=False)
                    raise _NotDelivered(f"HTTP {resp.status}")
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise _NotDelivered(
                    (str(exc) or type(exc).__name__).replace(url, _redact(url))
                ) from exc

        try:
            await retries.call(attempt, WEBHOOK_RETRY, _NotDelivered.retried)
        except _NotDelivered as exc:
            self.failed += 1
            log.warning(
                "webhook failed",
                extra={
                    "step": "notify",
                    "url": _redact(url),
                    "event": n.event.value,
                    "job": n.job,
                    "error": exc.error,
                },
            )
            return
        self.sent += 1


class _NotDelivered(Exception):
    """One webhook attempt that did not deliver: why (no URL secrets), and whether another
    attempt may (a redirect is never retried)."""

    def __init__(self, error: str, *, again: bool = True) -> None:
        super().__init__(error)
        self.error = error
        self.again = again

    @staticmethod
    def retried(exc: BaseException) -> bool:
        return isinstance(exc, _NotDelivered) and exc.again


def _redact(url: str) -> str:
    """A webhook URL for the logs: scheme, host and port only — never its ``user:password``
    nor its path (Slack's path is the secret)."""
    from urllib.parse import urlparse

    p = urlparse(url)
    try:
        port = f":{p.port}" if p.port else ""
    except ValueError:
        port = ""
    host = p.hostname or "?"
    host = f"[{host}]" if ":" in host else host
    return f"{p.scheme}://{host}{port}/…"
