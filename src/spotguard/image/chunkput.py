"""The store side of one chunk of an image being written: found stored already (and checked,
on a file store), or stored — raw from its plaintext, or packed into a pooled buffer.

Why apart from :mod:`spotguard.image.writer`: the writer orders the pipeline (slots, the
deferral, dedup within the image, the commit); this is what happens to one chunk once its
address is known, and on a node's freeze it is where each chunk's trips through the event
loop are counted: a raw chunk on a store that writes a list of buffers is looked up and, if
absent, written in one call in the store's thread (:meth:`ChunkStorer.stat_or_put_raw`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from spotguard.errors import ImageCorrupt, ObjectNotFound
from spotguard.image.buffers import BufferPool, Lease
from spotguard.image.codec import ChunkCodec
from spotguard.image.rawframe import raw_frame_parts, raw_frame_size
from spotguard.image.sink import ChunkOwner
from spotguard.image.stats import TransferStats
from spotguard.store import ImageStore, get_into
from spotguard.store.base import BlockingStore, ObjectInfo

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

    async def stat_or_put_raw(self, key: str, plain: bytes | memoryview) -> ObjectInfo | None:
        """What is stored at ``key`` (nothing written), or None once the raw frame of
        ``plain`` is written there — in one call in the store's thread (a raw chunk on a
        store that :meth:`writes_parts`)."""
        store = self.store
        assert isinstance(store, BlockingStore)
        t0 = time.perf_counter()
        info = await store.put_parts_unless_stored(key, functools.partial(raw_frame_parts, plain))
        self.stats.add_step("put" if info is None else "stat", t0)
        return info

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
