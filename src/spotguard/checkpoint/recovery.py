"""What :meth:`~spotguard.checkpoint.engine.Engine.recover` does with the crash marker a killed
process left (a restarted agent runs it at start-up; so do the next park and unpark): one
rule per ``op`` of the marker (:mod:`.marker`).

* ``freeze``, ``suspend``, ``resume``: every GPU process restored and unlocked, the tree
  continued (the engine's one bring-back) — once no ``criu dump`` holds the tree: a freeze's
  CRIU outlives the process that ran it and unwinds the dump itself, curing and resuming the
  tasks (:mod:`.criu`); brought back under it, the job would be continued while CRIU's
  parasite is still inside it. One that holds the tree longer than a dump may take
  (``criu_timeout``) is killed, rather than leave the job frozen for ever. A suspend whose
  record (park's) exists had completed: the job stays suspended and only the marker goes. A
  resume's record is removed once the job runs (it is no longer parked).
* ``restore`` (a park's image by unpark, or any other restore: the agent's of an assignment,
  ``spotguard restore``): killed while CRIU restored the tree, what CRIU left
  — processes waiting in its restorer for ever — is killed: they started after the process
  that ran the restore and name the image directory (CRIU's own, mid-restore) or the job's
  directory (the restored init of ``spotguard run``), they and their trees; the job stays
  parked, its image and record intact, and unparks again. Killed after CRIU returned (the
  restored root and its start time are in the marker): the restore is finished — GPU
  restored and unlocked, tree continued, ``job.json`` names the new pid, a park's record and
  image removed, as the unpark would have — unless the GPU memory carried beside CRIU was
  not all back (``pages_pending``: the tree is still stopped, the driver would restore
  zeros): that tree is killed and the job stays parked (or, not a park's, is restored again
  from its image by the next attempt).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from spotguard.errors import JobError

from . import proctree
from .jobs import JobInfo
from .marker import FreezeMarker, MarkerRecord, Op
from .procfacts import same_process, start_time

if TYPE_CHECKING:
    from .suspend import EngineParts

log = logging.getLogger(__name__)


async def recover(eng: EngineParts, job: JobInfo) -> bool:
    """Act on ``job``'s marker if the process that wrote it is gone (see the module doc).
    True if there was something to recover; :class:`JobError` if the writer still runs."""
    marker = FreezeMarker(job)
    rec = marker.read()
    if rec is None:
        return False
    other = rec.running_elsewhere()
    if other is not None:
        raise JobError(f"job {job.name!r}: a freeze is still running (pid {other})")
    kept = Path(rec.record) if rec.record else None
    if rec.op is Op.SUSPEND and kept is not None and kept.exists():
        marker.clear()  # killed after its commit: the job is suspended and recorded
        log.info("an interrupted suspend had completed", extra={"job": job.name})
        return False
    if rec.op is Op.RESTORE:
        await _restore(eng, job, rec, kept)
    else:
        tree = rec.tree
        if proctree.alive(job.pid):
            tree = sorted(set(tree) | set(proctree.tree(job.pid)))
        await criu_let_go(job, tree, eng.settings.criu_timeout)
        await eng.bring_back(job, tree, rec.gpu_pids)  # NCCL too: suspend releases
        if rec.op is Op.RESUME and kept is not None:
            kept.unlink(missing_ok=True)  # the job runs: it is no longer suspended
    marker.clear()
    log.info(
        "recovered job after an interrupted freeze",
        extra={"job": job.name, "gpu_pids": rec.gpu_pids, "step": rec.op},
    )
    return True


async def _restore(eng: EngineParts, job: JobInfo, rec: MarkerRecord, kept: Path | None) -> None:
    """A restore cut short: finished when CRIU had restored the tree, else undone."""
    if rec.job_start is not None:
        if not same_process(rec.job_pid, rec.job_start):
            return  # restored, then it ended on its own: the park is left as it is
        tree = proctree.tree(rec.job_pid)
        if rec.pages_pending:  # its GPU memory never came back: undone, the job parked
            proctree.signal_all(tree, signal.SIGKILL)
            await _gone(tree, HALF_RESTORED_EXIT_S)
            log.warning(
                "killed a restore whose staged GPU memory was not back; the job stays parked",
                extra={"job": job.name, "pid": rec.job_pid},
            )
            return
        await eng.bring_back(job, tree, rec.gpu_pids)
        await asyncio.to_thread(_restored, job.with_pid(rec.job_pid), kept, rec.images)
        log.info("finished an interrupted restore", extra={"job": job.name, "pid": rec.job_pid})
        return
    for root in half_restored(job, rec):
        doomed = proctree.tree(root)
        proctree.signal_all(doomed, signal.SIGKILL)
        # gone before this returns: their sockets (a server's port) and GPU state are freed
        # only when they have exited, and the caller restores the job next
        await _gone(doomed, HALF_RESTORED_EXIT_S)
        log.warning(
            "killed what an interrupted restore left; the job stays parked",
            extra={"job": job.name, "pid": root},
        )


def _dumping_criu(pid: int) -> bool:
    """Whether ``pid`` is a ``criu dump`` (any binary named ``criu``: the wrapper runs it
    through the prefix's loader, so its name is in its arguments, not in ``comm``) — or a
    process whose command line has gone: one in the last instants of its exit (its memory
    goes before the kernel lets its tracees go), which a CRIU finishing its unwind is. Either
    holds the tree until it stops tracing it; a zombie has already let go."""
    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    if not "".join(argv):
        return True
    return "dump" in argv and any(Path(a).name == "criu" for a in argv)


async def criu_let_go(job: JobInfo, tree: list[int], limit: float) -> None:
    """Wait until no ``criu dump`` traces a process of ``tree`` (one left by a killed agent,
    or one the engine left to unwind a cancelled dump); past ``limit`` seconds, kill the ones
    that still do and wait for them to exit (the kernel then lets the tree go). A tracer once
    seen as a CRIU stays one while it traces the tree, whatever its command line reads then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    waited = False
    seen: set[int] = set()
    while holders := [p for p in proctree.tracers(tree) if p in seen or _dumping_criu(p)]:
        seen.update(holders)
        if not waited:
            log.info(
                "waiting for a criu dump to let the job go",
                extra={"job": job.name, "pid": holders[0]},
            )
            waited = True
        if loop.time() > deadline:
            log.error(
                "killed a CRIU that held the job longer than a dump may take",
                extra={"job": job.name, "pid": holders[0], "seconds": limit},
            )
            proctree.signal_all(holders, signal.SIGKILL)
            await _gone(holders, HALF_RESTORED_EXIT_S)
            return
        await asyncio.sleep(0.05)


#: seconds to wait for the killed remains of a restore to exit
HALF_RESTORED_EXIT_S = 30.0


async def _gone(pids: list[int], limit: float) -> None:
    """Wait until none of ``pids`` is alive (zombies count as gone: they hold no files), at
    most ``limit`` seconds; then raise :class:`JobError` naming those left."""
    deadline = asyncio.get_running_loop().time() + limit
    while left := [p for p in pids if proctree.alive(p)]:
        if asyncio.get_running_loop().time() > deadline:
            raise JobError(f"processes {left} of an interrupted operation did not exit when killed")
        await asyncio.sleep(0.05)


def _restored(job: JobInfo, kept: Path | None, images: str | None) -> None:
    """What a restore does last: ``job.json`` names the running pid; a park's record and
    its parked image go (another restore's images are its source's, not this host's)."""
    job.save()
    if kept is not None:
        kept.unlink(missing_ok=True)
        if images:
            shutil.rmtree(images, ignore_errors=True)


def half_restored(job: JobInfo, rec: MarkerRecord) -> list[int]:
    """The topmost processes a ``criu restore`` killed midway left (see the module doc)."""
    marks = {m for m in (rec.images, str(job.dir)) if m}
    if rec.agent_start is None or not marks:
        return []
    found: dict[int, int] = {}  # pid → parent
    for pid in psutil.pids():
        started = start_time(pid)
        if started is None or started < rec.agent_start or pid == os.getpid():
            continue
        try:
            proc = psutil.Process(pid)
            argv, parent = proc.cmdline(), proc.ppid()
        except psutil.Error:
            continue
        if marks & set(argv):
            found[pid] = parent
    return sorted(p for p, parent in found.items() if parent not in found)
