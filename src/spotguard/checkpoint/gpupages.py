"""The GPU memory the driver staged in host memory, moved by spotguard beside CRIU, in parallel.

After ``cuCheckpointProcessCheckpoint`` the device memory of a GPU process sits in host memory
the driver mapped for it: one anonymous private mapping the size of the process's GPU memory
(docs/benchmarks.md, "Huge pages for the driver's checkpoint"). CRIU moves a process's pages
through one pipe, one thread each way: a 40 GiB process dumped at ~3 GB/s and paged in at
~2.4 GB/s, however many cores the machine has. So spotguard moves those pages itself:

* **freeze** — the address ranges that became writable anonymous memory during the driver's
  checkpoint (:func:`writable_anon` before, :func:`staged_ranges` after) are named to CRIU
  with ``--external-pages PID:START-END`` (spotguard's CRIU patch 0004: it writes no pages for
  them) and, while CRIU holds the tree frozen, read with ``process_vm_readv`` by several
  threads into image files of their own (``gpupages-NSPID-START-K``, one per part, each part
  its own stream of chunks through the image writer: hashed, compressed and stored in
  parallel like every file of the image);
* **restore** — CRIU restores each range as a mapping with no pages yet; before the driver's
  restore reads it, the parts are fetched (every chunk verified against its authenticated
  address) and written back with ``process_vm_writev`` by several threads. All-zero chunks,
  and all-zero 2 MiB blocks inside the others, are not written: the fresh mapping already
  reads zero (:func:`.procmem.write_nonzero`).

Reading only while the tree is frozen makes the copy exact whoever mapped the range (a thread
of the job mapping memory during the checkpoint included). The ranges, their parts and sizes
are in the image's metadata (:class:`GpuPages`, schema 4); an older image has none and
restores as before. Where CRIU lacks the option or ``[checkpoint] gpu_pages = "criu"``, CRIU
moves the pages as it always did.

The bytes move through :mod:`.procmem` (``process_vm_readv``/``writev``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from spotguard.errors import CheckpointError, ImageError, SpotguardError

from .procmem import read_memory, write_nonzero

log = logging.getLogger(__name__)

#: a range smaller than this stays with CRIU (not worth a file of its own)
MIN_RANGE_BYTES = 64 << 20
#: the most parts copied at once by default (a setting may name more): the copies of this
#: path peak at about 8 threads and slow down beyond (bench/pagecopy.py, docs/benchmarks.md:
#: 64 threads on a 64-core node moved a third of what 8 did)
MAX_WORKERS = 8
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PART_NAME = re.compile(r"(gpu|cpu)pages-[0-9]+-[0-9a-f]+-[0-9]+")
#: the prefix of the parts of the GPU memory the driver staged (the job's own memory carried
#: beside CRIU: :data:`.cpupages.PREFIX`)
PREFIX = "gpupages"

#: fill(offset, view): put the part's bytes at ``offset`` into ``view`` (runs in a thread)
PageFill = Callable[[int, memoryview], None]
#: put(offset, view): write ``view`` at ``offset`` of the part into the job (runs in a thread)
PagePut = Callable[[int, memoryview], None]
#: zero(offset, length): that stretch of the part is all zero (for a source that says so)
PageZero = Callable[[int, int], None]


class PagesTarget(Protocol):
    async def put_pages(self, name: str, size: int, fill: PageFill) -> None: ...


class PagesSource(Protocol):
    async def get_pages(
        self,
        name: str,
        size: int,
        put: PagePut,
        *,
        zero: PageZero | None = None,
        in_flight: int | None = None,
    ) -> None:
        """Hand file ``name`` (which must hold exactly ``size`` bytes) to ``put(offset,
        view)`` (called in a worker thread), every byte verified first; all-zero stretches
        may be left out (the memory they go to already reads zero), named to ``zero(offset,
        length)`` where given; up to ``in_flight`` pieces at once where the source can."""
        ...


class Place(Protocol):
    """Where a restore's chunks go when the driver's restore reads them meanwhile
    (:class:`spotguard.checkpoint.placing.Placer`)."""

    def put(self, addr: int, view: memoryview) -> None: ...
    def zero(self, addr: int, length: int) -> None: ...


@dataclass(frozen=True)
class Range:
    """``[start, end)`` of host process ``pid``'s memory; ``prefix`` names its parts: the
    GPU memory the driver staged (:data:`PREFIX`) or the job's own (:mod:`.cpupages`)."""

    pid: int
    start: int
    end: int
    prefix: str = PREFIX

    @property
    def size(self) -> int:
        return self.end - self.start

    def criu_arg(self) -> str:
        return f"{self.pid}:{self.start:x}-{self.end:x}"


