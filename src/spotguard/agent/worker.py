"""One protected job: its pending requests, one checkpoint at a time, and what follows.

A :class:`JobWorker` keeps the requests for its job (one per notice, plus the periodic one)
and runs the one that must start first, when it is due. While it waits, a newer notice with an
earlier start takes the lead, and a cancelled notice is simply dropped. Once a checkpoint has
started it runs to the end (the engine thaws the job on any failure); a notice arriving
meanwhile waits for it, and the image it then takes is small thanks to dedup — except that a
leave-running checkpoint gives way to a notice's exit that the daemon's ``gives_way`` says is
predicted to fit its deadline on its own (:mod:`.giveway`), so an interruption notice does
not wait behind the upload of a periodic or rebalance image. A due exit always goes before a
due periodic one.

A failed checkpoint never ends the worker: the job stays protected — except an ``exit``
whose upload failed after the job was stopped (the checkpoint raises
:class:`~spotguard.operations.ImageKept`): the job is then ``pushing`` (its kept staged image
is pushed again by the agent until durable, see :mod:`spotguard.agent.pusher`) and becomes
``exited`` through :meth:`JobWorker.kept_durable`.

Why this module and :mod:`.outcomes`: the worker *decides* — the request queue, the job's
state (moved only by :data:`~spotguard.agent.jobstate.TRANSITIONS`) and what its waiters are
told; :class:`~spotguard.agent.outcomes.JobReports` *tells* the outside each outcome (metrics,
one log line per step, the controller's reports, never awaited: :meth:`Reporter.emit` only
spools).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psutil

from spotguard.checkpoint import scan
from spotguard.errors import SpotguardError
from spotguard.modes import Mode
from spotguard.notices.base import Notice, NoticeKind
from spotguard.operations import CheckpointResult, ImageKept

from .giveway import GivesWay, GiveWay
from .identity import Identity
from .jobstate import ACTIVE, JobState, check_move
from .metrics import AgentMetrics
from .outcomes import JobReports
from .reporter import Reporter

log = logging.getLogger(__name__)

PERIODIC = "periodic"
#: a notice's checkpoint that failed with a retryable error (the runtime or CRIU gave up on
#: a freeze, a store hiccup) is tried this many more times while its deadline allows
RETRIES = 1
#: ... if at least this many seconds remain before the deadline when it would start again
RETRY_MARGIN_S = 15.0
#: ... after this pause (what failed may be transient: a freeze a just-restored tree refused)
RETRY_AFTER_S = 2.0


@dataclass
class Request:
    """A checkpoint to take: for a notice (``notice``) or the periodic schedule."""

    key: str  # the notice id, or PERIODIC
    mode: Mode
    start_at: datetime
    reason: str
    notice: Notice | None = None
    waiters: list[asyncio.Future[dict[str, Any]]] = field(default_factory=list)
    tries: int = 0  # checkpoints already tried for it (see RETRIES)

    @property
    def deadline(self) -> datetime | None:
        return self.notice.deadline if self.notice else None


#: runs one checkpoint of the job: (mode, deadline, meta, on_frozen) → result
Checkpointer = Callable[
    [Mode, datetime | None, dict[str, Any], Callable[[float], None]],
    Awaitable[CheckpointResult],
]


class JobWorker:
    """Protects one job (by name and pid) until it exits or is stopped by a checkpoint."""

    def __init__(
        self,
        name: str,
        pid: int,
        checkpointer: Checkpointer,
        *,
        reporter: Reporter,
        metrics: AgentMetrics,
        instance: dict[str, Any],
        periodic_interval: float = 0.0,
        last_image_at: float | None = None,
        ident: Identity | None = None,
        file_limits: scan.FileLimits | None = None,
        gives_way: GivesWay | None = None,
    ) -> None:
        self.name = name
        self.giving = GiveWay(name, gives_way)  # None: a notice waits for the one under way
        self.pid = pid
        self.ident = ident  # the job's process: pid and start time (alive() compares it)
        self.file_limits = file_limits  # what a checkpoint carries of its files (early check)
        self.checkpointer = checkpointer
        self.reporter = reporter
        self.metrics = metrics
        self.instance = instance
        self.reports = JobReports(name, reporter=reporter, metrics=metrics, instance=instance)
        self.periodic_interval = periodic_interval
        self.last_image: CheckpointResult | None = None
        self.last_notice: str | None = None  # the notice (or "periodic") it was taken for
        self.last_image_at = last_image_at
        self.state = JobState.PROTECTING  # moved only by :meth:`move` (jobstate.TRANSITIONS)
        self.stood_down: str | None = None  # why this agent no longer acts for the job
        self.activity: dict[str, Any] | None = None
        self.pending: dict[str, Request] = {}
        self.failures = 0
        self.checkpoints = 0
        self.cannot_checkpoint: list[str] = []  # what the early check found (status)
        self._wake = asyncio.Event()
        self.idle = asyncio.Event()  # set while no checkpoint runs
        self.idle.set()
        self._started = time.time()

    # --- requests -----------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def move(self, state: JobState) -> None:
        """Move to ``state``; JobStateError (state kept) where jobstate.TRANSITIONS forbid."""
        check_move(self.name, self.state, state)
        self.state = state

    def submit(self, req: Request) -> bool:
        """Queue ``req`` (a second request for the same notice is ignored)."""
        if not self.active:
            for w in req.waiters:
                if not w.done():
                    w.set_result({"job": self.name, "state": self.state, "skipped": True})
            return False
        if req.key in self.pending:
            self.pending[req.key].waiters.extend(req.waiters)
            return False
        self.pending[req.key] = req
        log.info(
            "checkpoint scheduled",
            extra={
                "step": "schedule",
                "job": self.name,
                "notice": req.key,
                "action": req.mode.value,
                "start_at": req.start_at.isoformat(),
                "reason": req.reason,
            },
        )
        self._wake.set()
        self.giving.consider(req, self.pending)
        return True

    def cancel(self, key: str) -> bool:
        """Drop the pending request for notice ``key``; False if none was waiting."""
        req = self.pending.pop(key, None)
        if req is None:
            return False
        log.info(
            "notice cancelled before the freeze: nothing to do",
            extra={"step": "cancel", "job": self.name, "notice": key},
        )
        for w in req.waiters:
            if not w.done():
                w.set_result({"job": self.name, "cancelled": True})
        self._wake.set()
        return True

    def _periodic_due(self) -> datetime | None:
        if self.periodic_interval <= 0:
            return None
        base = self.last_image_at if self.last_image_at is not None else self._started - 1e9
        return datetime.fromtimestamp(base + self.periodic_interval, UTC)

    def _next(self) -> Request | None:
        """The request that must start first (periodic included)."""
        candidates = list(self.pending.values())
        due = self._periodic_due()
        if due is not None:
            candidates.append(
                Request(PERIODIC, Mode.RESUME, due, f"periodic every {self.periodic_interval}s")
            )
        if not candidates:
            return None
        now = datetime.now(UTC)
        exits = [r for r in candidates if r.mode is Mode.EXIT and r.start_at <= now]
        if exits:  # a due exit goes first: an image taken before it would be superseded at once
            return min(exits, key=lambda r: r.start_at)
        return min(candidates, key=lambda r: (r.start_at, r.mode is not Mode.EXIT))

    # --- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        """Check what no checkpoint could carry; then wait for the next due request, run it;
        until the job is gone."""
        await self._early_check()
        while self.active:
            req = self._next()
            timeout = None if req is None else (req.start_at - datetime.now(UTC)).total_seconds()
            if timeout is None or timeout > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            assert req is not None
            self.pending.pop(req.key, None)
            await self._run_one(req)

    async def _run_one(self, req: Request) -> None:
        """Run ``req``'s checkpoint as a task of its own, so that a notice may cancel a
        leave-running one (:class:`~.giveway.GiveWay`); the worker's own cancellation goes
        through."""
        task = asyncio.create_task(self._execute(req), name=f"checkpoint-{self.name}")
        self.giving.running = (req, task)
        try:
            await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            by = self.giving.gave_way_to
            if by is None or (me is not None and me.cancelling()):
                raise
            for w in req.waiters:
                if not w.done():
                    w.set_result({"job": self.name, "gave_way_to": by})
        finally:
            self.giving.done()

    async def _early_check(self) -> None:
        """Tell the operator now, not at the notice, when the job holds something no
        checkpoint can carry (:data:`~spotguard.checkpoint.scan.EARLY_RULES`, and files over
        :class:`~spotguard.checkpoint.scan.FileLimits`): a log line and ``cannot_checkpoint``
        in status. The job stays protected: it may let go of it."""
        try:
            found = await asyncio.to_thread(scan.early_findings, self.pid, self.file_limits)
        except (OSError, psutil.Error, SpotguardError) as exc:  # a look ahead only
            log.debug("early check failed", extra={"job": self.name, "error": str(exc)})
            return
        self.cannot_checkpoint = [str(f) for f in found]
        if found:
            log.warning(
                "this job cannot be checkpointed as it is; a notice would not save it",
                extra={"step": "protect", "job": self.name, "reason": "; ".join(map(str, found))},
            )

    def job_ended(self) -> None:
        """The job's process is gone without us stopping it: nothing more to protect."""
        if not self.active:
            return
        self.move(JobState.FINISHED)
        self.reports.finished()
        self._release_waiters({"job": self.name, "state": JobState.FINISHED})
        self._wake.set()

    def parked(self) -> None:
        """The job was parked as an image: its process is gone but its state is kept, so it
        did not finish; the agent protects it again once it runs (unpark)."""
        if not self.active:
            return
        self.move(JobState.PARKED)
        log.info(
            "job parked; protected again once it runs", extra={"step": "job", "job": self.name}
        )
        self._release_waiters({"job": self.name, "state": JobState.PARKED})
        self._wake.set()

    def stand_down(self, reason: str) -> bool:
        """The job is owned elsewhere now: stop acting for it (no checkpoint, no report). A
        checkpoint already running finishes first (the job must not stay frozen). False
        when the worker was not active."""
        if not self.active or self.stood_down is not None:
            return False
        self.stood_down = reason
        log.error(
            "the job is owned by another instance now; this agent stands down for it",
            extra={"step": "protect", "job": self.name, "pid": self.pid, "reason": reason},
        )
        if self.state is JobState.PROTECTING:
            self.move(JobState.STOOD_DOWN)
        self._release_waiters({"job": self.name, "state": JobState.STOOD_DOWN, "reason": reason})
        self._wake.set()
        return True

    def held_elsewhere(self, reason: str) -> None:
        """Another agent (another state dir) protects the job (:mod:`.joblock`): this one
        never acts for it, so two agents never dump it at one notice."""
        self.stood_down = reason
        self.move(JobState.STOOD_DOWN)
        log.error(
            "another agent protects this job; this agent leaves it alone",
            extra={"step": "protect", "job": self.name, "pid": self.pid, "reason": reason},
        )

    def alive(self) -> bool:
        """Whether the job's own process runs: by identity (pid and start time) when the
        agent recorded it, so a stranger given the job's pid is never taken for the job."""
        if self.ident is not None:
            return self.ident.alive()
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _release_waiters(self, result: dict[str, Any]) -> None:
        for req in self.pending.values():
            for w in req.waiters:
                if not w.done():
                    w.set_result(result)
        self.pending.clear()

    async def _execute(self, req: Request) -> None:
        if not self.alive():  # gone since the last liveness look (its pid may be another's)
            self.pending[req.key] = req  # its waiters hear "finished" with the others
            self.job_ended()
            return
        mode = req.mode
        notice_json = req.notice.to_json() if req.notice else None
        seen = req.notice.received_at.timestamp() if req.notice else time.time()
        started = time.time()
        self.move(JobState.CHECKPOINTING)
        self.idle.clear()
        self.activity = {
            "step": "checkpoint",
            "notice": req.key,
            "mode": mode,
            "since": datetime.fromtimestamp(started, UTC).isoformat(),
            "deadline": req.deadline.isoformat() if req.deadline else None,
        }
        extra = {"job": self.name, "notice": req.key, "mode": mode}
        log.info("checkpoint starting", extra={"step": "checkpoint", **extra, "reason": req.reason})

        def on_frozen(frozen_at: float) -> None:
            self.reports.frozen(mode, notice_json, seen, frozen_at)
            if self.activity is not None:
                self.activity["frozen_at"] = datetime.fromtimestamp(frozen_at, UTC).isoformat()

        meta = {"reason": req.reason, "notice": notice_json}
        try:
            result = await self.checkpointer(mode, req.deadline, meta, on_frozen)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one failed checkpoint must never end protection
            self._failed(req, exc, started)
            return
        finally:
            self.activity = None
            if self.state is JobState.CHECKPOINTING:
                self.move(JobState.PROTECTING if self.stood_down is None else JobState.STOOD_DOWN)
            self.idle.set()
        self._succeeded(req, result, seen)

    def _failed(self, req: Request, exc: Exception, started: float) -> None:
        self.failures += 1
        notice_json = req.notice.to_json() if req.notice else None
        error = self.reports.failed(req.key, notice_json, exc, started)
        if self._retry(req, exc):
            return
        for w in req.waiters:
            if not w.done():
                w.set_result({"job": self.name, "error": error})
        if isinstance(exc, ImageKept):
            # Stopped by the checkpoint; its image waits on this host for the store.
            self.move(JobState.PUSHING)
            self._release_waiters({"job": self.name, "state": JobState.PUSHING, "error": error})
            self._wake.set()
            return
        if not self.alive():
            self.job_ended()

    def _retry(self, req: Request, exc: Exception) -> bool:
        """Queue a failed notice's checkpoint again (its waiters wait on) when the error is
        retryable, tries are left, the job runs on and its deadline leaves time; a periodic
        one waits for its next turn. Why: a notice's checkpoint is the job's last chance on
        this VM, and a freeze that failed once (CRIU timed out freezing a tree restored in
        place a moment before, a store that blinked) usually succeeds the second time."""
        if req.notice is None or req.tries >= RETRIES or not getattr(exc, "retryable", False):
            return False
        if isinstance(exc, ImageKept):  # stopped, its image here: pushed, never taken again
            return False
        if req.key in self.pending or not self.alive():  # superseded, or nothing left to save
            return False
        again = datetime.now(UTC) + timedelta(seconds=RETRY_AFTER_S)
        if req.deadline is not None and (req.deadline - again).total_seconds() < RETRY_MARGIN_S:
            return False
        req.tries += 1
        req.start_at = again
        self.pending[req.key] = req
        self._wake.set()
        log.warning(
            "checkpoint failed; trying again",
            extra={"job": self.name, "notice": req.key, "mode": req.mode, "attempt": req.tries + 1},
        )
        return True

    def _succeeded(self, req: Request, result: CheckpointResult, seen: float) -> None:
        notice_json = req.notice.to_json() if req.notice else None
        drain = req.notice is not None and req.notice.kind is NoticeKind.DRAIN
        self._durable(req.key, req.mode, notice_json, drain, result, seen, req.waiters)

    def kept_durable(self, result: CheckpointResult, notice: dict[str, Any] | None) -> None:
        """The kept image of a failed exit landed in the store: report it as that exit's
        DURABLE (then EXITED, READY_TO_RELAUNCH after a drain)."""
        key = str((notice or {}).get("id") or "kept")
        drain = (notice or {}).get("kind") == NoticeKind.DRAIN.value
        self._durable(key, result.mode, notice, drain, result, result.frozen_at, [])

    def _durable(
        self,
        key: str,
        mode: Mode,
        notice_json: dict[str, Any] | None,
        drain: bool,
        result: CheckpointResult,
        seen: float,
        waiters: list[asyncio.Future[dict[str, Any]]],
    ) -> None:
        self.checkpoints += 1
        self.last_image_at = result.frozen_at
        self.last_image, self.last_notice = result, key
        summary = {**result.summary(), "notice": key}
        self.reports.durable(key, notice_json, result, seen)
        if mode is Mode.EXIT:
            self.move(JobState.EXITED)
            self.reports.exited(notice_json, result.image_url, drain=drain)
            self._release_waiters({"job": self.name, "state": JobState.EXITED, **summary})
        outcome = {"job": self.name, "state": self.state, **summary}
        for w in waiters:
            if not w.done():
                w.set_result(outcome)

    def status(self) -> dict[str, Any]:
        periodic = self._periodic_due()
        return {
            "job": self.name,
            "pid": self.pid,
            "state": self.state,
            "reason": self.stood_down,  # why this agent does not act for it (stood_down)
            "activity": self.activity,
            "last_image": (
                {**self.last_image.summary(), "notice": self.last_notice}
                if self.last_image
                else None
            ),
            "checkpoints": self.checkpoints,
            "failures": self.failures,
            "cannot_checkpoint": self.cannot_checkpoint,
            "next_periodic": periodic.isoformat() if periodic and self.active else None,
            "pending": [
                {
                    "notice": r.key,
                    "action": r.mode.value,
                    "start_at": r.start_at.isoformat(),
                    "reason": r.reason,
                }
                for r in sorted(self.pending.values(), key=lambda r: r.start_at)
            ],
        }
