"""Write an image: files in, chunks out (hash → dedup check → compress → upload), manifest last.

Pipeline, per chunk, with bounded memory::

    write() cuts chunk ─► [wait for an in-flight slot]  ◄── back-pressure on the producer
                          address (thread pool) ─► in store? ─ yes ─► skip (dedup)
                                                             └ no ──► compress+encrypt
                                                                      (thread pool) ─► put

``max_inflight`` chunks may be between "cut" and "stored"; the producer's ``write`` waits for a
slot beyond that, so a fast source (CRIU's pipe, a tmpfs directory) cannot outrun the store.
On a store that writes a list of buffers (the file store), a chunk stored raw is looked up and
written by the thread that addressed it — the producer's own, where it copies memory in — so
it crosses the event loop once (:mod:`spotguard.image.chunkput`).
Nothing is visible until :meth:`ImageWriter.commit` writes the manifest, with if-absent
semantics, after every chunk it refers to is durable: ``store.sync`` of all of them, in one
batch (the file store fsyncs there rather than on every put). On a ``file://`` store a chunk
found already stored is decoded and checked before it is trusted, since a writer that crashed
before its sync, followed by a power loss, can leave a short chunk file behind; a damaged one is
written again (docs/image-format.md, "Durability"). Leaving the ``async with`` block with an
exception, or without committing, writes no manifest.

This module owns the pipeline and the writer's lifecycle; files are cut into chunks by
:mod:`spotguard.image.sink` (:class:`FileSink`, re-exported here) and the store side of the
commit (writing marker, durability, manifest) is :mod:`spotguard.image.commit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from spotguard.errors import ImageError, SpotguardError
from spotguard.image import commit
from spotguard.image.buffers import BufferPool, Deferral, Held, Lease
from spotguard.image.chunkput import ChunkStorer, Claims
from spotguard.image.codec import ChunkCodec, Cipher, compress_bound
from spotguard.image.history import next_sequence
from spotguard.image.keys import ImageKeys
from spotguard.image.manifest import ChunkRef, Codec, FileEntry, ImageRef, Manifest
from spotguard.image.rawframe import raw_frame_size
from spotguard.image.settings import ImageSettings
from spotguard.image.sink import SMALL_CHUNK, ChunkOwner, ChunkPipeline, Early, FileSink
from spotguard.image.stats import ProgressFn, TransferStats
from spotguard.names import check_job_name, chunk_key, new_image_id
from spotguard.store import ImageStore, RetryPolicy, open_store
from spotguard.timeline import Timeline

__all__ = ["SMALL_CHUNK", "ChunkOwner", "ChunkPipeline", "FileSink", "ImageWriter", "store_for"]

log = logging.getLogger(__name__)

T = TypeVar("T")

MARKER_REFRESH_S = 300.0
#: how long an abandoned write tries to remove its writing marker before leaving it to gc
ABANDON_CLEANUP_S = 5.0


def store_for(url: str, settings: ImageSettings) -> ImageStore:
    """Open the store at ``url`` with the transfer settings applied."""
    return open_store(
        url,
        io_workers=settings.io_workers,
        retry=RetryPolicy(attempts=settings.retries, timeout=settings.store_timeout),
        sse=settings.sse or None,
        sse_kms_key_id=settings.sse_kms_key_id or None,
    )


class ImageWriter:
    """Writes one image of ``job`` into ``store``; use as ``async with``.

    >>> async with ImageWriter("s3://bucket/images", "train-1") as w:   # doctest: +SKIP
    ...     await w.add_file("/staging/pages-1.img", "pages-1.img")
    ...     f = w.file("stream/core.img"); await f.write(b"..."); await f.close()
    ...     manifest = await w.commit({"timeline": [...]})
    """

    def __init__(
        self,
        store: ImageStore | str,
        job: str,
        image_id: str | None = None,
        *,
        chunk_size: int | None = None,
        level: int | None = None,
        workers: int | None = None,
        max_inflight: int | None = None,
        cipher: Cipher | None = None,
        keys: ImageKeys | None = None,
        dedup: bool | None = None,
        settings: ImageSettings,
        progress: ProgressFn | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        s = settings
        try:
            self.job = check_job_name(job)
        except ValueError as exc:
            raise ImageError(str(exc)) from exc
        self.settings = s
        self.image_id = image_id or new_image_id()
        self.chunk_size = chunk_size or s.chunk_size
        self.level = s.level if level is None else level
        self.workers = workers or s.cpu_workers()
        self.max_inflight = max_inflight or max(2, (s.max_inflight_mb << 20) // self.chunk_size)
        k = keys if keys is not None else ImageKeys.from_settings(s)
        self.keys = k.with_cipher(cipher) if cipher is not None else k
        self.cipher = self.keys.cipher
        self.dedup = s.dedup if dedup is None else dedup
        self.codec = ChunkCodec(self.level, self.cipher, raw_saving=s.raw_saving)
        self.progress = progress
        self.timeline = timeline if timeline is not None else Timeline()
        self.stats = TransferStats()
        self._store_arg = store
        self._own_store = isinstance(store, str)
        self.store: ImageStore = store_for(store, s) if isinstance(store, str) else store
        self.ref = ImageRef(self.store.url, self.job, self.image_id)
        # A file store's plain puts are durable only after sync: a chunk already there may be
        # a short file left by a crashed writer and a power loss, so it is checked first.
        self.verify_stored = self.store.url.startswith("file:")
        self._files: list[FileSink] = []
        self._names: set[str] = set()
        self._tasks: set[asyncio.Task[ChunkRef]] = set()
        self._claims = Claims()  # each address's first chunk (dedup within the image)
        self._preexisting: set[str] = set()
        self._sem = asyncio.Semaphore(self.max_inflight)
        # Pooled chunk buffers (see spotguard.image.buffers): at most `max_inflight` exist;
        # plaintext (input) buffers are capped below that so compressed output always has one.
        self.buffer_limit = max(3, self.max_inflight)
        self.input_limit = max(
            1, min(self.workers + 2, self.buffer_limit - max(1, self.buffer_limit // 4))
        )
        self.buffers = BufferPool(compress_bound(self.chunk_size), self.buffer_limit)
        self._storer = ChunkStorer(
            self.url, self.store, self.codec, self.buffers, self.stats, self._cpu
        )
        self._input_slots = asyncio.Semaphore(self.input_limit)
        self._pool: ThreadPoolExecutor | None = None
        self._error: BaseException | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._sequence: asyncio.Task[int] | None = None
        self._manifest: Manifest | None = None
        self._entered = False
        #: chunks of a held leave-running image kept raw until the job resumes (``hold``)
        self.deferral = Deferral()

    @property
    def url(self) -> str:
        """The image URL this writer commits to."""
        return self.ref.url

    # --- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> ImageWriter:
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="image-cpu")
        self._entered = True
        self._t0 = time.time()
        try:
            await self._put_marker()
        except BaseException:
            await self._shutdown()
            raise
        self._heartbeat = asyncio.create_task(self._refresh_marker())
        # The job's newest authenticated sequence, read while the chunks are written.
        self._sequence = asyncio.create_task(next_sequence(self.store, self.job, self.keys))
        log.info(
            "image write started",
            extra={"image": self.url, "chunk_size": self.chunk_size, "zstd_level": self.level},
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._manifest is None:
            await self._abort(exc)
        await self._shutdown()

    async def _abort(self, exc: BaseException | None) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        log.warning(
            "image write abandoned: no manifest written",
            extra={"image": self.url, "error": str(exc) if exc else "not committed"},
        )
        # Bounded: the caller may be a pause given up for a notice's exit, which waits for
        # it; a marker left (the store hung, or this failed) gc removes after its grace period.
        with contextlib.suppress(SpotguardError, TimeoutError):
            await asyncio.wait_for(
                commit.remove_writing_marker(self.store, self.ref), ABANDON_CLEANUP_S
            )

    async def _shutdown(self) -> None:
        for task in (self._heartbeat, self._sequence):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for f in self._files:
            f.drop()
        self.buffers.close()
        if self._own_store:
            await self.store.aclose()

    async def _put_marker(self) -> None:
        await commit.put_writing_marker(self.store, self.ref, self._t0)

    async def _refresh_marker(self) -> None:
        """Keep the writing marker young so a concurrent gc keeps our dedup'd chunks."""
        while True:
            await asyncio.sleep(MARKER_REFRESH_S)
            try:
                await self._put_marker()
            except SpotguardError as exc:
                log.warning("could not refresh writing marker", extra={"error": str(exc)})

    # --- adding data --------------------------------------------------------------------
    def file(self, name: str, mode: int = 0o644) -> FileSink:
        """A new file of the image (``name`` is a relative ``/``-separated path)."""
        if not self._entered:
            raise ImageError("ImageWriter must be used as 'async with'")
        if self._manifest is not None:
            raise ImageError(f"image {self.url} is already committed")
        if name in self._names:
            raise ImageError(f"file {name!r} is already in image {self.url}")
        sink = FileSink(self, name, mode)
        self._names.add(name)
        self._files.append(sink)
        return sink

    async def add_file(self, path: str | Path, name: str | None = None) -> FileEntry:
        """Stream the file at ``path`` into the image as ``name`` (default: its base name)."""
        p = Path(path)
        st = await asyncio.to_thread(p.stat)
        sink = self.file(name or p.name, mode=st.st_mode & 0o777)
        f = await asyncio.to_thread(p.open, "rb", buffering=0)
        try:
            if st.st_size < SMALL_CHUNK:  # small file: one read, one chunk
                await sink.write(await asyncio.to_thread(f.read))
            else:
                await sink.read_from(f)
        finally:
            await asyncio.to_thread(f.close)
        await sink.close()
        return FileEntry(name=sink.name, size=sink.size, mode=sink.mode)

    def hold(self, inflight_bytes: int, input_bytes: int) -> None:
        """Let ``inflight_bytes`` more of chunks be between "cut" and "stored", and
        ``input_bytes`` of them in plaintext buffers this writer hands out (:meth:`produce`'s):
        a leave-running image kept in host memory while the store catches up
        (:mod:`spotguard.checkpoint.hold`). May be called while chunks are in flight."""
        more = -(-max(0, inflight_bytes) // self.chunk_size)
        more_in = -(-max(0, input_bytes) // self.chunk_size)
        for _ in range(more):
            self._sem.release()
        for _ in range(more_in):
            self._input_slots.release()
        self.max_inflight += more
        self.input_limit += more_in
        self.deferral.grant(more - more_in, more_in)
        # The plaintext buffers handed out grow with the hold, so the pool does too, and its
        # share for compressed output stays what it was (see __init__): a held chunk waits for
        # one with its plaintext, already counted, rather than taking fresh memory for a copy.
        self.buffer_limit += more_in
        self.buffers.grow(more_in)

    async def acquire_input(self) -> Lease:
        """A pooled buffer for a chunk's plaintext; waits while `input_limit` are out."""
        await self._input_slots.acquire()
        try:
            buf = await self.buffers.acquire()
        except BaseException:
            self._input_slots.release()
            raise
        return Lease(self.buffers, buf, self._input_slots)

    # --- the pipeline -------------------------------------------------------------------
    def raise_if_failed(self) -> None:
        """Raise the first error of a chunk in the pipeline (the write is then lost)."""
        if self._error is not None:
            raise self._error

    async def _cpu(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def submit_chunk(
        self,
        sink: FileSink,
        plain: bytes | memoryview,
        lease: ChunkOwner | None = None,
        held: Held | None = None,
        early: Early | None = None,
    ) -> None:
        """Start one chunk of ``sink`` through the pipeline; waits for an in-flight slot.
        ``held``: which pool ``lease`` is of, where the chunk may wait raw (:attr:`deferral`);
        ``early``: its address, found by the producer (:meth:`address_now`)."""
        t0 = time.perf_counter()
        try:
            await self._sem.acquire()
            self.stats.add_step("slot", t0)
        except BaseException:
            if lease is not None:
                lease.release()
            if early is not None:
                self._claims.abandon(early)
            raise
        if self._error is not None:
            self._sem.release()
            if lease is not None:
                lease.release()
            if early is not None:
                self._claims.abandon(early)
            raise self._error
        gate = self.deferral.take(held)
        task = asyncio.create_task(self._process(plain, lease, sink.raw_saving, gate, early))
        self._tasks.add(task)
        sink.refs.append(task)
        task.add_done_callback(lambda t: self._done(t, lease))

    def _done(self, task: asyncio.Task[ChunkRef], lease: ChunkOwner | None) -> None:
        self._sem.release()
        if lease is not None:
            if task.cancelled():
                lease.discard()  # its thread may still be reading the buffer
            else:
                lease.release()
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()

    async def _process(
        self,
        plain: bytes | memoryview,
        lease: ChunkOwner | None,
        raw_saving: float | None = None,
        gate: asyncio.Event | None = None,
        early: Early | None = None,
    ) -> ChunkRef:
        size = len(plain)
        if gate is not None:
            t0 = time.perf_counter()
            await gate.wait()
            self.stats.add_step("deferred", t0)
        if early is None:
            t0 = time.perf_counter()
            early = await self._cpu(self.address_now, plain, raw_saving)
            self.stats.add_step("hash", t0)
        else:  # found by the producer's thread
            self.stats.add_seconds("hash", early.seconds)
        addr = early.address
        if early.stored is None:  # (a chunk stored by its thread claimed its address there)
            earlier = self._claims.claim(addr)
            if earlier is not None:  # the same chunk twice in this image (zero pages, ...)
                if lease is not None:
                    lease.release()
                ref = await asyncio.shield(asyncio.wrap_future(earlier))
                self._count(size, 0, skipped=ref.stored_size)
                return ref
        try:
            ref = await self._store(plain, lease, raw_saving, early)
        except BaseException as exc:
            self._claims.settle(addr, exc)
            raise
        self._claims.settle(addr, ref)
        return ref

    async def _store(
        self,
        plain: bytes | memoryview,
        lease: ChunkOwner | None,
        raw_saving: float | None,
        early: Early,
    ) -> ChunkRef:
        """Store the chunk this image claimed the address of (or find it stored, checked)."""
        size, addr, raw = len(plain), early.address, early.raw
        key = chunk_key(self.job, addr)
        put = self._storer
        found: int | None = None
        if early.stored is not None:  # looked up, and written if absent, by its own thread
            found = early.stored.found
            self.stats.add_seconds("put" if found is None else "stat", early.stored.seconds)
            if found is None:
                self._count(size, raw_frame_size(size), raw=True)
                return ChunkRef(digest=addr, size=size, stored_size=raw_frame_size(size), raw=True)
        elif self.dedup:
            t0 = time.perf_counter()
            info = await self.store.stat(key)
            self.stats.add_step("stat", t0)
            found = None if info is None else info.size
        if found is not None and self.verify_stored and not await put.intact(key, addr, size):
            found = None  # damaged: written again below (an atomic replace)
        if found is not None:
            if lease is not None:
                lease.release()
            self._preexisting.add(addr)
            self._count(size, 0, skipped=found)
            # stored no smaller than the plaintext: a raw frame (or zstd's raw blocks)
            return ChunkRef(digest=addr, size=size, stored_size=found, raw=found >= size)
        if size < SMALL_CHUNK:
            blob, raw = await self._cpu(self.codec.pack, plain, addr, None, None, raw_saving)
            await self.store.put(key, blob)
            stored = len(blob)
        else:
            stored, raw = await put.encode_put(key, plain, addr, lease, raw_saving, raw)
        self._count(size, stored, raw=raw)
        return ChunkRef(digest=addr, size=size, stored_size=stored, raw=raw)

    def hashes_now(self) -> bool:
        """Whether a chunk submitted now goes straight on (no held image's job is frozen):
        its producer may then find its address in its own thread (:meth:`address_now`)."""
        return self.deferral.is_open()

    def address_now(self, plain: bytes | memoryview, raw_saving: float | None) -> Early:
        """A chunk's address, and where its store writes parts whether it is stored raw —
        blocking, in a worker thread (the producer's, or the pipeline's). A raw chunk whose
        address this image has not claimed yet is claimed and stored here too (looked up
        first when dedup is on): no second trip through the event loop to a store thread."""
        t0 = time.perf_counter()
        raw: bool | None = None
        if self._storer.writes_parts() and len(plain) >= SMALL_CHUNK:
            addr, raw = self.codec.address_and_raw(plain, raw_saving)
        else:
            addr = self.codec.address_of(plain)
        seconds = time.perf_counter() - t0
        if not (raw and self.dedup) or self._claims.claim(addr) is not None:
            return Early(addr, raw, seconds)
        try:
            stored = self._storer.store_now(chunk_key(self.job, addr), plain)
        except BaseException as exc:
            self._claims.settle(addr, exc)
            raise
        return Early(addr, raw, seconds, stored)

    def abandon(self, early: Early) -> None:
        """A chunk addressed (and maybe claimed and stored) that will never be submitted."""
        self._claims.abandon(early)

    def _count(
        self, size: int, stored: int, *, skipped: int | None = None, raw: bool = False
    ) -> None:
        self.stats.count_chunk(size, stored, skipped=skipped, raw=raw)
        self.stats.chunks_deferred = self.deferral.chunks
        self.stats.retries = getattr(self.store, "retries", 0)
        self.stats.buffers_made = self.buffers.made
        if self.progress is not None:
            self.progress(self.stats)

    # --- commit -------------------------------------------------------------------------
    async def commit(self, meta: dict[str, Any] | None = None) -> Manifest:
        """Wait for every chunk, then write the manifest (last, if-absent). Returns it."""
        if self._manifest is not None:
            return self._manifest
        open_files = [f.name for f in self._files if not f.closed]
        if open_files:
            raise ImageError(f"close these files before commit: {', '.join(open_files)}")
        with self.timeline.step("chunks durable", chunks=len(self._tasks)):
            results = await asyncio.gather(*self._tasks, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            await commit.sync_chunks(self.store, self.ref, self._claims)
        with self.timeline.step("manifest"):
            io = self.settings.io_workers
            await commit.recheck_preexisting(self.store, self.ref, self._preexisting, io)
            assert self._sequence is not None
            manifest = commit.build_manifest(
                self.ref,
                [f.entry() for f in self._files],
                codec=Codec(level=self.level, chunk_size=self.chunk_size),
                keys=self.keys,
                meta=meta or {},
                sequence=await self._sequence,
            )
            await commit.write_manifest(self.store, self.ref, manifest)
        self._manifest = manifest
        self.stats.finished = time.monotonic()
        try:
            await commit.remove_writing_marker(self.store, self.ref)
        except SpotguardError as exc:
            log.warning("could not remove writing marker", extra={"error": str(exc)})
        log.info("image committed", extra={"image": self.url, **self.stats.to_json()})
        return manifest
