"""A freeze's memory copied by spotguard beside CRIU: what it is, and the copy itself.

Two kinds of memory leave a dump beside CRIU's pipes (``--external-pages``, spotguard's CRIU
patch 0004), each read by several threads with ``process_vm_readv`` into image files of its
own:

* the GPU memory the driver staged in host memory (:mod:`.gpupages`: step ``gpu_pages``);
* the job's own large private memory (:mod:`.cpupages`: step ``cpu_pages``), its ranges
  made exact once the tree is frozen.

Both start from the moment CRIU has stopped the processes they belong to
(:func:`.proctree.wait_seized`) and run while CRIU dumps the rest; the engine's post-dump
step waits for them, so the job goes on (or is killed) only once they are copied.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spotguard.image.settings import DEFAULT_CHUNK_SIZE as CHUNK
from spotguard.timeline import Timeline

from . import cpupages, gpupages, proctree
from .criu import Criu
from .meta import ImageMeta
from .settings import CheckpointSettings
from .staging import DumpTarget
from .suspend import Faults


@dataclass(frozen=True)
class Beside:
    """What a freeze copies beside CRIU: ``staged`` GPU memory (``gpu``: the step runs) and
    the job's ``own`` memory (``cpu``: the step runs, with no range too)."""

    staged: Sequence[gpupages.Range] = ()
    own: Sequence[gpupages.Range] = ()
    gpu: bool = False
    cpu: bool = False

    @property
    def any(self) -> bool:
        return self.gpu or self.cpu

    def criu_args(self) -> list[str]:
        """``--external-pages`` values: every range CRIU leaves out."""
        return [r.criu_arg() for r in (*self.staged, *self.own)]


async def own_memory(
    criu: Criu, s: CheckpointSettings, tree: Sequence[int], staged: Sequence[gpupages.Range]
) -> tuple[bool, list[gpupages.Range]]:
    """Whether spotguard moves the job's own large private memory (``[checkpoint] cpu_pages =
    "spotguard"`` and a CRIU with ``--external-pages``), and the ranges it chose now."""
    if s.cpu_pages != "spotguard" or not await criu.has_external_pages():
        return False, []
    found = await asyncio.to_thread(
        cpupages.candidates, tree, staged, min_bytes=s.cpu_pages_min_mib << 20
    )
    return True, found


async def copy(
    what: Beside,
    target: DumpTarget,
    meta: ImageMeta,
    ns_of: Mapping[int, int],
    s: CheckpointSettings,
    tl: Timeline,
    faults: Faults,
    frozen: threading.Event,
    failed: threading.Event,
) -> None:
    """Copy ``what`` into ``target`` once CRIU has seized its processes (``frozen`` set
    first: CRIU is done, or gone), recording it in ``meta``; nothing once ``failed``."""
    pids = sorted({r.pid for r in (*what.staged, *what.own)})
    early = await asyncio.to_thread(proctree.wait_seized, pids, frozen)
    if not early:  # a process gone before CRIU seized it: the rest are frozen only by then
        await asyncio.to_thread(frozen.wait)
    if failed.is_set():
        return
    workers = s.gpu_page_workers or None
    own_workers = s.cpu_page_workers or cpupages.default_workers()

    async def gpu() -> None:
        with tl.step("gpu_pages", ranges=len(what.staged), while_criu_dumps=early) as gs:
            await faults.before("gpu_pages")
            meta.gpu_pages = await gpupages.save(
                target, what.staged, ns_of, chunk=CHUNK, workers=workers, stop=failed
            )
            gs.detail["bytes"] = sum(r.size for r in what.staged)

    async def cpu() -> None:
        with tl.step("cpu_pages", chosen=len(what.own), while_criu_dumps=early) as cs:
            await faults.before("cpu_pages")
            exact = await asyncio.to_thread(cpupages.frozen, what.own)
            meta.cpu_pages = await gpupages.save(
                target, exact, ns_of, chunk=CHUNK, workers=own_workers, stop=failed
            )
            cs.detail.update(ranges=len(exact), bytes=sum(r.size for r in exact))

    work = [gpu()] if what.gpu else []
    if what.cpu:
        work.append(cpu())
    await gpupages.run_all(work, "copying memory beside CRIU")
