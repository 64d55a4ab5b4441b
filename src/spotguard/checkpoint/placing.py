"""The staged GPU memory written back while the driver's restore already reads it.

A restore otherwise runs two stages of about equal length one after the other: the write-back
of the range the driver staged (``gpu_pages``, ~6 s for 41 GB on an H200: the host's rate of
making fresh pages) and the driver's restore, which reads that range (~6 s). The driver API
has no way to start on part of it, so spotguard makes the range safe to read early instead:

1. into the restored process (:mod:`.inject`): a ``userfaultfd`` and a scratch mapping;
2. the staged ranges are registered with the ``userfaultfd`` for missing pages: any read of a
   page not yet written waits, in the kernel, until spotguard places it;
3. each verified chunk is written into a scratch slot of the process (``process_vm_writev``:
   fresh huge pages, as before) and moved into place with ``UFFDIO_MOVE`` (Linux 6.8+), which
   moves whole huge pages and wakes a reader waiting on them; all-zero chunks get the zero
   page (``UFFDIO_ZEROPAGE``). The chunks go in address order, so a driver reading the range
   front to back finds it written ahead of it;
4. the driver's restore runs meanwhile; once every chunk is placed the ``userfaultfd`` is
   closed (the registration goes with it) and the scratch mapping unmapped.

Why ``UFFDIO_MOVE`` and not ``UFFDIO_COPY``: a copy places 4 KiB pages, and the driver's
restore reads those slower than huge pages — measured, the overlap then gained little
(docs/benchmarks.md, "Could the driver's restore start before the staged memory is back?").
A move keeps the huge page ``process_vm_writev`` made.

Every byte is verified before it is written, as before. Where any of this cannot be set up
(another architecture, an older kernel, ptrace or ``userfaultfd`` refused), :func:`open_placers`
returns no placers (and why) and the restore writes everything back first, as it always did.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import platform
import queue
import select
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from spotguard.errors import InjectError

from . import inject
from .gpupages import GpuPages
from .procmem import read_memory, write_memory

log = logging.getLogger(__name__)

_UFFDIO_API, _UFFDIO_REGISTER, _UFFDIO_ZEROPAGE = 0xC018AA3F, 0xC020AA00, 0xC020AA04
_UFFDIO_MOVE = 0xC028AA05
_UFFD_API, _FEATURE_MOVE, _MODE_MISSING = 0xAA, 1 << 16, 1
_HUGE = 2 << 20
_MAP_NORESERVE, _MADV_DONTNEED = 0x4000, 4  # (MAP_NORESERVE: in Python's mmap from 3.13)
#: the end of the scratch mapping: the puppet's signal mask, the ioctl's argument, its stack
_CONTROL = 64 << 10
T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)
_ioctl = _libc.ioctl
_ioctl.restype = ctypes.c_int
_ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_NR_PIDFD_OPEN, _NR_PIDFD_GETFD = 434, 438


class _Move(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("dst", "src", "len", "mode")] + [
        ("moved", ctypes.c_int64)
    ]


class _Zero(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("start", "len", "mode")] + [
        ("zeroed", ctypes.c_int64)
    ]


def _io(fd: int, req: int, arg: ctypes.Structure | ctypes.Array[ctypes.c_uint64]) -> int:
    """``ioctl``; 0 or the errno."""
    if _ioctl(fd, req, ctypes.byref(arg)) == 0:
        return 0
    return ctypes.get_errno()


def _their_fd(pid: int, fd: int) -> int:
    """A duplicate, in this process, of ``pid``'s file descriptor ``fd``."""
    pidfd = _syscall(_NR_PIDFD_OPEN, pid, 0)
    if pidfd < 0:
        raise OSError(ctypes.get_errno(), f"pidfd_open({pid})")
    try:
        ours = _syscall(_NR_PIDFD_GETFD, pidfd, fd, 0)
        if ours < 0:
            raise OSError(ctypes.get_errno(), f"pidfd_getfd({pid}, {fd})")
        return int(ours)
    finally:
        os.close(pidfd)


@dataclass
class PlaceStats:
    """What one process's placing did (the timeline's detail)."""

    moved_bytes: int = 0
    zero_bytes: int = 0
    faults: int = 0  # reads of the range that had to wait for a chunk


class _Tracer(threading.Thread):
    """The one OS thread that makes every ptrace request for a process (ptrace answers only
    the thread that attached); other threads hand it work and wait for the answer."""

    def __init__(self, pid: int) -> None:
        super().__init__(name=f"spotguard-place-{pid}", daemon=True)
        self._work: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]
        self._work = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while (item := self._work.get()) is not None:
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> T:
        fut: Future[T] = Future()
        self._work.put((fn, fut))
        return fut.result()

    def stop(self) -> None:
        self._work.put(None)
        self.join()


