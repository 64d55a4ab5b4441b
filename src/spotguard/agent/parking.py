"""The agent's side of park: run the park policies for the jobs it protects, never touch a job
it is checkpointing or has a notice pending for, and tell parked jobs from finished ones.

A job parked as an image (tmpfs, disk, store) has no process: its worker is set aside as
``parked`` (no ``job_finished`` is reported) and the agent protects it again when it runs
under its new pid. A job suspended in place keeps its process and stays protected: a notice
checkpoints it like any other (the engine knows what a suspended job needs).

A job parked to a store is reported to the controller (:class:`~spotguard.contracts.
ParkedEvent`), whoever parked it — the agent's policies or ``spotguard park --to URL``: the
controller holds it as ``parked`` (not finished) and can unpark it on any node. The event's
id is derived from the image, so the agent and the command reporting the same park are one
event to the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, resolve_job
from spotguard.contracts import InstanceInfo, ParkedEvent
from spotguard.errors import SpotguardError
from spotguard.park import record, waker
from spotguard.park.policy import ParkPolicy, webhooks
from spotguard.park.record import ParkRecord
from spotguard.park.store import store_path

from .reporter import Reporter
from .restore import read_assignment
from .settings import AgentSettings
from .worker import JobWorker

if TYPE_CHECKING:
    from .daemon import Agent


def is_parked(state_dir: Path, job: str) -> bool:
    """True while the job has a park record (its state is kept, it did not finish)."""
    try:
        return record.load(state_dir, job) is not None
    except Exception:  # noqa: BLE001 - an unreadable record still means "do not call it done"
        return True


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


async def gone(worker: JobWorker, state_dir: Path) -> None:
    """The job's process is gone: parked as an image (kept; protected again when it runs;
    reported to the controller when parked to a store) or finished by itself.

    A park under way holds the job's park lock from before the job stops until its record is
    written (for a store: until the image's manifest is), so this waits for it before
    deciding: a parked job is never taken for finished."""
    async with record.alocked(state_dir, worker.name):
        parked = is_parked(state_dir, worker.name)
        rec = record.load(state_dir, worker.name) if parked else None
    if not parked:
        worker.job_ended()
        return
    ev = parked_event(rec, worker.instance) if rec is not None else None
    if ev is not None:
        worker.reporter.emit(ev)
    worker.parked()


def parked_away(info: JobInfo, state_dir: Path) -> bool:
    """A job whose process is gone and which is parked (an agent started after the park):
    nothing to protect until it is unparked, and nothing to report as started."""
    return not proctree.alive(info.pid) and is_parked(state_dir, info.name)


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
        reporter = Reporter(where[0], where[1], state_dir / "agent" / "outbox")
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


def parked_status(state_dir: Path) -> list[dict[str, Any]]:
    """The parked jobs of this node as ``status`` shows them: where, since when, why."""
    out = []
    for rec in record.all_records(state_dir):
        out.append(
            {
                "job": rec.job,
                "place": rec.place,
                "where": rec.location,
                "since": rec.since.isoformat(),
                "reason": rec.reason,
                "bytes": rec.bytes,
                "gpu_memory_freed": rec.gpu_bytes_freed,
                "wake_on_connect": rec.wake_on_connect,
            }
        )
    return out


def policy_for(agent: Agent) -> ParkPolicy:
    """The park policy over the agent's workers: busy while checkpointing or with a notice
    pending; webhooks told; wake-on-connect listeners started with the agent's config."""
    checkpoint, workers = agent.checkpoint_settings, agent.workers
    agent.metrics.count_parked(checkpoint.state_dir)
    engine = operations.engine_for(checkpoint)

    def busy(job: str) -> bool:
        w = workers.get(job)
        return w is None or w.state != "protecting" or bool(w.pending)

    async def start_waker(job: str) -> None:
        await asyncio.to_thread(waker.spawn, checkpoint.state_dir, job, agent.config)

    def jobs() -> list[JobInfo]:
        out = []
        for w in list(workers.values()):
            if w.active:
                with contextlib.suppress(SpotguardError):
                    out.append(resolve_job(w.name, state_dir=checkpoint.state_dir))
        return out

    policy = ParkPolicy(
        settings=agent.park_settings,
        checkpoint=checkpoint,
        engine=engine,
        jobs=jobs,
        busy=busy,
        start_waker=start_waker,
        store=store_path(checkpoint, agent.image_settings, engine),
    )
    if agent.notifier is not None:
        policy.notify = webhooks(agent.notifier)
    return policy
