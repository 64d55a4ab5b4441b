"""Who owns a job at the controller, and moving it on: the ownership epoch (fencing).

Each job has an :class:`~spotguard.contracts.Owner` — the instance and the ownership *epoch*
that may report for it. Every relaunch issues a new epoch (:func:`new_epoch`; the new
instance's assignment and scoped token carry it), so a report from an older epoch — the old
VM's agent restarted after its exit checkpoint, a second agent, an abandoned VM — is
:func:`stale`: recorded, ignored, answered with ``stand_down``.
"""

from __future__ import annotations

from typing import Any

from spotguard.contracts import AnyEvent, Owner
from spotguard.controller.state import Change, JobRecord, JobState

MOVING = frozenset({JobState.LAUNCHING, JobState.RESTORING})


def iid_of(d: dict[str, Any] | None) -> str | None:
    v = (d or {}).get("instance_id")
    return str(v) if v else None


def new_epoch(rec: JobRecord) -> int:
    """Hand the job to a new owner (not chosen yet): reports of the old epoch are stale."""
    rec.data.epochs = max(rec.data.epochs, rec.data.owner.epoch) + 1
    rec.data.owner = Owner(instance_id=None, epoch=rec.data.epochs)
    return rec.data.epochs


def relaunch(rec: JobRecord, reason: str, *, drain: bool, terminate_old: bool) -> Change:
    """Move to LAUNCHING for a new round under a new epoch, queueing the old instance(s)
    for termination."""
    rec.state = JobState.LAUNCHING
    rec.reason = reason
    rec.launch_token = None
    rec.launch_attempt = 0
    d = rec.data
    d.capacity_rounds = 0
    d.drain = drain
    d.skip_offers = []
    launched, d.launched = d.launched, None  # the instance the controller launched for the job
    if terminate_old and iid_of(rec.instance):
        d.terminate = [*d.terminate, dict(rec.instance)]
    if terminate_old and iid_of(launched) and iid_of(launched) != iid_of(rec.instance):
        assert launched is not None
        d.terminate = [*d.terminate, launched]
    epoch = new_epoch(rec)
    return Change(rec, reason, {"image_url": rec.image_url, "epoch": epoch})


def stale(rec: JobRecord, ev: AnyEvent) -> str | None:
    """Why ``ev`` does not come from the job's owner (None: it does).

    With an epoch (every agent holding a scoped token): it must be the owner's. Without one
    (a fleet-token agent): a report naming an instance other than the owner's is stale — a
    STARTED too: an agent protecting the job elsewhere does not take it over — except the
    reports of the instance being restored.
    """
    owner = rec.data.owner
    if ev.epoch is not None:
        if ev.epoch == owner.epoch:
            return None
        return f"epoch {ev.epoch}; the job is owned by epoch {owner.epoch}" + (
            f" on {owner.instance_id}" if owner.instance_id else ""
        )
    iid = ev.instance.instance_id
    if iid is None or owner.instance_id is None or iid == owner.instance_id:
        return None
    if iid == iid_of(rec.pending) or rec.state in MOVING:
        return None  # judged by the moving states' own rules
    return f"instance {iid}; the job is owned by {owner.instance_id} (epoch {owner.epoch})"
