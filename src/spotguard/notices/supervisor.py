"""One source, kept alive: the supervision the agent's bus and the controller's fleet watch share.

:class:`SourceSupervisor` runs a source's ``watch()`` and hands each notice to ``deliver``.
Whatever stops the watch — a :class:`~spotguard.errors.NoticeError` (refused, 5xx, garbage),
or a bug (any other exception, in the source or in ``deliver``) — is logged in one line naming
the source and the reason, and the source is watched again after an exponential, jittered,
capped backoff (:class:`~spotguard.notices.backoff.Backoff`); a recovery is logged once. A
source whose ``watch()`` returns has finished, and so has :meth:`SourceSupervisor.run`.

Example sequence: ``watch`` → notice a → MetadataUnavailable ("refused"; retry in 0.5 s) →
``watch`` → RuntimeError (a bug; retry in 1 s) → ``watch`` → notice b ("works again after 2
failure(s)") → ``watch`` returns ("finished").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from spotguard.errors import NoticeError
from spotguard.notices.backoff import Backoff
from spotguard.notices.base import Notice, NoticeSource, Polling

log = logging.getLogger(__name__)

Deliver = Callable[[Notice], Awaitable[None]]


@dataclass
class SourceHealth:
    """What the supervisor knows about one source (for status pages and metrics)."""

    name: str
    state: str = "watching"  # watching | failing | finished
    failures: int = 0  # consecutive failures
    last_error: str | None = None
    notices: int = 0  # notices this source delivered (duplicates included)


class SourceSupervisor:
    """Watch ``source`` until it finishes, restarting it after every failure (module doc).

    ``health_check`` is how often, while the source is failing, its ``last_success``
    (:class:`~spotguard.notices.base.Polling` sources) is looked at to notice a recovery
    that brought no notice.
    """

    def __init__(
        self,
        source: NoticeSource,
        deliver: Deliver,
        *,
        backoff: Backoff | None = None,
        health_check: float = 1.0,
    ) -> None:
        self.source = source
        self.deliver = deliver
        self.backoff = backoff or Backoff()
        self.health_check = health_check
        self.health = SourceHealth(source.name)

    async def run(self) -> None:
        """Watch, restart on failure, return once the source has finished (cancellable)."""
        name = self.source.name
        while True:
            started = time.monotonic()
            watcher = asyncio.create_task(self._pump(), name=f"notice-source-{name}")
            try:
                await self._await(watcher, started)
            finally:
                if not watcher.done():
                    watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watcher
            exc = watcher.exception()
            if exc is None:
                self.health.state = "finished"
                log.info("notice source finished", extra={"source": name})
                return
            await asyncio.sleep(self._failed(exc))

    async def _await(self, watcher: asyncio.Task[None], started: float) -> None:
        while not watcher.done():
            timeout = self.health_check if self.health.failures else None
            await asyncio.wait({watcher}, timeout=timeout)
            last = self.source.last_success if isinstance(self.source, Polling) else None
            if self.health.failures and last is not None and last > started:
                self._recovered()

    async def _pump(self) -> None:
        stream = self.source.watch()
        try:
            async for notice in stream:
                self.health.notices += 1
                if self.health.failures:
                    self._recovered()
                await self.deliver(notice)
        finally:
            if isinstance(stream, AsyncGenerator):
                await stream.aclose()

    def _failed(self, exc: BaseException) -> float:
        delay = self.backoff.next()
        h = self.health
        h.failures, h.state, h.last_error = self.backoff.failures, "failing", reason(exc)
        log.warning(
            "notice source %s failed: %s; retrying in %.2f s",
            h.name,
            h.last_error,
            delay,
            extra={
                "source": h.name,
                "error": h.last_error,
                "failures": h.failures,
                "retry_in": round(delay, 2),
            },
        )
        return delay

    def _recovered(self) -> None:
        h = self.health
        if h.failures:
            log.info(
                "notice source %s works again after %d failure(s)",
                h.name,
                h.failures,
                extra={"source": h.name},
            )
        h.failures, h.state = 0, "watching"
        self.backoff.reset()


def reason(exc: BaseException) -> str:
    """One line for a source failure: the message of a NoticeError, the class of a bug."""
    if isinstance(exc, NoticeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
