"""The restore's steps, in order — the half of :mod:`.engine` that brings an image back.

``source`` (download/verify) ─► ``preflight`` ─► ``put_files`` ─► ``criu_restore`` ─►
``gpu_pages`` ─► ``gpu_restore`` (UUID remap) ─► ``gpu_unlock`` ─► ``nccl_rebuild`` ─► finish.

:meth:`~spotguard.checkpoint.engine.Engine.restore` runs :func:`restore` with itself as
``eng``; nothing else calls it, so the engine stays the one place that orders the steps.
Every restore holds the job's crash marker before CRIU runs (a park's, naming its record, from
the download on; any other once preflight and the carried files' checks passed, so a refused
image creates nothing): an agent killed midway finds it at start-up and finishes the restore or
undoes it
(:mod:`.recovery`) instead of restoring the job a second time. On any failure the restored
tree is killed (a tree without its GPU state cannot run), the source is aborted and the
marker cleared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from spotguard.errors import CheckpointError, GpuError, SpotguardError
from spotguard.names import check_job_name
from spotguard.statedir import StateDir
from spotguard.timeline import Timeline

from . import cpupages, files, gpupages, ncclctl, placing, proctree, recovery, restart, suspend
from .criu import Criu
from .jobs import JobInfo, link_job_dir
from .marker import FreezeMarker, Op
from .meta import ImageMeta
from .preflight import preflight, wait_pids_free
from .results import RestoreResult
from .settings import CheckpointSettings
from .staging import RestoreSource
from .suspend import EngineParts

log = logging.getLogger(__name__)

#: scratch slots per restored GPU process when placing overlaps the driver's restore, and
#: the bytes of each (a chunk of the image, or a piece of a directory image's part)
_SLOTS, _SLOT = 2 * gpupages.MAX_WORKERS, 64 << 20

#: a park's restore: its commit, run as the last step under the crash marker
OnRestored = Callable[[RestoreResult], Awaitable[None]]


class RestoreParts(EngineParts, Protocol):
    """What a restore uses of the engine: the in-place parts and its CRIU."""

    criu: Criu


async def restore(
    eng: RestoreParts,
    source: RestoreSource,
    *,
    state_dir: Path | None = None,
    restore_gpus: str | None = None,
    record: Path | None = None,
    commit: OnRestored | None = None,
) -> RestoreResult:
    """Restore the image from ``source`` with ``eng``'s CRIU, GPU hook and settings; the job
    runs again when this returns.
    ``restore_gpus``: this restore's GPUs (the setting's syntax), over the setting.
    ``record`` (a park's restore): the crash marker is taken, naming it, and ``commit``
    (which removes it) runs as the last step (:meth:`recover` finishes or undoes a
    restore killed midway)."""
    tl = Timeline()
    s = eng.settings
    state = state_dir or s.state_dir
    pid: int | None = None
    started = False
    marker: FreezeMarker | None = None
    places: dict[int, placing.Placer] | None = None
    try:
        with tl.step("source"):
            await eng.faults.before("source")
            started = True
            meta = await source.start()
        job = JobInfo.from_json(meta.job)
        if record is not None:  # a park's (this host's own image): claimed at once
            marker = await _claim(job, record, source.images_dir, None)
        else:  # before preflight, which refuses a job a killed restore left running
            await _settle(eng, job, state)
        with tl.step("preflight") as ps:
            await eng.faults.before("preflight")
            remap = await preflight(
                meta, eng.criu, eng.gpu, state, restore_gpus=restore_gpus or s.restore_gpus
            )
            if meta.root_ns_pid != 1:
                # no own PID namespace: its exact PIDs must be free (a job killed a
                # moment ago may still hold them as zombies)
                ps.detail["pid_wait_s"] = await wait_pids_free(meta.pids, s.pid_wait)
        with tl.step("put_files", files=len(meta.files)):
            await eng.faults.before("put_files")
            await asyncio.to_thread(ncclctl.prepare_restore, job.name)
            await asyncio.to_thread(
                files.put_back,
                meta.files,
                source.extras_dir,
                image_job_dir=job.dir,
                job_dir=StateDir(state).job(job.name),
                authenticated=source.authenticated,
            )
        if marker is None:  # any other: once preflight and the files' checks passed, so a
            # refused image creates nothing
            marker = await _claim(job, None, source.images_dir, state)
        with tl.step("criu_restore") as rs:
            await eng.faults.before("criu_restore")
            pid = await restart.criu_restore(eng.criu, source, meta, eng.settings, rs.detail)
            rs.detail["sparse_bytes"] = source.sparse_bytes
        by_ns = proctree.host_pids_by_ns_pid(pid)
        gpu_pids = [by_ns[n] for n in meta.gpu_processes if n in by_ns]
        if len(gpu_pids) != len(meta.gpu_processes):
            raise GpuError(
                f"restored tree lacks GPU processes {meta.gpu_processes} (found {by_ns})"
            )
        tree = [*by_ns.values()]
        beside = bool(meta.gpu_pages or meta.cpu_pages)  # CRIU left the tree stopped
        if marker is not None:  # restored stopped: until its memory is back, undone if cut
            marker.update(gpu_pids=gpu_pids, tree=tree, job_pid=pid, pages_pending=beside)
        await _own_memory(eng, source, meta, by_ns, tl, marker, gpu_pids)
        if meta.gpu_pages:  # the GPU memory the driver staged, back before it reads it
            with tl.step("gpu_pages", ranges=len(meta.gpu_pages)) as gs:
                await eng.faults.before("gpu_pages")
                staged = sum(g.end - g.start for g in meta.gpu_pages)
                if s.restore_overlap and gpu_pids and staged >= s.restore_overlap_min_mib << 20:
                    places, why = await asyncio.to_thread(
                        placing.open_placers, meta.gpu_pages, by_ns, _SLOTS, _SLOT
                    )
                    if why:
                        gs.detail["overlap_refused"] = why
                gs.detail["overlap"] = places is not None
                if places is None:
                    gs.detail["bytes"] = await gpupages.load(
                        source, meta.gpu_pages, by_ns, workers=s.gpu_page_workers or None
                    )
                    _memory_back(marker, gpu_pids, tree)
        # the driver needs them running; CRIU left them all stopped where memory came beside it
        suspend.continue_stopped(tree, every=beside)
        if gpu_pids:
            with tl.step("gpu_restore", pids=gpu_pids, remap=remap or {}) as gr:
                await eng.faults.before("gpu_restore")
                restore = eng.gpu.restore(gpu_pids, remap or None)
                if places is None:
                    await restore
                else:
                    gr.detail.update(
                        await _overlapped(source, meta.gpu_pages, by_ns, places, restore, s)
                    )
                    _memory_back(marker, gpu_pids, tree)
            with tl.step("gpu_unlock", pids=gpu_pids):
                await eng.faults.before("gpu_unlock")
                await eng.gpu.unlock(gpu_pids)
        with tl.step("nccl_rebuild") as rb:
            await eng.faults.before("nccl_rebuild")
            rebuilt = await eng.nccl.rebuild(job.name, [*by_ns.values()], restored=True)
            rb.detail.update(rebuilt.to_json())
        with tl.step("finish"):
            await eng.faults.before("finish")
            job = job.with_pid(pid)
            job.save()
            link_job_dir(job, state)
            await source.finish()
            result = RestoreResult(job, pid, tl, meta, gpu_pids)
            if commit is not None:
                await commit(result)
    except BaseException as exc:
        if pid is not None and proctree.alive(pid):
            # a tree restored without its GPU state cannot run: do not leave it locked or
            # stopped — every process of it (a job without its own PID namespace has no init
            # whose death takes the rest)
            with contextlib.suppress(SpotguardError):
                proctree.signal_all(proctree.tree(pid), signal.SIGKILL)
        if places is not None:
            await asyncio.shield(asyncio.to_thread(_close_all, places))
        if started:
            await asyncio.shield(source.abort())
        if marker is not None:
            marker.clear()
        log.warning("restore failed", extra={"error": str(exc), "step": tl.failed_step()})
        if isinstance(exc, SpotguardError | asyncio.CancelledError | KeyboardInterrupt):
            raise
        raise CheckpointError(f"restore failed: {exc}") from exc
    if marker is not None:
        marker.clear()
    log.info("job restored", extra={"job": job.name, "pid": pid, "gpu_pids": gpu_pids})
    return result


async def _overlapped(
    source: RestoreSource,
    pages: list[gpupages.GpuPages],
    by_ns: dict[int, int],
    places: dict[int, placing.Placer],
    restore: Awaitable[None],
    s: CheckpointSettings,
) -> dict[str, object]:
    """The driver's restore while the staged memory is placed under it (:mod:`.placing`).
    When either side fails the other cannot end usefully — a driver waiting on a page that
    will never come returns only when its process dies, a write-back into processes whose
    restore failed would run to its end — so the GPU processes are killed at once, the
    write-back is cancelled (it may wait for a store that stalled), the driver let finish, and
    the first failure is raised."""
    t0 = time.perf_counter()
    load = asyncio.ensure_future(
        gpupages.load(source, pages, by_ns, workers=s.gpu_page_workers or None, places=places)
    )
    driver = asyncio.ensure_future(restore)
    pages_s = 0.0
    try:
        await asyncio.wait({load, driver}, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t.exception() for t in (load, driver) if t.done() and not t.cancelled()]
        first = next((e for e in failed if e is not None), None)
        if first is not None:
            raise first
        written = await load
        pages_s = time.perf_counter() - t0
        await driver
    finally:
        if not (load.done() and driver.done()):  # a failure, or this restore cancelled
            for ns_pid in places:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(by_ns[ns_pid], signal.SIGKILL)
            load.cancel()  # it may wait for a store that never answers again
            await asyncio.gather(load, driver, return_exceptions=True)
        await asyncio.to_thread(_close_all, places)
    stats = [p.stats for p in places.values()]
    return {
        "overlap": True,
        "pages_s": round(pages_s, 3),
        "bytes": written,
        "zero_bytes": sum(x.zero_bytes for x in stats),
        "faults": sum(x.faults for x in stats),
    }


async def _settle(eng: RestoreParts, job: JobInfo, state: Path) -> None:
    """What a killed restore or freeze of the job left on this host (its marker, read
    through this host's directory of the job, by its checked name: the image's own directory
    is not created before preflight) goes through :meth:`recover` — finished or undone,
    never restored over: a restore it finishes leaves the job running, which preflight then
    refuses to restore twice."""
    check_job_name(job.name)
    here = replace(job, dir=StateDir(state).job(job.name))
    left = await asyncio.to_thread(FreezeMarker(here).read)
    if left is not None and left.running_elsewhere() is None:
        await recovery.recover(eng, here)


async def _claim(
    job: JobInfo, record: Path | None, images: Path, state: Path | None
) -> FreezeMarker:
    """The crash marker of this restore, taken in ``job``'s directory (the one the image
    names, where CRIU reopens the job's files); with ``state``, linked under this host's
    state dir first where it lives elsewhere, as the finished restore does — where a
    restarted agent's recovery looks for markers."""
    await asyncio.to_thread(job.dir.mkdir, parents=True, exist_ok=True)
    if state is not None:
        await asyncio.to_thread(link_job_dir, job, state)
    marker = FreezeMarker(job)
    marker.take(Op.RESTORE, record=record, images=images)
    return marker


async def _own_memory(
    eng: RestoreParts,
    source: RestoreSource,
    meta: ImageMeta,
    by_ns: dict[int, int],
    tl: Timeline,
    marker: FreezeMarker | None,
    gpu_pids: list[int],
) -> None:
    """The job's own memory carried beside CRIU (:mod:`.cpupages`) written back, the tree
    still stopped: none of it runs before its memory is whole."""
    if not meta.cpu_pages:
        return
    with tl.step("cpu_pages", ranges=len(meta.cpu_pages)) as cs:
        await eng.faults.before("cpu_pages")
        workers = eng.settings.cpu_page_workers or cpupages.default_workers()
        cs.detail["bytes"] = await gpupages.load(source, meta.cpu_pages, by_ns, workers=workers)
    if not meta.gpu_pages:
        _memory_back(marker, gpu_pids, list(by_ns.values()))


def _memory_back(marker: FreezeMarker | None, gpu_pids: list[int], tree: list[int]) -> None:
    """The staged GPU memory is all back: a restore cut short from here on is finished by
    :meth:`recover`, no longer undone."""
    if marker is not None:
        marker.update(gpu_pids=gpu_pids, tree=tree)


def _close_all(places: dict[int, placing.Placer]) -> None:
    for p in places.values():
        p.close()
