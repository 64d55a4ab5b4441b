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

:class:`AzureMetadataClient` is the one client of Azure's instance metadata service: the
source, cloud detection and the instance facts all read through it. A NotBefore that is empty
(the event started) or unreadable means now.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from spotguard.errors import MetadataMalformed, MetadataUnavailable, NoticeError
from spotguard.notices.base import Cloud, Notice, NoticeKind
from spotguard.notices.endpoints import azure_endpoint
from spotguard.notices.fetch import MetadataHttp, Reply
from spotguard.notices.timefmt import deadline_of

if TYPE_CHECKING:
    from spotguard.notices.settings import NoticeSettings

PATH = "/metadata/scheduledevents"
API_VERSION = "2020-07-01"
INSTANCE_PATH = "/metadata/instance"
INSTANCE_API = "2021-02-01"
HEADERS = {"Metadata": "true"}
EVENT_KINDS = {
    "Preempt": NoticeKind.PREEMPT,
    "Terminate": NoticeKind.MAINTENANCE,
    "Reboot": NoticeKind.MAINTENANCE,
    "Redeploy": NoticeKind.MAINTENANCE,
    "Freeze": NoticeKind.MAINTENANCE,
}
_TYPES = {k.lower(): k for k in EVENT_KINDS}  # EventType is matched without regard to case
#: an event whose NotBefore is empty (it has started), unreadable or past is acted on now
#: with the notice Azure documents for Preempt, its shortest: 30 s
BUDGET = timedelta(seconds=30)


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
    name = _TYPES.get(str(event_type).strip().lower())
    if name is None:
        raise MetadataMalformed(f"{PATH}: event {event_id} has unknown EventType {event_type!r}")
    deadline = deadline_of(event.get("NotBefore"), f"{PATH} {event_id} NotBefore", BUDGET)
    return Notice(event_id, Cloud.AZURE, EVENT_KINDS[name], deadline, name, raw=dict(event))


class AzureMetadataClient:
    """Requests to the Azure instance metadata service, with its header and API versions."""

    def __init__(self, endpoint: str | None = None, *, timeout: float = 2.0) -> None:
        self.endpoint = azure_endpoint(endpoint)
        self.http = MetadataHttp("azure", timeout)

    @classmethod
    def from_settings(cls, s: NoticeSettings, endpoint: str | None = None) -> AzureMetadataClient:
        """The client the ``[notices]`` settings describe."""
        return cls(endpoint, timeout=s.timeout)

    async def request(
        self, method: str, path: str, api_version: str, json_body: Any = None
    ) -> Reply:
        """One request; any answer but 2xx is :class:`MetadataUnavailable`."""
        reply = await self.http.request(
            method,
            self.endpoint + path,
            headers=HEADERS,
            params={"api-version": api_version},
            json_body=json_body,
        )
        if not 200 <= reply.status < 300:
            raise MetadataUnavailable(f"{reply.url}: HTTP {reply.status}")
        return reply

    async def compute(self) -> dict[str, Any]:
        """The ``compute`` object of ``/metadata/instance`` (this VM's facts)."""
        reply = await self.request("GET", INSTANCE_PATH, INSTANCE_API)
        doc = reply.json()
        compute = doc.get("compute") if isinstance(doc, dict) else None
        if not isinstance(compute, dict):
            raise MetadataMalformed(f"{reply.url}: answer has no compute object")
        return compute

    async def aclose(self) -> None:
        await self.http.aclose()


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
        self.client = AzureMetadataClient(endpoint, timeout=timeout)
        self.poll_interval = poll_interval
        self.last_success: float | None = None
        self.incarnation: int | None = None
        self._current: dict[str, Notice] = {}

    @property
    def endpoint(self) -> str:
        return self.client.endpoint

    @property
    def url(self) -> str:
        return f"{self.endpoint}{PATH}"

    async def _document(self) -> Reply:
        return await self.client.request("GET", PATH, API_VERSION)

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
            if held is not None and (
                not n.raw.get("NotBefore") or n.raw.get("NotBefore") == held.raw.get("NotBefore")
            ):
                # a started event has a blank NotBefore, an unreadable one reads as "now"
                # each time: the deadline stays what it was
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
        try:
            await self.client.request(
                "POST", PATH, API_VERSION, json_body={"StartRequests": [{"EventId": notice.id}]}
            )
        except MetadataUnavailable as exc:
            raise MetadataUnavailable(f"acknowledge {notice.id}: {exc}") from exc

    async def aclose(self) -> None:
        await self.client.aclose()
