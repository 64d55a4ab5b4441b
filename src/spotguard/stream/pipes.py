"""Pipe I/O for the streamer.

Event loop side: :func:`wait_fd` (the streamer socket). Thread side: :func:`fill` reads a
pipe into a big reused buffer (:class:`PiecePool`), :func:`put_all` writes one, in worker
threads. Reading CRIU's page data on the loop's own thread was what bounded a streamed
dump (docs/benchmarks.md, "Streaming": every byte was zeroed, read and copied again there,
mostly with the GIL held); in a thread the one copy out of the pipe runs with the GIL
released and the loop only hands finished pieces on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import select
import threading
from functools import cache
from pathlib import Path

from spotguard.image.memops import populate

log = logging.getLogger(__name__)

#: the largest pipe a process without CAP_SYS_RESOURCE may ask for (the kernel's default: 1 MiB)
PIPE_MAX = Path("/proc/sys/fs/pipe-max-size")


def ensure_pipe_max(size: int, path: Path = PIPE_MAX) -> int:
    """Raise the kernel's pipe size limit to ``size`` bytes if it is lower; return the limit
    in effect (0 if it cannot be read).

    Why: without CAP_SYS_RESOURCE — which root in a container, or on the GPU machines
    measured, does not have — ``F_SETPIPE_SZ`` stops at ``fs.pipe-max-size`` (1 MiB by
    default), and a stream's pipes stayed at 1 MiB: CRIU's restore then waited on the pipe
    and took 2-4 s longer for a 40 GiB job (docs/benchmarks.md, "Pipe sizes"). A higher
    limit is never lowered. Raising it needs root; where it cannot be written the limit
    stays and one log line says what that costs."""
    try:
        current = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    if current >= size:
        return current
    try:
        path.write_text(str(size))
    except OSError as exc:
        log.info(
            "pipes stay at fs.pipe-max-size (streams and dumps are slower)",
            extra={"bytes": current, "error": str(exc)},
        )
        return current
    log.info(
        "raised fs.pipe-max-size (streams, CRIU's page pipes)",
        extra={"bytes": size, "previous": current},
    )
    return size


async def wait_fd(fd: int, *, write: bool = False) -> None:
    """Return once ``fd`` is readable (or writable), or has hung up."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    if write:
        loop.add_writer(fd, ready)
    else:
        loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


# --- thread side: blocking pipe reads off the event loop ---------------------------------------


class Interrupted(Exception):
    """A thread's wait was cut short: the transfer is being stopped."""


#: How often a reader thread waiting on a quiet pipe looks at its stop flag (seconds): the
#: most an abort waits before CRIU's pipe is closed and CRIU sees EPIPE.
POLL_S = 0.05


