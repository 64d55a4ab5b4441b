"""The freeze engine: the ONLY place that orders the steps of a checkpoint and a restore.

Freeze (dump)::

    scan ─► nccl_release ─► gpu_lock ─► gpu_checkpoint ─► criu_dump ──────────► resume ─► finish
                          (all GPU processes in parallel)  └ capture_files      gpu_restore
                                                           └ finish, then exit + gpu_unlock
                                                             (EXIT mode)       + nccl_rebuild

* ``scan``: the tree's pids, which of them hold GPU state, memory → staging plan (tmpfs or
  disk, decided up front, logged, in the result); the freeze preflight (:mod:`.scan`)
  refuses a tree CRIU cannot dump before anything is locked or frozen, and plans the TCP
  options (``--tcp-established``, network lock) from the sockets it holds.
* ``nccl_release`` / ``nccl_rebuild``: NCCL communicators of processes with spotguard's shim
  released (all ranks at once) before the GPU lock, rebuilt after resume/restore (:mod:`.ncclctl`).
* GPU lock and checkpoint run for every GPU process at once; the driver must release the GPU
  before CRIU freezes the tree (it does its work through a thread of the job itself).
* ``criu_dump`` freezes and dumps the tree; ``gpu_pages`` copies the GPU memory the driver
  staged and ``cpu_pages`` the job's own large private memory, both of which CRIU leaves
  out, from the moment CRIU has stopped their processes (:func:`.proctree.wait_seized`)
  while it dumps the rest (:mod:`.beside`, :mod:`.gpupages`, :mod:`.cpupages`; restore
  writes them back after ``criu_restore``, the tree still stopped); ``capture_files``
  snapshots the output files while the tree is frozen (:mod:`.files`).
* ``resume`` (leave-running) brings the GPU state back and unlocks; in ``exit`` mode the
  image is completed (``finish``) while the tree is still frozen, and only then does CRIU
  kill it — a failure up to that point leaves the job running.

On ANY failure — an error, a timeout, cancellation — the job is brought back: every GPU process
found checkpointed is restored, every locked one unlocked, every process sent SIGCONT — once a
CRIU still dumping (cancelled, past its time) has unwound and let the tree go; CRIU itself
resumes a tree when a dump fails, and if we die it outlives us and unwinds the dump itself
(:mod:`.criu`; :mod:`.criuhook`: the post-dump hook answers "no" once we are gone). An
``operation.json`` marker in the job directory (:mod:`.marker`) lives exactly as long as a freeze;
:meth:`Engine.recover` uses it to bring a job back after the process running the freeze was killed.
What a freeze and a restore return is in :mod:`.results`.

Suspend in place (park ``--to memory``: no image) is the engine's third mode,
:meth:`Engine.suspend` / :meth:`Engine.resume`, with its steps in :mod:`.suspend` (``scan ─►
nccl_release ─► gpu_lock ─► gpu_checkpoint ─► stop ─► record``; resume ``cont ─► gpu_restore ─►
gpu_unlock ─► nccl_rebuild ─► record``), under the same marker, faults seam, bring-back and
recovery. A park's restore (``record=``) holds the marker too, its commit the last step. What
:meth:`Engine.recover` does per operation: :mod:`.recovery`.

Restore: ``source`` (download/verify) ─► ``preflight`` ─► ``put_files`` ─► ``criu_restore`` ─►
``cpu_pages`` ─► ``gpu_pages`` ─► ``gpu_restore`` (UUID remap) ─► ``gpu_unlock`` ─►
``nccl_rebuild`` ─► finish.

Every step is timed in a :class:`~spotguard.timeline.Timeline` (in the result and the image's
metadata); tests inject failures through :class:`Faults`, consulted before each step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from spotguard.errors import CheckpointError, JobError, SpotguardError
from spotguard.facts import GpuInventory, HostFacts
from spotguard.timeline import Timeline

from . import (
    beside,
    files,
    gpupages,
    mounts,
    nccl,
    ncclctl,
    procfacts,
    proctree,
    recovery,
    restoring,
    scan,
    stagefault,
    suspend,
)
from .criu import Criu
from .cuda import GpuHook, GpuState, NoGpu
from .hold import NO_HOLD, hold_for
from .jobs import JobInfo, own_mount_ns, own_net_ns
from .marker import MARKER, FreezeMarker, Op
from .meta import ImageMeta
from .restoring import OnRestored
from .results import FreezeResult, Mode, RestoreResult
from .settings import CheckpointSettings
from .staging import DumpTarget, RestoreSource, dir_bytes
from .suspend import Faults, OnResumed, OnSuspended, Suspended

__all__ = [
    "FREEZE_STEPS",
    "MARKER",
    "RESTORE_STEPS",
    "Engine",
    "Faults",
    "FreezeResult",
    "Mode",
    "RestoreResult",
]

log = logging.getLogger(__name__)

#: seconds a dump's CRIU, left to unwind (cancelled, past its time), has to let the tree go
#: before the engine kills it and brings the job back
CRIU_UNWIND_S = 30.0

#: failed freezes being undone (a task is kept alive only by a strong reference)
_UNDOING: set[asyncio.Future[None]] = set()

FREEZE_STEPS = (
    "scan",
    "nccl_release",
    "gpu_lock",
    "gpu_checkpoint",
    "criu_dump",
    "gpu_pages",
    "cpu_pages",
    "capture_files",
    "gpu_restore",
    "gpu_unlock",
    "nccl_rebuild",
    "finish",
)
RESTORE_STEPS = (
    "source",
    "preflight",
    "put_files",
    "criu_restore",
    "cpu_pages",
    "gpu_pages",
    "gpu_restore",
    "gpu_unlock",
    "nccl_rebuild",
    "finish",
)


class _NoFaults:
    async def before(self, step: str) -> None:
        return None


class Engine:
    """Orders CRIU and the GPU hook into freeze, restore and recover."""

    def __init__(
        self,
        criu: Criu,
        gpu: GpuHook | None = None,
        *,
        settings: CheckpointSettings,
        faults: Faults | None = None,
        nccl: ncclctl.NcclControl | None = None,
    ) -> None:
        self.criu = criu
        self.gpu: GpuHook = gpu if gpu is not None else NoGpu()
        self.settings = settings  # loaded once by the caller (the CLI, the agent)
        self.faults: Faults = faults or _NoFaults()
        self.nccl = nccl or ncclctl.NcclControl.of(settings)

    # --- freeze ----------------------------------------------------------------------------

    async def freeze(
        self,
        job: JobInfo,
        target: DumpTarget,
        mode: Mode,
        *,
        tcp_established: bool | None = None,
    ) -> FreezeResult:
        """Checkpoint ``job`` into ``target``; the job keeps running (RESUME) or ends (EXIT).

        On failure the job is running and unlocked again and the error is re-raised.
        """
        tl = Timeline()
        s = self.settings
        tcp = s.tcp_established if tcp_established is None else tcp_established
        if not proctree.alive(job.pid):
            raise JobError(f"job {job.name!r}: process {job.pid} is not running")
        job.dir.mkdir(parents=True, exist_ok=True)
        marker = FreezeMarker(job)
        marker.take(Op.FREEZE, mode)
        tree: list[int] = [job.pid]
        gpu_pids: list[int] = []
        active: list[int] = []
        held: list[int] = []
        started = False
        nccl_touched = False
        try:
            with tl.step("scan") as st:
                await self.faults.before("scan")
                # children that exit while the tree is read are left out (a forking job)
                tree, tree_ns = procfacts.live_tree(job.pid)
                gpu_pids = await self.gpu.gpu_pids(tree)
                # a job suspended in place (parked): its GPU state is already in host memory
                # and its tree stopped; the driver steps skip those, bring-back keeps them so
                done_gpu, held = await suspend.parked(self.gpu, tree, gpu_pids)
                active = [p for p in gpu_pids if p not in done_gpu]
                nccl.refuse_uncheckpointable(job.name, gpu_pids)
                net = await scan.preflight(self.criu, s.network_lock, job.name, tree, gpu_pids, tcp)
                st.detail.update(net.to_json())
                ns_of = dict(zip(tree, tree_ns, strict=True))
                gpu_ns = [ns_of.get(p) or proctree.ns_pid(p) for p in gpu_pids]
                marker.update(gpu_pids=active, tree=[p for p in tree if p not in held])
                gpu_bytes = self.gpu.memory_used(gpu_pids) if gpu_pids else 0
                cpu_bytes = proctree.rss_bytes(tree)
                need = 2 * gpu_bytes + cpu_bytes
                sid = os.getsid(job.pid)
                shell_job = sid != job.pid and sid not in tree
                inventory = self.gpu.inventory() if gpu_pids else GpuInventory()
                st.detail.update(
                    pids=len(tree), gpu_pids=len(gpu_pids), gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes
                )
            started = True
            # leave-running: the job goes on once its image is copied out, not stored
            keep = mode is Mode.RESUME and target.stream
            hold = (
                hold_for(
                    s.resume_buffer_mb,
                    cpu_bytes,
                    gpu_bytes,
                    pack_later=s.pack_after_resume,
                    prefault=s.prefault_hold,
                )
                if keep
                else NO_HOLD
            )
            plan = await target.start(job.name, need, hold)
            tl.mark(
                "staging", mode=plan.mode, path=plan.path, reason=plan.reason,
                hold_bytes=plan.hold_bytes,
            )  # fmt: skip
            images_dir = target.images_dir
            criu_version = await self.criu.version()
            awake = [p for p in tree if p not in held]
            with tl.step("nccl_release") as ns:
                await self.faults.before("nccl_release")
                nccl_touched = True
                released = await self.nccl.release(job.name, awake, s.gpu_lock_timeout, mode)
                ns.detail.update(released.to_json())
            before = await gpupages.before(self.criu, s.gpu_pages, active)
            staged: list[gpupages.Range] = []
            if active:
                with tl.step("gpu_lock", pids=active):
                    await self.faults.before("gpu_lock")
                    await self.gpu.lock(active, s.gpu_lock_timeout)
                with tl.step("gpu_checkpoint", pids=active) as gc:
                    await self.faults.before("gpu_checkpoint")
                    pf = await stagefault.checkpoint(self.gpu, active, s, gpu_bytes)
                    gc.detail.update(pf.to_json())
                staged = gpupages.staged_ranges(before)
            own_cpu, own = await beside.own_memory(self.criu, s, tree, staged)
            what = beside.Beside(staged, own, gpu=bool(before), cpu=own_cpu)
            host = HostFacts.probe(criu_version)
            meta = ImageMeta(
                job=job.to_json(),
                mode=mode,
                criu_version=criu_version,
                host=host,
                gpu=inventory,
                gpu_processes=gpu_ns,
                root_ns_pid=tree_ns[0],
                pids=tree_ns,
                staging=plan.to_json(),
                timeline=[],
                mount_ns=own_mount_ns(job.pid),
                # host's network namespace: a restore here may find the job's closed sockets on them
                listen_ports=[] if own_net_ns(job.pid) else list(net.listen_ports),
            )

            async def finish() -> None:
                with tl.step("finish"):
                    await self.faults.before("finish")
                    meta.timeline = tl.to_list()
                    await target.finish(meta)

            frozen, failed = threading.Event(), threading.Event()
            copying = (
                asyncio.ensure_future(
                    beside.copy(what, target, meta, ns_of, s, tl, self.faults, frozen, failed)
                )
                if what.any
                else None
            )

            async def on_frozen() -> None:
                # CRIU has written the image; the tree is still frozen.
                if copying is not None:
                    frozen.set()
                    await copying
                with tl.step("capture_files") as cs:
                    await self.faults.before("capture_files")
                    paths = files.candidates(job.dir, proctree.writable_files(tree))
                    meta.files = await asyncio.to_thread(
                        files.capture, paths, target.extras_dir, s.max_file_bytes
                    )
                    cs.detail.update(files=len(meta.files), bytes=sum(f.size for f in meta.files))
                    if survey is not None:  # which host mounts the frozen tree uses
                        meta.mounts = await asyncio.to_thread(mounts.mark_used, survey, tree)
                if mode is Mode.EXIT:
                    await finish()  # before CRIU kills the job: if it fails, CRIU resumes it
                else:  # the job goes on: its pages out of CRIU's pipes first
                    await target.drain()

            try:
                with tl.step("criu_dump", leave_running=mode is Mode.RESUME) as ds:
                    await self.faults.before("criu_dump")
                    survey = None
                    if meta.mount_ns:
                        survey = await asyncio.to_thread(mounts.survey, job.pid, job.dir)
                    await self.criu.dump(
                        job.pid,
                        images_dir,
                        leave_running=mode is Mode.RESUME,
                        stream=target.stream,
                        tcp_established=net.tcp_established,
                        network_lock=net.lock,
                        manage_cgroups=s.manage_cgroups,
                        shell_job=shell_job,
                        on_frozen=on_frozen,
                        time_limit=s.criu_timeout,
                        mount_ns=meta.mount_ns,
                        ghost_limit=s.ghost_limit,
                        external_mounts=survey.dump_args() if survey is not None else (),
                        external_pages=what.criu_args(),
                    )
                    if not target.stream:
                        ds.detail["bytes"] = dir_bytes(images_dir)
            except BaseException:  # the copy ends before the job goes on
                failed.set()
                raise
            finally:
                if copying is not None:
                    frozen.set()
                    if failed.is_set():  # it may wait for a store nothing drains any more
                        copying.cancel()
                    await asyncio.gather(copying, return_exceptions=True)
            if mode is Mode.RESUME:
                if active:
                    with tl.step("gpu_restore", pids=active):
                        await self.faults.before("gpu_restore")
                        await self.gpu.restore(active)
                    with tl.step("gpu_unlock", pids=active):
                        await self.faults.before("gpu_unlock")
                        await self.gpu.unlock(active)
                with tl.step("nccl_rebuild") as rb:
                    await self.faults.before("nccl_rebuild")
                    rb.detail.update((await self.nccl.rebuild(job.name, awake)).to_json())
                await finish()
        except BaseException as exc:
            awake = [p for p in tree if p not in held]
            # one shielded task: a second cancellation cannot skip the bring-back
            undo = asyncio.ensure_future(
                self._undo_freeze(job, tree, awake, active, nccl_touched, target, started)
            )
            _UNDOING.add(undo)  # held: it goes on after a second cancellation of ours
            undo.add_done_callback(_UNDOING.discard)
            await asyncio.shield(undo)
            marker.clear()
            log.warning(
                "freeze failed; job resumed",
                extra={"job": job.name, "error": str(exc), "step": tl.failed_step()},
            )
            if isinstance(exc, SpotguardError | asyncio.CancelledError | KeyboardInterrupt):
                raise
            raise CheckpointError(f"freeze of {job.name!r} failed: {exc}") from exc
        marker.clear()
        result = FreezeResult(job, images_dir, mode, tl, inventory, host, plan, meta, gpu_pids)
        log.info(
            "job frozen",
            extra={"job": job.name, "mode": str(mode), "images_dir": str(images_dir),
                   "pause_s": round(result.pause_seconds, 3), "staging": plan.mode},
        )  # fmt: skip
        return result

    async def _undo_freeze(
        self,
        job: JobInfo,
        tree: Sequence[int],
        awake: Sequence[int],
        active: Sequence[int],
        nccl_touched: bool,
        target: DumpTarget,
        started: bool,
    ) -> None:
        """A failed freeze's undoing. The target's abort closes CRIU's stream first, so a CRIU
        still dumping (cancelled, past its time) fails and unwinds; it lets the tree go
        itself (killed, it could leave its parasite in a task), so the job is brought back
        only after it has — without waiting for the rest of the abort."""
        aborting = asyncio.ensure_future(target.abort()) if started else None
        try:
            await recovery.criu_let_go(job, list(tree), CRIU_UNWIND_S)
        except JobError as gone:  # a killed CRIU that never exited: bring back anyway
            log.error("criu did not let the job go", extra={"job": job.name, "error": str(gone)})
        await self.bring_back(job, awake, active, reopen_nccl=nccl_touched)
        if aborting is not None:
            await aborting

    async def bring_back(
        self,
        job: JobInfo,
        tree: Sequence[int],
        gpu_pids: Sequence[int],
        *,
        reopen_nccl: bool = True,
    ) -> None:
        """Make every GPU process running and unlocked again and every process runnable,
        then (``reopen_nccl``) open NCCL's gates and rebuild released communicators. The
        one bring-back: a failed freeze or suspend, and :meth:`recover`."""
        for pid in gpu_pids:
            if not proctree.alive(pid):
                continue
            try:
                st = await self.gpu.state(pid)
                if st is GpuState.CHECKPOINTED:
                    await self.gpu.restore([pid])
                    st = GpuState.LOCKED
                if st is GpuState.LOCKED:
                    await self.gpu.unlock([pid])
            except (SpotguardError, OSError) as exc:
                log.error("could not bring GPU state back", extra={"pid": pid, "error": str(exc)})
        live = [p for p in tree if proctree.alive(p)]
        if len(live) < len(tree):  # killed while held (from outside, or at a breakpoint a
            # killed CRIU left in it): what comes back is not the whole job, and must say so
            log.error(
                "processes of the job are gone: not brought back",
                extra={"job": job.name, "pids": [p for p in tree if p not in live]},
            )
        proctree.signal_all(live, signal.SIGCONT)
        if reopen_nccl and live:
            await self.nccl.bring_back(job.name, live)

    async def recover(self, job: JobInfo) -> bool:
        """Bring back a job left mid-freeze, mid-suspend, mid-resume or mid-restore (a
        park's) by a killed process (a restarted agent, the next park or unpark): the rules
        per operation are in :mod:`.recovery`. True if there was something to recover."""
        return await recovery.recover(self, job)

    # --- suspend in place (the steps: :mod:`.suspend`) -------------------------------------

    async def suspend(
        self,
        job: JobInfo,
        *,
        record: Path | None = None,
        commit: OnSuspended | None = None,
    ) -> Suspended:
        """Suspend ``job`` in place (GPU state into its host memory, tree stopped), then
        ``commit`` while the crash marker is held (``record``: the file ``commit`` writes, by
        which :meth:`recover` knows the suspend completed). On failure the job runs again."""
        return await suspend.suspend(self, job, record=record, commit=commit)

    async def resume(
        self,
        job: JobInfo,
        gpu_pids: Sequence[int],
        *,
        remap: Mapping[str, str] | None = None,
        record: Path | None = None,
        commit: OnResumed | None = None,
    ) -> Timeline:
        """Resume a job suspended in place, then ``commit`` (``record``: the file it removes,
        which :meth:`recover` removes after finishing a resume killed midway)."""
        return await suspend.resume(self, job, gpu_pids, remap=remap, record=record, commit=commit)

    # --- restore ---------------------------------------------------------------------------

    async def restore(
        self,
        source: RestoreSource,
        *,
        state_dir: Path | None = None,
        restore_gpus: str | None = None,
        record: Path | None = None,
        commit: OnRestored | None = None,
    ) -> RestoreResult:
        """Restore the image from ``source``; the job runs again when this returns.
        ``restore_gpus``: this restore's GPUs (the setting's syntax), over the setting.
        ``record`` (a park's restore): the crash marker is taken, naming it, and ``commit``
        (which removes it) runs as the last step (:meth:`recover` finishes or undoes a
        restore killed midway). The steps: :mod:`.restoring`."""
        return await restoring.restore(
            self, source, state_dir=state_dir, restore_gpus=restore_gpus, record=record,
            commit=commit,
        )  # fmt: skip
