"""Manual: an operator asks to vacate the node (``spotguard drain``, the agent's local API).

A drain is a notice like any other: kind ``drain``, cloud ``manual``, a deadline the operator
chooses and the reason kept in ``raw["reason"]``. :meth:`ManualSource.drain` queues it and
returns it; :meth:`ManualSource.cancel` withdraws one that has not run its course.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

from spotguard.errors import ConfigError
from spotguard.notices.base import Cloud, Notice, NoticeKind

_CLOSED = object()


class ManualSource:
    """Drain requests as notices. One consumer (the bus) watches it."""

    name = "manual"
    cloud = Cloud.MANUAL

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Notice | object] = asyncio.Queue()
        self._active: dict[str, Notice] = {}

    async def drain(self, reason: str, deadline_s: float) -> Notice:
        """Ask for the node to be vacated within ``deadline_s`` seconds; returns the notice."""
        if not deadline_s > 0:
            raise ConfigError(f"drain deadline must be positive seconds, got {deadline_s!r}")
        now = datetime.now(UTC)
        notice = Notice(
            f"manual-{uuid.uuid4().hex[:12]}",
            Cloud.MANUAL,
            NoticeKind.DRAIN,
            now + timedelta(seconds=deadline_s),
            "drain",
            raw={"reason": reason, "deadline_s": deadline_s},
            received_at=now,
        )
        self._active[notice.id] = notice
        await self._queue.put(notice)
        return notice

    async def cancel(self, notice_id: str) -> Notice | None:
        """Withdraw a drain; returns the cancelled notice, or None when there is no such one."""
        notice = self._active.pop(notice_id, None)
        if notice is None:
            return None
        cancelled = notice.cancel()
        await self._queue.put(cancelled)
        return cancelled

    def settle(self, notice_id: str) -> None:
        """A drain ran its course (its outcome is known): no longer active, nothing queued."""
        self._active.pop(notice_id, None)

    def active(self) -> list[Notice]:
        """Drains requested and not cancelled."""
        return list(self._active.values())

    async def watch(self) -> AsyncIterator[Notice]:
        """Yield each drain and cancellation; ends once :meth:`aclose` was called."""
        while True:
            item = await self._queue.get()
            if item is _CLOSED:
                return
            assert isinstance(item, Notice)
            yield item

    async def aclose(self) -> None:
        await self._queue.put(_CLOSED)
