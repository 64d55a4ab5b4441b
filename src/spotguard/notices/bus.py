"""The notice bus: many sources in, one stream of notices out.

:class:`NoticeBus` runs every source's ``watch()`` in its own task and yields, in arrival
order, each notice the first time it is seen, each change of a notice (same id, new deadline
or action) and each withdrawal of a notice it delivered (same id, ``cancelled=True``).
Duplicates — the same notice from a restarted source, from two sources, or again in a later
poll — are delivered once.

A source that fails (refused connections, 5xx, timeouts, garbage answers, or a bug) never
stops the bus: each source runs under a :class:`~spotguard.notices.supervisor.SourceSupervisor`
(the same one the controller's fleet watch uses), which logs the failure in one line, restarts
the source after an exponential, jittered, capped backoff and logs again once it works. A
source whose ``watch()`` returns has finished; the bus ends when every source has finished.

Example::

    async with NoticeBus([AwsImdsSource(), ManualSource()]) as bus:
        async for notice in bus:
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from types import TracebackType

from spotguard.notices.backoff import Backoff
from spotguard.notices.base import Acknowledging, Notice, NoticeSource, cloud_of
from spotguard.notices.supervisor import SourceHealth, SourceSupervisor

__all__ = ["NoticeBus", "SourceHealth"]

log = logging.getLogger(__name__)

#: queue item: a notice and its source, or None when a source task has ended
_Item = tuple[NoticeSource, Notice] | None


class NoticeBus:
    """Merge sources into one deduplicated notice stream (see the module docstring)."""

    def __init__(
        self,
        sources: Iterable[NoticeSource],
        *,
        backoff_initial: float = 0.5,
        backoff_max: float = 10.0,
        health_check: float = 1.0,
    ) -> None:
        self.sources = list(sources)
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"notice sources need distinct names, got {names}")
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._running = 0
        self._delivered: dict[str, Notice] = {}
        self._origin: dict[str, NoticeSource] = {}
        self._closed = False
        self._supervisors = {
            s.name: SourceSupervisor(
                s,
                self._deliverer(s),
                backoff=Backoff(backoff_initial, backoff_max),
                health_check=health_check,
            )
            for s in self.sources
        }
        self.health = {name: sup.health for name, sup in self._supervisors.items()}

    def _deliverer(self, source: NoticeSource) -> Callable[[Notice], Awaitable[None]]:
        async def deliver(notice: Notice) -> None:
            await self._queue.put((source, notice))

        return deliver

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start watching every source (done on first iteration if not called)."""
        if self._tasks or self._closed:
            return
        self._running = len(self.sources)
        self._tasks = [
            asyncio.create_task(self._run(s), name=f"notice-source-{s.name}") for s in self.sources
        ]

    async def __aenter__(self) -> NoticeBus:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every source task and close every source."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for source in self.sources:
            try:
                await source.aclose()
            except Exception as exc:  # noqa: BLE001 - closing must reach every source
                log.warning(
                    "closing notice source failed",
                    extra={"source": source.name, "error": str(exc)},
                )

    # -- the stream --------------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Notice]:
        return self

    async def __anext__(self) -> Notice:
        self.start()
        while True:
            if self._running == 0 and self._queue.empty():
                raise StopAsyncIteration
            item = await self._queue.get()
            if item is None:
                self._running -= 1
                continue
            source, notice = item
            if self._accept(source, notice):
                return notice

    def _accept(self, source: NoticeSource, notice: Notice) -> bool:
        """Deliver a notice when it is new, changed, or the withdrawal of one delivered."""
        before = self._delivered.get(notice.id)
        if before is None and notice.cancelled:
            return False  # the withdrawal of something never delivered
        if before is not None and _same(before, notice):
            return False
        self._delivered[notice.id] = notice
        self._origin[notice.id] = source
        log.info(
            "notice withdrawn" if notice.cancelled else "notice",
            extra={
                "source": source.name,
                "notice": notice.id,
                "kind": notice.kind.value,
                "action": notice.action,
                "deadline": notice.deadline.isoformat(),
            },
        )
        return True

    def active(self) -> list[Notice]:
        """Notices delivered and not withdrawn, soonest deadline first."""
        live = [n for n in self._delivered.values() if not n.cancelled]
        return sorted(live, key=lambda n: n.deadline)

    async def acknowledge(self, notice: Notice) -> bool:
        """Tell the cloud that spotguard is ready for ``notice``'s event to go ahead.

        Returns True when the notice's source acknowledged it (Azure), False when the source has
        no such step (AWS, GCP, manual). Raises NoticeError if the acknowledgement failed."""
        source = self._origin.get(notice.id)
        if source is None:
            source = next((s for s in self.sources if cloud_of(s) == notice.cloud), None)
        if not isinstance(source, Acknowledging):
            return False
        await source.acknowledge(notice)
        log.info("notice acknowledged", extra={"source": source.name, "notice": notice.id})
        return True

    # -- supervision -------------------------------------------------------------------------

    async def _run(self, source: NoticeSource) -> None:
        try:
            await self._supervisors[source.name].run()
        finally:
            self._queue.put_nowait(None)


def _same(a: Notice, b: Notice) -> bool:
    """Whether ``b`` says nothing ``a`` did not (two withdrawals are the same news)."""
    if a.cancelled and b.cancelled:
        return True
    return (a.cancelled, a.deadline, a.action, a.kind) == (
        b.cancelled,
        b.deadline,
        b.action,
        b.kind,
    )
