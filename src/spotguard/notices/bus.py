"""The notice bus: many sources in, one stream of notices out.

:class:`NoticeBus` runs every source's ``watch()`` in its own task and yields, in arrival
order, each notice the first time it is seen, each change of a notice (same id, new deadline
or action) and each withdrawal of a notice it delivered (same id, ``cancelled=True``).
Duplicates — the same notice from a restarted source, from two sources, or again in a later
poll — are delivered once.

A source that fails (refused connections, 5xx, timeouts, garbage answers, or a bug) never
stops the bus: it is logged in one line naming the source and the reason, restarted after an
exponential, jittered, capped backoff, and logged again once it works. A source whose
``watch()`` returns has finished; the bus ends when every source has finished.

Example::

    async with NoticeBus([AwsImdsSource(), ManualSource()]) as bus:
        async for notice in bus:
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from spotguard.errors import NoticeError
from spotguard.notices.backoff import Backoff
from spotguard.notices.base import Notice, NoticeSource

log = logging.getLogger(__name__)

#: queue item: a notice and its source, or None when a source task has ended
_Item = tuple[NoticeSource, Notice] | None


@dataclass
class SourceHealth:
    """What the bus knows about one source (for status pages and metrics)."""

    name: str
    state: str = "watching"  # watching | failing | finished
    failures: int = 0  # consecutive failures
    last_error: str | None = None
    notices: int = 0  # notices this source delivered (duplicates included)


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
        self._health_check = health_check
        self.health = {s.name: SourceHealth(s.name) for s in self.sources}
        self._backoffs = {s.name: Backoff(backoff_initial, backoff_max) for s in self.sources}
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._running = 0
        self._delivered: dict[str, Notice] = {}
        self._origin: dict[str, NoticeSource] = {}
        self._closed = False

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
                    extra={"source": source.name, "reason": str(exc)},
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
                "notice_id": notice.id,
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
            source = next(
                (s for s in self.sources if getattr(s, "cloud", None) == notice.cloud), None
            )
        ack = getattr(source, "acknowledge", None)
        if source is None or ack is None:
            return False
        await ack(notice)
        log.info("notice acknowledged", extra={"source": source.name, "notice_id": notice.id})
        return True

    # -- supervision -------------------------------------------------------------------------

    async def _run(self, source: NoticeSource) -> None:
        health = self.health[source.name]
        backoff = self._backoffs[source.name]
        try:
            while True:
                failed_at = time.monotonic()
                watcher = asyncio.create_task(self._pump(source, health))
                try:
                    while not watcher.done():
                        await asyncio.wait(
                            {watcher}, timeout=self._health_check if health.failures else None
                        )
                        last = getattr(source, "last_success", None)
                        if health.failures and isinstance(last, float) and last > failed_at:
                            self._recovered(health)
                finally:
                    if not watcher.done():
                        watcher.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await watcher
                exc = watcher.exception()
                if exc is None:
                    health.state = "finished"
                    log.info("notice source finished", extra={"source": source.name})
                    return
                delay = backoff.next()
                health.failures = backoff.failures
                health.state = "failing"
                health.last_error = _reason(exc)
                log.warning(
                    "notice source %s failed: %s; retrying in %.2f s",
                    source.name,
                    health.last_error,
                    delay,
                    extra={
                        "source": source.name,
                        "reason": health.last_error,
                        "failures": health.failures,
                        "retry_in": round(delay, 2),
                    },
                )
                await asyncio.sleep(delay)
        finally:
            self._queue.put_nowait(None)

    async def _pump(self, source: NoticeSource, health: SourceHealth) -> None:
        stream = source.watch()
        try:
            async for notice in stream:
                health.notices += 1
                if health.failures:
                    self._recovered(health)
                await self._queue.put((source, notice))
        finally:
            closer: Any = getattr(stream, "aclose", None)
            if closer is not None:
                await closer()

    def _recovered(self, health: SourceHealth) -> None:
        if health.failures:
            log.info(
                "notice source %s works again after %d failure(s)",
                health.name,
                health.failures,
                extra={"source": health.name},
            )
        health.failures = 0
        health.state = "watching"
        self._backoffs[health.name].reset()


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


def _reason(exc: BaseException) -> str:
    """One line for a source failure: the message of a NoticeError, the class of a bug."""
    if isinstance(exc, NoticeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
