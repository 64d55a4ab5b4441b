"""GCP: interruption notices from the Compute Engine metadata server, by long-poll.

Two values are followed at once, each with ``?wait_for_change=true&last_etag=<etag>`` (header
``Metadata-Flavor: Google``), so a change is seen as soon as the server has it:

=====================================  ===================================================
``instance/preempted``                 ``TRUE`` → ``preempt``, deadline = now + 30 s
                                       (:data:`PREEMPT_NOTICE`, GCP's documented notice)
``instance/maintenance-event``         ``TERMINATE_ON_HOST_MAINTENANCE`` → ``maintenance``,
                                       deadline = now + 60 s (:data:`MAINTENANCE_NOTICE`);
                                       ``MIGRATE_ON_HOST_MAINTENANCE`` → ``maintenance`` with
                                       that action (live migration: the agent may ignore it);
                                       back to ``NONE`` → the notice is withdrawn
=====================================  ===================================================

The first read of each value is a plain GET (which returns at once with the current value and
its ETag), so a notice that was already raised before the source started is not missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from spotguard.errors import MetadataMalformed, MetadataUnavailable
from spotguard.notices.base import Cloud, Notice, NoticeKind, stable_id
from spotguard.notices.endpoints import gcp_endpoint
from spotguard.notices.fetch import MetadataHttp, Reply

if TYPE_CHECKING:
    from spotguard.notices.settings import NoticeSettings

PREFIX = "/computeMetadata/v1/"
HEADERS = {"Metadata-Flavor": "Google"}
PREEMPTED = "instance/preempted"
MAINTENANCE = "instance/maintenance-event"
PREEMPT_NOTICE = timedelta(seconds=30)
MAINTENANCE_NOTICE = timedelta(seconds=60)
MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")


class GcpMetadataClient:
    """GETs against the metadata server with the required header and its answer checked."""

    def __init__(self, endpoint: str | None = None, *, timeout: float = 2.0) -> None:
        self.endpoint = gcp_endpoint(endpoint)
        self.http = MetadataHttp("gcp", timeout)

    @classmethod
    def from_settings(cls, s: NoticeSettings, endpoint: str | None = None) -> GcpMetadataClient:
        """The client the ``[notices]`` settings describe."""
        return cls(endpoint, timeout=s.timeout)

    async def get(
        self, path: str, *, params: dict[str, str] | None = None, limit_s: float | None = None
    ) -> Reply:
        reply = await self.http.request(
            "GET", self.endpoint + PREFIX + path, headers=HEADERS, params=params, limit_s=limit_s
        )
        if reply.status not in (200, 404):
            raise MetadataUnavailable(f"{reply.url}: HTTP {reply.status}")
        if reply.status == 200 and reply.headers.get("Metadata-Flavor") != "Google":
            raise MetadataMalformed(f"{reply.url}: answer lacks 'Metadata-Flavor: Google'")
        return reply

    async def get_text(self, path: str) -> str | None:
        """The value at ``path``, or None on 404."""
        reply = await self.get(path)
        return None if reply.status == 404 else reply.text()

    async def aclose(self) -> None:
        await self.http.aclose()


def preempted_notice(value: str, etag: str) -> Notice | None:
    """``instance/preempted`` → a preempt notice (None for FALSE; any case)."""
    value = value.strip().upper()
    if value == "FALSE":
        return None
    if value != "TRUE":
        raise MetadataMalformed(f"{PREEMPTED}: expected TRUE or FALSE, got {value[:40]!r}")
    raw = {"preempted": value, "etag": etag}
    deadline = datetime.now(UTC) + PREEMPT_NOTICE
    return Notice(
        stable_id(Cloud.GCP, NoticeKind.PREEMPT, raw),
        Cloud.GCP,
        NoticeKind.PREEMPT,
        deadline,
        "PREEMPTED",
        raw=raw,
    )


def maintenance_notice(value: str, etag: str) -> Notice | None:
    """``instance/maintenance-event`` → a maintenance notice (None for NONE; any case)."""
    value = value.strip().upper()
    if value not in MAINTENANCE_VALUES:
        raise MetadataMalformed(f"{MAINTENANCE}: unknown value {value[:60]!r}")
    if value == "NONE":
        return None
    raw = {"maintenance-event": value, "etag": etag}
    deadline = datetime.now(UTC) + MAINTENANCE_NOTICE
    ident = stable_id(Cloud.GCP, NoticeKind.MAINTENANCE, raw)
    return Notice(ident, Cloud.GCP, NoticeKind.MAINTENANCE, deadline, value, raw=raw)


class GcpMetadataSource:
    """Notices from the GCP metadata server (see the module docstring)."""

    name = "gcp"
    cloud = Cloud.GCP

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 2.0,
        long_poll: int = 60,
        name: str = "gcp",
    ) -> None:
        self.name = name
        self.client = GcpMetadataClient(endpoint, timeout=timeout)
        self.timeout = timeout
        self.long_poll = long_poll
        self.last_success: float | None = None
        # per followed value: its last ETag and the notice it gave (kept across restarts)
        self._etag: dict[str, str | None] = {PREEMPTED: None, MAINTENANCE: None}
        self._current: dict[str, Notice | None] = {PREEMPTED: None, MAINTENANCE: None}

    @property
    def endpoint(self) -> str:
        return self.client.endpoint

    async def _read(self, key: str) -> tuple[str, str]:
        etag = self._etag[key]
        if etag is None:
            reply = await self.client.get(key)
        else:
            params = {
                "wait_for_change": "true",
                "last_etag": etag,
                "timeout_sec": str(self.long_poll),
            }
            reply = await self.client.get(key, params=params, limit_s=self.long_poll + self.timeout)
        if reply.status == 404:
            raise MetadataMalformed(f"{reply.url}: not served (is this a GCP metadata server?)")
        new_etag = reply.headers.get("ETag") or reply.headers.get("Etag") or ""
        if not new_etag:
            raise MetadataMalformed(f"{reply.url}: answer has no ETag")
        return reply.text(), new_etag

    async def _follow(self, key: str, out: asyncio.Queue[Notice | BaseException]) -> None:
        parse = preempted_notice if key == PREEMPTED else maintenance_notice
        try:
            while True:
                value, etag = await self._read(key)
                unchanged = etag == self._etag[key]
                notice = None if unchanged else parse(value, etag)
                self._etag[key] = etag
                self.last_success = time.monotonic()
                if unchanged:
                    continue  # the long-poll timed out with no change
                old = self._current[key]
                if old is not None and (notice is None or notice.id != old.id):
                    await out.put(old.cancel())
                if notice is not None and (old is None or notice.id != old.id):
                    await out.put(notice)
                self._current[key] = notice
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to watch(), which re-raises it
            await out.put(exc)

    async def watch(self) -> AsyncIterator[Notice]:
        """Yield notices as the long-polls return them; raises NoticeError on failure."""
        queue: asyncio.Queue[Notice | BaseException] = asyncio.Queue()
        tasks = [asyncio.create_task(self._follow(k, queue)) for k in (PREEMPTED, MAINTENANCE)]
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def aclose(self) -> None:
        await self.client.aclose()
