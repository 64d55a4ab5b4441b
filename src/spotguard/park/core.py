"""Park and unpark: free a job's GPU and CPU while keeping its exact state, and bring it back.

Where the state goes (``--to``):

* ``memory`` (default): suspended in place (:mod:`spotguard.checkpoint.suspend`) — the driver
  moves GPU memory into the process's own host memory and releases the GPU, the tree is
  stopped. Nothing is written, so this is the fastest both ways; the job keeps its PIDs and
  sockets (clients wait in the accept queue instead of being refused).
* ``tmpfs`` / ``disk``: a checkpoint in ``exit`` mode into a directory in memory or on disk;
  the processes end and free their ports and PIDs.
* a store URL: an ordinary image in the store, which any node can restore.

Then a park record (:mod:`.record`). Unpark resumes in place or restores the image on this
node. The engine park is given orders every step — suspend in place is one of its modes
(``Engine.suspend`` / ``resume``), and the record is written (or, for a resume, removed) as
its last step, under its crash marker — so its guarantees hold here too: a failed park
leaves the job running (nothing is recorded), a failed unpark leaves the state where it was
(the record stays, the job can be unparked again), and a park or unpark killed midway is
brought back by the engine's ``recover`` (a restarted agent), a partial image of a killed
park to tmpfs or disk removed by the next park or unpark (:mod:`.local`).

Before touching anything, unpark checks what would make the restore fail late: the ports the
job listened on must be free (images only), and the GPUs must have room for the memory it
held. Each has its own one-line error naming the port (and who holds it) or the memory
missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from spotguard.checkpoint import proctree, seal, suspend
from spotguard.checkpoint.engine import Engine, Mode, RestoreResult
from spotguard.checkpoint.jobs import JobInfo, resolve_job
from spotguard.checkpoint.marker import FreezeMarker
from spotguard.checkpoint.meta import META_NAME
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget, dir_bytes
from spotguard.errors import JobError, JobNotFound, ParkError
from spotguard.store import URL_SCHEMES

from . import bridge, gpu, record, sockets
from .local import clear_partial, find_unrecorded, image_dir, private_base, set_aside
from .record import ListenAddress, ParkRecord, Place
from .settings import ParkSettings

log = logging.getLogger(__name__)

#: (job, store URL) → (image URL, image bytes); stops the job (exit mode)
StoreCheckpoint = Callable[[JobInfo, str], Awaitable[tuple[str, int]]]
#: image URL → the restored job's new host pid
StoreRestore = Callable[[str], Awaitable[int]]


OwnedElsewhere = Callable[[ParkRecord], Awaitable[str | None]]


@dataclass(frozen=True)
class StorePath:
    """How park reaches a store: the same checkpoint/restore composition the agent uses."""

    checkpoint: StoreCheckpoint
    restore: StoreRestore
    #: asked before a store park is restored here: why the job must not come back on this
    #: node (its controller brought it back elsewhere), or None. See ``park.report``.
    owned_elsewhere: OwnedElsewhere | None = None


_PLACES: dict[str, Place] = {"memory": "memory", "tmpfs": "tmpfs", "disk": "disk"}


def place_of(to: str) -> Place:
    """The place for a ``--to`` value (memory, tmpfs, disk or a store URL); else refused."""
    if to in _PLACES:
        return _PLACES[to]
    if to.startswith(URL_SCHEMES):
        return "store"
    raise ParkError(f"--to {to!r}: use memory, tmpfs, disk or a store URL (s3://, gs://, file://)")


def _check_memory_room(engine: Engine, tree: list[int], gpu_pids: list[int]) -> None:
    """A job parked to memory needs its GPU state twice (in the process, then the image)
    plus its CPU memory, as staging does; refuse up front rather than fill RAM."""
    gpu = engine.gpu.memory_used(gpu_pids) if gpu_pids else 0
    need = 2 * gpu + proctree.rss_bytes(tree)
    free = int(psutil.virtual_memory().available)
    if need > free:
        raise ParkError(
            f"not enough host memory to park to memory: need about {need >> 20} MiB, "
            f"{free >> 20} MiB available; use --to disk or a store URL"
        )


async def park(
    job: JobInfo,
    *,
    to: str,
    engine: Engine,
    settings: CheckpointSettings,
    park_settings: ParkSettings,
    store: StorePath | None = None,
    reason: str = "",
    wake_on_connect: bool = False,
    priority: int = 0,
) -> ParkRecord:
    """Freeze ``job`` (exit mode) into ``to`` and record it as parked.

    Raises :class:`ParkError` (already parked, no room, bad ``to``) before anything is done to
    the job; any failure of the freeze itself leaves the job running (the engine's guarantee).
    """
    place = place_of(to)
    state = settings.state_dir
    async with record.alocked(state, job.name, wait=False):
        await _after_a_killed_one(engine, job)
        if record.load(state, job.name) is not None:
            raise ParkError(f"job {job.name!r} is already parked (spotguard unpark {job.name})")
        if not proctree.alive(job.pid):
            raise JobError(f"job {job.name!r}: process {job.pid} is not running")
        tree = proctree.tree(job.pid)
        listen = sockets.listening(tree)
        gpu_pids = await engine.gpu.gpu_pids(tree)
        gpu_bytes = engine.gpu.memory_used(gpu_pids) if gpu_pids else 0
        started = time.monotonic()

        def parked(location: str, size: int, in_place: tuple[int, ...] = ()) -> ParkRecord:
            return ParkRecord(
                job=job.name,
                place=place,
                location=location,
                reason=reason,
                bytes=size,
                gpu_bytes_freed=gpu_bytes,
                park_seconds=round(time.monotonic() - started, 3),
                listen=tuple(ListenAddress.of(a) for a in listen),
                wake_on_connect=wake_on_connect and bool(listen),
                priority=priority,
                job_dir=str(job.dir),
                pid=job.pid,
                gpu_pids=in_place,
                gpus=tuple((d.uuid, d.model) for d in gpu.devices()) if gpu_pids else (),
                gpu_use=gpu.use_by_device(gpu_pids) if gpu_pids else {},
            )

        if place == "memory":
            rec = await _suspend(job, engine, state, parked)
        else:
            # the job's listening sockets stay open in this process through the dump, for
            # its wake listener (:mod:`.bridge`): no moment with the port free
            held = bridge.take(tree, listen) if wake_on_connect else []
            try:
                if place == "store":
                    if store is None:
                        raise ParkError("parking to a store URL needs the store settings")
                    location, size = await store.checkpoint(job, to)
                else:
                    if place == "tmpfs":
                        _check_memory_room(engine, tree, gpu_pids)
                    location, size = await _freeze_here(job, place, engine, settings, park_settings)
                rec = parked(location, size)
                record.save(state, rec)
            except BaseException:
                bridge.close(held)
                raise
            bridge.keep(job.name, held)
    log.info(
        "job parked",
        extra={
            "job": job.name,
            "place": place,
            "location": rec.location,
            "bytes": rec.bytes,
            "gpu_bytes": gpu_bytes,
            "seconds": rec.park_seconds,
            "reason": reason,
        },
    )
    return rec


async def _after_a_killed_one(engine: Engine, job: JobInfo) -> None:
    """A park, unpark (or checkpoint) of the job killed midway left the engine's marker: the
    next park or unpark first finishes or undoes it (``Engine.recover``). A marker this very
    process holds (an agent's own checkpoint under way) is left alone."""
    left = FreezeMarker(job).read()
    if left is not None and left.agent_pid != os.getpid():
        await engine.recover(job)


async def _suspend(
    job: JobInfo, engine: Engine, state: Path, parked: Callable[..., ParkRecord]
) -> ParkRecord:
    """Suspend the job in place through the engine; its record is written as the engine's
    last step, under its crash marker (a park killed before the record is undone by the
    engine's ``recover``; one killed after it is complete)."""
    out: list[ParkRecord] = []

    async def commit(sus: suspend.Suspended) -> None:
        rec = parked(f"in place (pid {job.pid})", proctree.rss_bytes(sus.tree), tuple(sus.gpu_pids))
        record.save(state, rec)
        out.append(rec)

    await engine.suspend(job, record=record.path(state, job.name), commit=commit)
    return out[0]


async def _freeze_here(
    job: JobInfo, place: Place, engine: Engine, cs: CheckpointSettings, ps: ParkSettings
) -> tuple[str, int]:
    """An exit-mode image of the job in this node's tmpfs or disk: (where, bytes). What a
    killed park left there before is cleared first (:func:`.local.clear_partial`)."""
    d = image_dir(place, job.name, cs, ps)
    private_base(d)
    clear_partial(d)
    set_aside(d)
    target = DirectoryTarget(d, key=seal.HostKey.for_state(cs.state_dir))
    await engine.freeze(job, target, Mode.EXIT)
    return str(d), dir_bytes(d)


def _holder(addr: sockets.Address) -> str:
    """Who listens on ``addr`` now (for the error message)."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            port = getattr(conn.laddr, "port", None)
            if conn.status == psutil.CONN_LISTEN and port == addr.port and conn.pid:
                try:
                    name = psutil.Process(conn.pid).name()
                except psutil.Error:
                    name = "?"
                return f" (held by pid {conn.pid}, {name})"
    except psutil.Error:
        return ""
    return ""


def check_ports_free(rec: ParkRecord, *, held_by_waker: bool = False) -> None:
    """Every address the job listened on can be bound again, or :class:`ParkError`.

    ``held_by_waker``: the job's wake-on-connect listener holds the ports (root's sockets,
    ``SO_REUSEPORT``; :mod:`.wake`): the probe sets ``SO_REUSEPORT`` too, as CRIU does when
    it binds the job's socket, so it passes beside the listener and fails on any other
    holder — another user's socket, or one of root's without ``SO_REUSEPORT``."""
    for la in rec.listen:
        addr = la.address()
        with socket.socket(sockets.family_of(addr), socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if held_by_waker:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                s.bind((addr.host, addr.port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise ParkError(f"cannot check port {addr}: {exc}") from exc
                raise ParkError(
                    f"job {rec.job!r} listened on {addr}, which is taken now{_holder(addr)}; "
                    "free it, then unpark again (the parked state is kept)"
                ) from exc


def check_gpu_room(rec: ParkRecord, free_bytes: Callable[[], int | None]) -> None:
    """The GPUs have room for the memory the job held, or :class:`ParkError`."""
    if not rec.gpu_bytes_freed:
        return
    free = free_bytes()
    if free is not None and free < rec.gpu_bytes_freed:
        raise ParkError(
            f"job {rec.job!r} needs {rec.gpu_bytes_freed >> 20} MiB of GPU memory, "
            f"{free >> 20} MiB is free; the parked state is kept — unpark when the GPU has room"
        )


async def _resume_in_place(
    rec: ParkRecord, engine: Engine, cs: CheckpointSettings, remap: dict[str, str] | None
) -> int:
    """Resume a job suspended in place; a job that ended meanwhile loses its record (its
    state went with it, e.g. checkpointed and stopped by a notice) and is reported."""
    job = resolve_job(rec.job, state_dir=cs.state_dir)
    if not proctree.alive(rec.pid):
        record.remove(cs.state_dir, rec.job)
        raise ParkError(
            f"job {rec.job!r} is no longer parked here: process {rec.pid} ended while parked "
            "(a notice checkpoints parked jobs too: look for its latest image)"
        )
    path = record.path(cs.state_dir, rec.job)

    async def commit() -> None:  # under the engine's marker: a killed resume is finished
        record.remove(cs.state_dir, rec.job)

    await engine.resume(job, rec.gpu_pids, remap=remap, record=path, commit=commit)
    return rec.pid


def place_gpus(rec: ParkRecord, host: Callable[[], list[gpu.Device]]) -> list[str] | None:
    """The host GPUs (in the order of the GPUs it saw when parked) to bring the job back onto:
    its own where they have room, else others of the same model (UUID remap); None when
    nothing needs placing. :class:`ParkError` when no GPU of the model has room (the parked
    state is kept)."""
    if not rec.gpu_use or not rec.gpus:
        return None
    devices = host()
    if not devices:
        return None
    image = [gpu.Device(uuid, model, 0) for uuid, model in rec.gpus]
    chosen = gpu.choose(image, rec.gpu_use, devices)
    if chosen is None:
        need = max(rec.gpu_use.values())
        models = sorted({m for _u, m in rec.gpus})
        raise ParkError(
            f"job {rec.job!r} needs {need >> 20} MiB on a {' / '.join(models)} GPU and none "
            "has that much free now; the parked state is kept — unpark when a GPU has room"
        )
    return chosen


def _waker_alive(rec: ParkRecord) -> bool:
    """Whether the job's wake-on-connect listener runs (it holds the job's ports), us
    included."""
    return rec.waker_pid is not None and (
        rec.waker_pid == os.getpid() or proctree.alive(rec.waker_pid)
    )


def stop_waker(rec: ParkRecord) -> None:
    """Tell the job's wake-on-connect listener that the job runs again (SIGTERM), unless it
    is us. Sent once the restored job listens beside it (:mod:`.wake`): it then hands the
    clients it accepted to the job, lets go of the ports and exits on its own — not waited
    for, as it may be relaying a long connection."""
    pid = rec.waker_pid
    if pid is None or pid == os.getpid() or not proctree.alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)


@dataclass(frozen=True)
class Unparked:
    """A job running again after unpark: where from, its pid, how long it took."""

    job: str
    pid: int
    place: Place
    location: str
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {
            "job": self.job,
            "pid": self.pid,
            "place": self.place,
            "location": self.location,
            "seconds": self.seconds,
        }


async def _refuse_if_owned_elsewhere(rec: ParkRecord, store: StorePath, state: Path) -> None:
    """A job parked to a store may have been brought back on another node through the
    controller (``spotguard jobs unpark``): restoring it here too would run it twice. When
    the controller says so, this node's record is dropped (the image stays in the store) and
    the unpark is refused in one line."""
    if store.owned_elsewhere is None:
        return
    why = await store.owned_elsewhere(rec)
    if why is None:
        return
    record.remove(state, rec.job)
    log.warning(
        "the parked job runs elsewhere; its park record here is dropped",
        extra={"job": rec.job, "image": rec.location, "reason": why},
    )
    raise ParkError(
        f"job {rec.job!r} is not unparked here: {why}; this node's park record is dropped "
        f"(the image stays at {rec.location})"
    )


async def _bring_back(
    rec: ParkRecord,
    engine: Engine,
    settings: CheckpointSettings,
    park_settings: ParkSettings,
    store: StorePath | None,
    remap: dict[str, str] | None,
    chosen: list[str] | None,
) -> int:
    """Resume or restore the job from wherever it is parked; the running job's pid. An
    image restores onto the GPUs ``chosen`` when they differ from its own (``remap``)."""
    job, state = rec.job, settings.state_dir
    if rec.place == "memory":
        return await _resume_in_place(rec, engine, settings, remap)
    if rec.place == "store":
        if store is None:
            raise ParkError("unparking from a store URL needs the store settings")
        await _refuse_if_owned_elsewhere(rec, store, state)
        return await store.restore(rec.location)
    d = Path(rec.location)
    if d != image_dir(rec.place, job, settings, park_settings):
        raise ParkError(
            f"the park record of {job!r} names {d}, not this host's park directory "
            "for it; refusing to restore from there"
        )
    private_base(d)
    if not (d / META_NAME).is_file():
        raise ParkError(f"the parked state of {job!r} is missing at {d}")
    source = DirectorySource(d, key=seal.HostKey.for_state(state))
    gpus = ",".join(chosen) if remap is not None and chosen is not None else None

    async def commit(_restored: RestoreResult) -> None:
        # under the engine's marker: a restore killed before this is undone or finished
        record.remove(state, job)
        await asyncio.to_thread(shutil.rmtree, d, True)

    result = await engine.restore(
        source, state_dir=state, restore_gpus=gpus, record=record.path(state, job), commit=commit
    )
    return result.pid


async def unpark(
    job: str,
    *,
    engine: Engine,
    settings: CheckpointSettings,
    park_settings: ParkSettings,
    store: StorePath | None = None,
    gpu_free: Callable[[], int | None] = lambda: None,
    wait_lock: bool = True,
    gpu_devices: Callable[[], list[gpu.Device]] = gpu.devices,
) -> Unparked:
    """Restore a parked job on this node; its record and local image go once it runs.

    ``wait_lock=False`` refuses at once when another park/unpark of the job is under way.
    A wake-on-connect listener of the job keeps holding its ports through the restore and is
    told to go only once the job runs (:mod:`.wake`): there is no moment when the port is
    free for another user to bind.
    """
    state = settings.state_dir
    async with record.alocked(state, job, wait=wait_lock):
        with contextlib.suppress(JobNotFound):
            await _after_a_killed_one(engine, resolve_job(job, state_dir=state))
        rec = record.load(state, job) or find_unrecorded(job, settings, park_settings)
        if rec is None:
            raise ParkError(f"job {job!r} is not parked")
        # a wake-on-connect listener keeps the ports until the restored job holds them (no
        # gap another user could bind in); it is told to go once the job runs
        if rec.place != "memory":  # suspended in place, the job still holds its ports
            check_ports_free(rec, held_by_waker=_waker_alive(rec))
        chosen = place_gpus(rec, gpu_devices)
        if chosen is None:
            check_gpu_room(rec, gpu_free)
        remap = None
        if chosen is not None and chosen != [u for u, _m in rec.gpus]:
            remap = dict(zip((u for u, _m in rec.gpus), chosen, strict=True))
        started = time.monotonic()
        try:
            pid = await _bring_back(rec, engine, settings, park_settings, store, remap, chosen)
        except BaseException:
            if record.load(state, job) is None:  # the record was dropped: not parked here
                stop_waker(rec)
            raise
        record.remove(state, job)
        stop_waker(rec)
    done = Unparked(job, pid, rec.place, rec.location, round(time.monotonic() - started, 3))
    log.info(
        "job unparked",
        extra={"job": job, "pid": pid, "place": rec.place, "seconds": done.seconds},
    )
    return done
