"""The job state machine's reaction to agent events — pure functions, no I/O.

:func:`on_event` takes a job's record (or ``None`` for a job seen for the first time) and an
agent event (:data:`~spotguard.contracts.AgentEvent`) and returns the
:class:`~spotguard.controller.state.Change` to persist (or ``None``). The reconcile loop
(:mod:`spotguard.controller.core`) does what takes time — fall back to the store's newest
image, launch, wait, terminate.

::

    PROTECTED ──NOTICE──► INTERRUPTING ──DURABLE──► CHECKPOINTED ──EXITED / READY_TO_RELAUNCH──►
        ▲ ▲                    │ (deadline+grace, no image: newest image in store)     │
        │ └─DURABLE (resume)───┤                                                       │
        │   CHECKPOINT_FAILED  └───────────────────────────────────────────────► LAUNCHING
        │   (job runs on)                                                          │ launched
        └──────────────────── RESTORED ◄──────────────── RESTORING ◄───────────────┘
                      RESTORE_FAILED: retryable → LAUNCHING; the image's fault → LAUNCHING
                      from an older image; else → FAILED
    LAUNCHING + RESTORED / RESTORE_FAILED of the round's epoch: kept, applied once the launch
    is recorded (a controller restarted mid-launch adopts the VM after its agent reported)
    any ──JOB_FINISHED──► FINISHED          max restarts, no offer → FAILED(reason)
    PROTECTED / INTERRUPTING / CHECKPOINTED ──PARKED──► PARKED ──unpark (API)──► LAUNCHING
                            PROTECTED ◄──STARTED (unparked by hand)──┘

**One handler per (state, kind)**: :data:`HANDLERS` maps every pair to a small function;
``tests/controller/test_controller_machine.py`` runs each pair.

**Fencing** (:mod:`spotguard.controller.ownership`): an event from an epoch that does not own
the job is recorded in the history and changes nothing; the API answers it 409 with
``stand_down``. Events without an epoch (an agent holding the fleet token) are fenced by
instance id where both are known.

What leads to a relaunch: EXITED or READY_TO_RELAUNCH (the job stopped), or — for a notice
that ends the VM (:meth:`~spotguard.controller.state.JobData.ends_vm`) — its deadline plus
grace passing with no report that the job still runs. A DURABLE with ``mode == "resume"``
leaves the job running, so it brings the job back to PROTECTED; so does a notice the agent
decided to ignore (``decision == "none"``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spotguard.contracts import (
    Action,
    AnyEvent,
    CheckpointFailedEvent,
    DurableEvent,
    EventKind,
    ExitedEvent,
    Mode,
    NoticeEvent,
    Owner,
    ParkedEvent,
    ReadyToRelaunchEvent,
    RestoredEvent,
    RestoreFailedEvent,
    StartedEvent,
)
from spotguard.controller.edge import instance_facts
from spotguard.controller.ownership import MOVING, iid_of, new_epoch, relaunch, stale
from spotguard.controller.reportfacts import origin, seen_notice, spec_from
from spotguard.controller.state import TERMINAL, Change, JobRecord, JobState

#: Reports about the instance a job is leaving; after the relaunch started they only add facts.
OLD_INSTANCE_KINDS = frozenset(
    {
        EventKind.NOTICE,
        EventKind.FROZEN,
        EventKind.DURABLE,
        EventKind.CHECKPOINT_FAILED,
        EventKind.EXITED,
        EventKind.READY_TO_RELAUNCH,
    }
)
LIVE = frozenset({JobState.PROTECTED, JobState.INTERRUPTING, JobState.CHECKPOINTED})


@dataclass(frozen=True)
class Options:
    """The controller settings the state machine needs."""

    default_store: str | None = None
    default_notice_s: float = 120.0
    terminate_old: bool = True
    terminate_finished: bool = True


@dataclass
class Ctx:
    """One event being applied to one record."""

    rec: JobRecord
    ev: AnyEvent
    opts: Options
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def iid(self) -> str | None:
        return self.ev.instance.instance_id

    @property
    def where(self) -> str:
        return self.iid or "an unnamed instance"

    def change(self, reason: str, *, note: bool = False) -> Change:
        url = getattr(self.ev, "image_url", None)
        size = getattr(self.ev, "image_bytes", None)
        image = (url, size) if isinstance(url, str) and url else None
        return Change(self.rec, reason, self.detail, note=note, image=image)

    def note(self, reason: str) -> Change:
        return self.change(reason, note=True)


Handler = Callable[[Ctx], Change]


# ----- helpers -------------------------------------------------------------------------------


# ----- handlers by kind ----------------------------------------------------------------------


def _record_only(c: Ctx) -> Change:
    return c.note(f"{c.ev.kind.value} on {c.where}")


def _after_end(c: Ctx) -> Change:
    return c.note(f"{c.ev.kind.value} from {c.where} after {c.rec.state.value} (recorded)")


def _started(c: Ctx) -> Change:
    rec, ev = c.rec, c.ev
    assert isinstance(ev, StartedEvent)
    if rec.state is JobState.LAUNCHING:
        return c.note(f"started on {c.where} while launching (ignored)")
    pending = iid_of(rec.pending)
    if rec.state is JobState.RESTORING and ev.epoch is None and c.iid not in (None, pending):
        return c.note(f"started on {c.where}, not the instance being restored")
    rec.state = JobState.PROTECTED
    rec.instance = instance_facts(
        ev.instance.model_dump() if c.iid else (rec.pending or rec.instance)
    )
    rec.data.owner = Owner(instance_id=c.iid or pending, epoch=rec.data.owner.epoch)
    rec.data.parked_image = rec.data.parked_reason = None  # unparked by hand, if it was parked
    rec.pending = None
    return c.change(f"agent protects the job on {c.where}")


def _restored(c: Ctx) -> Change:
    rec, ev = c.rec, c.ev
    assert isinstance(ev, RestoredEvent)
    # The agent names its instance as its metadata service does; the local provider's VM
    # ids are not that, so the epoch, or restoring the assigned image, identifies it too.
    pending = iid_of(rec.pending)
    vouched = ev.epoch is not None or ev.image_url == rec.image_url
    if c.iid is not None and pending and c.iid != pending and not vouched:
        return c.note(f"restored on {c.where}, not the instance being restored")
    rec.state = JobState.PROTECTED
    rec.instance = instance_facts(ev.instance.model_dump() if c.iid else rec.pending)
    rec.data.launched = rec.pending
    rec.data.skip_offers = []
    rec.data.failed_rounds = 0  # the restart budget counts failed recoveries in a row
    rec.data.owner = Owner(instance_id=c.iid or pending, epoch=rec.data.owner.epoch)
    rec.pending = None
    rec.launch_token = None
    rec.spec = spec_from(rec, ev)
    return c.change(f"job restored and running on {c.where}")


def _not_restoring(c: Ctx) -> Change:
    return c.note(f"{c.ev.kind.value} on {c.where} while {c.rec.state.value} (recorded)")


def _before_launch_recorded(c: Ctx) -> Change:
    """LAUNCHING: the VM of this round (its epoch) reports before its launch is recorded — a
    controller that died after the provider's launch adopts the VM only on restart. The
    report was answered, so it is not sent again: keep it for :func:`settle_early_report`."""
    ev = c.ev
    if ev.epoch is None or ev.epoch != c.rec.data.owner.epoch:
        return _not_restoring(c)
    assert isinstance(ev, RestoredEvent | RestoreFailedEvent)
    c.rec.data.early_report = ev
    return c.note(f"{ev.kind.value} on {c.where} before its launch was recorded (kept)")


def settle_early_report(launched: Change) -> Change:
    """LAUNCHING → RESTORING was just made: apply a report of the round kept meanwhile (so
    a restored job is not left waiting for a RESTORED it already sent)."""
    rec = launched.record
    ev, rec.data.early_report = rec.data.early_report, None
    if ev is None or ev.epoch != rec.data.owner.epoch or rec.state is not JobState.RESTORING:
        return launched
    c = Ctx(rec, ev, Options(), {**launched.detail, "early": ev.kind.value})
    done = _restored(c) if isinstance(ev, RestoredEvent) else _restore_failed(c)
    done.reason = f"{launched.reason}; {done.reason}"
    return done


def _restore_failed(c: Ctx) -> Change:
    """Retryable → a new round; the image's fault → a new round from an older image (the
    loop picks it); anything else (preflight, mismatch, key) → FAILED."""
    rec, ev = c.rec, c.ev
    assert isinstance(ev, RestoreFailedEvent)
    err = ev.error
    c.detail["error"] = err.model_dump()
    if rec.pending:
        rec.data.terminate = [*rec.data.terminate, rec.pending]
    rec.pending = None
    if not err.retryable and not err.image_fault:
        rec.state = JobState.FAILED
        rec.reason = f"restore failed on {c.where} and cannot succeed elsewhere: {err.message}"
        return c.change(rec.reason)
    rec.state = JobState.LAUNCHING
    rec.launch_token = None
    rec.launch_attempt = 0
    new_epoch(rec)
    if err.retryable:
        rec.reason = f"restore failed on {c.where} ({err.message}); relaunching"
        return c.change(rec.reason)
    bad = ev.image_url
    if bad not in rec.data.bad_images:
        rec.data.bad_images = [*rec.data.bad_images, bad]
    rec.data.older_image = True
    rec.reason = (
        f"image {bad} cannot be restored ({err.message}); relaunching from the newest older "
        "complete image"
    )
    return c.change(rec.reason)


def _finished(c: Ctx) -> Change:
    rec = c.rec
    rec.state = JobState.FINISHED
    rec.reason = f"the job exited on {c.where}"
    if c.opts.terminate_finished:
        # Only instances the controller launched: the one the job was restored on, and
        # one still being restored. The first instance of a job belongs to whoever made it.
        queued = list(rec.data.terminate)
        for ref in (rec.data.launched, rec.pending):
            if iid_of(ref) and all(iid_of(q) != iid_of(ref) for q in queued):
                assert ref is not None
                queued.append(ref)
        rec.data.launched = None
        rec.data.terminate = queued
        rec.pending = None
        if queued:
            rec.reason += "; terminating the instance the controller launched"
    return c.change(rec.reason)


def _finished_again(c: Ctx) -> Change:
    return c.note("job finished (again)")


def _notice(c: Ctx) -> Change:
    rec, ev = c.rec, c.ev
    assert isinstance(ev, NoticeEvent)
    n = ev.notice
    seen = seen_notice(c.rec, c.iid, ev)
    if seen is not None:
        c.detail["duplicate_of"] = seen.model_dump()
        reason = (
            f"duplicate notice {n.id} from {origin(ev)} on {c.where} "
            f"(already applied from {seen.origin})"
        )
        return Change(rec, reason, c.detail, note=True, duplicate=True)
    if n.cancelled:
        if rec.state is JobState.INTERRUPTING:
            rec.state = JobState.PROTECTED
            rec.deadline = None
            return c.change(f"notice {n.id} cancelled")
        return c.note(f"notice {n.id} cancelled")
    kind = n.kind or "interruption"
    if ev.decision is Action.NONE and not n.ends_vm():
        return c.note(f"{kind} notice on {c.where}: the agent does nothing for it; the job runs on")
    deadline = n.deadline.timestamp() if n.deadline else None
    rec.deadline = deadline if deadline is not None else time.time() + c.opts.default_notice_s
    rec.data.notice = n
    rec.data.decision = ev.decision
    if rec.state is JobState.PROTECTED:
        rec.state = JobState.INTERRUPTING
        return c.change(f"{kind} notice on {c.where}")
    return c.note(f"notice on {c.where} while {rec.state.value}")


def _durable(c: Ctx) -> Change:
    rec, ev = c.rec, c.ev
    assert isinstance(ev, DurableEvent)
    rec.image_url = ev.image_url
    rec.spec = spec_from(rec, ev)
    if rec.state is JobState.INTERRUPTING and ev.mode is Mode.RESUME and not rec.data.ends_vm():
        # The agent checkpointed and let the job run on (rebalance, maintenance with
        # "resume"): nothing to relaunch; a later EXITED or preempt notice still is.
        rec.state = JobState.PROTECTED
        rec.deadline = None
        return c.change(f"image {ev.image_url} is durable; the job runs on on {c.where}")
    if rec.state is JobState.INTERRUPTING:
        rec.state = JobState.CHECKPOINTED
        return c.change(f"image {ev.image_url} is durable")
    return c.note(f"periodic image {ev.image_url} is durable")


def _exited(c: Ctx) -> Change:
    rec, ev = c.rec, c.ev
    assert isinstance(ev, ExitedEvent | ReadyToRelaunchEvent)
    drain = ev.kind is EventKind.READY_TO_RELAUNCH
    if ev.image_url:
        rec.image_url = ev.image_url
    if rec.state is JobState.CHECKPOINTED or ev.image_url:
        how = "drained" if drain else "exited"
        reason = f"{how} on {c.where} after a durable image; relaunching"
        return relaunch(rec, reason, drain=drain, terminate_old=c.opts.terminate_old)
    # Left without a durable image from this round: fall back to the newest image now.
    rec.state = JobState.INTERRUPTING
    rec.deadline = time.time()
    rec.data.fallback_now = True
    return c.change(f"{ev.kind.value} on {c.where} with no durable image; using the newest image")


def _checkpoint_failed(c: Ctx) -> Change:
    rec, ev = c.rec, c.ev
    assert isinstance(ev, CheckpointFailedEvent)
    msg = ev.error.message
    c.detail["error"] = ev.error.model_dump()
    rec.data.checkpoint_error = msg
    if rec.state is JobState.INTERRUPTING and not rec.data.ends_vm():
        # The engine thawed the job and the VM is not going away: it simply runs on.
        rec.state = JobState.PROTECTED
        rec.deadline = None
        return c.change(f"checkpoint failed on {c.where}: {msg}; the job runs on")
    return c.note(f"checkpoint failed on {c.where}: {msg}")


def _parked(c: Ctx) -> Change:
    """The job was parked to a store: its process ended, the image holds its state. PARKED
    is not an end and nothing relaunches it on its own (a notice pending is moot: no VM holds
    the job any more); ``unpark`` through the API, or a STARTED from its owner (unparked by
    hand there), brings it back."""
    rec, ev = c.rec, c.ev
    assert isinstance(ev, ParkedEvent)
    again = rec.state is JobState.PARKED
    rec.state = JobState.PARKED
    rec.image_url = ev.image_url
    rec.deadline = None
    d = rec.data
    d.parked_image, d.parked_reason = ev.image_url, ev.reason
    d.notice, d.decision, d.fallback_now, d.action = None, None, False, None
    rec.reason = f"parked to {ev.image_url} on {c.where}" + (f" ({ev.reason})" if ev.reason else "")
    return c.note(rec.reason + " (again)") if again else c.change(rec.reason)


def _parked_while_moving(c: Ctx) -> Change:
    return c.note(f"parked on {c.where} while {c.rec.state.value}: the relaunch goes on (recorded)")


def _while_parked(c: Ctx) -> Change:
    return c.note(f"{c.ev.kind.value} on {c.where} while parked: nothing of it runs (recorded)")


_BY_KIND: dict[EventKind, Handler] = {
    EventKind.NOTICE: _notice,
    EventKind.FROZEN: _record_only,
    EventKind.DURABLE: _durable,
    EventKind.CHECKPOINT_FAILED: _checkpoint_failed,
    EventKind.EXITED: _exited,
    EventKind.READY_TO_RELAUNCH: _exited,
}


def _while_moving(kind: EventKind) -> Handler:
    """LAUNCHING / RESTORING: a report about the instance the job left (or one that names
    no instance) adds facts only; one from another (the new) instance is handled as usual."""

    def handle(c: Ctx) -> Change:
        rec = c.rec
        old = iid_of(rec.instance)
        if c.ev.epoch is None and (
            c.iid is None or (c.iid == old and c.iid != iid_of(rec.pending))
        ):
            url = getattr(c.ev, "image_url", None)
            if isinstance(url, str) and url:
                rec.image_url = rec.image_url or url
            return c.note(f"late {kind.value} from the old instance {c.where} (ignored)")
        return _BY_KIND[kind](c)

    return handle


def _while_restoring(kind: EventKind, st: JobState) -> Handler:
    if st is JobState.RESTORING:
        return _restored if kind is EventKind.RESTORED else _restore_failed
    return _before_launch_recorded if st is JobState.LAUNCHING else _not_restoring


def _table() -> dict[tuple[JobState, EventKind], Handler]:
    t: dict[tuple[JobState, EventKind], Handler] = {}
    for st in JobState:
        for kind in EventKind:
            if kind is EventKind.STARTED:
                h: Handler = _started
            elif kind in (EventKind.RESTORED, EventKind.RESTORE_FAILED):
                h = _while_restoring(kind, st)
            elif kind is EventKind.JOB_FINISHED:
                h = _finished_again if st in TERMINAL else _finished
            elif st in TERMINAL:
                h = _after_end
            elif kind is EventKind.PARKED:
                h = _parked_while_moving if st in MOVING else _parked
            elif st is JobState.PARKED:
                h = _while_parked
            elif kind is EventKind.RESTORING:
                h = _record_only
            elif st in MOVING:
                h = _while_moving(kind)
            else:
                h = _BY_KIND[kind]
            t[(st, kind)] = h
    return t


#: The handler of every (state, kind).
HANDLERS: dict[tuple[JobState, EventKind], Handler] = _table()


def _first(ev: AnyEvent, opts: Options) -> JobRecord:
    rec = JobRecord(name=ev.job, state=JobState.PROTECTED, instance=ev.instance.model_dump())
    rec.store = (ev.store if isinstance(ev, StartedEvent) else None) or opts.default_store
    epoch = ev.epoch or 0
    rec.data.owner = Owner(instance_id=ev.instance.instance_id, epoch=epoch)
    rec.data.epochs = epoch
    if isinstance(ev, DurableEvent | RestoredEvent):
        rec.spec = spec_from(rec, ev)
    return rec


def on_event(rec: JobRecord | None, ev: AnyEvent, opts: Options) -> Change | None:
    """The change an agent event makes to a job (``None``: nothing to record)."""
    first: Change | None = None
    if rec is None:
        rec = _first(ev, opts)
        first = Change(
            rec, f"first report ({ev.kind.value})", {"instance": ev.instance.model_dump()}
        )
        if ev.kind in (EventKind.STARTED, EventKind.RESTORED):
            return first
    if isinstance(ev, StartedEvent) and ev.store:
        rec.store = ev.store
    detail: dict[str, Any] = {
        "event": ev.kind.value,
        "event_id": ev.event_id,
        "instance": ev.instance.instance_id,
        "epoch": ev.epoch,
    }
    c = Ctx(rec, ev, opts, detail)
    why = stale(rec, ev)
    if why is not None:
        detail["stale"] = why
        url = getattr(ev, "image_url", None)
        if ev.kind is EventKind.DURABLE and isinstance(url, str):
            rec.image_url = rec.image_url or url
        out = c.note(f"{ev.kind.value} from a non-owner ({why}): ignored")
        out.stale = why
        return out
    return HANDLERS[(rec.state, ev.kind)](c)
