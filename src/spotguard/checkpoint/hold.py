"""How much of a leave-running image may wait in host memory while the job goes on.

A leave-running checkpoint freezes the job, copies its state out and lets it run again; the
image then streams to the store. The job must stay frozen until every byte is *copied out*
(CRIU's pipes hold references to the job's own pages, and the GPU memory the driver staged is
given back to the GPU by the restore), but not until every byte is *stored*: a store that
takes 40 GB at 1 GB/s would otherwise hold a training job for 40 s. So a streamed target may
keep up to :class:`Hold` bytes of chunks in host memory beyond its usual in-flight bound;
past that, it waits for the store as before (back-pressure, never unbounded memory).

The budget (``[checkpoint] resume_buffer_mb``) is what the host can spare when the checkpoint
starts: ``MemAvailable`` less the GPU memory the driver is about to stage into host memory and
a reserve (a twentieth of the host's memory, at least 1 GiB). An exit checkpoint holds
nothing: the job ends at the dump, and holding its image would only delay durability.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from spotguard.sizing import MEMINFO
from spotguard.sizing import meminfo as read_meminfo

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
#: what CRIU writes beyond the job's resident memory (its own image files, page rounding)
_FILES_SLACK = 64 * MiB
#: reserve kept free on the host: a twentieth of its memory, at least this
_RESERVE_MIN = GiB


@dataclass(frozen=True)
class Hold:
    """Bytes of an image a streamed target may keep in host memory before it makes the
    dump wait for the store: ``files`` of CRIU's image files (the capture's pieces) and
    ``pages`` of the GPU memory copied beside CRIU (the writer's buffers, filled by the copy;
    up to ``pages`` more of those may wait filled for a slot, so the memory this can take is
    at most ``files + 2 * pages``). ``pack_later``: the chunks held wait raw, neither
    hashed, compressed nor stored, until the job runs again (``[checkpoint]
    pack_after_resume``): the frozen job's cores copy it out instead."""

    files: int = 0
    pages: int = 0
    pack_later: bool = False
    #: bytes of the held pieces faulted in before the freeze, while the job still runs
    #: (``[checkpoint] prefault_hold``): about the job's resident memory, within ``files``
    prefault: int = 0
    #: bytes more of them for the GPU memory's copy, where its size is known: about the GPU
    #: memory in use, within ``pages``. When not 0 the GPU memory is copied into the same
    #: pieces as CRIU's files (their pool holds ``pages`` more), not the writer's buffers
    prefault_pages: int = 0

    @property
    def total(self) -> int:
        return self.files + self.pages

    @property
    def memory(self) -> int:
        """The most host memory this hold can take."""
        return self.files + 2 * self.pages


NO_HOLD = Hold()


def spare(meminfo: Path = MEMINFO) -> int:
    """Bytes the host can spare now: ``MemAvailable`` less the reserve."""
    info = read_meminfo(meminfo)
    reserve = max(_RESERVE_MIN, info.get("MemTotal", 0) // 20)
    return max(0, info.get("MemAvailable", 0) - reserve)


def hold_for(
    setting_mb: int,
    cpu_bytes: int,
    gpu_bytes: int,
    *,
    pack_later: bool = False,
    prefault: bool = False,
    meminfo: Path = MEMINFO,
) -> Hold:
    """The hold for a leave-running image of a job with ``cpu_bytes`` resident and
    ``gpu_bytes`` of GPU memory (0: not known), as ceilings: where the host can spare the
    whole image (``setting_mb`` -1, or ``setting_mb`` MiB allow it), the room it can spare;
    else as much as fits, split between CRIU's files and the GPU memory in proportion;
    nothing for ``setting_mb`` 0. Memory is taken only as the image flows. ``pages`` is granted
    part by part as the staged memory's size becomes known, each grant checked against
    :func:`spare` again then (the staging exists by that time). ``pack_later`` and
    ``prefault`` (then the job's resident memory, within the grant): see :class:`Hold`."""
    if setting_mb == 0:
        return NO_HOLD
    room = max(0, spare(meminfo) - gpu_bytes)  # the driver stages gpu_bytes first
    if setting_mb > 0:
        room = min(room, setting_mb * MiB)
    files = cpu_bytes + cpu_bytes // 8 + _FILES_SLACK
    if gpu_bytes > 0:
        pages = gpu_bytes + gpu_bytes // 4 + _FILES_SLACK
    else:  # not known: whatever is left, each part checked against the memory then
        pages = max(0, room - files) // 2
    want = Hold(files, pages)
    if want.memory <= room:
        # The rest of the room to CRIU's files too: what they come to is known only as they
        # flow (a CUDA process dumps more than its resident memory at the scan), and pieces
        # are made only as bytes arrive, so a ceiling costs nothing unused.
        got = Hold(room - 2 * pages, pages, pack_later)
        return _with_prefault(got, cpu_bytes, gpu_bytes) if prefault else got
    # Not all of it: the same share of each, so neither side waits alone.
    share = room / want.memory
    got = Hold(int(files * share), int(pages * share), pack_later)
    if prefault:
        got = _with_prefault(got, cpu_bytes, gpu_bytes)
    log.info(
        "a leave-running checkpoint keeps part of its image in memory; the job waits for the "
        "rest to be stored",
        extra={"hold_bytes": got.total, "need_bytes": want.total},
    )
    return got


def _with_prefault(hold: Hold, cpu_bytes: int, gpu_bytes: int) -> Hold:
    """``hold`` with its CRIU part faulted in up to the job's resident memory (what CRIU's
    files come to, about: the pages it dumps), and its GPU part up to the GPU memory in use
    (what the driver stages, about) where that is known: the copy out of the staging would
    otherwise make fresh pages at the VM's rate while the job waits frozen."""
    return replace(
        hold,
        prefault=min(hold.files, cpu_bytes),
        prefault_pages=min(hold.pages, gpu_bytes) if gpu_bytes > 0 else 0,
    )
