"""The job state machine's reaction to agent events — pure functions, no I/O.

:func:`on_event` takes a job's record (or ``None`` for a job seen for the first time) and an
:class:`~spotguard.contracts.AgentEvent` and returns the :class:`~spotguard.controller.state.Change`
to persist (or ``None``). The reconcile loop (:mod:`spotguard.controller.core`) does what takes
time — fall back to the store's newest image, launch, wait, terminate.

::

    PROTECTED ──NOTICE──► INTERRUPTING ──DURABLE──► CHECKPOINTED ──EXITED / READY_TO_RELAUNCH──►
        ▲ ▲                    │ (deadline+grace, no image: newest image in store)     │
        │ └─DURABLE (resume)───┤                                                       │
        │   CHECKPOINT_FAILED  └───────────────────────────────────────────────► LAUNCHING
        │   (job runs on)                                                          │ launched
        └──────────────────── RESTORED ◄──────────────── RESTORING ◄───────────────┘
                                          RESTORE_FAILED (retryable) → LAUNCHING
    any ──JOB_FINISHED──► FINISHED          give-up errors, max restarts → FAILED(reason)

What leads to a relaunch: EXITED or READY_TO_RELAUNCH (the job stopped), or — for a notice
that ends the VM (:func:`ends_vm`: a preempt notice, or one the agent answered with ``exit``)
— its deadline plus grace passing with no report that the job still runs. A checkpoint the
agent *resumed* from (rebalance, maintenance with ``resume``, periodic) leaves the job
running, so its DURABLE (``detail.mode == "resume"``) brings the job back to PROTECTED; so
does a notice the agent decided to ignore (``decision == "none"``).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from spotguard.contracts import AgentEvent, EventKind
from spotguard.controller.state import TERMINAL, Change, JobRecord, JobState
from spotguard.facts import GpuInventory, InstanceFacts
from spotguard.providers.base import LaunchSpec

#: Restore failures (``detail["error_type"]`` of a RESTORE_FAILED event) that another instance
#: would not fix: give up instead of relaunching.
GIVE_UP_ERRORS = frozenset(
    {"PreflightError", "MismatchError", "ImageCorrupt", "ImageNotFound", "DecryptionError"}
)

#: Reports about the instance a job is leaving; after the relaunch started they only add facts.
_OLD_INSTANCE_KINDS = frozenset(
    {
        EventKind.NOTICE,
        EventKind.FROZEN,
        EventKind.DURABLE,
        EventKind.CHECKPOINT_FAILED,
        EventKind.EXITED,
        EventKind.READY_TO_RELAUNCH,
    }
)


def _iid(d: dict[str, Any] | None) -> str | None:
    v = (d or {}).get("instance_id")
    return str(v) if v else None


def _deadline(ev: AgentEvent, default_s: float) -> float:
    raw = (ev.notice or {}).get("deadline")
    if isinstance(raw, str):
        try:
            return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    return time.time() + default_s


def _spec_from(ev: AgentEvent, old: dict[str, Any]) -> dict[str, Any]:
    """The launch spec from what the agent reports about the job's GPUs and host."""
    if ev.gpu is None:
        return old
    host = ev.detail.get("host") if isinstance(ev.detail.get("host"), dict) else None
    mem = ev.detail.get("min_memory_mib")
    spec = LaunchSpec.from_facts(
        GpuInventory.from_json(ev.gpu),
        InstanceFacts.from_json(ev.instance or None),
        host,
        int(mem) if isinstance(mem, int) else None,
    )
    return spec.to_json()


#: How many (instance, notice) keys a job remembers for dedup of fleet and agent reports.
NOTICES_REMEMBERED = 32


def _notice_origin(notice: dict[str, Any]) -> str:
    return "the fleet queue" if notice.get("cloud") == "fleet" else "the agent"


def _seen_notice(rec: JobRecord, iid: str | None, notice: dict[str, Any]) -> dict[str, Any] | None:
    """Whether this notice (per instance, id and cancellation) was applied already; if not,
    remember it. The fleet source's ids equal the on-VM AWS source's for the same
    interruption (:mod:`spotguard.notices.fleet`), so whichever report comes second — under
    its own event id — is recognised here. Notice ids carry no instance id, hence the key."""
    nid = notice.get("id")
    if not nid:
        return None
    key = f"{iid or _iid(rec.instance) or '-'}|{nid}|{int(bool(notice.get('cancelled')))}"
    seen: dict[str, Any] = rec.data.setdefault("notices_seen", {})
    if key in seen:
        return dict(seen[key])
    seen[key] = {"origin": _notice_origin(notice), "at": time.time()}
    for old in sorted(seen, key=lambda k: seen[k]["at"])[: max(0, len(seen) - NOTICES_REMEMBERED)]:
        del seen[old]
    return None