def fill(fd: int, view: memoryview, stop: threading.Event) -> int:
    """Read from the non-blocking pipe ``fd`` until ``view`` is full or the pipe's writer
    closed it; returns the bytes read (fewer than ``len(view)`` only at EOF).

    Runs in a worker thread: ``poll`` and ``readv`` release the GIL, so the copy out of the
    pipe costs the event loop nothing. Raises :class:`Interrupted` once ``stop`` is set."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    filled, size = 0, len(view)
    wait_ms = int(POLL_S * 1000)
    while filled < size:
        if stop.is_set():
            raise Interrupted
        try:
            n = os.readv(fd, [view[filled:]])
        except (BlockingIOError, InterruptedError):
            poller.poll(wait_ms)
            continue
        if n == 0:
            break
        filled += n
    return filled


class PiecePool:
    """Reused piece buffers shared by every reader thread of one transfer; at most ``count``
    exist. :meth:`take` blocks while all are out — the back-pressure that stops reading, so
    CRIU's pipe fills and CRIU waits. Thread-safe.

    Reuse matters: a fresh buffer costs a page fault (and the kernel zeroing the page) per
    4 KiB on first touch, which on a VM runs slower than the copy itself. Buffers are
    anonymous maps advised ``MADV_HUGEPAGE`` (one fault per 2 MiB where the kernel allows).
    """

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        self.count = max(1, count)
        self.out = 0
        self.peak = 0
        self._free: list[mmap.mmap] = []
        self._made = 0
        self._closed = False
        self._cond = threading.Condition()

    @property
    def made(self) -> int:
        """Buffers that exist now (free or out)."""
        return self._made

    def take(self) -> mmap.mmap:
        """A free buffer (waits for one); raises :class:`Interrupted` once closed."""
        with self._cond:
            while not self._free and self._made >= self.count and not self._closed:
                self._cond.wait()
            if self._closed:
                raise Interrupted
            self.out += 1
            self.peak = max(self.peak, self.out)
            if self._free:
                return self._free.pop()
            self._made += 1
        try:
            return self._make()
        except BaseException:  # not made (no memory, an address-space limit): not counted
            with self._cond:
                self.out -= 1
                self._made -= 1
                self._cond.notify()
            raise

    def _make(self) -> mmap.mmap:
        buf = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self.size >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                buf.madvise(mmap.MADV_HUGEPAGE)
        return buf

    def reserve(self, n: int) -> list[mmap.mmap]:
        """Make up to ``n`` more buffers now — their maps only, counted against ``count`` —
        for :meth:`fill` to fault in. Apart because making a map takes the process's
        address-space lock for writing while a populate holds it for reading: threads that
        each made a map and then populated it waited on one another's populates at every map
        (6 GB/s on 16 cores against 26 GB/s with every map made first: ``bench.prefault``)."""
        with self._cond:
            k = 0 if self._closed else max(0, min(n, self.count - self._made))
            self._made += k
        made: list[mmap.mmap] = []
        try:
            for _ in range(k):
                made.append(self._make())
        except OSError:  # no room for more maps: fewer pieces made ahead, the rest on demand
            with self._cond:
                self._made -= k - len(made)
                self._cond.notify_all()
        return made

    def fill(self, bufs: list[mmap.mmap], stop: threading.Event | None = None) -> int:
        """Fault in the pages of ``bufs`` (from :meth:`reserve`; ``memops.populate``) and
        make each free for :meth:`take`: the frozen job's image is then copied into pages
        that exist. Once ``stop`` is set the rest are made free as they are (faulted when
        written); once the pool is closed they are dropped. Returns how many it faulted in."""
        done = 0
        for buf in bufs:
            if not (stop is not None and stop.is_set()) and not self._closed:
                populate(buf)
                done += 1
            with self._cond:
                if not self._closed:
                    self._free.append(buf)
                    self._cond.notify()
        return done

    def prefault(self, n: int, stop: threading.Event | None = None) -> int:
        """Make up to ``n`` more buffers now, their pages faulted in, free for :meth:`take`
        (:meth:`reserve` then :meth:`fill`, in this thread). Stops at ``count`` buffers, once
        closed, or when ``stop`` is set; returns how many it faulted in."""
        return self.fill(self.reserve(n), stop)

    def release(self, buf: mmap.mmap) -> None:
        """Give back a buffer for reuse."""
        with self._cond:
            self.out -= 1
            if self._closed:
                return
            self._free.append(buf)
            self._cond.notify()

    def discard(self, buf: mmap.mmap) -> None:
        """Give back a buffer that must not be reused (a thread may still read it): it is
        left to the garbage collector and a fresh one may be made in its place."""
        with self._cond:
            self.out -= 1
            self._made -= 1
            self._cond.notify()

    def close(self) -> None:
        """Wake every waiter (they raise :class:`Interrupted`) and drop the free buffers."""
        with self._cond:
            self._closed = True
            self._free.clear()
            self._cond.notify_all()


def put_all(fd: int, data: bytes | bytearray | memoryview, stop: threading.Event) -> None:
    """Write all of ``data`` into the non-blocking pipe ``fd`` from a worker thread, waiting
    (GIL released) while the pipe is full. Raises BrokenPipeError once the reader has gone,
    :class:`Interrupted` once ``stop`` is set."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    view = memoryview(data).cast("B")
    wait_ms = int(POLL_S * 1000)
    while view:
        if stop.is_set():
            raise Interrupted
        try:
            n = os.write(fd, view)
        except (BlockingIOError, InterruptedError):
            poller.poll(wait_ms)
            continue
        view = view[n:]


# --- vmsplice: pages into a pipe by reference -------------------------------------------------


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_SPLICE_F_NONBLOCK = 0x02


@cache
def _vmsplice() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``vmsplice``, or None where there is none (then pieces are written)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).vmsplice
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_uint]
    fn.restype = ctypes.c_ssize_t
    return fn


class SpliceUnsupported(Exception):
    """The kernel or libc refused ``vmsplice``: write the data instead."""


def splice_all(fd: int, buf: mmap.mmap, size: int, stop: threading.Event) -> None:
    """Move the first ``size`` bytes of ``buf`` into the non-blocking pipe ``fd`` by reference
    (``vmsplice``): the pipe points at ``buf``'s pages, so there is no copy into the pipe and
    the reader's copy out of it is the only one. The caller must never write to ``buf`` again
    (an :class:`~spotguard.image.buffers.OwnedChunk`: unmapped right after).

    Waits (GIL released) while the pipe is full; raises BrokenPipeError once the reader has
    gone, :class:`Interrupted` once ``stop`` is set, :class:`SpliceUnsupported` if nothing
    could be spliced (the caller writes the rest)."""
    fn = _vmsplice()
    if fn is None:
        raise SpliceUnsupported("no vmsplice in libc")
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        base = ctypes.addressof(anchor)
    finally:
        del anchor  # the address stays valid: the caller holds the map until we return
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    wait_ms = int(POLL_S * 1000)
    off = 0
    while off < size:
        if stop.is_set():
            raise Interrupted
        iov = _IoVec(base + off, size - off)
        n = fn(fd, ctypes.byref(iov), 1, _SPLICE_F_NONBLOCK)
        if n >= 0:
            off += n
            continue
        err = ctypes.get_errno()
        if err in (errno.EAGAIN, errno.EINTR):
            poller.poll(wait_ms)
        elif err == errno.EPIPE:
            raise BrokenPipeError(err, os.strerror(err))
        elif err in (errno.EINVAL, errno.ENOSYS, errno.EPERM) and off == 0:
            raise SpliceUnsupported(os.strerror(err))
        else:
            raise OSError(err, f"vmsplice: {os.strerror(err)}")