class Placer:
    """Places chunks of one restored process's staged ranges (see the module's steps)."""

    def __init__(self, pid: int, ranges: Sequence[tuple[int, int]], slots: int, slot: int) -> None:
        """Set up placing for ``pid``'s ``ranges`` with ``slots`` scratch slots of ``slot``
        bytes. Raises :class:`InjectError` or :class:`OSError` where it cannot."""
        self.pid = pid
        self.slot = slot
        self.stats = PlaceStats()
        self._ranges = list(ranges)
        self._length = slots * slot + _HUGE + _CONTROL
        self._lock = threading.Lock()
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._tracer = _Tracer(pid)
        self._uffd = -1
        self._theirs = -1
        self._scratch = 0
        self._puppet: inject.Puppet | None = None
        try:
            self._tracer.submit(self._setup)
        except BaseException:
            self._tracer.stop()
            raise
        base = self._scratch + (-self._scratch) % _HUGE
        for k in range(slots):
            self._slots.put(base + k * slot)
        self._control = self._scratch + self._length - _CONTROL
        self._closing = threading.Event()
        self._counter = threading.Thread(target=self._count_faults, daemon=True)
        self._counter.start()

    def _count_faults(self) -> None:
        """Read the fault reports as they come (a report left unread is dropped when its
        fault is resolved, so only a reader counts them); the faults wait for the placing
        either way."""
        while not self._closing.is_set():
            try:
                if select.select([self._uffd], [], [], 0.05)[0]:
                    n = len(os.read(self._uffd, 32 * 64)) // 32
                    with self._lock:
                        self.stats.faults += n
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, ValueError):
                return

    def _setup(self) -> None:
        """(tracer thread) The ``userfaultfd`` and the scratch mapping, made by the process;
        the ranges registered; the thread that will move pages spawned."""
        pid = self.pid
        with inject.Injector(pid) as inj:
            flags = os.O_CLOEXEC | os.O_NONBLOCK
            self._theirs = inject.check(inj.call(inject.NR_USERFAULTFD, flags), "userfaultfd", pid)
            try:
                self._uffd = _their_fd(pid, self._theirs)
                api = (ctypes.c_uint64 * 3)(_UFFD_API, _FEATURE_MOVE, 0)
                if err := _io(self._uffd, _UFFDIO_API, api):
                    raise OSError(err, "UFFDIO_API with UFFD_FEATURE_MOVE (Linux 6.8+)")
                prot = mmap.PROT_READ | mmap.PROT_WRITE
                anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
                self._scratch = inject.check(
                    inj.call(inject.NR_MMAP, 0, self._length, prot, anon, -1, 0), "mmap", pid
                )
                control = self._scratch + self._length - _CONTROL
                write_memory(pid, control, memoryview(bytearray(b"\xff" * 8)))  # puppet sigmask
                for lo, hi in self._ranges:  # whatever CRIU left there (zero pages) goes
                    madv = inj.call(inject.NR_MADVISE, lo, hi - lo, _MADV_DONTNEED)
                    inject.check(madv, "madvise(MADV_DONTNEED)", pid)
                for lo, hi in self._ranges:
                    reg = (ctypes.c_uint64 * 4)(lo, hi - lo, _MODE_MISSING, 0)
                    if err := _io(self._uffd, _UFFDIO_REGISTER, reg):
                        raise OSError(err, f"UFFDIO_REGISTER {lo:#x}-{hi:#x}")
                self._puppet = inj.spawn(stack=control + _CONTROL - 64, sigset=control)
            except BaseException:
                if self._uffd >= 0:
                    os.close(self._uffd)
                inj.call(inject.NR_CLOSE, self._theirs)
                if self._scratch:
                    inj.call(inject.NR_MUNMAP, self._scratch, self._length)
                raise

    def put(self, addr: int, view: memoryview) -> None:
        """Write ``view`` (verified bytes) into the process at ``addr``: into a scratch slot,
        then moved into place (runs in a worker thread)."""
        slot = self._slots.get()
        try:
            for off in range(0, len(view), self.slot):
                piece = view[off : off + self.slot]
                write_memory(self.pid, slot, piece)
                self._tracer.submit(functools.partial(self._move, addr + off, slot, len(piece)))
        finally:
            self._slots.put(slot)
        with self._lock:
            self.stats.moved_bytes += len(view)

    def zero(self, addr: int, length: int) -> None:
        """Map the zero page over ``[addr, addr + length)`` (an all-zero chunk)."""
        done = 0
        while done < length:
            z = _Zero(addr + done, length - done, 0, 0)
            err = _io(self._uffd, _UFFDIO_ZEROPAGE, z)
            if not err:
                break
            done += max(int(z.zeroed), 0)
            if err == errno.EEXIST:  # a page there already (it reads what it holds)
                done += mmap.PAGESIZE
            elif err != errno.EAGAIN:
                raise OSError(err, f"UFFDIO_ZEROPAGE {addr + done:#x}: {os.strerror(err)}")
        with self._lock:
            self.stats.zero_bytes += length

    def _move(self, dst: int, src: int, n: int) -> None:
        """(tracer thread) ``UFFDIO_MOVE`` run by the puppet: the kernel moves pages only
        within the calling process's own memory."""
        assert self._puppet is not None
        arg = self._control + 64
        done = 0
        while done < n:
            m = _Move(dst + done, src + done, n - done, 0, 0)
            write_memory(self.pid, arg, memoryview(m).cast("B"))
            ret = self._puppet.call(inject.NR_IOCTL, self._theirs, _UFFDIO_MOVE, arg)
            if ret == 0:
                return
            read_memory(self.pid, arg, memoryview(m).cast("B"))
            done += max(int(m.moved), 0)
            if -ret not in (errno.EAGAIN, errno.EBUSY):
                raise OSError(-ret, f"UFFDIO_MOVE to {dst + done:#x}: {os.strerror(-ret)}")

    def close(self) -> None:
        """Close the ``userfaultfd`` (its registration goes with it), end the puppet and
        unmap the scratch mapping (now empty) in the process."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._counter.join()
        os.close(self._uffd)
        try:
            self._tracer.submit(self._teardown)
        except (InjectError, OSError) as exc:  # an empty mapping left behind: no harm
            log.info("scratch mapping left in the restored process", extra={"error": str(exc)})
        finally:
            self._tracer.stop()

    def _teardown(self) -> None:
        """(tracer thread)"""
        if self._puppet is not None:
            self._puppet.call(inject.NR_CLOSE, self._theirs)
            self._puppet.call(inject.NR_MUNMAP, self._scratch, self._length)
            self._puppet.exit()


def readiness() -> tuple[bool, str, str]:
    """Whether this host can place a restore's staged GPU memory under the driver's restore:
    (ok, what was found, what to do) for ``spotguard doctor``. A probe on a child process:
    the whole set-up (ptrace, ``userfaultfd``, ``UFFDIO_MOVE``) on a page of its memory."""
    if not inject.supported():
        return False, f"{platform.machine()}: system calls are injected on x86-64 only", ""
    probe = subprocess.Popen(
        [sys.executable, "-c", _PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert probe.stdout is not None
        base = int(probe.stdout.readline())
        placer = Placer(probe.pid, [(base, base + _HUGE)], 1, _HUGE)
        try:
            placer.put(base, memoryview(bytearray(b"\x5a" * _HUGE)))
        finally:
            placer.close()
    except (InjectError, OSError, ValueError) as exc:
        return (
            False,
            f"restores write the GPU memory back before the driver's restore ({exc})",
            "Linux 6.8+ (UFFDIO_MOVE), ptrace allowed (kernel.yama.ptrace_scope < 3), agent "
            "run as root",
        )
    finally:
        probe.kill()
        probe.wait()
    return True, "userfaultfd + UFFDIO_MOVE work: large restores overlap the driver's", ""


#: a process holding one untouched, 2 MiB-aligned huge page of memory (readiness's probe)
_PROBE = """
import ctypes, mmap, sys, time
m = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
a = ctypes.addressof(ctypes.c_char.from_buffer(m))
print(a + (-a) % (2 << 20), flush=True)
time.sleep(60)
"""


def open_placers(
    pages: Sequence[GpuPages], host_pid: Mapping[int, int], slots: int, slot: int
) -> tuple[dict[int, Placer] | None, str]:
    """One :class:`Placer` per restored process holding staged GPU memory (by namespace
    pid), or ``None`` and why where placing cannot be set up for any of them (the caller
    writes everything back first; what was set up is closed again)."""
    if not inject.supported():
        return None, "system calls are injected on x86-64 only"
    ranges: dict[int, list[tuple[int, int]]] = {}
    for gp in pages:
        ranges.setdefault(gp.ns_pid, []).append((gp.start, gp.end))
    out: dict[int, Placer] = {}
    try:
        for ns_pid, rs in ranges.items():
            out[ns_pid] = Placer(host_pid[ns_pid], rs, slots, slot)
    except (InjectError, OSError, KeyError) as exc:
        for p in out.values():
            p.close()
        log.info("restore without overlap: placing cannot be set up", extra={"error": str(exc)})
        return None, str(exc)
    return out, ""