def ends_vm(notice: dict[str, Any] | None, decision: object = None) -> bool:
    """Whether a notice means the job's VM goes away: a preempt notice (spot terminate, GCP
    preemption, Azure Preempt, the fleet queue's warning), or any notice the agent answered
    by stopping the job (``decision == "exit"``). Only such a notice's deadline may lead to a
    relaunch without the agent saying the job stopped."""
    n = notice or {}
    return n.get("kind") == "preempt" or (decision or n.get("decision")) == "exit"


def relaunch(rec: JobRecord, reason: str, *, drain: bool, terminate_old: bool) -> Change:
    """Move to LAUNCHING for a new round, queueing the old instance for termination."""
    rec.state = JobState.LAUNCHING
    rec.reason = reason
    rec.launch_token = None
    rec.launch_attempt = 0
    rec.data.pop("capacity_rounds", None)
    rec.data["drain"] = drain
    rec.data.pop("skip_offers", None)
    launched = rec.data.pop("ref", None)  # the instance the controller launched for the job
    if terminate_old and _iid(rec.instance):
        rec.data.setdefault("terminate", []).append(rec.instance)
    if terminate_old and _iid(launched) and _iid(launched) != _iid(rec.instance):
        rec.data.setdefault("terminate", []).append(launched)
    return Change(rec, reason, {"image_url": rec.image_url})


