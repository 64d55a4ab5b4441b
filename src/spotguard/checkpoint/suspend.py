"""Suspend in place: the engine's third mode — free a job's GPU and CPU without writing an
image, and resume it.

The fastest way to park a job on the node it runs on is to write nothing at all: the driver
checkpoint API moves every GPU process's device memory into that process's own host memory
and releases the GPU; SIGSTOP then stops every process of the tree. The job keeps its PIDs,
its open files and its sockets (a client that connects meanwhile waits in the kernel's accept
queue, it is not refused). Resume is the reverse: GPU restore (onto the same GPUs, or others
of the same model through a UUID map) and unlock — after SIGCONT, since the driver does its
work through a thread of the job's own process (a stopped process would never answer).

:class:`~spotguard.checkpoint.engine.Engine` runs these (``Engine.suspend`` /
``Engine.resume``: this module holds their step order, the engine's faults seam is consulted
before each step, as for a freeze)::

    suspend: scan ─► nccl_release ─► gpu_lock ─► gpu_checkpoint ─► stop ─► record
    resume:  cont ─► gpu_restore ─► gpu_unlock ─► nccl_rebuild ─► record
                    (GPU processes in parallel; the driver works through a thread of the job)

``nccl_release`` / ``nccl_rebuild`` are the freeze's own (:mod:`.ncclctl`): the NCCL
communicators of every process with spotguard's shim are released, all ranks at once, before
the GPU lock (a rank that cannot quiesce within the lock timeout fails the suspend in one
line, the job runs on) and rebuilt once the resumed job runs again — the driver's checkpoint
never meets what NCCL shares between processes (P2P, SHM, NVLS). While the job is suspended
its communicators do not exist.

Both take the engine's crash marker (``operation.json``, :mod:`.marker`, ``op`` ``suspend`` /
``resume``) before touching the job and clear it only after ``record`` — the caller's commit
(park writes its park record there, or removes it) — so a process killed at any instant
leaves a marker that :meth:`~spotguard.checkpoint.engine.Engine.recover` (a restarted agent)
acts on: the job brought back running (GPU restored and unlocked, SIGCONT), and for a resume
the record file removed; a suspend whose record was written is complete and stays suspended.

A failure while suspending brings the job back exactly as a freeze does (released
communicators rebuilt). A failure while resuming leaves the record (the job's GPU state is
still in its host memory) and raises, so a later resume can try again.

A suspended job can still be checkpointed (a notice while it is parked): the engine skips the
driver steps for processes already checkpointed, and an image of it resumes when restored.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from spotguard.errors import JobError, SpotguardError
from spotguard.timeline import Timeline

from . import proctree, stagefault
from .cuda import GpuHook, GpuState
from .jobs import JobInfo
from .marker import FreezeMarker, Op
from .ncclctl import NcclControl
from .settings import CheckpointSettings

log = logging.getLogger(__name__)


class EngineParts(Protocol):
    """What the in-place steps (and :mod:`.recovery`) use of the
    :class:`~spotguard.checkpoint.engine.Engine` that runs them."""

    gpu: GpuHook
    settings: CheckpointSettings
    nccl: NcclControl

    @property
    def faults(self) -> Faults: ...

    async def bring_back(
        self,
        job: JobInfo,
        tree: Sequence[int],
        gpu_pids: Sequence[int],
        *,
        reopen_nccl: bool = True,
    ) -> None: ...


class Faults(Protocol):
    """Test seam: consulted before each step; raising there fails that step."""

    async def before(self, step: str) -> None: ...


SUSPEND_STEPS = ("scan", "nccl_release", "gpu_lock", "gpu_checkpoint", "stop", "record")
RESUME_STEPS = ("cont", "gpu_restore", "gpu_unlock", "nccl_rebuild", "record")


@dataclass
class Suspended:
    """A job suspended in place: its tree, its GPU processes and how long each step took."""

    job: JobInfo
    tree: list[int]
    gpu_pids: list[int]
    gpu_bytes: int
    cpu_bytes: int
    timeline: Timeline = field(default_factory=Timeline)

    @property
    def seconds(self) -> float:
        return self.timeline.span()


#: the caller's commit, run as the last step while the marker is held (park: its record)
OnSuspended = Callable[[Suspended], Awaitable[None]]
OnResumed = Callable[[], Awaitable[None]]


async def suspend(
    eng: EngineParts, job: JobInfo, *, record: Path | None, commit: OnSuspended | None
) -> Suspended:
    """Move the job's GPU state into its host memory, release the GPU, stop the tree, then
    ``commit``; the marker lives from before the first step to after ``commit``."""
    if not proctree.alive(job.pid):
        raise JobError(f"job {job.name!r}: process {job.pid} is not running")
    tl = Timeline()
    gpu, faults = eng.gpu, eng.faults
    tree: list[int] = [job.pid]
    gpu_pids: list[int] = []
    job.dir.mkdir(parents=True, exist_ok=True)
    marker = FreezeMarker(job)
    marker.take(Op.SUSPEND, record=record)
    nccl_touched = False
    try:
        with tl.step("scan") as st:
            await faults.before("scan")
            tree = proctree.tree(job.pid)
            gpu_pids = await gpu.gpu_pids(tree)
            marker.update(gpu_pids=gpu_pids, tree=tree)
            gpu_bytes = gpu.memory_used(gpu_pids) if gpu_pids else 0
            cpu_bytes = proctree.rss_bytes(tree)
            st.detail.update(pids=len(tree), gpu_pids=len(gpu_pids), gpu_bytes=gpu_bytes)
        with tl.step("nccl_release") as ns:
            await faults.before("nccl_release")
            nccl_touched = True
            released = await eng.nccl.release(
                job.name, tree, eng.settings.gpu_lock_timeout, mode="park"
            )
            ns.detail.update(released.to_json())
        if gpu_pids:
            with tl.step("gpu_lock", pids=gpu_pids):
                await faults.before("gpu_lock")
                await gpu.lock(gpu_pids, eng.settings.gpu_lock_timeout)
            with tl.step("gpu_checkpoint", pids=gpu_pids) as gc:
                await faults.before("gpu_checkpoint")
                pf = await stagefault.checkpoint(gpu, gpu_pids, eng.settings, gpu_bytes)
                gc.detail.update(pf.to_json())
        with tl.step("stop"):
            await faults.before("stop")
            # the tree as it is now (a process may have forked meanwhile), root last so that
            # a reaper never sees a half-stopped family; the marker first names them all
            now = proctree.tree(job.pid)
            tree = sorted(set(tree) | set(now))
            marker.update(gpu_pids=gpu_pids, tree=tree)
            tree = now
            proctree.signal_all(reversed(tree), signal.SIGSTOP)
        done = Suspended(job, tree, gpu_pids, gpu_bytes, cpu_bytes, tl)
        with tl.step("record"):
            await faults.before("record")
            if commit is not None:
                await commit(done)
    except BaseException as exc:
        await asyncio.shield(eng.bring_back(job, tree, gpu_pids, reopen_nccl=nccl_touched))
        marker.clear()
        log.warning("suspend failed; job resumed", extra={"job": job.name, "error": str(exc)})
        raise
    marker.clear()
    return done


async def resume(
    eng: EngineParts,
    job: JobInfo,
    gpu_pids: Sequence[int],
    *,
    remap: Mapping[str, str] | None,
    record: Path | None,
    commit: OnResumed | None,
) -> Timeline:
    """SIGCONT the tree, then GPU state back (``remap``: image GPU UUID → this host's) and
    unlock (until the unlock the job's CUDA calls wait), then ``commit``."""
    tl = Timeline()
    gpu, faults = eng.gpu, eng.faults
    if not proctree.alive(job.pid):
        raise JobError(f"job {job.name!r}: process {job.pid} is gone; it cannot be resumed")
    marker = FreezeMarker(job)
    marker.take(Op.RESUME, record=record)
    tree = proctree.tree(job.pid)
    marker.update(gpu_pids=[p for p in gpu_pids if proctree.alive(p)], tree=tree)
    try:
        # The driver restores through a thread of the job's own process: the tree must run
        # first (its CUDA calls still block until the unlock).
        with tl.step("cont"):
            await faults.before("cont")
            proctree.signal_all(tree, signal.SIGCONT)
        waiting = [p for p in gpu_pids if proctree.alive(p)]
        states = {p: await gpu.state(p) for p in waiting}
        to_restore = [p for p, s in states.items() if s is GpuState.CHECKPOINTED]
        if to_restore:
            with tl.step("gpu_restore", pids=to_restore):
                await faults.before("gpu_restore")
                await gpu.restore(to_restore, remap)
        locked = [p for p in waiting if p in to_restore or states[p] is GpuState.LOCKED]
        if locked:
            with tl.step("gpu_unlock", pids=locked):
                await faults.before("gpu_unlock")
                await gpu.unlock(locked)
        with tl.step("nccl_rebuild") as rb:
            await faults.before("nccl_rebuild")
            rb.detail.update((await eng.nccl.rebuild(job.name, tree)).to_json())
        with tl.step("record"):
            await faults.before("record")
            if commit is not None:
                await commit()
    finally:
        marker.clear()  # a failure leaves the record: a later resume tries again
    return tl


#: the pending-signal lines of /proc/PID/status (the thread's own, the process's shared)
_PENDING = ("SigPnd:", "ShdPnd:")
_SIGSTOP_BIT = 1 << (signal.SIGSTOP - 1)


def stopped(pid: int) -> bool:
    """True if the process is stopped (``T``), as a job suspended in place is, or is about to
    be: a ``SIGSTOP`` sent and not yet acted on (CRIU stops a task it restores stopped with
    one, which may still be pending when it exits)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return True
        with open(f"/proc/{pid}/status") as f:
            pending = (int(ln.split()[1], 16) for ln in f if ln.startswith(_PENDING))
            return any(mask & _SIGSTOP_BIT for mask in pending)
    except (OSError, IndexError, ValueError):
        return False


async def parked(
    gpu: GpuHook, tree: Sequence[int], gpu_pids: Sequence[int]
) -> tuple[list[int], list[int]]:
    """(GPU processes already checkpointed, processes stopped) of a tree: what a job
    suspended in place has, which a freeze must neither checkpoint again nor wake."""
    done = []
    for pid in gpu_pids:
        try:
            if await gpu.state(pid) is GpuState.CHECKPOINTED:
                done.append(pid)
        except SpotguardError:
            continue
    return done, [p for p in tree if stopped(p)]


def continue_stopped(tree: Sequence[int], *, every: bool = False) -> None:
    """SIGCONT the processes of a restored tree that CRIU brought back stopped (an image of a
    job that was suspended in place runs again; called before the GPU restore, which needs
    the job's own threads).

    ``every``: CRIU left the whole tree stopped (``--leave-stopped``, while memory carried
    beside it is put back), so each process gets SIGCONT whatever ``/proc`` shows at this
    instant. A reading would not do: a stopped process that a tracer lets go (the placer's
    set-up, :mod:`.placing`) shows running for a moment before it stops again, and one
    skipped then stays stopped for good."""
    chosen = list(tree) if every else [p for p in tree if stopped(p)]
    proctree.signal_all(chosen, signal.SIGCONT)
