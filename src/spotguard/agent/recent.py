"""The agent's recent events, for its web page (``GET /events``, :mod:`spotguard.webui`).

A bounded in-memory ring (the last :data:`SIZE` events; nothing survives a restart — the
controller's history is the record), read newest first. Fed from two places, so that it
holds what happened to this host's jobs whoever did it:

* every report the agent makes (:meth:`RecentEvents.tee` wraps the reporter's ``on_emit``):
  protected (started), a notice (per job, with the decision), frozen, durable, checkpoint
  failed, exited, restoring / restored / restore failed, finished;
* the park records in the state dir (:meth:`RecentEvents.watch_parks`, a look every second):
  a record that appears is a park (at the record's own ``since``), one that goes is an
  unpark — whoever parked (``spotguard park``, the agent's policies) or unparked (the CLI, a
  wake-on-connect listener). A store park's ``parked`` report is not taken from the reporter
  for that reason (it would show twice).

A notice that reached no job (none was protected) comes from the dispatcher's list when the
ring is read (:meth:`RecentEvents.read`). Every text is plain text; the page sets it with
``textContent``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from spotguard.contracts import (
    AnyEvent,
    CheckpointFailedEvent,
    DurableEvent,
    ExitedEvent,
    FrozenEvent,
    JobFinishedEvent,
    NoticeEvent,
    NoticeInfo,
    ParkedEvent,
    ReadyToRelaunchEvent,
    RestoredEvent,
    RestoreFailedEvent,
    RestoringEvent,
    StartedEvent,
)
from spotguard.park import record
from spotguard.park.record import ParkRecord

#: how many events the ring keeps
SIZE = 200
#: the longest text kept for one event (a long error message is cut)
TEXT_MAX = 240

Kind = Literal[
    "started", "notice", "frozen", "durable", "checkpoint_failed", "exited",
    "ready_to_relaunch", "restoring", "restored", "restore_failed", "job_finished",
    "parked", "unparked",
]  # fmt: skip


class RecentEvent(BaseModel):
    """One event: when, which job (None: a notice that reached no job), what, in words."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    at: datetime
    job: str | None
    kind: Kind
    text: str


class RecentAnswer(BaseModel):
    """``GET /events``: the recent events, newest first."""

    model_config = ConfigDict(extra="forbid")

    events: list[RecentEvent]


def _image(url: str | None) -> str:
    return url.rsplit("/", 1)[-1] if url else "-"


def _mib(n: int | None) -> str:
    return f", {n / (1 << 20):.1f} MiB" if n else ""


def _notice(n: NoticeInfo | None) -> str:
    if n is None:
        return ""
    kind = f"{n.kind or 'a'} notice"
    return f" for the {kind} {n.id}" if n.id else f" for {kind}"


def _text(ev: AnyEvent) -> str | None:
    """The event in a few words; None for an event the ring does not keep."""
    match ev:
        case StartedEvent():
            return f"protected (pid {ev.pid})" if ev.pid else "protected"
        case NoticeEvent():
            n = ev.notice
            words = f"{n.kind} notice from {n.cloud}" + (" withdrawn" if n.cancelled else "")
            decision = f": {ev.decision.value}" if ev.decision else ""
            return words + decision + (f" ({ev.reason})" if ev.reason else "")
        case FrozenEvent():
            after, since = ev.notice_to_frozen_s, "the notice" if ev.notice else "it began"
            took = f", {after:.1f} s after {since}" if after is not None else ""
            return f"frozen for a {ev.mode.value} checkpoint{_notice(ev.notice)}{took}"
        case DurableEvent():
            return f"image {_image(ev.image_url)} durable ({ev.mode.value}{_mib(ev.image_bytes)})"
        case CheckpointFailedEvent():
            at = f" at {ev.step}" if ev.step else ""
            kept = "; its image waits on this host for the store" if ev.kept else ""
            return f"checkpoint failed{at}: {ev.error.message}{kept}"
        case ExitedEvent():
            return f"stopped after its checkpoint (image {_image(ev.image_url)})"
        case ReadyToRelaunchEvent():
            return "drained: ready to be relaunched elsewhere"
        case RestoringEvent():
            return f"restoring {_image(ev.image_url)} (attempt {ev.attempt or 1})"
        case RestoredEvent():
            took = f" in {ev.seconds:.1f} s" if ev.seconds is not None else ""
            return f"restored from {_image(ev.image_url)}{took}"
        case RestoreFailedEvent():
            return f"restore of {_image(ev.image_url)} failed: {ev.error.message}"
        case ParkedEvent():
            return None  # seen in the park records (:meth:`RecentEvents.look_at_parks`)
        case JobFinishedEvent():
            return "finished by itself"