def on_event(
    rec: JobRecord | None,
    ev: AgentEvent,
    *,
    default_store: str | None = None,
    default_notice_s: float = 120.0,
    terminate_old: bool = True,
    terminate_finished: bool = True,
) -> Change | None:
    """The change an agent event makes to a job (``None``: nothing to record)."""
    kind = ev.kind
    iid = _iid(ev.instance)
    if rec is None:
        rec = JobRecord(name=ev.job, state=JobState.PROTECTED, instance=dict(ev.instance))
        rec.store = ev.detail.get("store") or default_store
        rec.spec = _spec_from(ev, {})
        first = Change(rec, f"first report ({kind.value})", {"instance": ev.instance})
        if kind in (EventKind.STARTED, EventKind.RESTORED):
            return first
    else:
        first = None
    if isinstance(ev.detail.get("store"), str):
        rec.store = ev.detail["store"]
    image = (ev.image_url, ev.image_bytes) if ev.image_url else None
    where = iid or "an unnamed instance"
    detail: dict[str, Any] = {"event": kind.value, "event_id": ev.event_id, "instance": iid}
    if ev.error:
        detail["error"] = ev.error

    def change(reason: str, *, note: bool = False) -> Change:
        assert rec is not None
        return Change(rec, reason, detail, note=note, image=image)

    st = rec.state
    moving = st in (JobState.LAUNCHING, JobState.RESTORING)
    from_old = iid is not None and iid == _iid(rec.instance) and iid != _iid(rec.pending)
    if moving and kind in _OLD_INSTANCE_KINDS and (from_old or iid is None):
        if image:
            rec.image_url = rec.image_url or ev.image_url
        return change(f"late {kind.value} from the old instance {where} (ignored)", note=True)

    if kind is EventKind.STARTED:
        if st is JobState.RESTORING and iid not in (None, _iid(rec.pending)):
            return change(f"started on {where}, not the instance being restored", note=True)
        if st is JobState.LAUNCHING:
            return change(f"started on {where} while launching (ignored)", note=True)
        rec.state = JobState.PROTECTED
        rec.instance = dict(ev.instance) or dict(rec.pending or {})
        rec.pending = None
        rec.spec = _spec_from(ev, rec.spec)
        return change(f"agent protects the job on {where}")

    if kind is EventKind.RESTORED:
        if st is not JobState.RESTORING:
            return change(f"restored on {where} while {st.value} (recorded)", note=True)
        # The agent names its instance as its metadata service does; the local provider's VM
        # ids are not that, so restoring the assigned image identifies the new instance too.
        same_image = ev.image_url is not None and ev.image_url == rec.image_url
        if iid is not None and _iid(rec.pending) and iid != _iid(rec.pending) and not same_image:
            return change(f"restored on {where}, not the instance being restored", note=True)
        rec.state = JobState.PROTECTED
        rec.instance = dict(ev.instance) or dict(rec.pending or {})
        rec.data["ref"] = rec.pending
        rec.data.pop("skip_offers", None)
        rec.pending = None
        rec.launch_token = None
        rec.spec = _spec_from(ev, rec.spec)
        return change(f"job restored and running on {where}")

    if kind is EventKind.RESTORE_FAILED:
        if st is not JobState.RESTORING:
            return change(f"restore failed on {where} while {st.value} (recorded)", note=True)
        err = ev.error or "no reason given"
        etype = str(ev.detail.get("error_type") or ev.detail.get("reason") or err.split(":", 1)[0])
        if rec.pending:
            rec.data.setdefault("terminate", []).append(rec.pending)
        rec.pending = None
        if etype in GIVE_UP_ERRORS:
            rec.state = JobState.FAILED
            rec.reason = f"restore failed on {where}: {etype}: {err}"
            return change(rec.reason)
        rec.state = JobState.LAUNCHING
        rec.launch_token = None
        rec.launch_attempt = 0
        rec.reason = f"restore failed on {where} ({etype or 'error'}: {err}); relaunching"
        return change(rec.reason)

    if kind is EventKind.JOB_FINISHED:
        if st in TERMINAL:
            return change("job finished (again)", note=True)
        rec.state = JobState.FINISHED
        rec.reason = f"the job exited on {where}"
        if terminate_finished:
            # Only instances the controller launched: the one the job was restored on, and
            # one still being restored. The first instance of a job belongs to whoever made it.
            queued = rec.data.setdefault("terminate", [])
            for ref in (rec.data.pop("ref", None), rec.pending):
                if _iid(ref) and all(_iid(q) != _iid(ref) for q in queued):
                    queued.append(ref)
            rec.pending = None
            if queued:
                rec.reason += "; terminating the instance the controller launched"
        return change(rec.reason)

    if st in TERMINAL:
        return first or change(f"{kind.value} from {where} after {st.value} (recorded)", note=True)

    if kind is EventKind.NOTICE:
        notice = ev.notice or {}
        seen = _seen_notice(rec, iid, notice)
        if seen is not None:
            detail["duplicate_of"] = seen
            return Change(
                rec,
                f"duplicate notice {notice.get('id')} from {_notice_origin(notice)} on {where} "
                f"(already applied from {seen['origin']})",
                detail,
                note=True,
                duplicate=True,
            )
        if notice.get("cancelled"):
            if st is JobState.INTERRUPTING:
                rec.state = JobState.PROTECTED
                rec.deadline = None
                return change(f"notice {notice.get('id')} cancelled")
            return change(f"notice {notice.get('id')} cancelled", note=True)
        decision = ev.detail.get("decision")
        if decision == "none" and not ends_vm(notice):
            return change(f"{notice.get('kind', 'interruption')} notice on {where}: the agent "
                          "does nothing for it; the job runs on", note=True)  # fmt: skip
        rec.deadline = _deadline(ev, default_notice_s)
        rec.data["notice"] = {**notice, "decision": decision} if decision else notice
        if st is JobState.PROTECTED:
            rec.state = JobState.INTERRUPTING
            return change(f"{notice.get('kind', 'interruption')} notice on {where}")
        return change(f"notice on {where} while {st.value}", note=True)

    if kind is EventKind.DURABLE:
        if not ev.image_url:
            return change(f"durable report from {where} without image_url (ignored)", note=True)
        rec.image_url = ev.image_url
        rec.spec = _spec_from(ev, rec.spec)
        resumed = ev.detail.get("mode") == "resume"
        if st is JobState.INTERRUPTING and resumed and not ends_vm(rec.data.get("notice")):
            # The agent checkpointed and let the job run on (rebalance, maintenance with
            # "resume"): nothing to relaunch; a later EXITED or preempt notice still is.
            rec.state = JobState.PROTECTED
            rec.deadline = None
            return change(f"image {ev.image_url} is durable; the job runs on on {where}")
        if st is JobState.INTERRUPTING:
            rec.state = JobState.CHECKPOINTED
            return change(f"image {ev.image_url} is durable")
        return change(f"periodic image {ev.image_url} is durable", note=True)

    if kind in (EventKind.EXITED, EventKind.READY_TO_RELAUNCH):
        drain = kind is EventKind.READY_TO_RELAUNCH
        if ev.image_url:
            rec.image_url = ev.image_url
        if st is JobState.CHECKPOINTED or ev.image_url:
            return relaunch(
                rec,
                f"{'drained' if drain else 'exited'} on {where} after a durable image; relaunching",
                drain=drain,
                terminate_old=terminate_old,
            )
        # Left without a durable image from this round: fall back to the newest image now.
        rec.state = JobState.INTERRUPTING
        rec.deadline = time.time()
        rec.data["fallback_now"] = True
        return change(f"{kind.value} on {where} with no durable image; using the newest image")

    if kind is EventKind.CHECKPOINT_FAILED:
        rec.data["checkpoint_error"] = ev.error
        if st is JobState.INTERRUPTING and not ends_vm(rec.data.get("notice")):
            # The engine thawed the job and the VM is not going away: it simply runs on.
            rec.state = JobState.PROTECTED
            rec.deadline = None
            return change(f"checkpoint failed on {where}: {ev.error}; the job runs on")
        return change(f"checkpoint failed on {where}: {ev.error}", note=True)

    return first or change(f"{kind.value} on {where}", note=True)
