"""Reusable chunk buffers with a hard bound on how many exist at once.

Why a pool: on a VM a fresh 64 MiB buffer costs a page fault (and the kernel zeroing a page)
per 4 KiB the first time it is touched — measured here, allocating and filling fresh buffers
runs at about the speed of zstd level 1, and threads faulting at the same time serialise on the
address-space lock. A buffer that is reused has its pages already mapped, so reading a chunk
into it, compressing into it or decompressing into it costs only the copy.

Buffers are anonymous ``mmap`` regions advised ``MADV_HUGEPAGE`` where the kernel offers it
(``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise``): their first touch then costs
one fault per 2 MiB. They are allocated lazily, up to ``limit``; :meth:`BufferPool.acquire`
waits while ``limit`` buffers are out, which is the memory bound of a transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import mmap
from collections import deque
from typing import Literal, Protocol

_HUGEPAGE = 2 << 20


class BufferPool:
    """At most ``limit`` buffers of ``size`` bytes; ``acquire`` waits while all are out.

    Not thread-safe: acquire and release on the event loop's thread (worker threads only use
    the buffers they are handed).
    """

    def __init__(self, size: int, limit: int) -> None:
        if size <= 0 or limit <= 0:
            raise ValueError("buffer size and limit must be positive")
        self.size = size
        self.limit = limit
        self._free: deque[mmap.mmap] = deque()
        self._out: set[int] = set()
        self._allocated = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.peak = 0  # most buffers allocated at once
        self.made = 0  # buffers allocated over the pool's life (reuse keeps this low)

    @property
    def allocated(self) -> int:
        """Buffers that exist now (free or out)."""
        return self._allocated

    @property
    def in_use(self) -> int:
        return len(self._out)

    def _make(self) -> mmap.mmap:
        size = -(-self.size // mmap.PAGESIZE) * mmap.PAGESIZE
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if size >= _HUGEPAGE and hasattr(mmap, "MADV_HUGEPAGE"):
            # A kernel without transparent huge pages: 4 KiB pages it is.
            with contextlib.suppress(OSError):
                buf.madvise(mmap.MADV_HUGEPAGE)
        self._allocated += 1
        self.made += 1
        self.peak = max(self.peak, self._allocated)
        return buf

    def try_acquire(self) -> mmap.mmap | None:
        """A buffer now, or None when ``limit`` are out."""
        if self._free:
            buf = self._free.pop()  # the most recently used: its pages are warm
        elif self._allocated < self.limit:
            buf = self._make()
        else:
            return None
        self._out.add(id(buf))
        return buf

    async def acquire(self) -> mmap.mmap:
        """A buffer (``size`` bytes or a little more, page-rounded); waits for a free one."""
        while True:
            buf = self.try_acquire()
            if buf is not None:
                return buf
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._wake()  # woken and cancelled at once: pass the turn on
                raise

    def release(self, buf: mmap.mmap) -> None:
        """Give ``buf`` back for reuse (the caller must hold no view of it any more)."""
        self._out.discard(id(buf))
        self._free.append(buf)
        self._wake()

    def discard(self, buf: mmap.mmap) -> None:
        """Forget ``buf`` without reusing it (a worker thread may still touch it: its memory
        goes away when the last reference does); a new buffer may be made in its place."""
        if id(buf) in self._out:
            self._out.discard(id(buf))
            self._allocated -= 1
        self._wake()

    def grow(self, n: int) -> None:
        """Allow ``n`` more buffers (a hold granted while the pool is in use: waiters wake)."""
        self.limit += n
        for _ in range(n):
            self._wake()

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def close(self) -> None:
        """Unmap the free buffers (buffers still out are freed when dropped)."""
        while self._free:
            buf = self._free.pop()
            self._allocated -= 1
            with contextlib.suppress(BufferError):  # a view still alive: GC frees it later
                buf.close()


#: which buffers a deferred chunk holds: a piece of its producer's own pool (the stream
#: capture's, handed over whole) or one of the writer's input buffers (filled by a producer)
Held = Literal["owned", "input"]


class Deferral:
    """Chunks of a leave-running image kept raw — not hashed, compressed or stored — until
    the job runs again (:meth:`open`), so that while it is frozen the machine's cores go to
    copying it out of CRIU's pipes and the GPU staging rather than to the chunk pipeline.

    Why bounded by credits: a deferred chunk holds its buffer and an in-flight slot until the
    gate opens. Only as many chunks wait as the hold added room for (:meth:`grant`, from
    ``ImageWriter.hold``), counted apart for the two pools their buffers come from; any other
    chunk goes through at once, so the producers never run out of buffers while chunks wait,
    and an image larger than the hold streams as before. Event-loop only.
    """

    def __init__(self) -> None:
        self.owned = 0
        self.input = 0
        self.chunks = 0  # chunks that waited
        self._open = asyncio.Event()
        self._open.set()

    def grant(self, owned: int, input_: int) -> None:
        """Room for ``owned`` more chunks of a producer's pool and ``input_`` more of the
        writer's input buffers to wait."""
        self.owned += max(0, owned)
        self.input += max(0, input_)

    def close(self) -> None:
        """From now on chunks with room wait (the job is about to be frozen)."""
        self._open.clear()

    def open(self) -> None:
        """The job runs again: every waiting chunk goes on, and no other waits."""
        self._open.set()

    def is_open(self) -> bool:
        """No chunk waits now (no held image's job is frozen)."""
        return self._open.is_set()

    def take(self, held: Held | None) -> asyncio.Event | None:
        """The gate a new chunk holding ``held`` buffers waits at, or None to go on now."""
        if held is None or self._open.is_set():
            return None
        if held == "owned" and self.owned > 0:
            self.owned -= 1
        elif held == "input" and self.input > 0:
            self.input -= 1
        else:
            return None
        self.chunks += 1
        return self._open


