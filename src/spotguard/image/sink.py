"""The files of an image being written: each :class:`FileSink` cuts what is written into
chunks and hands them to the writer's chunk pipeline.

Why a module of their own: cutting (a small-chunk path in plain ``bytes``, pooled buffers
for the rest, whole chunks taken without a copy) is the producer side and knows nothing of
stores, codecs or manifests; :mod:`spotguard.image.writer` owns the pipeline it feeds
(:class:`ChunkPipeline`) and :mod:`spotguard.image.commit` the manifest.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from spotguard.errors import ImageError
from spotguard.image.buffers import Held, Lease, Taking
from spotguard.image.manifest import ChunkRef, FileEntry


def fill(f: Any, view: memoryview) -> int:
    """Read into ``view`` until it is full or the file ends; the bytes read."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


SMALL_CHUNK = 1 << 20
"""Chunks below this size use plain ``bytes`` instead of pooled buffers (small CRIU files)."""


class ChunkOwner(Protocol):
    """Who gets a chunk's plaintext buffer back: once it is compressed or found stored
    (``release``: reuse it), or when its chunk was cancelled (``discard``: a worker thread may
    still read it). Called once, on the event loop; a :class:`Lease` is one."""

    def release(self) -> None: ...

    def discard(self) -> None: ...


@dataclass(frozen=True)
class Stored:
    """What the thread that addressed a chunk did with the store: ``found``, the size of the
    object already at its key (nothing written; the pipeline checks it before trusting it),
    or None: the chunk was written (its raw frame); ``seconds`` the store took."""

    found: int | None
    seconds: float
    #: the chunk's plaintext bytes
    size: int


@dataclass(frozen=True)
class Early:
    """A chunk's address (and whether it is stored raw, where that is decided with it)
    found in a worker thread, with the seconds it took; ``stored``: where that thread also
    looked it up and stored it (a raw chunk the image had not claimed yet), what it did."""

    address: str
    raw: bool | None
    seconds: float
    stored: Stored | None = None


class ChunkPipeline(Protocol):
    """What a :class:`FileSink` feeds: the chunk pipeline of an
    :class:`~spotguard.image.writer.ImageWriter` (hash, dedup, compress, upload)."""

    chunk_size: int

    def raise_if_failed(self) -> None:
        """Raise the first error of a chunk already in the pipeline, if any."""

    async def acquire_input(self) -> Lease:
        """A pooled buffer for one chunk's plaintext (waits while too many are out)."""

    async def submit_chunk(
        self,
        sink: FileSink,
        plain: bytes | memoryview,
        owner: ChunkOwner | None = None,
        held: Held | None = None,
        early: Early | None = None,
    ) -> None:
        """Hand one chunk of ``sink`` to the pipeline (waits for an in-flight slot); the
        chunk's task is appended to ``sink.refs``. ``held``: the pool ``owner`` is of, where
        the chunk may wait raw while a held image's job is frozen (``Deferral``); ``early``:
        its address, found by the producer (:meth:`address_now`)."""

    def hashes_now(self) -> bool:
        """Whether a chunk submitted now goes straight on (none waits raw): its producer may
        then find its address in its own thread."""

    def address_now(self, plain: bytes | memoryview, raw_saving: float | None) -> Early:
        """A chunk's address (blocking: in a worker thread); a raw chunk may be stored there
        too (:attr:`Early.stored`)."""

    def abandon(self, early: Early) -> None:
        """A chunk addressed by :meth:`address_now` that will never be submitted (thread-safe)."""


