"""Fault in the host memory the driver stages GPU memory in, several threads at once, while the
driver's checkpoint runs.

``cuCheckpointProcessCheckpoint`` maps host memory the size of the process's GPU memory and
fills it from one thread of the process. On the GPU VMs measured, most of that call's time is
the kernel making those pages (fresh, zeroed huge pages: ~3-4 GB/s from one thread, about 8
GB/s from several; the driver's checkpoint ran at 2.6-3.1 GB/s, docs/benchmarks.md). Nothing
in the driver API lets the caller hand it memory, so spotguard makes the pages *beside* it:
while the checkpoint runs, :class:`Prefault` watches the GPU processes' maps, and each new
writable anonymous range (what the driver maps for the checkpoint) is read by several threads
with ``process_vm_readv``, one byte per 2 MiB.

Why this is exact: a read never changes memory. Whoever faults a page first — the driver
writing it or a thread reading it — the page ends up holding what the driver wrote. For a read
fault to make a real page instead of mapping the shared zero page, the host's huge zero page
is turned off for the checkpoint (``transparent_hugepage/use_zero_page`` = 0, put back when
the last checkpoint that needed it is done), and transparent huge pages must be ``always``
(as the agent sets them): the read fault then allocates the zeroed, writable huge page the
driver's write finds present. Where either cannot be had, nothing is read (the reads would
only map zero pages) and the checkpoint runs as before.

Why ``process_vm_readv`` (:func:`~spotguard.checkpoint.procmem.touch`): it is the one call that
faults another process's pages without writing them (``process_madvise`` refuses
``MADV_POPULATE_*`` for another process), and it releases the GIL, so the threads fault on
separate cores.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from spotguard.checkpoint import gpupages, procmem
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.sizing import MEMINFO
from spotguard.sizing import meminfo as read_meminfo

log = logging.getLogger(__name__)

#: one read per huge page
HUGE = 2 << 20
#: huge pages faulted per process_vm_readv call (64 MiB): short enough that the threads
#: stop soon after the checkpoint returns
_PER_CALL = 32
#: how often the maps are read while the checkpoint runs, until a range is found; then
#: :data:`POLL_FOUND_S` (the driver maps its range once, within ms of the call; reading
#: the maps of a process with thousands of mappings costs a core's milliseconds each time)
POLL_S = 0.002
POLL_FOUND_S = 0.05
_THP = Path("/sys/kernel/mm/transparent_hugepage")


def _cut(pid: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``[lo, hi)`` of ``pid`` in pieces of one read each, from its first huge page."""
    first = lo + (-lo) % HUGE
    step = HUGE * _PER_CALL
    return [(pid, a, min(a + step, hi)) for a in range(first, hi, step)]


# --- the host setting ---------------------------------------------------------------------
class _ZeroPage:
    """The huge zero page off while at least one checkpoint needs it off (counted), then put
    back as it was. The value found is also written to ``saved_path`` (under /run, which a
    reboot empties exactly when it resets the kernel's setting), so that a process killed
    while the page was off leaves the next checkpoint the value to put back. Host-wide, but
    counted per process: two processes checkpointing at once may put it back before the
    other ends, which only makes that one's reads map zero pages (no prefault, no harm)."""

    def __init__(self, path: Path, saved_path: Path) -> None:
        self.path = path
        self.saved_path = saved_path
        self.lock = threading.Lock()
        self.users = 0
        self.saved: str | None = None

    def _original(self, now: str) -> str:
        """The value to put back: one a killed process recorded, else ``now``."""
        try:
            recorded = self.saved_path.read_text().strip()
        except OSError:
            return now
        return recorded if now == "0" and recorded in ("0", "1") else now

    def acquire(self) -> bool:
        """Turn the huge zero page off; False where that cannot be done (no THP, not root)."""
        with self.lock:
            if self.users == 0:
                try:
                    old = self._original(self.path.read_text().strip())
                    if old != "0":
                        self.saved_path.parent.mkdir(parents=True, exist_ok=True)
                        self.saved_path.write_text(old)
                        self.path.write_text("0")
                except OSError as exc:
                    log.info("GPU staging not prefaulted", extra={"error": str(exc)})
                    return False
                self.saved = old
            self.users += 1
            return True

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0 and self.saved is not None and self.saved != "0":
                try:
                    self.path.write_text(self.saved)
                    self.saved_path.unlink(missing_ok=True)
                except OSError as exc:
                    log.warning("huge zero page not put back", extra={"error": str(exc)})
            if self.users == 0:
                self.saved = None