class Reusable(Protocol):
    """A pool a :class:`Lease` gives its buffer back to (:class:`BufferPool`, or the stream
    capture's thread-safe ``PiecePool``)."""

    def release(self, buf: mmap.mmap) -> None: ...

    def discard(self, buf: mmap.mmap) -> None: ...


class Taking(Reusable, Protocol):
    """A thread-safe pool that also hands buffers out, blocking while none is free (the
    stream capture's ``PiecePool``)."""

    def take(self) -> mmap.mmap: ...


class Lease:
    """One pooled buffer held by one chunk; given back exactly once.

    ``release`` returns it for reuse; ``discard`` drops it (a worker thread of a cancelled
    chunk may still touch it). ``slot`` is the input-buffer slot it also holds, if any.
    """

    def __init__(self, pool: Reusable, buf: mmap.mmap, slot: asyncio.Semaphore | None) -> None:
        self.pool = pool
        self.buf = buf
        self.view = memoryview(buf)
        self._slot = slot
        self._done = False

    def _end(self, reuse: bool) -> None:
        if self._done:
            return
        self._done = True
        if reuse:
            self.pool.release(self.buf)
        else:
            self.pool.discard(self.buf)
        if self._slot is not None:
            self._slot.release()

    def release(self) -> None:
        self._end(True)

    def discard(self) -> None:
        self._end(False)


class OwnedChunk:
    """One decoded chunk in a private anonymous map that nothing else will ever write.

    Why: a receiver may hand these pages to the kernel by reference (``vmsplice`` into a
    pipe) and then :meth:`close` the map. The pipe keeps the pages alive until its reader has
    copied them out, and no one can modify them meanwhile: unmapped pages are never reused
    while referenced, unlike heap memory (a freed ``bytes`` may be reused by ``malloc`` while
    the pipe still points at it). Fresh maps cost page faults, but those are taken by the
    decoding threads in parallel, not by the one thread feeding the pipe.

    :meth:`leased` makes one over a :class:`BufferPool`'s buffer instead, for a consumer that
    copies the bytes out before it closes the chunk (``process_vm_writev`` into a restored
    job): :meth:`close` gives the buffer back for the next chunk, whose read then costs no
    page faults. Never for a chunk whose pages are handed on by reference.
    """

    __slots__ = ("_lease", "map", "size")

    def __init__(self, size: int) -> None:
        length = max(-(-size // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE)
        self.map = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if length >= _HUGEPAGE and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self.map.madvise(mmap.MADV_HUGEPAGE)
        self.size = size
        self._lease: Lease | None = None

    @classmethod
    def leased(cls, pool: BufferPool, buf: mmap.mmap, size: int) -> OwnedChunk:
        """A chunk of ``size`` bytes in ``buf``, acquired from ``pool`` (at least that big)."""
        if size > len(buf):
            pool.release(buf)
            raise ValueError(f"a {size}-byte chunk does not fit a {len(buf)}-byte buffer")
        chunk = cls.__new__(cls)
        chunk.map, chunk.size = buf, size
        chunk._lease = Lease(pool, buf, None)
        return chunk

    @property
    def fresh(self) -> bool:
        """The map is new (untouched pages read zero), not a reused buffer."""
        return self._lease is None

    def __len__(self) -> int:
        return self.size

    def close(self) -> None:
        """Unmap; pages a pipe still references stay valid for its reader. A view still held
        somewhere defers the unmap to garbage collection (still safe: nothing writes here).
        A leased chunk's buffer goes back to its pool."""
        if self._lease is not None:
            self._lease.release()
            return
        with contextlib.suppress(BufferError):
            self.map.close()

    def abandon(self) -> None:
        """Like :meth:`close` after a failed or cancelled read, when a worker thread may still
        write into the map: a leased buffer is dropped, never reused."""
        if self._lease is not None:
            self._lease.discard()
            return
        self.close()


class PrioritySlots:
    """At most ``n`` holders at once; waiters get a slot lowest ``priority`` first (then in
    arrival order). Event-loop only, like :class:`BufferPool`.

    Why: the restore reads many files at once through shared thread pools whose queues are
    first come, first served. CRIU cannot go on until the small files it opens (a task's
    core, its memory map) and the first pages of each task arrive; queued behind other
    files' read-ahead (sixteen 64 MiB chunks each) they held every task up, one after
    another. With a chunk's index in its file as the priority, every file's first chunk goes
    before anyone's read-ahead.
    """

    def __init__(self, n: int) -> None:
        if n <= 0:
            raise ValueError("slots must be positive")
        self.n = n
        self._free = n
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def acquire(self, priority: int) -> None:
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._order), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot just as it was cancelled: pass it on
            raise

    def release(self) -> None:
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():  # a cancelled waiter is skipped
                fut.set_result(None)
                return
        self._free += 1
