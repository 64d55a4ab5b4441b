"""AWS: interruption notices from the EC2 instance metadata service (IMDSv2).

Polls, every ``poll_interval`` seconds, over one keep-alive connection:

==================================================  ==========================================
``/latest/meta-data/spot/instance-action``          ``{"action": "terminate"|"stop"|"hibernate",
                                                    "time": RFC 3339}`` → ``preempt`` with that
                                                    action and deadline; 404 = no event
``/latest/meta-data/events/recommendations/         ``{"noticeTime": ...}`` → ``rebalance``;
rebalance``                                         AWS gives no deadline, so spotguard uses
                                                    noticeTime + :data:`REBALANCE_GRACE` as a
                                                    conservative one
``/latest/meta-data/events/maintenance/scheduled``  JSON array of events → ``maintenance`` with
                                                    ``id`` = EventId, ``action`` = Code, deadline
                                                    NotBefore; State ``canceled`` → cancelled;
                                                    ``completed`` → ignored
==================================================  ==========================================

A token comes from ``PUT /latest/api/token`` with the TTL header, is renewed before it expires
and fetched again on a 401. IMDSv1 (no token) is used only when allowed and the token call is
refused. A notice whose answer disappears or changes is withdrawn (yielded cancelled). A
notice whose time is missing, unreadable or past is acted on now with AWS's two minutes
(:func:`~spotguard.notices.timefmt.deadline_of`); actions are matched without regard to case.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from spotguard.errors import MetadataMalformed, MetadataUnavailable, NoticeError
from spotguard.notices.base import Cloud, Notice, NoticeKind, stable_id
from spotguard.notices.endpoints import aws_endpoint
from spotguard.notices.fetch import MetadataHttp, Reply
from spotguard.notices.timefmt import deadline_of, due_time

if TYPE_CHECKING:
    from spotguard.notices.settings import NoticeSettings

log = logging.getLogger(__name__)

TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
SCHEDULED = "/latest/meta-data/events/maintenance/scheduled"

#: deadline spotguard assumes after a rebalance recommendation (AWS promises none)
REBALANCE_GRACE = timedelta(seconds=120)
SPOT_ACTIONS = ("terminate", "stop", "hibernate")  # matched without regard to case
#: the warning AWS documents for a spot interruption: the budget of a notice whose time is
#: missing, unreadable or past (and of a scheduled event's unreadable NotBefore)
SPOT_WARNING = timedelta(seconds=120)


class ImdsClient:
    """IMDSv2 GETs with the token flow: renewed before expiry, fetched again on 401."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        token_ttl: int = 21600,
        imdsv1: bool = False,
        timeout: float = 2.0,
    ) -> None:
        self.endpoint = aws_endpoint(endpoint)
        self.token_ttl = token_ttl
        self.imdsv1 = imdsv1
        self.http = MetadataHttp("aws", timeout)
        self._token: str | None = None
        self._expires = 0.0  # monotonic time after which the token must not be used
        self._v1 = False
        self.tokens_fetched = 0

    @classmethod
    def from_settings(cls, s: NoticeSettings, endpoint: str | None = None) -> ImdsClient:
        """The client the ``[notices]`` settings describe (IMDSv1 fallback included)."""
        return cls(endpoint, token_ttl=s.token_ttl, imdsv1=s.imdsv1, timeout=s.timeout)

    async def _fetch_token(self) -> None:
        reply = await self.http.request(
            "PUT", self.endpoint + TOKEN_PATH, headers={TTL_HEADER: str(self.token_ttl)}
        )
        if reply.status == 200:
            token = reply.text().strip()
            if not token or len(token) > 512 or any(c.isspace() for c in token):
                raise MetadataMalformed(f"{reply.url}: answer is not an IMDSv2 token")
            self._token = token
            # the service may grant less than asked: it says how much in the TTL header
            try:
                ttl = min(self.token_ttl, int(reply.headers.get(TTL_HEADER, self.token_ttl)))
            except ValueError:
                ttl = self.token_ttl
            # renew when 80 % of the lifetime has passed (at least 1 s before the end)
            margin = max(1.0, 0.2 * ttl) if ttl > 1 else 0.5
            self._expires = time.monotonic() + max(0.5, ttl - margin)
            self.tokens_fetched += 1
            return
        if self.imdsv1 and reply.status in (403, 404, 405):
            if not self._v1:
                log.warning(
                    "IMDSv2 token refused; using IMDSv1 as configured",
                    extra={"status": reply.status},
                )
            self._v1 = True
            return
        raise MetadataUnavailable(f"{reply.url}: IMDSv2 token refused with HTTP {reply.status}")

    async def _headers(self) -> dict[str, str]:
        if not self._v1 and (self._token is None or time.monotonic() >= self._expires):
            await self._fetch_token()
        return {TOKEN_HEADER: self._token} if self._token and not self._v1 else {}

    async def get(self, path: str) -> Reply:
        """GET ``path``; on 401 the token is fetched again and the request repeated once."""
        reply = await self.http.request("GET", self.endpoint + path, headers=await self._headers())
        if reply.status == 401:
            self._token, self._v1 = None, False
            reply = await self.http.request(
                "GET", self.endpoint + path, headers=await self._headers()
            )
            if reply.status == 401:
                raise MetadataUnavailable(f"{reply.url}: 401 even with a fresh IMDSv2 token")
        return reply

    async def get_text(self, path: str) -> str | None:
        """The text at ``path``, or None on 404."""
        reply = await self.get(path)
        if reply.status == 404:
            return None
        if reply.status != 200:
            raise MetadataUnavailable(f"{reply.url}: HTTP {reply.status}")
        return reply.text()

    async def aclose(self) -> None:
        await self.http.aclose()


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise MetadataMalformed(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def instance_action(payload: Any) -> Notice:
    """``spot/instance-action`` → a preempt notice."""
    data = _object(payload, INSTANCE_ACTION)
    raw_action = data.get("action")
    action = raw_action.strip().lower() if isinstance(raw_action, str) else raw_action
    if action not in SPOT_ACTIONS:
        raise MetadataMalformed(f"{INSTANCE_ACTION}: unknown action {raw_action!r}")
    deadline = deadline_of(data.get("time"), f"{INSTANCE_ACTION} time", SPOT_WARNING)
    ident = stable_id(Cloud.AWS, NoticeKind.PREEMPT, data)
    return Notice(ident, Cloud.AWS, NoticeKind.PREEMPT, deadline, str(action), raw=dict(data))


def rebalance(payload: Any) -> Notice:
    """``events/recommendations/rebalance`` → a rebalance notice (deadline: see module doc)."""
    data = _object(payload, REBALANCE)
    noticed = due_time(data.get("noticeTime"), f"{REBALANCE} noticeTime")
    ident = stable_id(Cloud.AWS, NoticeKind.REBALANCE, data)
    return Notice(ident, Cloud.AWS, NoticeKind.REBALANCE, noticed + REBALANCE_GRACE, raw=dict(data))


def scheduled_events(payload: Any) -> list[Notice]:
    """``events/maintenance/scheduled`` → maintenance notices (cancelled ones included,
    completed ones left out)."""
    if not isinstance(payload, list):
        raise MetadataMalformed(f"{SCHEDULED}: expected a JSON array")
    out = []
    for item in payload:
        event = _object(item, SCHEDULED)
        event_id = event.get("EventId")
        state = str(event.get("State", "active")).lower()
        if not isinstance(event_id, str) or not event_id:
            raise MetadataMalformed(f"{SCHEDULED}: event without EventId")
        if state == "completed":
            continue
        if state not in ("active", "canceled", "cancelled"):
            raise MetadataMalformed(f"{SCHEDULED}: event {event_id} has unknown State {state!r}")
        deadline = deadline_of(
            event.get("NotBefore"), f"{SCHEDULED} {event_id} NotBefore", SPOT_WARNING
        )
        code = event.get("Code")
        notice = Notice(
            event_id,
            Cloud.AWS,
            NoticeKind.MAINTENANCE,
            deadline,
            str(code) if code else None,
            cancelled=state != "active",
            raw=dict(event),
        )
        out.append(notice)
    return out


def _changed(old: Notice, new: Notice) -> bool:
    """Whether ``new`` says something ``old`` did not. The same answer read again is the same
    notice, even when its time was unreadable and so read as "now" both times."""
    if old.raw and old.raw == new.raw:
        return old.cancelled != new.cancelled
    return (old.cancelled, old.deadline, old.action) != (new.cancelled, new.deadline, new.action)


def _one(parse: Callable[[Any], Notice]) -> Callable[[Any], list[Notice]]:
    return lambda payload: [parse(payload)]


#: the paths one poll reads, most urgent first, with what turns their answer into notices
PARSERS: tuple[tuple[str, Callable[[Any], list[Notice]]], ...] = (
    (INSTANCE_ACTION, _one(instance_action)),
    (REBALANCE, _one(rebalance)),
    (SCHEDULED, scheduled_events),
)


class AwsImdsSource:
    """Notices from the AWS instance metadata service (see the module docstring)."""

    name = "aws"
    cloud = Cloud.AWS

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        poll_interval: float = 1.0,
        token_ttl: int = 21600,
        imdsv1: bool = False,
        timeout: float = 2.0,
        name: str = "aws",
    ) -> None:
        self.name = name
        self.poll_interval = poll_interval
        self.imds = ImdsClient(endpoint, token_ttl=token_ttl, imdsv1=imdsv1, timeout=timeout)
        self.last_success: float | None = None  # monotonic time of the last complete poll
        # what each path last said, by notice id, so a change is yielded exactly once
        self._seen: dict[str, dict[str, Notice]] = {}

    @property
    def endpoint(self) -> str:
        return self.imds.endpoint

    async def _json(self, path: str) -> Any | None:
        text = await self.imds.get_text(path)
        if text is None:
            return None
        reply = Reply(200, text.encode(), url=self.endpoint + path)
        return reply.json()

    async def poll(self) -> list[Notice]:
        """One round over the three paths: the notices that are new, changed or withdrawn."""
        changes, failure = await self._round()
        if failure is not None:
            raise failure
        return changes

    async def _round(self) -> tuple[list[Notice], NoticeError | None]:
        # Every path is read even when one fails, so a broken rebalance answer never hides a
        # spot interruption; the first failure is returned with the others' changes.
        changes: list[Notice] = []
        failure: NoticeError | None = None
        for path, parse in PARSERS:
            try:
                payload = await self._json(path)
                current = [] if payload is None else parse(payload)
            except NoticeError as exc:
                failure = failure or exc
                continue
            changes.extend(self._diff(path, current))
        if failure is None:
            self.last_success = time.monotonic()
        return changes, failure

    def _diff(self, path: str, current: list[Notice]) -> list[Notice]:
        before = self._seen.get(path, {})
        now = {n.id: n for n in current}
        out = []
        for ident, gone in before.items():
            if ident not in now and not gone.cancelled and path != SCHEDULED:
                # an answer that went away or changed withdraws the notice it gave; scheduled
                # events that leave the list have simply run their course
                out.append(gone.cancel())
        kept: dict[str, Notice] = {}
        for ident, notice in now.items():
            old = before.get(ident)
            if old is None:
                if notice.cancelled:  # a cancellation of something never seen is noise
                    continue
                out.append(notice)
            elif _changed(old, notice):
                out.append(notice)
            else:
                notice = old  # the same answer: keep the deadline it was first read with
            kept[ident] = notice
        self._seen[path] = kept
        return out

    async def watch(self) -> AsyncIterator[Notice]:
        """Yield notices (and withdrawals) as polls find them; raises NoticeError on failure."""
        while True:
            changes, failure = await self._round()
            for notice in changes:
                yield notice
            if failure is not None:
                raise failure
            await asyncio.sleep(self.poll_interval)

    async def aclose(self) -> None:
        await self.imds.aclose()