_ZERO_PAGE = _ZeroPage(_THP / "use_zero_page", Path("/run/spotguard/use_zero_page.saved"))


def _thp_always(thp: Path = _THP) -> bool:
    try:
        return "[always]" in (thp / "enabled").read_text()
    except OSError:
        return False


def readiness(thp: Path = _THP) -> tuple[bool, str, str]:
    """Whether this host lets a checkpoint fault the driver's staging beside it: (ok, what was
    found, what to do) for ``spotguard doctor``."""
    always = _thp_always(thp)
    knob = thp / "use_zero_page"
    settable = knob.exists() and os.access(knob, os.W_OK)
    if always and settable:
        return True, "THP always, huge zero page settable: staging faulted in beside the driver", ""
    found = f"THP {'always' if always else 'not always'}, huge zero page " + (
        "settable" if settable else "not settable"
    )
    return (
        False,
        found + ": the driver's checkpoint makes its pages from one thread (slower)",
        'run the agent as root with [agent] transparent_hugepages = "always" (the default)',
    )


# --- watching and faulting ----------------------------------------------------------------
@dataclass
class PrefaultStats:
    """What :class:`Prefault` did: ranges found, bytes read ahead of the driver."""

    ranges: int = 0
    bytes: int = 0
    first_seen_s: float | None = None
    active: bool = False
    capped: bool = False  # the ranges held more than the budget: the rest left to the driver
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"prefault_ranges": self.ranges, "prefault_bytes": self.bytes}
        if self.first_seen_s is not None:
            out["prefault_first_s"] = round(self.first_seen_s, 3)
        if self.capped:
            out["prefault_capped"] = True
        return out


