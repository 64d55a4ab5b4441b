"""Public test doubles, so users can test their own integrations against spotguard.

* :class:`MetadataSim` — the real metadata emulator (AWS IMDSv2, GCP, Azure), in-process:
  ``async with MetadataSim() as sim: sim.state.send("aws", "preempt")``; ``sim.env()`` gives
  the variables that point spotguard and the cloud SDKs at it.
* :class:`SimClient` — its control API client (inject, change, cancel notices and faults).
* :class:`ScriptedSource` — a :class:`~spotguard.notices.base.NoticeSource` that yields the
  notices it is given (and raises the exceptions it is given, to rehearse failures).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime, timedelta

from spotguard.notices.base import Cloud, Notice, NoticeKind, stable_id
from spotguard.simulator import MetadataSim, SimClient

__all__ = ["MetadataSim", "ScriptedSource", "SimClient", "make_notice"]


def make_notice(
    kind: NoticeKind | str = NoticeKind.PREEMPT,
    *,
    cloud: Cloud | str = Cloud.MANUAL,
    in_seconds: float = 120.0,
    action: str | None = None,
    notice_id: str | None = None,
    cancelled: bool = False,
) -> Notice:
    """A notice for tests: deadline ``in_seconds`` from now, a stable id unless given."""
    kind, cloud = NoticeKind(kind), Cloud(cloud)
    ident = notice_id or stable_id(cloud, kind, {"action": action, "in": in_seconds})
    deadline = datetime.now(UTC) + timedelta(seconds=in_seconds)
    return Notice(ident, cloud, kind, deadline, action, cancelled=cancelled)


class ScriptedSource:
    """Yields the items of ``script`` in order: a :class:`Notice` is yielded, an exception is
    raised (the bus then restarts the source, which resumes after it), a number sleeps that
    many seconds. After the script: ends (``then="end"``) or waits forever (``"wait"``)."""

    def __init__(
        self,
        script: Iterable[Notice | BaseException | float],
        *,
        name: str = "scripted",
        then: str = "end",
    ) -> None:
        if then not in ("end", "wait"):
            raise ValueError("then must be 'end' or 'wait'")
        self.name = name
        self.script = list(script)
        self.then = then
        self.position = 0
        self.watches = 0  # how often watch() was started (restarts included)
        self.closed = False

    async def watch(self) -> AsyncIterator[Notice]:
        self.watches += 1
        while self.position < len(self.script):
            item = self.script[self.position]
            self.position += 1
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Notice):
                yield item
            else:
                await asyncio.sleep(float(item))
        if self.then == "wait":
            await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed = True
