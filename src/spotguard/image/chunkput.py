"""The store side of one chunk of an image being written: found stored already (and checked,
on a file store), or stored — raw from its plaintext, or packed into a pooled buffer — and the
claims that let each address of an image be stored by one chunk only.

Why apart from :mod:`spotguard.image.writer`: the writer orders the pipeline (slots, the
deferral, the commit); this is what happens to one chunk once its address is known, and on a
node's freeze it is where each chunk's trips through the event loop are counted: a raw chunk
on a store that writes a list of buffers is looked up and, if absent, written by the very
thread that copied it in or addressed it (:meth:`ChunkStorer.store_now`), the image's claim
on its address taken there under a lock (:class:`Claims`), so it crosses the loop once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future
from typing import Any

from spotguard.errors import ImageCorrupt, ImageError, ObjectNotFound
from spotguard.image.buffers import BufferPool, Lease
from spotguard.image.codec import ChunkCodec
from spotguard.image.manifest import ChunkRef
from spotguard.image.rawframe import raw_frame_parts, raw_frame_size
from spotguard.image.sink import ChunkOwner, Early, Stored
from spotguard.image.stats import TransferStats
from spotguard.store import ImageStore, get_into
from spotguard.store.base import BlockingStore

log = logging.getLogger(__name__)


class ChunkStorer:
    """Stores chunks for one writer: its store, codec, output buffers, counters and worker
    pool (``cpu`` runs a blocking call there)."""

    def __init__(
        self,
        url: str,
        store: ImageStore,
        codec: ChunkCodec,
        buffers: BufferPool,
        stats: TransferStats,
        cpu: Callable[..., Awaitable[Any]],
    ) -> None:
        self.url = url
        self.store = store
        self.codec = codec
        self.buffers = buffers
        self.stats = stats
        self._cpu = cpu

    def writes_parts(self) -> bool:
        """A raw chunk can go to the store from its plaintext (no cipher; a store of this
        process's that writes a list of buffers, ``writev``). A store wrapped by something
        else (a test's gate, a proxy) takes chunks the general way."""
        store = self.store
        return self.codec.cipher is None and isinstance(store, BlockingStore) and store.writes_parts

    def store_now(self, key: str, plain: bytes | memoryview) -> Stored:
        """Look a raw chunk up at ``key`` and, where nothing is there, write its raw frame —
        blocking, in the calling thread (the one that addressed it), with the store's
        retries: what was found, or that it was written (a store that :meth:`writes_parts`)."""
        store = self.store
        assert isinstance(store, BlockingStore)
        t0 = time.perf_counter()
        info = store.put_parts_unless_stored_now(key, functools.partial(raw_frame_parts, plain))
        return Stored(None if info is None else info.size, time.perf_counter() - t0, len(plain))

    async def intact(self, key: str, addr: str, size: int) -> bool:
        """Whether the stored chunk at ``key`` decodes to ``size`` bytes with address
        ``addr`` (read into a pooled buffer; the decoded plaintext is dropped)."""
        async with self._pooled() as out:
            try:
                stored = await get_into(self.store, key, out.view)
                await self._cpu(self.codec.decode, stored, addr, size)
                return True
            except (ImageCorrupt, ObjectNotFound) as exc:
                log.warning(
                    "stored chunk is damaged or gone; writing it again",
                    extra={"image": self.url, "chunk": addr, "error": str(exc)},
                )
                return False

    async def encode_put(
        self,
        key: str,
        plain: bytes | memoryview,
        addr: str,
        lease: ChunkOwner | None,
        raw_saving: float | None = None,
        raw: bool | None = None,
    ) -> tuple[int, bool]:
        """Compress (or frame raw) into a pooled buffer, free the plaintext, upload straight
        from the buffer. Returns the stored size and whether the frame is raw (``raw``: as
        decided already, else by ``pack``)."""
        store = self.store
        if self.writes_parts() and isinstance(store, BlockingStore):
            if raw is None:
                t0 = time.perf_counter()
                raw = await self._cpu(self.codec.incompressible, plain, raw_saving)
                self.stats.add_step("pack", t0)
            if raw:  # stored from the plaintext itself, its headers between the blocks
                t0 = time.perf_counter()
                # the frame's ~1,000 views made in the store's thread, not the loop
                await store.put_parts(key, functools.partial(raw_frame_parts, plain))
                self.stats.add_step("put", t0)
                return raw_frame_size(len(plain)), True
        async with self._pooled() as out:
            t0 = time.perf_counter()
            data, raw = await self._cpu(self.codec.pack, plain, addr, out.view, raw, raw_saving)
            self.stats.add_step("pack", t0)
            if lease is not None:
                lease.release()  # compressed: the plaintext buffer can take the next chunk
            t0 = time.perf_counter()
            await self.store.put(key, data)
            self.stats.add_step("put", t0)
            n = len(data)
            if isinstance(data, memoryview):
                data.release()
            return n, raw

    @contextlib.asynccontextmanager
    async def _pooled(self) -> AsyncIterator[Lease]:
        """One of the writer's output buffers for a call: given back after it, or dropped
        when the call was cancelled (a worker thread may still be reading or writing it)."""
        t0 = time.perf_counter()
        out = Lease(self.buffers, await self.buffers.acquire(), None)
        self.stats.add_step("buffer", t0)
        try:
            yield out
        except asyncio.CancelledError:
            out.discard()
            raise
        except BaseException:
            out.release()
            raise
        out.release()


class Claims:
    """Each address of an image's chunks, claimed by the first chunk to reach it — in the
    event loop or in a worker thread — whose :class:`ChunkRef` the later chunks of the same
    address wait for (dedup within an image: zero pages, shared buffers).

    Why a lock and a :class:`concurrent.futures.Future`, not a dict of tasks: a raw chunk is
    claimed and stored by the thread that addressed it, before it has a task."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs: dict[str, Future[ChunkRef]] = {}

    def claim(self, addr: str) -> Future[ChunkRef] | None:
        """None when the caller is first to ``addr`` (it must :meth:`settle` it); else the
        first one's ChunkRef, to come."""
        with self._lock:
            earlier = self._refs.get(addr)
            if earlier is None:
                self._refs[addr] = Future()
            return earlier

    def settle(self, addr: str, outcome: ChunkRef | BaseException) -> None:
        """The claimant's outcome, for the chunks waiting on it (once; later calls do nothing)."""
        with self._lock:
            fut = self._refs[addr]
            if fut.done():
                return
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

    def abandon(self, early: Early) -> None:
        """A chunk its thread claimed and stored never reached the pipeline (its producer
        was cancelled): the chunks waiting on its address get its ChunkRef where the thread
        wrote it, else (found stored, never checked) fail rather than wait for ever."""
        stored = early.stored
        if stored is None:
            return
        addr = early.address
        if stored.found is None:
            n = stored.size
            ref = ChunkRef(digest=addr, size=n, stored_size=raw_frame_size(n), raw=True)
            self.settle(addr, ref)
        else:
            self.settle(addr, ImageError(f"chunk {addr} was abandoned before it was checked"))

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._refs))
