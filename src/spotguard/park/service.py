"""One park service for the CLI (``spotguard park``/``unpark``/``park-wake``) and the agent's
policies (:mod:`.policy`): the park or unpark itself (:func:`.core.park`,
:func:`.core.unpark`), then the wake-on-connect listener, the webhooks, and — for a park to a
store the service is told to report — the controller (:mod:`.report`).

A park, in order::

    core.park (the job's state kept, its record written)
    → the wake-on-connect listener started (or the job's kept sockets let go)
    → "parked" to the webhooks, with how the job comes back
    → a store park reported to the controller, and the epoch it holds the job under kept
      in the record (only when ``report`` is on: ``spotguard park``; the agent reports the
      park when its worker sees the job gone)

An unpark of a store park asks the controller first whether the job came back elsewhere
(:func:`.report.owned_elsewhere`), when the service knows a controller.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.checkpoint.engine import Engine
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.notify import Notification, Notifier, NotifyEvent

from . import bridge, core, gpu, record, waker
from .record import ParkRecord
from .settings import ParkSettings

if TYPE_CHECKING:
    from spotguard.agent.settings import AgentSettings

#: (event, details) → a notification (webhooks); failures are the notifier's to log
Notify = Callable[[str, dict[str, Any]], Awaitable[None]]
#: job name → start its wake-on-connect listener
StartWaker = Callable[[str], Awaitable[None]]
#: this node's agent settings (where its controller is), loaded when first needed
Controller = Callable[[], "AgentSettings"]


async def no_notify(event: str, details: dict[str, Any]) -> None:
    return None


def webhooks(notifier: Notifier) -> Notify:
    """A :data:`Notify` that sends through the webhooks (``parked``, ``unparked``; a failed
    park as ``failed``), with the reason and how the job comes back in words."""

    async def send(event: str, details: dict[str, Any]) -> None:
        kind = {"parked": NotifyEvent.PARKED, "unparked": NotifyEvent.UNPARKED}.get(
            event, NotifyEvent.FAILED
        )
        words = [str(details[k]) for k in ("reason", "error") if details.get(k)]
        if details.get("comes_back"):
            words.append(f"back with: {details['comes_back']}")
        notifier.notify(
            Notification(
                event=kind, job=str(details["job"]), source="park",
                reason="; ".join(words) or None,
            )
        )  # fmt: skip

    return send


def spawn_waker(state_dir: Path, config: str | None) -> StartWaker:
    """A :data:`StartWaker` that starts ``spotguard park-wake`` with the ``config`` file."""

    async def start(job: str) -> None:
        await asyncio.to_thread(waker.spawn, state_dir, job, config)

    return start


def comes_back(rec: ParkRecord) -> str:
    """How a parked job comes back, in words (the webhooks' ``back with:``)."""
    how = f"spotguard unpark {rec.job}"
    if rec.wake_on_connect:
        how += " or connect to " + ", ".join(str(a.address()) for a in rec.listen)
    return how


@dataclass(frozen=True)
class Parked:
    """A park done: the job's record (with the controller's epoch when one was kept) and
    what the controller was told (``reported``, ``queued``, or None: not reported)."""

    record: ParkRecord
    controller: str | None = None


@dataclass
class ParkService:
    """Park and unpark jobs of this node, with their listener, webhooks and controller."""

    settings: ParkSettings
    checkpoint: CheckpointSettings
    engine: Engine
    store: core.StorePath | None = None
    notify: Notify = no_notify
    start_waker: StartWaker | None = None
    #: where this node's controller is: asked before a store park is unparked here
    controller: Controller | None = None
    #: a park to a store is reported to ``controller`` (``spotguard park``)
    report: bool = False

    async def park(
        self, job: JobInfo, reason: str, *, wake: bool, to: str | None = None, priority: int = 0
    ) -> Parked:
        """Park ``job`` to ``to`` (default ``[park] to``); see the module's order."""
        to = to or self.settings.to
        agent = None
        if self.report and self.controller is not None and core.place_of(to) == "store":
            agent = self.controller()
        rec = await core.park(
            job,
            to=to,
            engine=self.engine,
            settings=self.checkpoint,
            park_settings=self.settings,
            store=self.store,
            reason=reason,
            wake_on_connect=wake,
            priority=priority,
        )
        if rec.wake_on_connect and self.start_waker is not None:
            await self.start_waker(job.name)
        else:
            bridge.release(job.name)  # the job's sockets kept for a listener: none comes
        await self.notify(
            "parked",
            {"job": job.name, "reason": reason, "place": rec.place, "bytes": rec.bytes,
             "gpu_memory_freed": rec.gpu_bytes_freed, "comes_back": comes_back(rec)},
        )  # fmt: skip
        told = await self._report(rec, agent) if agent is not None else None
        # the record as the listener (its pid) and the report (the epoch) left it
        return Parked(record.load(self.checkpoint.state_dir, rec.job) or rec, told)

    async def _report(self, rec: ParkRecord, agent: AgentSettings) -> str | None:
        """Report a store park to the controller; once it took it, keep the epoch it holds
        the job under in the record (a later epoch means it came back elsewhere)."""
        from .report import controller_epoch, report_parked

        state = self.checkpoint.state_dir
        told = await report_parked(rec, agent, state)
        if told == "reported":
            epoch = await controller_epoch(agent, rec.job)
            async with record.alocked(state, rec.job):
                now = record.load(state, rec.job)
                if now is not None and epoch is not None:
                    record.save(state, now.model_copy(update={"controller_epoch": epoch}))
        return told

    def _unpark_store(self, job: str) -> core.StorePath | None:
        """The store path of an unpark: for a job parked to a store, with the controller's
        check whether the job came back elsewhere (when a controller is known)."""
        if self.store is None or self.controller is None:
            return self.store
        rec = record.load(self.checkpoint.state_dir, job)
        if rec is None or rec.place != "store":
            return self.store
        from .report import owned_elsewhere

        return dataclasses.replace(self.store, owned_elsewhere=owned_elsewhere(self.controller()))

    async def unpark(
        self, job: str, *, reason: Callable[[core.Unparked], str] | None = None
    ) -> core.Unparked:
        """Bring ``job`` back on this node and tell the webhooks (``reason``: why, in words,
        from the job brought back)."""
        done = await core.unpark(
            job,
            engine=self.engine,
            settings=self.checkpoint,
            park_settings=self.settings,
            store=self._unpark_store(job),
            gpu_free=gpu.free_bytes,
        )
        details: dict[str, Any] = {"job": job, "pid": done.pid, "seconds": done.seconds}
        if reason is not None:
            details["reason"] = reason(done)
        await self.notify("unparked", details)
        return done
