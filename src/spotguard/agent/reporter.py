"""Reports to the controller: ``AgentEvent`` → ``POST {controller}/v1/events`` (Bearer token),
sent through the one controller client (:class:`~spotguard.controller.client.ControllerClient`).

:meth:`Reporter.emit` is synchronous and cheap: it writes the event to a spool directory in the
state dir and wakes a background sender. The freeze path calls ``emit`` and never waits for
delivery. The sender delivers spooled events oldest first, retrying transient failures
(connection refused, timeouts, 5xx, 429, a wrong token) with exponential backoff
(:func:`spotguard.retry.call`); an event is deleted from the spool only once the controller
accepted it, so an agent restarted mid-way sends it again — which is safe, because the
controller deduplicates by ``event_id``. An event that cannot be spooled (a full or read-only
state dir) is kept in memory and sent all the same: the controller still hears of it, only a
restart in between would lose it.

Events of the job a scoped token names (:func:`spotguard.contracts.token_scope`) are stamped
with the token's ownership epoch. The controller's answer (an
:class:`~spotguard.contracts.EventAnswer`) goes to ``on_answer`` — also when it refused the
event as coming from a non-owner (409, ``stand_down``), so the agent can stand down. The
client's typed errors decide the rest: a retryable one (unreachable, 5xx, 429, an unknown
token) is retried; a 403 (the token may not act for that job) and other 4xx answers drop the
event: resending cannot help.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from spotguard import retry as retries
from spotguard import safefs
from spotguard.contracts import AnyEvent, EventAnswer, token_scope
from spotguard.controller import routes
from spotguard.controller.client import ControllerClient
from spotguard.errors import SpotguardError

from .metrics import AgentMetrics
from .settings import check_controller_url

log = logging.getLogger(__name__)


def _transient(exc: BaseException) -> bool:
    """The controller could not take the event now (a retryable typed error): try again."""
    return isinstance(exc, SpotguardError) and exc.retryable


class Reporter:
    """Durable, ordered, idempotent delivery of agent events (or just logging, alone)."""

    #: Event fields the reporter fills in itself (from a scoped token) when left unset.
    STAMPED = ("epoch",)

    def __init__(
        self,
        controller_url: str | None,
        token: str | None,
        spool_dir: Path,
        *,
        metrics: AgentMetrics | None = None,
        max_backoff_s: float = 30.0,
        timeout_s: float = 10.0,
        on_answer: Callable[[EventAnswer], None] | None = None,
        on_emit: Callable[[AnyEvent], None] | None = None,
        insecure: bool = False,
    ) -> None:
        if controller_url:  # https, or loopback http, or http with the explicit opt-in
            check_controller_url(controller_url, insecure=insecure)
        self.url = controller_url.rstrip("/") + routes.EVENTS if controller_url else None
        self.client = (
            ControllerClient(controller_url, token, timeout_s=timeout_s) if controller_url else None
        )
        self.token = token
        self.scope = token_scope(token) if token else None  # (job, epoch) of a VM token
        self.spool = spool_dir
        self.metrics = metrics
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.on_answer = on_answer  # sees each controller answer (e.g. action "drain")
        self.on_emit = on_emit  # sees each event as it is emitted (notifications)
        self.sent = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._unspooled: dict[str, bytes] = {}  # events the spool could not take, by name
        if self.url:
            self.spool.mkdir(parents=True, exist_ok=True, mode=0o700)

    @property
    def enabled(self) -> bool:
        return self.url is not None

    def emit(self, event: AnyEvent) -> None:
        """Queue ``event`` for delivery and return at once (a small file write at most)."""
        if event.epoch is None and self.scope is not None and self.scope[0] == event.job:
            event = event.model_copy(update={"epoch": self.scope[1]})
        said = event.model_dump(mode="json", include={"image_url", "error"})
        log.info(
            "report %s",
            event.kind.value,
            extra={
                "step": "report",
                "event": event.kind.value,
                "job": event.job,
                "event_id": event.event_id,
                "image": said.get("image_url"),
                "error": (said.get("error") or {}).get("message"),
            },
        )
        if self.on_emit is not None:
            self.on_emit(event)
        if not self.url:
            return
        name = f"{time.time_ns():020d}-{event.event_id}.json"
        body = event.model_dump_json()
        try:
            safefs.write_atomic(self.spool / name, body.encode())
        except OSError as exc:
            log.warning(
                "report could not be spooled; sending it from memory",
                extra={"step": "report", "event_id": event.event_id, "error": str(exc)},
            )
            if self.metrics:
                self.metrics.failures.labels("report").inc()
            self._unspooled[name] = body.encode()
        self._idle.clear()
        self._wake.set()

    def pending(self) -> list[Path]:
        """Spooled events not yet accepted by the controller, oldest first."""
        if not self.url or not self.spool.is_dir():
            return []
        return sorted(p for p in self.spool.glob("*.json") if not p.name.startswith("."))

    def _queue(self) -> list[Path | str]:
        """Every event not yet accepted: spooled (a path) or held in memory (its name)."""
        items: list[Path | str] = [*self.pending(), *self._unspooled]
        return sorted(items, key=lambda i: i.name if isinstance(i, Path) else i)

    async def start(self) -> None:
        """Start the background sender (resends whatever a previous run left spooled)."""
        if self.client is not None and self._task is None:
            await self.client.__aenter__()  # one connection pool for every report
            if self._queue():
                self._idle.clear()
            self._wake.set()
            self._task = asyncio.create_task(self._run(), name="spotguard-reporter")

    async def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the spool to drain; True when it did."""
        if not self.url:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.client is not None:
            await self.client.aclose()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            for item in self._queue():
                await self._deliver(item)
            if self.metrics:
                self.metrics.report_queue.set(len(self._queue()))
            if not self._queue():
                self._idle.set()

    async def _deliver(self, item: Path | str) -> None:
        if isinstance(item, str):
            body = self._unspooled[item]
        else:
            try:
                body = await asyncio.to_thread(item.read_bytes)
            except FileNotFoundError:
                return
        policy = retries.RetryPolicy(
            attempts=None, initial=0.25, maximum=self.max_backoff_s, jitter=0
        )
        try:
            await retries.call(
                lambda: self._post(body), policy, _transient, on_retry=self._log_retry
            )
        except SpotguardError as exc:
            # The controller refused this event for good (malformed, forbidden): never resend.
            log.error(
                "report rejected by the controller; dropped",
                extra={"step": "report", "file": getattr(item, "name", item), "error": str(exc)},
            )
            if self.metrics:
                self.metrics.failures.labels("report").inc()
        if isinstance(item, str):
            self._unspooled.pop(item, None)
        else:
            await asyncio.to_thread(item.unlink, missing_ok=True)
        self.sent += 1

    async def _post(self, body: bytes) -> None:
        assert self.client is not None
        answer = await self.client.send_event(body)
        if answer is not None and self.on_answer is not None:
            self.on_answer(answer)

    def _log_retry(self, r: retries.Retry) -> None:
        if self.metrics:
            self.metrics.failures.labels("report").inc()
        if retries.sparse(r.attempt):
            log.warning(
                "report not delivered; retrying",
                extra={"step": "report", "attempt": r.attempt, "error": str(r.error)},
            )
