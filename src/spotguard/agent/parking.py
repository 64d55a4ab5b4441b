"""The agent's side of park: run the park policies for the jobs it protects, never touch a job
it is checkpointing or has a notice pending for, and tell parked jobs from finished ones.

A job parked as an image (tmpfs, disk, store) has no process: its worker is set aside as
``parked`` (no ``job_finished`` is reported) and the agent protects it again when it runs
under its new pid. A job suspended in place keeps its process and stays protected: a notice
checkpoints it like any other (the engine knows what a suspended job needs).

A job parked to a store is reported to the controller when its worker sees the job gone
(:func:`spotguard.park.report.parked_event`), and a store park is unparked here only when
the controller agrees (:func:`spotguard.park.report.owned_elsewhere`). The parks and unparks
themselves go through :class:`spotguard.park.service.ParkService`, as ``spotguard park``'s do.

A job parked as an image in the node's tmpfs or on its disk would go with the node: a notice
that asks for a checkpoint has the agent push it to the store first (:func:`evacuate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from spotguard.checkpoint import proctree, seal
from spotguard.checkpoint.engine import Engine
from spotguard.checkpoint.jobs import JobInfo, resolve_job
from spotguard.checkpoint.meta import META_NAME, ImageMeta
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.errors import SpotguardError
from spotguard.facts import InstanceFacts
from spotguard.image import ImageSettings, push_dir
from spotguard.notify import Notifier
from spotguard.operations.kept import image_meta
from spotguard.park import record
from spotguard.park.policy import ParkPolicy
from spotguard.park.record import ParkRecord
from spotguard.park.report import parked_event
from spotguard.park.service import ParkService, no_notify, spawn_waker, webhooks
from spotguard.park.settings import ParkSettings
from spotguard.park.store import store_path

from .jobstate import JobState
from .metrics import AgentMetrics
from .reporter import Reporter
from .settings import AgentSettings
from .worker import JobWorker


def is_parked(state_dir: Path, job: str) -> bool:
    """True while the job has a park record (its state is kept, it did not finish)."""
    try:
        return record.load(state_dir, job) is not None
    except Exception:  # noqa: BLE001 - an unreadable record still means "do not call it done"
        return True


log = logging.getLogger(__name__)


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


async def watch_alive(worker: JobWorker, state_dir: Path, every_s: float) -> None:
    """Look every ``every_s`` seconds whether the job's process still runs while its worker
    protects it; once it is gone: :func:`gone` (parked, or finished by itself)."""
    while worker.active:
        if worker.state is JobState.PROTECTING and not worker.alive():
            await gone(worker, state_dir)
            return
        await asyncio.sleep(every_s)


def parked_away(info: JobInfo, state_dir: Path) -> bool:
    """A job whose process is gone and which is parked (an agent started after the park):
    nothing to protect until it is unparked, and nothing to report as started."""
    return not proctree.alive(info.pid) and is_parked(state_dir, info.name)


#: parks whose state lives only on this node's memory or disk (gone with the VM)
NODE_PLACES = ("tmpfs", "disk")


def kept_on_node(state_dir: Path) -> list[ParkRecord]:
    """Jobs parked as an image in this node's tmpfs or on its disk."""
    return [r for r in record.all_records(state_dir) if r.place in NODE_PLACES]


async def evacuate(
    job: str,
    *,
    store_url: str,
    state_dir: Path,
    image: ImageSettings,
    instance: InstanceFacts,
    reporter: Reporter | None,
) -> dict[str, Any]:
    """A notice says this node goes: push a job parked in its tmpfs or on its disk to the
    store as an ordinary image (manifest last; signed like any other), make the record say
    so (``store`` and the image URL), drop the local copy, and tell the controller the job is
    parked there, so it can be unparked on any node. The answer is the job's line in the
    notice's results. A failed push leaves the local image and its record as they were."""
    async with record.alocked(state_dir, job):
        rec = record.load(state_dir, job)
        if rec is None or rec.place not in NODE_PLACES:
            return {"job": job, "parked": True, "skipped": "not parked on this node any more"}
        d = Path(rec.location)
        try:
            # pushing signs it with the fleet's key: only what this host sealed goes
            await asyncio.to_thread(seal.verify, d, seal.HostKey.for_state(state_dir))
            meta = ImageMeta.read(d)
            base = {"parked": True, "reason": rec.reason, "instance": instance.to_json()}
            at = (d / META_NAME).stat().st_mtime
            push = await push_dir(d, store_url, job, image_meta(base, meta, at), settings=image)
        except (SpotguardError, OSError) as exc:
            log.error(
                "the parked job could not be pushed to the store; its image stays here",
                extra={"step": "upload", "job": job, "image": str(d), "error": str(exc)},
            )
            return {"job": job, "parked": True, "error": f"{type(exc).__name__}: {exc}"}
        moved = rec.model_copy(update={"place": "store", "location": push.image_url})
        record.save(state_dir, moved)
        await asyncio.to_thread(shutil.rmtree, d, True)
    log.info(
        "parked job pushed to the store ahead of the notice",
        extra={"step": "upload", "job": job, "image": push.image_url},
    )
    ev = parked_event(moved, instance.to_json())
    if reporter is not None and ev is not None:
        reporter.emit(ev)
    return {"job": job, "parked": True, "url": push.image_url, "bytes": moved.bytes}


