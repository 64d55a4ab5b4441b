"""Suspend in place: free a job's GPU and CPU without writing an image, and resume it.

The fastest way to park a job on the node it runs on is to write nothing at all: the driver
checkpoint API moves every GPU process's device memory into that process's own host memory
and releases the GPU; SIGSTOP then stops every process of the tree. The job keeps its PIDs,
its open files and its sockets (a client that connects meanwhile waits in the kernel's accept
queue, it is not refused). Resume is the reverse: GPU restore (onto the same GPUs, or others
of the same model through a UUID map) and unlock — after SIGCONT, since the driver does its
work through a thread of the job's own process (a stopped process would never answer).

Steps, each timed (like the engine's, which orders every operation that writes an image)::

    suspend: scan ─► gpu_lock ─► gpu_checkpoint ─► stop          (GPU processes in parallel)
    resume:  cont ─► gpu_restore ─► gpu_unlock  (the driver works through a thread of the job)

A failure while suspending brings the job back exactly as the engine does (GPU restored and
unlocked, SIGCONT). A failure while resuming leaves the job suspended — its state is still in
its host memory — and raises, so a later resume can try again.

A suspended job can still be checkpointed (a notice while it is parked): the engine skips the
driver steps for processes already checkpointed, and an image of it resumes when restored.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from spotguard.errors import JobError, SpotguardError
from spotguard.timeline import Timeline

from . import proctree
from .cuda import GpuHook, GpuState
from .jobs import JobInfo

log = logging.getLogger(__name__)


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


async def _bring_back(gpu: GpuHook, tree: Sequence[int], gpu_pids: Sequence[int]) -> None:
    for pid in gpu_pids:
        if not proctree.alive(pid):
            continue
        try:
            st = await gpu.state(pid)
            if st is GpuState.CHECKPOINTED:
                await gpu.restore([pid])
                st = GpuState.LOCKED
            if st is GpuState.LOCKED:
                await gpu.unlock([pid])
        except (SpotguardError, OSError) as exc:
            log.error("could not bring GPU state back", extra={"pid": pid, "error": str(exc)})
    proctree.signal_all([p for p in tree if proctree.alive(p)], signal.SIGCONT)


async def suspend(job: JobInfo, gpu: GpuHook, *, lock_timeout: float) -> Suspended:
    """Move the job's GPU state into its host memory, release the GPU and stop the tree."""
    if not proctree.alive(job.pid):
        raise JobError(f"job {job.name!r}: process {job.pid} is not running")
    tl = Timeline()
    tree: list[int] = [job.pid]
    gpu_pids: list[int] = []
    try:
        with tl.step("scan") as st:
            tree = proctree.tree(job.pid)
            gpu_pids = await gpu.gpu_pids(tree)
            gpu_bytes = gpu.memory_used(gpu_pids) if gpu_pids else 0
            cpu_bytes = proctree.rss_bytes(tree)
            st.detail.update(pids=len(tree), gpu_pids=len(gpu_pids), gpu_bytes=gpu_bytes)
        if gpu_pids:
            with tl.step("gpu_lock", pids=gpu_pids):
                await gpu.lock(gpu_pids, lock_timeout)
            with tl.step("gpu_checkpoint", pids=gpu_pids):
                await gpu.checkpoint(gpu_pids)
        with tl.step("stop"):
            # the tree as it is now (a process may have forked meanwhile), root last so that
            # a reaper never sees a half-stopped family
            tree = proctree.tree(job.pid)
            proctree.signal_all(reversed(tree), signal.SIGSTOP)
    except BaseException as exc:
        await asyncio.shield(_bring_back(gpu, tree, gpu_pids))
        log.warning("suspend failed; job resumed", extra={"job": job.name, "error": str(exc)})
        raise
    return Suspended(job, tree, gpu_pids, gpu_bytes, cpu_bytes, tl)


async def resume(
    job: JobInfo,
    gpu: GpuHook,
    gpu_pids: Sequence[int],
    *,
    remap: Mapping[str, str] | None = None,
) -> Timeline:
    """SIGCONT the tree, then GPU state back (``remap``: image GPU UUID → this host's) and
    unlock; until the unlock the job's CUDA calls wait."""
    tl = Timeline()
    if not proctree.alive(job.pid):
        raise JobError(f"job {job.name!r}: process {job.pid} is gone; it cannot be resumed")
    # The driver restores through a thread of the job's own process: the tree must run
    # first (its CUDA calls still block until the unlock).
    with tl.step("cont"):
        proctree.signal_all(proctree.tree(job.pid), signal.SIGCONT)
    waiting = [p for p in gpu_pids if proctree.alive(p)]
    states = {p: await gpu.state(p) for p in waiting}
    to_restore = [p for p, s in states.items() if s is GpuState.CHECKPOINTED]
    if to_restore:
        with tl.step("gpu_restore", pids=to_restore):
            await gpu.restore(to_restore, remap)
    locked = [p for p in waiting if p in to_restore or states[p] is GpuState.LOCKED]
    if locked:
        with tl.step("gpu_unlock", pids=locked):
            await gpu.unlock(locked)
    return tl


def stopped(pid: int) -> bool:
    """True if the process is stopped (``T``), as a job suspended in place is."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
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


def continue_stopped(tree: Sequence[int]) -> None:
    """SIGCONT the processes of a restored tree that CRIU brought back stopped (an image of a
    job that was suspended in place runs again; called before the GPU restore, which needs
    the job's own threads)."""
    proctree.signal_all([p for p in tree if stopped(p)], signal.SIGCONT)
