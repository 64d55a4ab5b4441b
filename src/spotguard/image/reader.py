"""Read an image: fetch → verify → decompress, pipelined, never handing out unverified bytes.

Opening an image authenticates its manifest against the host's keys first
(:mod:`spotguard.image.keys`; ``…/latest`` resolves by authenticated sequence and an older
genuine image is refused as a rollback, :mod:`spotguard.image.history`): every path that reads
an image — restore, ``images verify``, ``images pull`` — gets the same check, before any chunk.

Each chunk is fetched from the store (retried on transient errors by the store), decoded in a
thread pool (decrypt, decompress, re-hash) and compared with its address. A chunk that fails
is fetched once more (a flipped bit in transit or a torn cache); if it fails again the read
stops with :class:`~spotguard.errors.ImageCorrupt` naming the chunk and the files using it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

from spotguard.errors import ImageCorrupt, ImageError, ImageNotFound, ObjectNotFound
from spotguard.image import inplace
from spotguard.image.buffers import BufferPool, Lease, OwnedChunk, PrioritySlots
from spotguard.image.codec import ChunkCodec, Cipher, check_cipher
from spotguard.image.history import refuse_rollback, resolve
from spotguard.image.inplace import Then
from spotguard.image.keys import ImageKeys
from spotguard.image.manifest import (
    ChunkRef,
    ImageRef,
    Manifest,
    fetch_manifest,
    max_stored_chunk,
)
from spotguard.image.settings import ImageSettings
from spotguard.image.stats import ProgressFn, TransferStats
from spotguard.image.writer import store_for
from spotguard.names import chunk_key
from spotguard.store import ImageStore, get_into
from spotguard.store.base import BlockingStore, get_capped

T = TypeVar("T")
B = TypeVar("B", bytes, memoryview)

log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    """Result of checking every chunk of an image."""

    image_url: str
    chunks: int = 0
    bytes: int = 0
    stored_bytes: int = 0
    bad: list[dict[str, Any]] = field(default_factory=list)
    authenticated: str = ""  # "ed25519:<key id>", "hmac-sha256:<key id>" or "" (no keys)

    @property
    def ok(self) -> bool:
        return not self.bad

    def to_json(self) -> dict[str, Any]:
        return {
            "image": self.image_url,
            "ok": self.ok,
            "chunks": self.chunks,
            "bytes": self.bytes,
            "stored_bytes": self.stored_bytes,
            "authenticated": self.authenticated or None,
            "bad": self.bad,
        }


class ImageReader:
    """Reads one complete image. Use as ``async with ImageReader(url) as r:``.

    ``image`` is an image URL (``…/images/ID`` or ``…/images/latest``) or an :class:`ImageRef`
    (then ``store`` may pass an open store to share). ``keys`` (default: from ``settings``)
    decide which images are accepted; ``cipher`` overrides their encryption key.
    """

    def __init__(
        self,
        image: str | ImageRef,
        *,
        settings: ImageSettings,
        store: ImageStore | None = None,
        cipher: Cipher | None = None,
        keys: ImageKeys | None = None,
        workers: int | None = None,
        readahead: int | None = None,
    ) -> None:
        s = settings
        self.settings = s
        self.ref = image if isinstance(image, ImageRef) else ImageRef.parse(image)
        k = keys if keys is not None else ImageKeys.from_settings(s)
        self.keys = k.with_cipher(cipher) if cipher is not None else k
        self._own_store = store is None
        self.store: ImageStore = store or store_for(self.ref.store, s)
        self._cipher = self.keys.cipher
        self.authenticated = ""
        self.workers = workers or s.cpu_workers()
        self.readahead = readahead or s.max_inflight_chunks()
        self._manifest: Manifest | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._stored: BufferPool | None = None
        self._slots: PrioritySlots | None = None  # owned reads in progress, by priority
        self.codec = ChunkCodec()
        self.stats = TransferStats(phase="download")
        self.refetches = 0

    @property
    def url(self) -> str:
        return self.ref.url

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            raise ImageError("ImageReader is not open (use 'async with' or 'await open()')")
        return self._manifest

    async def open(self) -> ImageReader:
        """Find the manifest, authenticate it and check the key; no chunk is read yet.

        Raises :class:`~spotguard.errors.ImageUntrusted` (unsigned, altered, untrusted signer,
        rolled back), :class:`~spotguard.errors.DecryptionError`, :class:`ImageNotFound`."""
        latest = self.ref.image_id == "latest"
        self.ref = await resolve(self.store, self.ref, self.keys)
        try:
            m, raw = await fetch_manifest(self.store, self.ref.manifest_key, self.ref.url)
        except ObjectNotFound as exc:
            raise ImageNotFound(
                f"no complete image at {self.ref.url} (no manifest: never committed or deleted)"
            ) from exc
        check_cipher(m.encryption.key_id if m.encryption else None, self._cipher, self.url)
        self.authenticated = self.keys.authenticate(raw, m, self.ref.url)
        if m.job != self.ref.job or m.image_id != self.ref.image_id:
            raise ImageError(
                f"manifest at {self.ref.url} describes {m.job}/{m.image_id}, not this image"
            )
        if not latest:  # `latest` already is the newest authenticated sequence
            await refuse_rollback(self.store, m, self.keys, self.ref.url)
        if self.authenticated:
            log.info("image authenticated", extra={"image": self.url, "key": self.authenticated})
        self.codec = ChunkCodec(m.codec.level, self._cipher if m.encryption else None)
        self._manifest = m
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="image-cpu")
        self.stats.total = m.totals.bytes
        return self

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._own_store:
            await self.store.aclose()

    async def __aenter__(self) -> ImageReader:
        try:
            return await self.open()
        except BaseException:
            await self.aclose()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # --- chunks -----------------------------------------------------------------------------
    def _where(self, addr: str) -> str:
        names = [f.name for f in self.manifest.files if any(c.digest == addr for c in f.chunks)]
        return ", ".join(names[:3]) + (" …" if len(names) > 3 else "")

    async def _get_stored(self, ref: ChunkRef) -> bytes:
        """The stored bytes of a chunk, read with a cap (:func:`max_stored_chunk`): a larger
        object at its address (anyone who writes the store can put one) is refused as
        corrupt after that many bytes, never read whole."""
        return await self._capped(ref, lambda key, limit: get_capped(self.store, key, limit))

    async def _capped(self, ref: ChunkRef, read: Callable[[str, int], Awaitable[B]]) -> B:
        """``read(key, limit)`` of the chunk's stored bytes, refused as corrupt when missing
        or larger than ``limit`` (:func:`max_stored_chunk`) — never read further."""
        key = chunk_key(self.ref.job, ref.digest)
        limit = max_stored_chunk(ref.size)
        try:
            stored = await read(key, limit)
        except ObjectNotFound as exc:
            raise ImageCorrupt(
                f"chunk {ref.digest} is missing from the store", chunk=ref.digest
            ) from exc
        if len(stored) > limit:
            raise ImageCorrupt(
                f"chunk {ref.digest} is stored as more than {limit} bytes, more than "
                f"{ref.size} bytes can take: not read further",
                chunk=ref.digest,
            )
        return stored

    async def _fetch_decode(self, ref: ChunkRef) -> bytes:
        stored = await self._get_stored(ref)
        loop = asyncio.get_running_loop()
        plain: bytes = await loop.run_in_executor(
            self._pool, self.codec.decode, stored, ref.digest, ref.size
        )
        self.stats.stored_bytes += len(stored)
        return plain

    def fetch_window(self) -> int:
        """Chunks fetched at once by whole-image reads: enough requests in flight to hide store
        latency, few enough that buffers (two per chunk) stay within the memory bound."""
        return max(2, min(self.readahead, max(4, 2 * self.workers)))

    async def _fetch_decode_into(self, ref: ChunkRef, stored: Lease, plain: Lease) -> memoryview:
        key = chunk_key(self.ref.job, ref.digest)
        try:
            data = await get_into(self.store, key, stored.view)
        except ObjectNotFound as exc:
            raise ImageCorrupt(
                f"chunk {ref.digest} is missing from the store", chunk=ref.digest
            ) from exc
        self.stats.stored_bytes += len(data)
        loop = asyncio.get_running_loop()
        view: memoryview = await loop.run_in_executor(
            self._pool, self.codec.decode_into, data, ref.digest, ref.size, plain.view
        )
        return view

    async def read_chunk_into(self, ref: ChunkRef, stored: Lease, plain: Lease) -> memoryview:
        """Like :meth:`read_chunk`, reading into ``stored``'s buffer and decoding into
        ``plain``'s: returns the verified view of ``plain``."""
        return await self._checked(ref, lambda: self._fetch_decode_into(ref, stored, plain))

    async def _checked(self, ref: ChunkRef, fetch: Callable[[], Awaitable[T]]) -> T:
        """``fetch()`` the chunk; once more after a failed check (a torn read, a store
        hiccup), then :class:`ImageCorrupt` naming the files that hold it."""
        try:
            out = await fetch()
        except ImageCorrupt as first:
            self._refetch_warning(ref, first)
            try:
                out = await fetch()
            except ImageCorrupt as exc:
                raise self._corrupt(ref, exc) from exc
        self._counted(ref)
        return out

    def _refetch_warning(self, ref: ChunkRef, err: ImageCorrupt) -> None:
        self.refetches += 1
        log.warning(
            "chunk failed verification, fetching it again",
            # short: the error that follows a second failure names the whole digest
            extra={"image": self.url, "chunk": ref.digest[:12], "error": _why(err, ref)},
        )

    def _corrupt(self, ref: ChunkRef, exc: ImageCorrupt) -> ImageCorrupt:
        return ImageCorrupt(
            f"image {self.url}: chunk {ref.digest} (in {self._where(ref.digest)}) "
            f"is corrupt: {_why(exc, ref)}",
            chunk=ref.digest,
        )

    def _counted(self, ref: ChunkRef) -> None:
        self.stats.bytes += ref.size
        self.stats.chunks += 1
        self.stats.retries = getattr(self.store, "retries", 0)

    async def read_chunk(self, ref: ChunkRef) -> bytes:
        """The verified plaintext of one chunk (one refetch on a failed check)."""
        return await self._checked(ref, lambda: self._fetch_decode(ref))

    def iter_file(self, name: str) -> AsyncIterator[bytes]:
        """The file's verified bytes, chunk by chunk, in order; ``readahead`` chunks are
        fetched and decoded in parallel ahead of the consumer."""
        return self._windowed(name, lambda ref, _i: self.read_chunk(ref))

    async def _windowed(
        self,
        name: str,
        read: Callable[[ChunkRef, int], Coroutine[Any, Any, T]],
        drop: Callable[[T], None] | None = None,
    ) -> AsyncIterator[T]:
        """``read`` each chunk of file ``name`` (with its index in the file), ``readahead``
        at once, yielded in order; chunks read ahead and never yielded go to ``drop`` (to
        free what they hold)."""
        refs = enumerate(self.manifest.file(name).chunks)
        window: deque[asyncio.Task[T]] = deque()
        try:
            for i, ref in refs:
                window.append(asyncio.create_task(read(ref, i)))
                if len(window) >= self.readahead:
                    break
            while window:
                item = await window.popleft()
                nxt = next(refs, None)
                if nxt is not None:
                    window.append(asyncio.create_task(read(nxt[1], nxt[0])))
                yield item
        finally:
            for t in window:
                t.cancel()
            for r in await asyncio.gather(*window, return_exceptions=True):
                if drop is not None and not isinstance(r, BaseException):
                    drop(r)

    def _stored_buffers(self) -> BufferPool:
        """Reused buffers the owned path reads stored chunks into (a fresh ``bytes`` per chunk
        cost a page fault per 4 KiB, and its bytes could not be copied out without the GIL)."""
        if self._stored is None:
            size = max_stored_chunk(max(self.manifest.codec.chunk_size, 1))
            # As many as decode at once (fetches beyond wait for one), and a few for
            # remote stores' latency on small machines.
            self._stored = BufferPool(size, max(self.workers, min(self.readahead, 8)))
        return self._stored

    async def _fetch_decode_owned(
        self,
        ref: ChunkRef,
        priority: int = 0,
        buffers: BufferPool | None = None,
        then: Then | None = None,
    ) -> OwnedChunk:
        if buffers is None:
            out = OwnedChunk(ref.size)
        else:
            out = OwnedChunk.leased(buffers, await buffers.acquire(), ref.size)
        if ref.digest == self.codec.zero_address(ref.size):
            # All zero (the authenticated address says so): a fresh map already is.
            if not out.fresh or then is not None:
                try:
                    await asyncio.to_thread(inplace.zero, out, then)
                except BaseException:
                    out.abandon()
                    raise
            return out
        if self._slots is None:
            self._slots = PrioritySlots(max(2, self.workers))
        t0 = time.perf_counter()
        await self._slots.acquire(priority)
        self.stats.add_step("queue", t0)
        try:
            return await self._read_owned(ref, out, then)
        except BaseException:
            out.abandon()
            raise
        finally:
            self._slots.release()

    async def _read_owned(self, ref: ChunkRef, out: OwnedChunk, then: Then | None) -> OwnedChunk:
        if ref.raw and await self._read_raw_in_place(ref, out, then):
            return out
        pool = self._stored_buffers()
        t0 = time.perf_counter()
        lease = Lease(pool, await pool.acquire(), None)
        self.stats.add_step("buffer", t0)
        reuse = True
        try:
            t0 = time.perf_counter()
            if max_stored_chunk(ref.size) <= pool.size:
                stored = await self._get_into_capped(ref, lease.view)
            else:  # a chunk larger than the image's chunk size: read it on its own
                stored = memoryview(await self._get_stored(ref))
            self.stats.add_step("fetch", t0)
            t0 = time.perf_counter()
            then_s = await asyncio.get_running_loop().run_in_executor(
                self._pool, inplace.decode, self.codec, stored, ref, out, then
            )
            self.stats.add_seconds("decode", time.perf_counter() - t0 - then_s)
            if then is not None:
                self.stats.add_seconds("put", then_s)
            self.stats.stored_bytes += len(stored)
            stored.release()
        except BaseException as exc:
            reuse = not isinstance(exc, asyncio.CancelledError)  # else a thread may hold it
            raise  # (the caller closes ``out``)
        finally:
            if reuse:
                lease.release()
            else:
                lease.discard()
        return out

    async def _read_raw_in_place(self, ref: ChunkRef, out: OwnedChunk, then: Then | None) -> bool:
        """A raw chunk from a store that reads into a list of buffers: its blocks read
        straight into ``out`` (its headers aside), hashed as they land, and ``then`` applied
        to the verified bytes in the same thread (:mod:`.inplace`). One copy instead of three
        (read, copy out of the frame, hash). False when this store or chunk cannot (encrypted,
        or the object is not exactly the writer's raw layout): the caller reads it the general
        way, which decodes any frame."""
        store = self.store
        if self.codec.cipher is not None or not (
            isinstance(store, BlockingStore) and store.reads_parts
        ):
            return False
        t0 = time.perf_counter()
        key = chunk_key(self.ref.job, ref.digest)
        with memoryview(out.map) as whole:
            try:
                res = await inplace.read_raw(store, key, ref, whole, self.codec, then)
            except ObjectNotFound as exc:
                raise ImageCorrupt(
                    f"chunk {ref.digest} is missing from the store", chunk=ref.digest
                ) from exc
        self.stats.add_seconds("read_raw", time.perf_counter() - t0 - res.then_s)
        if then is not None:
            self.stats.add_seconds("put", res.then_s)
        if res.raw:
            self.stats.stored_bytes += res.stored
        return res.raw

    async def _get_into_capped(self, ref: ChunkRef, buf: memoryview) -> memoryview:
        """The stored bytes of a chunk read into ``buf``, with the cap of :meth:`_get_stored`."""
        return await self._capped(ref, lambda key, limit: get_into(self.store, key, buf[:limit]))

    async def read_chunk_owned(
        self,
        ref: ChunkRef,
        priority: int = 0,
        buffers: BufferPool | None = None,
        *,
        then: Then | None = None,
    ) -> OwnedChunk:
        """Like :meth:`read_chunk`, into an :class:`OwnedChunk` the caller must close.
        ``priority``: lower goes first when reads queue (the chunk's index in its file).
        ``buffers``: read into a reused buffer of this pool (:meth:`OwnedChunk.leased`: for a
        caller that copies the bytes out before closing, never one that hands them on by
        reference); its buffers must hold the image's chunk size. ``then``: called with the
        verified bytes (a view of exactly the chunk's size) before this returns, in the
        worker thread that read or decoded them (:mod:`.inplace`: no hop back through the
        event loop); its errors are raised as they are, and after a failed check it is
        called only for the bytes that pass the refetch."""
        return await self._checked(
            ref, lambda: self._fetch_decode_owned(ref, priority, buffers, then)
        )

    def iter_file_owned(self, name: str) -> AsyncIterator[OwnedChunk]:
        """Like :meth:`iter_file`, each chunk in its own :class:`OwnedChunk` that the consumer
        closes (it may hand the pages on by reference first: see ``OwnedChunk``)."""
        return self._windowed(name, self.read_chunk_owned, OwnedChunk.close)

    async def verify(self, progress: ProgressFn | None = None) -> VerifyReport:
        """Fetch and check every distinct chunk; collects every failure (does not stop)."""
        refs = list(self.manifest.chunk_refs().values())
        report = VerifyReport(self.url, authenticated=self.authenticated)
        sem = asyncio.Semaphore(self.readahead)

        async def one(ref: ChunkRef) -> None:
            async with sem:
                try:
                    await self.read_chunk(ref)
                except ImageCorrupt as exc:
                    report.bad.append(
                        {"chunk": ref.digest, "files": self._where(ref.digest), "error": str(exc)}
                    )
                    return
            report.chunks += 1
            report.bytes += ref.size
            report.stored_bytes += ref.stored_size
            if progress is not None:
                progress(self.stats)

        await asyncio.gather(*(one(r) for r in refs))
        return report


def chunk_plan(manifest: Manifest) -> dict[str, list[tuple[str, int, ChunkRef]]]:
    """address → every (file name, offset, ref) where that chunk's bytes go."""
    plan: dict[str, list[tuple[str, int, ChunkRef]]] = {}
    for f in manifest.files:
        off = 0
        for c in f.chunks:
            plan.setdefault(c.digest, []).append((f.name, off, c))
            off += c.size
    return plan


def _why(err: ImageCorrupt, ref: ChunkRef) -> str:
    """An error about a chunk without its leading ``chunk <digest>`` (the line names it)."""
    return str(err).removeprefix(f"chunk {ref.digest} ")