class _Handoff:
    """An :class:`Early` passed from the producer's thread to its coroutine. Where the
    coroutine was cancelled meanwhile (the thread runs on and its result is lost), the chunk
    its thread may have claimed and stored is abandoned (:meth:`ChunkPipeline.abandon`), so no
    other chunk of its address waits for it."""

    def __init__(self, pipeline: ChunkPipeline) -> None:
        self._w = pipeline
        self._lock = threading.Lock()
        self._early: Early | None = None
        self._dropped = False

    def give(self, early: Early) -> Early:
        """In the thread: hand ``early`` over (or abandon it, if it is no longer wanted)."""
        with self._lock:
            self._early = early
            dropped = self._dropped
        if dropped:
            self._w.abandon(early)
        return early

    def drop(self) -> None:
        """In the coroutine: the chunk will not be submitted."""
        with self._lock:
            self._dropped = True
            early = self._early
        if early is not None:
            self._w.abandon(early)


class FileSink:
    """One file being written into an image: ``await write(data)`` then ``await close()``.

    Written bytes are copied once, into a pooled chunk buffer; ``bytes`` of whole chunks (a
    reader handing over full chunks) are used as they are.
    """

    def __init__(self, pipeline: ChunkPipeline, name: str, mode: int) -> None:
        try:  # the name checked now, as a reader will check it: one line, not pydantic's
            FileEntry(name=name, size=0)
        except ValidationError as exc:
            why = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
            raise ImageError(f"the image cannot hold a file named {name!r}: {why}") from None
        self.name = name
        self.mode = mode & 0o777  # permission bits only (a reader refuses others)
        self.size = 0
        self.closed = False
        self._w = pipeline
        self._small = bytearray()  # the start of a chunk, until it outgrows SMALL_CHUNK
        self._lease: Lease | None = None  # the chunk being filled, once it is not small
        self._fill = 0
        self.refs: list[asyncio.Task[ChunkRef]] = []  # one per chunk, in order
        #: this file's threshold for storing a chunk raw (None: the writer's ``raw_saving``)
        self.raw_saving: float | None = None

    def _raise_if_closed(self) -> None:
        if self.closed:
            raise ImageError(f"file {self.name!r} of the image is already closed")

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``; full chunks go to the pipeline (this waits when it is full)."""
        self._raise_if_closed()
        self._w.raise_if_failed()
        view = memoryview(data).cast("B")
        n = len(view)
        if n == 0:
            return
        self.size += n
        cs = self._w.chunk_size
        if not self._small and self._lease is None and isinstance(data, bytes) and n >= cs:
            # Fast path (whole chunks as bytes): no copy, the views keep `data` alive.
            whole = n - n % cs
            for off in range(0, whole, cs):
                await self._w.submit_chunk(self, view[off : off + cs])
            view = view[whole:]
        while len(view):
            if self._lease is None and len(self._small) + len(view) <= SMALL_CHUNK:
                self._small += view
                if len(self._small) == cs:
                    await self._flush()
                return
            if self._lease is None:
                self._lease = await self._w.acquire_input()
                self._fill = len(self._small)
                self._lease.view[: self._fill] = self._small
                self._small = bytearray()
            take = min(cs - self._fill, len(view))
            self._lease.view[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == cs:
                await self._flush()

    async def write_owned(self, data: memoryview, owner: ChunkOwner) -> bool:
        """Take ``data`` as one whole chunk without copying it, if it starts a chunk (nothing
        pending) and is at most a chunk; ``owner`` gets the buffer back once the chunk is
        compressed. Returns False, touching nothing, when it does not fit: write it then.

        For a producer that fills chunk-sized buffers itself (the stream capture reads CRIU's
        pipes straight into them): the copy into a chunk buffer would be the only other
        pass over the data on the event loop's thread."""
        self._raise_if_closed()
        self._w.raise_if_failed()
        n = len(data)
        if self._small or self._lease is not None or not SMALL_CHUNK <= n <= self._w.chunk_size:
            return False
        self.size += n
        await self._w.submit_chunk(self, data, owner, "owned")
        return True

    async def _flush(self) -> None:
        """Send the chunk collected so far."""
        if self._lease is not None:
            lease, fill = self._lease, self._fill
            self._lease, self._fill = None, 0
            await self._w.submit_chunk(self, lease.view[:fill], lease)
        elif self._small:
            chunk = bytes(self._small)
            self._small = bytearray()
            await self._w.submit_chunk(self, chunk)

    async def close(self) -> None:
        """Send the last partial chunk. The file's chunks finish in the background."""
        if self.closed:
            return
        await self._flush()
        self.closed = True

    async def read_from(self, f: Any) -> None:
        """Read the open binary file ``f`` to its end as whole chunks straight into pooled
        buffers (``readinto``, no other copy); a buffer goes back to the pool once its chunk
        is compressed or found already stored."""
        cs = self._w.chunk_size
        while True:
            lease = await self._w.acquire_input()
            try:
                n = await asyncio.to_thread(fill, f, lease.view[:cs])
            except BaseException:
                lease.release()
                raise
            if not n:
                lease.release()
                return
            try:
                self._raise_if_closed()
                self._w.raise_if_failed()
            except BaseException:
                lease.release()
                raise
            self.size += n
            await self._w.submit_chunk(self, lease.view[:n], lease)
            if n < cs:
                return

    async def produce(self, size: int, fill: Callable[[int, memoryview], None]) -> None:
        """Write ``size`` bytes that ``fill(offset, view)`` puts straight into each pooled
        chunk buffer (in a worker thread; no other copy), then close the file. For bytes a
        producer copies in itself, such as another process's memory (:mod:`spotguard.
        checkpoint.gpupages`)."""
        await self._produce(size, fill, self._w.acquire_input, "input")

    async def produce_owned(
        self, size: int, fill: Callable[[int, memoryview], None], pool: Taking
    ) -> None:
        """:meth:`produce` into buffers of a producer's own pool of chunk-sized buffers
        (``pool.take()`` blocks, so it runs in a thread): the stream capture's pieces,
        faulted in before a leave-running freeze (``prefault_hold``), so the copy into them
        waits for no fresh page, and held as the capture's are (``owned``)."""

        async def take() -> Lease:
            return Lease(pool, await asyncio.to_thread(pool.take), None)

        await self._produce(size, fill, take, "owned")

    async def _produce(
        self,
        size: int,
        fill: Callable[[int, memoryview], None],
        lease_one: Callable[[], Awaitable[Lease]],
        held: Held,
    ) -> None:
        if self.size or self._small or self._lease is not None:
            raise ImageError(f"file {self.name!r}: produce() on a file already written to")
        cs = self._w.chunk_size
        for off in range(0, size, cs):
            n = min(cs, size - off)
            lease = await lease_one()
            early: Early | None = None
            hand = _Handoff(self._w)
            try:
                if self._w.hashes_now():  # addressed (and stored) in the thread that filled it
                    early = await asyncio.to_thread(
                        self._fill_and_address, fill, off, lease, n, hand
                    )
                else:  # a held image's job is frozen: its cores are the copy's
                    await asyncio.to_thread(fill, off, lease.view[:n])
                self._raise_if_closed()
                self._w.raise_if_failed()
            except asyncio.CancelledError:
                lease.discard()  # its thread may still be filling the buffer
                hand.drop()
                raise
            except BaseException:
                lease.release()
                hand.drop()
                raise
            self.size += n
            await self._w.submit_chunk(self, lease.view[:n], lease, held, early)
        await self.close()

    def _fill_and_address(
        self,
        fill: Callable[[int, memoryview], None],
        off: int,
        lease: Lease,
        n: int,
        hand: _Handoff,
    ) -> Early:
        with lease.view[:n] as view:  # made and released in the thread that uses it
            fill(off, view)
            return hand.give(self._w.address_now(view, self.raw_saving))

    def drop(self) -> None:
        """The write is abandoned: give back a half-filled buffer."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def entry(self) -> FileEntry:
        return FileEntry(
            name=self.name, size=self.size, mode=self.mode, chunks=[t.result() for t in self.refs]
        )