@dataclass(frozen=True)
class Part:
    name: str
    offset: int  # from the range's start
    size: int


@dataclass(frozen=True)
class GpuPages:
    """One range carried beside CRIU, as the image's metadata records it."""

    ns_pid: int
    start: int
    end: int
    parts: tuple[Part, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "ns_pid": self.ns_pid,
            "start": self.start,
            "end": self.end,
            "parts": [{"name": p.name, "offset": p.offset, "size": p.size} for p in self.parts],
        }

    @property
    def prefix(self) -> str:
        """What the range holds, by its parts' names: :data:`PREFIX` (GPU memory the driver
        staged) or :data:`.cpupages.PREFIX` (the job's own memory)."""
        return self.parts[0].name.split("-", 1)[0]

    @classmethod
    def from_json(cls, d: object, prefix: str = PREFIX) -> GpuPages:
        """Parse and check one entry: page-aligned, parts that tile the range exactly and
        carry the names this module gives, with ``prefix`` (``ValueError`` otherwise)."""
        if not isinstance(d, dict):
            raise ValueError(f"gpu_pages: {d!r} is not an object")
        ns_pid, start, end = d.get("ns_pid"), d.get("start"), d.get("end")
        for v in (ns_pid, start, end):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"gpu_pages: {d!r} has a bad pid or address")
        assert isinstance(ns_pid, int) and isinstance(start, int) and isinstance(end, int)
        if ns_pid < 1 or start >= end or (start | end) % _PAGE or end > 1 << 57:
            raise ValueError(f"gpu_pages: {start:#x}-{end:#x} of pid {ns_pid} is not a range")
        raw = d.get("parts")
        if not isinstance(raw, list) or not raw or len(raw) > 4096:
            raise ValueError("gpu_pages: no parts")
        parts: list[Part] = []
        at = 0
        for p in raw:
            if not isinstance(p, dict):
                raise ValueError(f"gpu_pages: part {p!r} is not an object")
            name, off, size = p.get("name"), p.get("offset"), p.get("size")
            if (
                not isinstance(name, str)
                or not _PART_NAME.fullmatch(name)
                or not name.startswith(prefix + "-")
            ):
                raise ValueError(f"{prefix}: part name {name!r}")
            if off != at or isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ValueError(f"gpu_pages: part {name} does not follow the one before")
            parts.append(Part(name, at, size))
            at += size
        if at != end - start:
            raise ValueError(f"gpu_pages: parts hold {at} bytes of a {end - start}-byte range")
        return cls(ns_pid, start, end, tuple(parts))


def check_part_name(name: str) -> str:
    """``name`` if it is a part's name (a plain file name this module gives), else ImageError."""
    if not _PART_NAME.fullmatch(name):
        raise ImageError(f"{name!r} is not a part of memory carried beside CRIU")
    return name


# --- which ranges -------------------------------------------------------------------------
def _maps(pid: int) -> list[tuple[int, int, str, bool]]:
    """(start, end, perms, anonymous) of every mapping of ``pid``."""
    out: list[tuple[int, int, str, bool]] = []
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, _, hi = fields[0].partition("-")
            anon = len(fields) < 6 and fields[4] == "0"
            out.append((int(lo, 16), int(hi, 16), fields[1], anon))
    return out