class Prefault:
    """While the driver checkpoints ``pids``: each new writable anonymous range of at least
    ``min_bytes`` (against ``before``, each pid's ranges before the checkpoint) is read one
    byte per huge page by ``workers`` threads, lowest addresses first — at most ``budget``
    bytes in all (None: no limit): a range a thread of the job maps meanwhile and uses
    sparsely must not be made whole."""

    def __init__(
        self,
        before: Mapping[int, list[tuple[int, int]]],
        workers: int,
        *,
        min_bytes: int = gpupages.MIN_RANGE_BYTES,
        poll_s: float = POLL_S,
        budget: int | None = None,
    ) -> None:
        self.before = {p: sorted(r) for p, r in before.items()}
        self.left = budget
        self.workers = max(1, workers)
        self.min_bytes = min_bytes
        self.poll_s = poll_s
        self.stats = PrefaultStats()
        self._stop = threading.Event()
        self._work: list[tuple[int, int, int]] = []  # (pid, start, end) of 64 MiB pieces
        self._cv = threading.Condition()
        self._seen: dict[int, list[tuple[int, int]]] = {p: [] for p in before}
        self._threads: list[threading.Thread] = []
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._threads = [threading.Thread(target=self._watch, name="prefault-watch", daemon=True)]
        self._threads += [
            threading.Thread(target=self._fault, name=f"prefault-{i}", daemon=True)
            for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Tell the threads to stop (each ends within one 64 MiB read); :meth:`join` waits."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()

    def join(self) -> None:
        for t in self._threads:
            t.join()

    def _scan(self) -> None:
        found: list[tuple[int, int, int]] = []
        for pid, old in self.before.items():
            new = gpupages.new_since(pid, old + self._seen[pid])
            for lo, hi in new:
                if hi - lo < self.min_bytes:
                    continue
                self._seen[pid].append((lo, hi))
                self.stats.ranges += 1
                if self.stats.first_seen_s is None:
                    self.stats.first_seen_s = time.perf_counter() - self._t0
                if self.left is not None:
                    if hi - lo > self.left:
                        self.stats.capped = True
                    hi = lo + max(0, min(hi - lo, self.left))
                    self.left -= hi - lo
                found += _cut(pid, lo, hi)
        if found:
            with self._cv:
                self._work.extend(found)
                self._cv.notify_all()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._scan()
            self._stop.wait(
                self.poll_s if not self.stats.ranges else max(self.poll_s, POLL_FOUND_S)
            )

    def _next(self) -> tuple[int, int, int] | None:
        with self._cv:
            while not self._work and not self._stop.is_set():
                self._cv.wait(0.05)
            if self._stop.is_set():
                return None
            # lowest pieces first: ahead of a driver that fills its range upwards
            return self._work.pop(0)

    def _fault(self) -> None:
        while (piece := self._next()) is not None:
            pid, lo, hi = piece
            addrs = list(range(lo, hi, HUGE))
            done = procmem.touch(pid, addrs)
            with self.stats.lock:
                self.stats.bytes += done * HUGE


@contextmanager
def _zero_page_off() -> Iterator[bool]:
    """The huge zero page off for the block where THP is ``always``; yields whether it is."""
    ok = _thp_always() and _ZERO_PAGE.acquire()
    try:
        yield ok
    finally:
        if ok:
            _ZERO_PAGE.release()


@asynccontextmanager
async def prefaulting(
    pids: Sequence[int], enabled: bool, workers: int | None = None, gpu_bytes: int = 0
) -> AsyncIterator[PrefaultStats]:
    """Around the driver's checkpoint of ``pids``: prefault what it stages (see the module)
    when ``enabled`` and the host allows it; yields the stats (``active`` says whether it
    ran). At most :func:`budget` bytes are read."""
    stats = PrefaultStats()
    if not pids or not enabled:
        yield stats
        return
    with _zero_page_off() as ok:
        if not ok:
            yield stats
            return
        before = {p: gpupages.writable_anon(p) for p in pids}
        k = workers or gpupages.default_workers()
        pf = Prefault(before, k, budget=budget(gpu_bytes))
        pf.stats.active = True
        pf.start()
        try:
            yield pf.stats
        finally:
            pf.stop()
            await asyncio.to_thread(pf.join)
            if pf.stats.ranges:
                log.info("GPU staging prefaulted", extra=pf.stats.to_json())


def budget(gpu_bytes: int, meminfo: Path = MEMINFO) -> int:
    """Bytes the reads may make: what the driver will stage (the processes' GPU memory, with
    a quarter and 512 MiB to spare; unknown when 0), and never more than the host's
    available memory less 1 GiB."""
    cap = max(0, read_meminfo(meminfo).get("MemAvailable", 0) - (1 << 30))
    return min(cap, gpu_bytes + gpu_bytes // 4 + (512 << 20)) if gpu_bytes > 0 else cap


class _Checkpoints(Protocol):
    async def checkpoint(self, pids: Sequence[int]) -> None: ...


async def checkpoint(
    gpu: _Checkpoints, pids: Sequence[int], settings: CheckpointSettings, gpu_bytes: int = 0
) -> PrefaultStats:
    """The driver's checkpoint of ``pids`` (holding ``gpu_bytes`` of GPU memory, 0 when
    unknown), with what it stages prefaulted beside it by ``gpu_page_workers`` threads when
    ``settings.prefault_staging``: how a freeze and a suspend in place call it."""
    enabled, workers = settings.prefault_staging, settings.gpu_page_workers or None
    async with prefaulting(pids, enabled, workers, gpu_bytes) as stats:
        await gpu.checkpoint(pids)
    return stats
