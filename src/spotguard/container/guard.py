"""The agent's container jobs: ``spotguard agent --job podman:NAME`` or
``containerd:NAMESPACE/ID`` (or ``job = [...]``).

A container job is guarded like a process job — a :class:`~spotguard.agent.worker.JobWorker`
takes its notices, drains and periodic checkpoints, reports them (STARTED, FROZEN, DURABLE,
EXITED, ...), and the ledger journals each checkpoint — but the worker's checkpoint is the
container's (:func:`~spotguard.container.dispatch.checkpoint`: podman's export, or
containerd's task checkpoint, through runc and spotguard's CRIU, one signed image, manifest
last) and what "the job runs" means is the runtime's (containerd's task state is read in
podman's shape, :meth:`~spotguard.container.containerd.Containerd.inspect`; it has no
"checkpointed" state, so a containerd container that ends is parked only by a park record):

* the job's name is the image's (``podman-<name>``: reports, ledger, status ``job``); status
  also names the container (``container``); its pid is the container's init process, watched
  by identity (pid and start time) every :data:`LIVENESS_S`. When it is gone, podman says why:
  checkpointed (parked by ``spotguard park``, or checkpointed by hand) → ``parked``; stopped or
  removed → ``finished``. A container restored in place (leave-running) runs on under a new
  pid, which the worker follows.
* a container that is not running is waited for (looked at every :data:`WAIT_S`); after an
  exit checkpoint, a park or an end, a running container of that name is guarded again.
* an assignment's image that is a container image is restored as a new container of the same
  image, name and mounts (:meth:`ContainerJobs.restoring`); a record
  ``<state_dir>/containers/jobs/<job>.json`` maps the job's name back to its container, so
  the assignment's job (``podman-<name>``), also after an agent restart, is guarded as one.

A container parked to a store (``spotguard park podman:NAME --to URL``) is reported to the
controller as parked (``ParkedEvent``), as a process's park is. A container parked in memory
(paused) is checkpointed by a notice all the same (:func:`~spotguard.container.park.thawed`).
Not here: the node's park policy (idle jobs) parks processes only (docs/containers.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from spotguard import safefs
from spotguard.agent import identity, journal
from spotguard.agent.dispatch import NoticeDispatcher
from spotguard.agent.jobstate import JobState
from spotguard.agent.ledger import newest_image, runs_elsewhere, stood_down
from spotguard.agent.settings import AgentSettings
from spotguard.agent.worker import JobWorker
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.meta import ImageMeta
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.config import ConfigFile, load
from spotguard.container import dispatch
from spotguard.container import park as container_park
from spotguard.container.backends import runtime_for
from spotguard.container.dispatch import Backend
from spotguard.container.settings import ContainerSettings
from spotguard.container.spec import ContainerImage, ContainerRef, Runtime, is_container_image
from spotguard.container.spec import is_container_job as names_container
from spotguard.contracts import InstanceInfo, Mode, ParkedEvent, StartedEvent, check_job_name
from spotguard.errors import SpotguardError
from spotguard.facts import GpuInventory, HostFacts
from spotguard.image import ImageReader, ImageSettings
from spotguard.operations.results import CheckpointResult, Frozen, Landed, RestoreResult
from spotguard.statedir import StateDir

log = logging.getLogger(__name__)

#: how often a guarded container's init process is looked at (one /proc read)
LIVENESS_S = 1.0
#: how often podman is asked whether a container that is not running runs now
WAIT_S = 1.0
#: how long podman may take to say what became of a container whose processes are gone
SETTLE_S = 30.0
#: how long a removed container's park record may take to appear (a park to a store removes
#: the container once its image is durable, then writes the record)
REMOVED_S = 5.0
MAX_RECORD_BYTES = 4096

Restore = Callable[[str, str], Awaitable[RestoreResult]]


class ContainerJobRecord(BaseModel):
    """``<state_dir>/containers/jobs/<job>.json``: the container a job name stands for."""

    model_config = ConfigDict(extra="forbid")

    container: str  # podman:NAME


def _records(state_dir: Path) -> Path:
    return safefs.ensure_private_dir(StateDir(state_dir).container_jobs)


def remember(state_dir: Path, ref: ContainerRef) -> None:
    """Record that job ``ref.job`` is the container ``ref`` (written atomically, root-only)."""
    data = ContainerJobRecord(container=str(ref)).model_dump_json().encode()
    safefs.write_file(_records(state_dir) / f"{ref.job}.json", data)


def ref_of(spec: str, state_dir: Path) -> ContainerRef | None:
    """The container ``spec`` names: ``podman:NAME`` (another runtime or a bad name is a
    one-line JobError), or a job name recorded by :func:`remember`; None for anything else
    (a pid, a process job's name, a cgroup)."""
    spec = spec.strip()
    if names_container(spec):
        return ContainerRef.parse(spec)
    try:
        check_job_name(spec)
    except ValueError:
        return None
    try:
        fd = safefs.open_dir_nofollow(_records(state_dir))
        try:
            data = safefs.read_at(fd, f"{spec}.json", limit=MAX_RECORD_BYTES)
        finally:
            os.close(fd)
        return ContainerRef.parse(ContainerJobRecord.model_validate_json(data).container)
    except FileNotFoundError:
        return None
    except (OSError, ValidationError, SpotguardError) as exc:
        log.warning(
            "unreadable container job record ignored", extra={"job": spec, "error": str(exc)}
        )
        return None


def _state(ctr: dict[str, Any] | None) -> tuple[str, int, bool]:
    """(status, init pid, checkpointed) from ``podman container inspect``."""
    st = (ctr or {}).get("State") or {}
    return str(st.get("Status") or "gone"), int(st.get("Pid") or 0), bool(st.get("Checkpointed"))


class ContainerWorker(JobWorker):
    """A :class:`JobWorker` whose job is a container: status names the container, and the
    process early check (session leader, io_uring, ...) is not run — runc and CRIU take the
    container's whole tree in its own namespaces."""

    def __init__(self, ref: ContainerRef, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ref = ref

    async def _early_check(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {**super().status(), "container": str(self.ref)}


class ContainerJobs:
    """The agent's container jobs; built by the daemon once notices are handled, with the
    dispatcher (reporter, metrics, instance, ledger, replay), the daemon's ``workers`` (a
    container job's worker goes in there: status, drains and notices see it) and
    ``settled`` (a job ended: an agent run with ``exit_when_done`` may stop)."""

    def __init__(
        self,
        notices: NoticeDispatcher,
        workers: MutableMapping[str, JobWorker],
        settled: Callable[[], None],
        agent: AgentSettings,
        checkpoint: CheckpointSettings,
        image: ImageSettings,
        *,
        store: str,
        config: str | None,
        config_file: ConfigFile | None = None,
    ) -> None:
        self.notices = notices
        self.workers = workers
        self.settled = settled
        self.periodic_s = agent.periodic_interval
        self.state_dir = checkpoint.state_dir
        self.criu = checkpoint.criu
        self.image = image
        self.store = store
        self.config = config
        self.config_file = config_file  # the file the command read (else read at first use)
        self.guarded: set[str] = set()  # job names with a guard loop
        self._backends: dict[Runtime, Backend] = {}

    def backend(self, runtime: Runtime) -> Backend:
        """The runtime's backend as ``[container]`` says (loaded once, when a container job
        of that runtime first needs it)."""
        if runtime not in self._backends:
            cfg = self.config_file if self.config_file is not None else self.config
            s = load(ContainerSettings, {}, config_file=cfg)
            self._backends[runtime] = runtime_for(runtime, s, criu=self.criu)
        return self._backends[runtime]

    # --- what the daemon calls ------------------------------------------------------------

    def guard(self, spec: str) -> Coroutine[Any, Any, None] | None:
        """The guard of the container ``spec`` names (see :func:`ref_of`), or None when it
        names no container (the daemon guards a process)."""
        ref = ref_of(spec, self.state_dir)
        if ref is None:
            return None
        if ref.job in self.guarded:  # named twice (``--job podman:x`` and its assignment)
            return asyncio.sleep(0)
        self.guarded.add(ref.job)
        return self._protect(ref)

    def restoring(self, process: Restore) -> Restore:
        """The assignment's restore: a container image comes back as a container
        (:meth:`restore`), any other through ``process``."""

        async def restore(image_url: str, job: str) -> RestoreResult:
            done = await self.restore(image_url, job)
            return done if done is not None else await process(image_url, job)

        return restore

    async def restore(self, image_url: str, job: str) -> RestoreResult | None:
        """Restore the container image at ``image_url`` as a new container (same image, name
        and mounts; the record verified first, then the whole image: restore_container);
        None when it is not a container image."""
        async with ImageReader(image_url, settings=self.image) as reader:
            meta, url = dict(reader.manifest.meta), reader.url
        if not is_container_image(meta):
            return None
        record = ContainerImage.from_meta(meta, url)
        backend = self.backend(record.runtime)
        done = await dispatch.restore(
            url, backend=backend, image_settings=self.image, state_dir=self.state_dir
        )
        ref = ContainerRef.parse(done.container)
        await asyncio.to_thread(remember, self.state_dir, ref)
        if ref.job != job:
            log.warning(
                "the assigned job's image holds another container's job",
                extra={"step": "restore", "job": job, "container": str(ref)},
            )
        _, pid, _ = _state(await dispatch.inspect(backend, ref))
        host = await asyncio.to_thread(HostFacts.probe, record.criu_version)
        image_meta = ImageMeta(
            job={"name": ref.job, "pid": pid, "container": str(ref)}, mode=record.mode,
            criu_version=record.criu_version, host=host, gpu=GpuInventory(), gpu_processes=[],
            root_ns_pid=1, pids=[], staging={}, timeline=done.timeline.to_list(),
        )  # fmt: skip
        info = self._info(ref, pid)
        return RestoreResult(info, pid, done.timeline, image_meta, image_url=url)

    # --- guarding one container -----------------------------------------------------------

    def _info(self, ref: ContainerRef, pid: int) -> JobInfo:
        return JobInfo(name=ref.job, pid=pid, dir=StateDir(self.state_dir).container_jobs)

    async def _protect(self, ref: ContainerRef) -> None:
        """Guard ``ref`` whenever it runs: wait for it, guard it until its worker ends, wait
        for it to run again (restored, unparked) — until the agent stops."""
        await asyncio.to_thread(remember, self.state_dir, ref)
        with contextlib.suppress(SpotguardError):  # no runtime: _running says so
            await dispatch.recover_held(self.backend(ref.runtime), self.state_dir)
        seen: tuple[str, int] | None = None
        while True:
            ctr = await self._running(ref, seen)
            _, pid, _ = _state(ctr)
            seen = (ctr["Id"], pid)
            await self._guard(ref, pid)
            self.settled()

    async def _running(self, ref: ContainerRef, seen: tuple[str, int] | None) -> dict[str, Any]:
        """podman's view of ``ref`` once it runs as another incarnation than ``seen``."""
        told = False
        while True:
            try:
                ctr = await dispatch.inspect(self.backend(ref.runtime), ref)
            except SpotguardError as exc:
                ctr = None
                if not told:
                    log.warning("podman cannot say", extra={"job": ref.job, "error": str(exc)})
            status, pid, _ = _state(ctr)
            if ctr is not None and status == "running" and pid > 0 and (ctr["Id"], pid) != seen:
                return ctr
            if not told:
                told = True
                self._absent(ref, status)
            await asyncio.sleep(WAIT_S)

    def _absent(self, ref: ContainerRef, status: str) -> None:
        """First look at a container that does not run: say so, and show in status what
        the ledger or a park record says became of it (exited by our checkpoint, parked)."""
        log.info(
            "container not running; guarded once it runs",
            extra={"step": "job", "job": ref.job, "container": str(ref), "reason": status},
        )
        if ref.job in self.workers:
            return
        rec = self.notices.ledger.get(ref.job)
        if rec is not None and rec.state is JobState.EXITED:
            self._worker(ref, rec.pid, None).move(JobState.EXITED)
            self.settled()
        elif (parked := container_park.load(self.state_dir, ref)) is not None:
            worker = self._worker(ref, 0, None)
            self._report_park(worker, parked)
            worker.move(JobState.PARKED)
            self.settled()

    def _report_park(
        self, worker: ContainerWorker, rec: container_park.ParkedContainer | None
    ) -> None:
        """A container parked to a store is reported to the controller as a process's park
        is (:func:`spotguard.park.report.parked_event`: the event's id comes from the job
        and the image, so reporting it again is one event): the controller holds the job as
        parked, not finished, and can unpark it anywhere. A park kept on this node is not
        reported (nor is a process's)."""
        if rec is None or rec.place != "store" or not rec.image_url:
            return
        digest = hashlib.sha256(f"{worker.name}\0{rec.image_url}".encode()).hexdigest()[:32]
        worker.reporter.emit(
            ParkedEvent(
                event_id=f"parked-{digest}", job=worker.name,
                instance=InstanceInfo.model_validate(worker.instance),
                image_url=rec.image_url, reason=rec.reason or None,
            )
        )  # fmt: skip

    def _worker(
        self,
        ref: ContainerRef,
        pid: int,
        ident: identity.Identity | None,
        last: float | None = None,
    ) -> ContainerWorker:
        d = self.notices

        async def checkpointer(
            mode: Mode,
            deadline: datetime | None,
            meta: dict[str, Any],
            on_frozen: Callable[[float], None],
        ) -> CheckpointResult:
            del deadline  # podman's own time limit ([container] timeout) bounds it
            return await self._checkpoint(worker, mode, meta, on_frozen)

        worker = ContainerWorker(
            ref, ref.job, pid, checkpointer, reporter=d.reporter, metrics=d.metrics,
            instance=d.instance.to_json(), periodic_interval=self.periodic_s,
            last_image_at=last, ident=ident,
        )  # fmt: skip
        self.workers[ref.job] = worker
        return worker

    async def _guard(self, ref: ContainerRef, pid: int) -> None:
        d, job = self.notices, ref.job
        current = self.workers.get(job)
        if current is not None and current.active:
            return
        info = self._info(ref, pid)
        ident = await asyncio.to_thread(identity.read, pid)
        newest = None
        with contextlib.suppress(SpotguardError):
            newest = await newest_image(self.store, job, self.image)
        if stood_down(d.ledger, info) or await runs_elsewhere(
            d.ledger, job, newest, d.instance.instance_id, self.image
        ):
            self._worker(ref, pid, ident).move(JobState.STOOD_DOWN)
            d.ledger.put(job, pid, JobState.STOOD_DOWN)
            return
        worker = self._worker(ref, pid, ident, newest[1] if newest is not None else None)
        log.info(
            "protecting container",
            extra={"step": "protect", "job": job, "container": str(ref), "pid": pid},
        )
        d.ledger.put(job, pid, JobState.PROTECTING, ident=ident)
        where = InstanceInfo.model_validate(d.instance.to_json())
        d.reporter.emit(StartedEvent(job=job, instance=where, pid=pid, store=self.store))
        d.replay(worker)
        watcher = asyncio.create_task(self._watch(worker), name=f"alive-{job}")
        try:
            await worker.run()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _watch(self, worker: ContainerWorker) -> None:
        """Watch the container's init process; once it is gone, ask podman what became of
        the container (:meth:`_gone`)."""
        while worker.active:
            await asyncio.sleep(LIVENESS_S)
            if worker.state is JobState.PROTECTING and not worker.alive():
                await self._gone(worker)

    async def _gone(self, worker: ContainerWorker) -> None:
        """The container's init process is gone: podman's checkpoint (a park) → parked;
        running under another pid (restored in place) → follow it; stopped, or removed with
        no park record → finished. podman may need a moment to see it (its state is synced
        on inspect, or once conmon reports the exit)."""
        ref, loop = worker.ref, asyncio.get_running_loop()
        start = loop.time()
        while worker.state is JobState.PROTECTING:
            try:
                ctr = await dispatch.inspect(self.backend(ref.runtime), ref)
            except SpotguardError:
                ctr = None
            status, pid, checkpointed = _state(ctr)
            parked = await asyncio.to_thread(container_park.load, self.state_dir, ref)
            if worker.state is not JobState.PROTECTING:
                return  # a checkpoint of ours began meanwhile: it decides
            if checkpointed or parked is not None:
                self._report_park(worker, parked)
                worker.parked()
                return
            if status == "running" and pid != worker.pid and proc_alive(pid):
                await self._follow(worker, ctr)
                return
            waited = loop.time() - start
            if status in ("exited", "stopped") or waited > SETTLE_S:
                worker.job_ended()
                return
            if ctr is None and waited > REMOVED_S:
                worker.job_ended()  # removed, and no park record came: removed by hand
                return
            await asyncio.sleep(0.25)

    async def _follow(self, worker: ContainerWorker, ctr: dict[str, Any] | None = None) -> None:
        """The container runs under a new init process (restored in place): guard that."""
        if ctr is None:
            with contextlib.suppress(SpotguardError):
                ctr = await dispatch.inspect(self.backend(worker.ref.runtime), worker.ref)
        status, pid, _ = _state(ctr)
        if status != "running" or pid <= 0 or pid == worker.pid:
            return
        worker.pid, worker.ident = pid, await asyncio.to_thread(identity.read, pid)
        self.notices.ledger.put(worker.name, pid, JobState.PROTECTING, ident=worker.ident)

    async def _checkpoint(
        self,
        worker: ContainerWorker,
        mode: Mode,
        meta: dict[str, Any],
        on_frozen: Callable[[float], None],
    ) -> CheckpointResult:
        """One checkpoint of the container, journaled like a process's; the image's meta
        carries the job, instance and host facts the controller and a restarted agent read."""
        ref, d = worker.ref, self.notices
        backend = self.backend(ref.runtime)
        host = await asyncio.to_thread(HostFacts.probe, backend.criu_version())
        facts = {
            **meta,
            "job": {"name": ref.job, "pid": worker.pid, "container": str(ref)},
            "mode": mode.value,
            "instance": d.instance.to_json(),
            "host": host.to_json(),
        }
        info = self._info(ref, worker.pid)
        try:
            with journal.checkpointing(d.ledger, info, mode, worker.alive) as journaled:
                try:
                    async with container_park.thawed(ref, podman=backend, state_dir=self.state_dir):
                        done = await dispatch.checkpoint(
                            ref, self.store, backend=backend, image_settings=self.image,
                            state_dir=self.state_dir, leave_running=mode is Mode.RESUME,
                            meta=facts, on_frozen=on_frozen,
                        )  # fmt: skip
                finally:
                    if mode is Mode.RESUME or not worker.alive():
                        await self._follow(worker)  # restored in place: a new init process
                frozen = Frozen(
                    job=ref.job, mode=mode, gpu=GpuInventory(), host=host, instance=d.instance,
                    frozen_at=done.frozen_at, freeze_seconds=done.freeze_seconds,
                    pause_seconds=done.pause_seconds,
                )  # fmt: skip
                landed = Landed(
                    done.image_url, done.stats, done.timeline, done.durable_at, done.streamed
                )
                result = CheckpointResult.of(frozen, landed)
                journaled(result)
        except SpotguardError as exc:
            if mode is Mode.EXIT:  # said loudly: a process would leave a kept image here
                log.error(
                    "container exit checkpoint failed; a container image is not kept on this "
                    "host for a later push: the container runs on, its newest durable image "
                    "is the one to restore",
                    extra={"step": "checkpoint", "job": ref.job, "error": str(exc)[:300]},
                )
            raise
        finally:
            if worker.pid != info.pid and worker.alive():  # the journal wrote the old pid
                d.ledger.put(ref.job, worker.pid, JobState.PROTECTING, ident=worker.ident)
        return result


def proc_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie)."""
    return pid > 0 and identity.read(pid) is not None