async def after_park(
    job: str,
    result: dict[str, Any],
    *,
    seconds_left: Callable[[], float],
    carry: Callable[[str], Awaitable[dict[str, Any]]],
    state_dir: Path,
) -> dict[str, Any] | None:
    """A notice's checkpoint of ``job`` made no image (``result``: refused because a park
    was dumping the job — "another freeze is in progress" — or the job's process went away
    in a park): when a park of the job is under way or ended in a park on this node, wait
    for it (its park lock) within the notice's deadline, then ``carry`` the parked image to
    the store (:func:`evacuate`). The answer is the job's line in the notice's results, or
    None when no park was involved or the park left the job running (the caller checkpoints
    it again)."""
    if not ("error" in result or result.get("skipped") or result.get("state") == "parked"):
        return result  # an image was made, or the notice was cancelled
    if not record.held(state_dir, job) and not _parked_on_node(state_dir, job):
        return result
    log.info(
        "a park of the job is under way at the notice; waiting for it",
        extra={"step": "notice", "job": job, "seconds_left": round(seconds_left(), 3)},
    )
    try:
        async with asyncio.timeout(max(0.0, seconds_left())):
            async with record.alocked(state_dir, job):
                rec = record.load(state_dir, job)
    except TimeoutError:
        log.error(
            "the park under way did not end within the notice's deadline",
            extra={"step": "notice", "job": job},
        )
        return {"job": job, "parked": True, "error": "a park under way outlasted the notice"}
    except SpotguardError as exc:
        return {"job": job, "error": f"{type(exc).__name__}: {exc}"}
    if rec is None or rec.place == "memory":
        return None  # the park failed (the job runs) or kept the job's process: checkpoint it
    if rec.place == "store":
        return {"job": job, "parked": True, "url": rec.location, "bytes": rec.bytes}
    return await carry(job)


def _parked_on_node(state_dir: Path, job: str) -> bool:
    try:
        rec = record.load(state_dir, job)
    except SpotguardError:
        return False
    return rec is not None and rec.place in NODE_PLACES


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


class NodeParks:
    """The jobs parked on this node, as a notice sees them: those kept in its tmpfs or on
    its disk (:meth:`kept`) go to ``store`` before the node does (:meth:`evacuate`), and a
    park under way at the notice is waited for (:meth:`after_park`)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        store: str,
        image: ImageSettings,
        instance: InstanceFacts,
        reporter: Reporter | None,
        metrics: AgentMetrics,
    ) -> None:
        self.state_dir = state_dir
        self.store = store
        self.image = image
        self.instance = instance
        self.reporter = reporter
        self.metrics = metrics

    def kept(self) -> list[ParkRecord]:
        return kept_on_node(self.state_dir)

    async def evacuate(self, job: str) -> dict[str, Any]:
        """:func:`evacuate` ``job``; any failure is the job's line in the notice's results."""
        try:
            return await evacuate(
                job, store_url=self.store, state_dir=self.state_dir, image=self.image,
                instance=self.instance, reporter=self.reporter,
            )  # fmt: skip
        except Exception as exc:  # one job's line in the results; the notice goes on
            self.metrics.failures.labels("evacuate").inc()
            log.error("parked job not pushed", exc_info=exc, extra={"job": job})
            return {"job": job, "parked": True, "error": f"{type(exc).__name__}: {exc}"}

    async def after_park(
        self, job: str, result: dict[str, Any], seconds_left: Callable[[], float]
    ) -> dict[str, Any] | None:
        """:func:`after_park` of ``job``, carrying its image with :meth:`evacuate`."""
        return await after_park(
            job, result, seconds_left=seconds_left, carry=self.evacuate, state_dir=self.state_dir
        )


def park_policy(
    workers: Mapping[str, JobWorker],
    *,
    checkpoint: CheckpointSettings,
    park: ParkSettings,
    image: ImageSettings,
    engine: Engine,
    agent: AgentSettings,
    notifier: Notifier | None,
    config: str | None,
) -> ParkPolicy:
    """The park policy over the agent's ``workers``: a job is busy while checkpointing or
    with a notice pending; webhooks told; wake-on-connect listeners started with the agent's
    ``config`` file; a store park is unparked here only when the controller ``agent`` names
    agrees (:func:`spotguard.park.report.owned_elsewhere`)."""
    state_dir = checkpoint.state_dir

    def busy(job: str) -> bool:
        w = workers.get(job)
        return w is None or w.state is not JobState.PROTECTING or bool(w.pending)

    def jobs() -> list[JobInfo]:
        out = []
        for w in list(workers.values()):
            if w.active:
                with contextlib.suppress(SpotguardError):
                    out.append(resolve_job(w.name, state_dir=state_dir))
        return out

    service = ParkService(
        settings=park,
        checkpoint=checkpoint,
        engine=engine,
        store=store_path(checkpoint, image, engine),
        notify=webhooks(notifier) if notifier is not None else no_notify,
        start_waker=spawn_waker(state_dir, config),
        controller=lambda: agent,
    )
    return ParkPolicy(service=service, jobs=jobs, busy=busy)
