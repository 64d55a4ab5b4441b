"""Azure: interruption notices from Scheduled Events (instance metadata service).

Polls ``/metadata/scheduledevents?api-version=2020-07-01`` (header ``Metadata: true``) every
``poll_interval`` seconds. The document is parsed again only when its ``DocumentIncarnation``
changes. Each event becomes a notice with ``id`` = EventId and deadline = NotBefore:

* ``Preempt`` → ``preempt`` (Azure gives about 30 s);
* ``Terminate``, ``Reboot``, ``Redeploy``, ``Freeze`` → ``maintenance`` with that ``action``;
* an event that leaves the document → the notice is withdrawn (yielded cancelled).

Azure holds an event until its NotBefore unless every affected VM approves it earlier;
:meth:`AzureEventsSource.acknowledge` sends that approval (``StartRequests``) and must be called
only once spotguard is ready for the event to go ahead (the image is durable).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from spotguard.errors import MetadataMalformed, MetadataUnavailable, NoticeError
from spotguard.notices.base import Cloud, Notice, NoticeKind
from spotguard.notices.endpoints import azure_endpoint
from spotguard.notices.fetch import MetadataHttp, Reply
from spotguard.notices.timefmt import parse_time

PATH = "/metadata/scheduledevents"
API_VERSION = "2020-07-01"
HEADERS = {"Metadata": "true"}
EVENT_KINDS = {
    "Preempt": NoticeKind.PREEMPT,
    "Terminate": NoticeKind.MAINTENANCE,
    "Reboot": NoticeKind.MAINTENANCE,
    "Redeploy": NoticeKind.MAINTENANCE,
    "Freeze": NoticeKind.MAINTENANCE,
}


def parse_document(payload: Any) -> tuple[int, list[Notice]]:
    """A Scheduled Events document → (DocumentIncarnation, notices)."""
    if not isinstance(payload, dict):
        raise MetadataMalformed(f"{PATH}: expected a JSON object")
    incarnation = payload.get("DocumentIncarnation")
    events = payload.get("Events")
    if not isinstance(incarnation, int) or not isinstance(events, list):
        raise MetadataMalformed(f"{PATH}: missing DocumentIncarnation or Events")
    notices = []
    for event in events:
        if not isinstance(event, dict):
            raise MetadataMalformed(f"{PATH}: an event is not a JSON object")
        notices.append(event_notice(event))
    return incarnation, notices


def event_notice(event: Mapping[str, Any]) -> Notice:
    """One scheduled event → a notice. An empty NotBefore (event started) means now."""
    event_id = event.get("EventId")
    event_type = event.get("EventType")
    if not isinstance(event_id, str) or not event_id:
        raise MetadataMalformed(f"{PATH}: event without EventId")
    kind = EVENT_KINDS.get(str(event_type))
    if kind is None:
        raise MetadataMalformed(f"{PATH}: event {event_id} has unknown EventType {event_type!r}")
    not_before = event.get("NotBefore")
    deadline = (
        parse_time(not_before, f"{PATH} {event_id} NotBefore") if not_before else datetime.now(UTC)
    )
    return Notice(event_id, Cloud.AZURE, kind, deadline, str(event_type), raw=dict(event))


class AzureEventsSource:
    """Notices from Azure Scheduled Events (see the module docstring)."""

    name = "azure"
    cloud = Cloud.AZURE

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        poll_interval: float = 1.0,
        timeout: float = 2.0,
        name: str = "azure",
    ) -> None:
        self.name = name
        self.endpoint = azure_endpoint(endpoint)
        self.poll_interval = poll_interval
        self.http = MetadataHttp("azure", timeout)
        self.last_success: float | None = None
        self.incarnation: int | None = None
        self._current: dict[str, Notice] = {}

    @property
    def url(self) -> str:
        return f"{self.endpoint}{PATH}"

    async def _document(self) -> Reply:
        reply = await self.http.request(
            "GET", self.url, headers=HEADERS, params={"api-version": API_VERSION}
        )
        if reply.status != 200:
            raise MetadataUnavailable(f"{reply.url}: HTTP {reply.status}")
        return reply

    async def poll(self) -> list[Notice]:
        """Read the document once: the notices that are new, changed or withdrawn."""
        incarnation, notices = parse_document((await self._document()).json())
        self.last_success = time.monotonic()
        if incarnation == self.incarnation:
            return []
        self.incarnation = incarnation
        now = {}
        for n in notices:
            held = self._current.get(n.id)
            if held is not None and not n.raw.get("NotBefore"):
                # a started event has a blank NotBefore: its deadline stays what it was
                n = replace(n, deadline=held.deadline)
            now[n.id] = n
        changes = [
            n
            for i, n in now.items()
            if i not in self._current
            or (self._current[i].deadline, self._current[i].action) != (n.deadline, n.action)
        ]
        changes += [old.cancel() for i, old in self._current.items() if i not in now]
        self._current = now
        return changes

    async def watch(self) -> AsyncIterator[Notice]:
        """Yield notices as polls find them; raises NoticeError on failure."""
        while True:
            for notice in await self.poll():
                yield notice
            await asyncio.sleep(self.poll_interval)

    async def acknowledge(self, notice: Notice) -> None:
        """Let the event behind ``notice`` start now (POST ``StartRequests``)."""
        if notice.cloud is not Cloud.AZURE:
            raise NoticeError(f"cannot acknowledge a {notice.cloud} notice on Azure")
        reply = await self.http.request(
            "POST",
            self.url,
            headers=HEADERS,
            params={"api-version": API_VERSION},
            json_body={"StartRequests": [{"EventId": notice.id}]},
        )
        if reply.status not in (200, 201, 202, 204):
            raise MetadataUnavailable(f"{reply.url}: acknowledge {notice.id}: HTTP {reply.status}")

    async def aclose(self) -> None:
        await self.http.aclose()