def _parked_text(rec: ParkRecord) -> str:
    words = f"parked to {rec.place}{_mib(rec.bytes)}"
    words += "; wakes on connect" if rec.wake_on_connect else ""
    return words + (f" ({rec.reason})" if rec.reason else "")


class RecentEvents:
    """The ring (see the module docstring)."""

    def __init__(self, size: int = SIZE) -> None:
        self._ring: deque[RecentEvent] = deque(maxlen=size)
        self._parked: dict[str, ParkRecord] = {}  # at the last look
        self._reached: deque[str] = deque(maxlen=size)  # ids of notices a job got

    def add(self, at: datetime, job: str | None, kind: Kind, text: str) -> None:
        cut = text if len(text) <= TEXT_MAX else text[: TEXT_MAX - 1] + "…"
        self._ring.append(RecentEvent(at=at, job=job, kind=kind, text=cut))

    def reported(self, ev: AnyEvent) -> None:
        """Keep a report of the agent's (the reporter's ``on_emit``)."""
        text = _text(ev)
        if isinstance(ev, NoticeEvent) and ev.notice.id:
            self._reached.append(ev.notice.id)
        if text is not None:
            self.add(ev.at, ev.job, ev.kind.value, text)

    def tee(self, then: Callable[[AnyEvent], None] | None) -> Callable[[AnyEvent], None]:
        """An ``on_emit`` that keeps each report here, then hands it to ``then``."""

        def emitted(ev: AnyEvent) -> None:
            self.reported(ev)
            if then is not None:
                then(ev)

        return emitted

    def look_at_parks(self, records: Sequence[ParkRecord]) -> None:
        """Compare the park records with the last look: new ones are parks, gone ones
        unparks (at the time of this look, at most one interval late)."""
        now = {r.job: r for r in records}
        last = self._parked
        for job, rec in now.items():
            if job not in last or last[job].since != rec.since:
                self.add(rec.since, job, "parked", _parked_text(rec))
        for job, rec in last.items():
            if job not in now:
                self.add(datetime.now(UTC), job, "unparked", f"unparked from {rec.place}")
        self._parked = now

    async def watch_parks(self, state_dir: Path, every_s: float = 1.0) -> None:
        """:meth:`look_at_parks` every ``every_s`` seconds, for ever."""
        while True:
            self.look_at_parks(await asyncio.to_thread(record.all_records, state_dir))
            await asyncio.sleep(every_s)

    def read(self, notices: Sequence[Mapping[str, Any]] = ()) -> RecentAnswer:
        """The events, newest first, with the ``notices`` (the dispatcher's ``seen``) that
        reached no job."""
        events = list(self._ring)
        for raw in notices:
            n = NoticeInfo.model_validate(raw)
            if n.id in self._reached or n.received_at is None:
                continue
            withdrawn = " withdrawn" if n.cancelled else ""
            text = f"{n.kind} notice from {n.cloud}{withdrawn}: no job protected ({n.id})"
            events.append(RecentEvent(at=n.received_at, job=None, kind="notice", text=text))
        events.sort(key=lambda e: e.at, reverse=True)
        return RecentAnswer(events=events)
