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
import mmap
import os
import select
import threading


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
        buf = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self.size >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                buf.madvise(mmap.MADV_HUGEPAGE)
        return buf

    def give(self, buf: mmap.mmap) -> None:
        with self._cond:
            self.out -= 1
            if self._closed:
                return
            self._free.append(buf)
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
