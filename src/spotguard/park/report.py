"""A park to a store and the controller: the report, the epoch, and who owns the job now.

A job parked to a store is reported to the controller (:class:`~spotguard.contracts.
ParkedEvent`), whoever parked it — the agent's policies or ``spotguard park --to URL``: the
controller holds it as ``parked`` (not finished) and can unpark it on any node. The event's
id is derived from the image, so the agent and the command reporting the same park are one
event to the controller.

Before a store park is restored on this node by hand (or by a wake-on-connect client), the
controller is asked (:func:`owned_elsewhere`): once ``spotguard jobs unpark`` has brought the
job back on another node, the controller holds it under a later ownership epoch, and this
node's copy must not run too. The epoch the job was parked under is kept in the park record
(:func:`controller_epoch`), or comes from the node's assignment.

The controller a node reports to is named by its agent's settings (or the assignment the
node was launched with): :func:`controller_of`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from spotguard.agent.reporter import Reporter
from spotguard.agent.restore import read_assignment
from spotguard.agent.settings import AgentSettings
from spotguard.contracts import Directive, InstanceInfo, ParkedEvent
from spotguard.controller.client import ControllerClient
from spotguard.errors import SpotguardError
from spotguard.lifecycle import MOVING, JobState
from spotguard.statedir import StateDir

from .record import ParkRecord

log = logging.getLogger(__name__)

#: How long ``spotguard park --to URL`` waits for the controller to take its report.
REPORT_WAIT_S = 10.0


def parked_event(rec: ParkRecord, instance: dict[str, Any] | None = None) -> ParkedEvent | None:
    """The controller's report of a park to a store (None for a park kept on this node)."""
    if rec.place != "store":
        return None
    digest = hashlib.sha256(f"{rec.job}\0{rec.location}".encode()).hexdigest()[:32]
    return ParkedEvent(
        event_id=f"parked-{digest}",
        job=rec.job,
        instance=InstanceInfo.model_validate(instance or {}),
        image_url=rec.location,
        image_bytes=rec.bytes,
        reason=rec.reason or None,
    )


def controller_of(settings: AgentSettings, job: str) -> tuple[str, str | None] | None:
    """The controller this node's agent reports ``job`` to, and the token: the agent's
    settings, else the assignment this node was launched with (for that job); None when
    there is none."""
    url, token = settings.controller_url, settings.controller_bearer()
    if not url:
        with contextlib.suppress(SpotguardError):
            got = read_assignment(settings.assignment)
            if got is not None and got.job == job and got.controller_url:
                url, token = got.controller_url, token or got.controller_token
    return (url, token) if url else None


async def report_parked(rec: ParkRecord, settings: AgentSettings, state_dir: Path) -> str | None:
    """For ``spotguard park --to URL``: tell this node's controller that the job is parked to
    a store. Returns ``"reported"``, ``"queued"`` (the controller did not take it within
    :data:`REPORT_WAIT_S`; the event waits in the agent's outbox, which the agent sends) or
    None (not a store, or no controller configured)."""
    ev = parked_event(rec)
    if ev is None:
        return None
    try:
        where = controller_of(settings, rec.job)
        if where is None:
            return None
        reporter = Reporter(
            where[0], where[1], StateDir(state_dir).outbox, insecure=_insecure(settings, rec.job)
        )
    except (SpotguardError, OSError) as exc:  # the job is parked all the same
        log.warning("the park is not reported", extra={"job": rec.job, "error": str(exc)})
        return None
    reporter.emit(ev)
    await reporter.start()
    try:
        done = await reporter.flush(REPORT_WAIT_S)
    finally:
        await reporter.aclose()
    if not done:
        log.warning(
            "the controller has not taken the park report yet; the agent will send it",
            extra={"job": rec.job, "controller": where[0]},
        )
    return "reported" if done else "queued"


def _insecure(settings: AgentSettings, job: str) -> bool:
    """Whether plain http to a controller off this host is the operator's choice here (the
    private-network mode: ``insecure_controller`` in the settings or this node's assignment
    for ``job``), as the agent's own reporter allows it."""
    if settings.insecure_controller:
        return True
    with contextlib.suppress(SpotguardError):
        got = read_assignment(settings.assignment)
        return got is not None and got.job == job and got.insecure_controller
    return False


def _assigned_epoch(settings: AgentSettings, job: str) -> int | None:
    """The epoch this node's assignment gives ``job`` (None: no assignment for it)."""
    with contextlib.suppress(SpotguardError):
        got = read_assignment(settings.assignment)
        if got is not None and got.job == job:
            return got.epoch
    return None


async def ask_controller(settings: AgentSettings, job: str, epoch: int | None) -> Directive | None:
    """The controller's directive for ``job`` as an agent of ``epoch`` sees it; None when no
    controller is configured, it does not know the job, or it cannot be reached in time."""
    where = controller_of(settings, job)
    if where is None:
        return None
    try:
        return await ControllerClient(*where, timeout_s=REPORT_WAIT_S).directive(job, epoch)
    except SpotguardError as exc:
        log.debug("no directive", extra={"step": "directive", "job": job, "error": str(exc)})
        return None


async def controller_epoch(settings: AgentSettings, job: str) -> int | None:
    """The ownership epoch the controller holds ``job`` under now (kept with a store park)."""
    epoch = _assigned_epoch(settings, job)
    if epoch is not None:
        return epoch
    answer = await ask_controller(settings, job, None)
    return answer.owner.epoch if answer is not None else None


def owned_elsewhere(settings: AgentSettings) -> Callable[[ParkRecord], Awaitable[str | None]]:
    """The check :func:`spotguard.park.core.unpark` runs before restoring a store park here:
    why the job must not come back on this node, or None. Refused when the controller says
    this node's epoch no longer owns the job, or that it is bringing the job back now; a
    controller that is not configured, does not know the job or cannot be reached does not
    stop the unpark (the fencing of reports still holds)."""

    async def check(rec: ParkRecord) -> str | None:
        epoch = rec.controller_epoch
        if epoch is None:
            epoch = _assigned_epoch(settings, rec.job)
        answer = await ask_controller(settings, rec.job, epoch)
        if answer is None:
            log.warning(
                "the controller could not say who owns the parked job; unparking here",
                extra={"job": rec.job},
            )
            return None
        if answer.state is JobState.PARKED and not answer.stand_down:
            return None
        owner = answer.owner
        on = f"on {owner.instance_id}" if owner.instance_id else "on a new instance"
        if answer.stand_down:
            return (
                f"the controller brought it back {on} (epoch {owner.epoch}; this node parked "
                f"it under epoch {epoch})"
            )
        if answer.state in MOVING:
            return f"the controller is bringing it back {on} now (state {answer.state})"
        return None

    return check