def writable_anon(pid: int) -> list[tuple[int, int]]:
    """The writable private anonymous ranges of ``pid`` now (empty if it is gone)."""
    try:
        return [(lo, hi) for lo, hi, perms, anon in _maps(pid) if anon and perms == "rw-p"]
    except (OSError, ValueError, IndexError):
        return []


def new_since(pid: int, old: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The writable anonymous ranges ``pid`` has now outside ``old`` (merged, sorted)."""
    return minus(merged(writable_anon(pid)), merged(old))


def minus(ranges: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` without any address in ``cut`` (both sorted, each without overlaps)."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        at = lo
        for clo, chi in cut:
            if chi <= at or clo >= hi:
                continue
            if clo > at:
                out.append((at, clo))
            at = max(at, chi)
        if at < hi:
            out.append((at, hi))
    return out


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def staged_ranges(
    before: Mapping[int, list[tuple[int, int]]], min_bytes: int = MIN_RANGE_BYTES
) -> list[Range]:
    """For each pid of ``before`` (its :func:`writable_anon` before the driver's checkpoint):
    the writable anonymous memory it has now that it did not have then, in ranges of at least
    ``min_bytes`` — what the driver staged the GPU memory in."""
    found: list[Range] = []
    for pid, old in before.items():
        new = new_since(pid, old)
        found += [Range(pid, lo, hi) for lo, hi in new if hi - lo >= min_bytes]
    return found


class _CanLeavePages(Protocol):
    async def has_external_pages(self) -> bool: ...


async def carried_beside(criu: _CanLeavePages, setting: str) -> bool:
    """Whether spotguard moves the GPU memory the driver stages (``[checkpoint] gpu_pages =
    "spotguard"`` and a CRIU with ``--external-pages``) rather than CRIU: the one place that
    decides, for the engine and for the planner's prediction."""
    return setting == "spotguard" and await criu.has_external_pages()


async def before(
    criu: _CanLeavePages, setting: str, gpu_pids: Sequence[int]
) -> dict[int, list[tuple[int, int]]]:
    """Each GPU process's :func:`writable_anon` before the driver's checkpoint, when
    spotguard is to move what the driver stages (:func:`carried_beside`); empty when CRIU
    moves it."""
    if not gpu_pids or not await carried_beside(criu, setting):
        return {}
    return {p: writable_anon(p) for p in gpu_pids}


def default_workers() -> int:
    """Parts copied at once, freezing or restoring: half the cores, at most
    :data:`MAX_WORKERS` (a restore's source writes two chunks of each part at once)."""
    return max(2, min(MAX_WORKERS, (os.cpu_count() or 2) // 2))


def split(r: Range, ns_pid: int, workers: int, chunk: int) -> GpuPages:
    """Cut ``r`` into up to ``workers`` parts of whole chunks (the last takes the rest)."""
    chunks = -(-r.size // chunk)
    n = max(1, min(workers, chunks))
    per = -(-chunks // n) * chunk
    parts = []
    for i, off in enumerate(range(0, r.size, per)):
        name = f"{r.prefix}-{ns_pid}-{r.start:x}-{i}"
        parts.append(Part(name, off, min(per, r.size - off)))
    return GpuPages(ns_pid, r.start, r.end, tuple(parts))


async def save(
    target: PagesTarget,
    ranges: Sequence[Range],
    ns_of: Mapping[int, int],
    *,
    chunk: int,
    workers: int | None = None,
    stop: threading.Event | None = None,
) -> list[GpuPages]:
    """Copy ``ranges`` (the tree frozen) into the image, ``workers`` parts at once; return
    what the metadata records. ``stop`` set (the dump failed meanwhile) ends the copy at the
    next chunk with :class:`CheckpointError`."""
    k = workers or default_workers()
    plan = [(r, split(r, ns_of[r.pid], k, chunk)) for r in ranges]
    gate = asyncio.Semaphore(k)

    async def one(r: Range, part: Part) -> None:
        def fill(off: int, view: memoryview) -> None:
            if stop is not None and stop.is_set():
                raise CheckpointError("the copy of memory beside CRIU stopped: the dump failed")
            read_memory(r.pid, r.start + part.offset + off, view)

        async with gate:
            await target.put_pages(part.name, part.size, fill)

    work = [one(r, part) for r, gp in plan for part in gp.parts]
    await run_all(work, "copying memory beside CRIU")
    total = sum(r.size for r in ranges)
    if ranges:
        log.info("memory copied beside CRIU", extra={"ranges": len(ranges), "bytes": total})
    return [gp for _, gp in plan]


async def load(
    source: PagesSource,
    pages: Sequence[GpuPages],
    host_pid: Mapping[int, int],
    *,
    workers: int | None = None,
    places: Mapping[int, Place] | None = None,
) -> int:
    """Write every part back into the restored processes (``host_pid``: namespace pid →
    host pid), ``workers`` parts at once; return the bytes written. With ``places`` (by
    namespace pid: the driver's restore reads meanwhile) each process's parts go one after
    another in address order, twice ``workers`` chunks at once over all processes, through
    its place (:mod:`.placing`)."""
    k = workers or default_workers()
    gate = asyncio.Semaphore(k)
    for gp in pages:
        if gp.ns_pid not in host_pid:
            raise ImageError(f"the image carries memory of pid {gp.ns_pid}, not restored")
    if places is not None:
        return await _load_in_order(source, pages, places, k)

    async def one(gp: GpuPages, part: Part) -> None:
        pid = host_pid[gp.ns_pid]

        def put(off: int, view: memoryview) -> None:
            _inside(part, off, len(view))
            # the restored mapping has no pages yet: blocks the job never touched stay so
            write_nonzero(pid, gp.start + part.offset + off, view)

        async with gate:
            await source.get_pages(part.name, part.size, put)

    await run_all(
        [one(gp, part) for gp in pages for part in gp.parts], "writing the staged GPU memory back"
    )
    return sum(gp.end - gp.start for gp in pages)


def _inside(part: Part, off: int, n: int) -> None:
    """A source's piece must lie within its part (a bad image never writes elsewhere)."""
    if off < 0 or off + n > part.size:
        raise ImageError(f"{part.name}: {n} bytes at {off} outside the part")


async def run_all(work: Sequence[Coroutine[Any, Any, None]], how: str) -> None:
    """Run ``work`` at once; the first failure raised as one typed error (a bad chunk, a
    call into the process that failed), the rest cancelled."""
    try:
        async with asyncio.TaskGroup() as tg:
            for w in work:
                tg.create_task(w)
    except* SpotguardError as eg:
        raise eg.exceptions[0] from None
    except* Exception as eg:  # noqa: BLE001 - said as a typed error, with the cause
        raise CheckpointError(f"{how} failed: {eg.exceptions[0]}") from eg.exceptions[0]


async def _load_in_order(
    source: PagesSource, pages: Sequence[GpuPages], places: Mapping[int, Place], workers: int
) -> int:
    by_pid: dict[int, list[GpuPages]] = {}
    for gp in pages:
        by_pid.setdefault(gp.ns_pid, []).append(gp)
    in_flight = max(2, 2 * workers // max(len(by_pid), 1))

    async def one_process(ns_pid: int, ranges: list[GpuPages]) -> None:
        place = places[ns_pid]
        for gp in sorted(ranges, key=lambda g: g.start):
            for part in sorted(gp.parts, key=lambda p: p.offset):
                base = gp.start + part.offset

                def put(off: int, view: memoryview, base: int = base, part: Part = part) -> None:
                    _inside(part, off, len(view))
                    place.put(base + off, view)

                def zero(off: int, n: int, base: int = base, part: Part = part) -> None:
                    _inside(part, off, n)
                    place.zero(base + off, n)

                await source.get_pages(part.name, part.size, put, zero=zero, in_flight=in_flight)

    await run_all([one_process(p, rs) for p, rs in by_pid.items()], "placing the staged GPU memory")
    return sum(gp.end - gp.start for gp in pages)
