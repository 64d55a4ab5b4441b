"""Write an image: files in, chunks out (hash → dedup check → compress → upload), manifest last.

Pipeline, per chunk, with bounded memory::

    write() cuts chunk ─► [wait for an in-flight slot]  ◄── back-pressure on the producer
                          address (thread pool) ─► in store? ─ yes ─► skip (dedup)
                                                             └ no ──► compress+encrypt
                                                                      (thread pool) ─► put

``max_inflight`` chunks may be between "cut" and "stored"; the producer's ``write`` waits for a
slot beyond that, so a fast source (CRIU's pipe, a tmpfs directory) cannot outrun the store.
Nothing is visible until :meth:`ImageWriter.commit` writes the manifest, with if-absent
semantics, after every chunk it refers to is durable: ``store.sync`` of all of them, in one
batch (the file store fsyncs there rather than on every put). On a ``file://`` store a chunk
found already stored is decoded and checked before it is trusted, since a writer that crashed
before its sync, followed by a power loss, can leave a short chunk file behind; a damaged one is
written again (docs/image-format.md, "Durability"). Leaving the ``async with`` block with an
exception, or without committing, writes no manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

from spotguard.contracts import check_job_name, chunk_key, new_image_id
from spotguard.errors import (
    ImageCorrupt,
    ImageError,
    ObjectNotFound,
    PreconditionFailed,
    SpotguardError,
)
from spotguard.image.buffers import BufferPool, Lease
from spotguard.image.codec import ChunkCodec, Cipher, compress_bound
from spotguard.image.history import next_sequence
from spotguard.image.keys import ImageKeys
from spotguard.image.manifest import (
    WRITING_MARKER,
    ChunkRef,
    Codec,
    Encryption,
    FileEntry,
    ImageRef,
    Manifest,
    Totals,
)
from spotguard.image.settings import ImageSettings
from spotguard.image.stats import ProgressFn, TransferStats
from spotguard.store import ImageStore, RetryPolicy, get_into, open_store
from spotguard.timeline import Timeline

log = logging.getLogger(__name__)

T = TypeVar("T")

MARKER_REFRESH_S = 300.0


def store_for(url: str, settings: ImageSettings) -> ImageStore:
    """Open the store at ``url`` with the transfer settings applied."""
    return open_store(
        url,
        io_workers=settings.io_workers,
        retry=RetryPolicy(attempts=settings.retries, timeout=settings.store_timeout),
        sse=settings.sse or None,
        sse_kms_key_id=settings.sse_kms_key_id or None,
    )


def _fill(f: Any, view: memoryview) -> int:
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


class FileSink:
    """One file being written into an image: ``await write(data)`` then ``await close()``.

    Written bytes are copied once, into a pooled chunk buffer; ``bytes`` of whole chunks (a
    reader handing over full chunks) are used as they are.
    """

    def __init__(self, writer: ImageWriter, name: str, mode: int) -> None:
        FileEntry(name=name, size=0)  # validates the name early
        self.name = name
        self.mode = mode & 0o777  # permission bits only (a reader refuses others)
        self.size = 0
        self.closed = False
        self._w = writer
        self._small = bytearray()  # the start of a chunk, until it outgrows SMALL_CHUNK
        self._lease: Lease | None = None  # the chunk being filled, once it is not small
        self._fill = 0
        self._refs: list[asyncio.Task[ChunkRef]] = []

    def _raise_if_closed(self) -> None:
        if self.closed:
            raise ImageError(f"file {self.name!r} of the image is already closed")

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``; full chunks go to the pipeline (this waits when it is full)."""
        self._raise_if_closed()
        self._w._raise_if_failed()
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
                await self._w._submit(self, view[off : off + cs])
            view = view[whole:]
        while len(view):
            if self._lease is None and len(self._small) + len(view) <= SMALL_CHUNK:
                self._small += view
                if len(self._small) == cs:
                    await self._flush()
                return
            if self._lease is None:
                self._lease = await self._w._acquire_input()
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
        self._w._raise_if_failed()
        n = len(data)
        if self._small or self._lease is not None or not SMALL_CHUNK <= n <= self._w.chunk_size:
            return False
        self.size += n
        await self._w._submit(self, data, owner)
        return True

    async def _flush(self) -> None:
        """Send the chunk collected so far."""
        if self._lease is not None:
            lease, fill = self._lease, self._fill
            self._lease, self._fill = None, 0
            await self._w._submit(self, lease.view[:fill], lease)
        elif self._small:
            chunk = bytes(self._small)
            self._small = bytearray()
            await self._w._submit(self, chunk)

    async def close(self) -> None:
        """Send the last partial chunk. The file's chunks finish in the background."""
        if self.closed:
            return
        await self._flush()
        self.closed = True

    def _drop(self) -> None:
        """The write is abandoned: give back a half-filled buffer."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def entry(self) -> FileEntry:
        return FileEntry(
            name=self.name, size=self.size, mode=self.mode, chunks=[t.result() for t in self._refs]
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
        self._by_addr: dict[str, asyncio.Task[ChunkRef]] = {}
        self._preexisting: set[str] = set()
        self._sem = asyncio.Semaphore(self.max_inflight)
        # Pooled chunk buffers (see spotguard.image.buffers): at most `max_inflight` exist;
        # plaintext (input) buffers are capped below that so compressed output always has one.
        self.buffer_limit = max(3, self.max_inflight)
        self.input_limit = max(
            1, min(self.workers + 2, self.buffer_limit - max(1, self.buffer_limit // 4))
        )
        self.buffers = BufferPool(compress_bound(self.chunk_size), self.buffer_limit)
        self._input_slots = asyncio.Semaphore(self.input_limit)
        self._pool: ThreadPoolExecutor | None = None
        self._error: BaseException | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._sequence: asyncio.Task[int] | None = None
        self._manifest: Manifest | None = None
        self._entered = False

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
        # If this fails, gc removes the stale marker after the grace period.
        with contextlib.suppress(SpotguardError):
            await asyncio.shield(self.store.delete(f"{self.ref.prefix}/{WRITING_MARKER}"))

    async def _shutdown(self) -> None:
        for task in (self._heartbeat, self._sequence):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for f in self._files:
            f._drop()
        self.buffers.close()
        if self._own_store:
            await self.store.aclose()

    async def _put_marker(self) -> None:
        body = {"job": self.job, "image_id": self.image_id, "host": socket.gethostname()}
        body["started"] = datetime.fromtimestamp(self._t0, UTC).isoformat()
        await self.store.put(f"{self.ref.prefix}/{WRITING_MARKER}", json.dumps(body).encode())

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
                await self._read_pooled(f, sink)
        finally:
            await asyncio.to_thread(f.close)
        await sink.close()
        return FileEntry(name=sink.name, size=sink.size, mode=sink.mode)

    async def _acquire_input(self) -> Lease:
        """A pooled buffer for a chunk's plaintext; waits while `input_limit` are out."""
        await self._input_slots.acquire()
        try:
            buf = await self.buffers.acquire()
        except BaseException:
            self._input_slots.release()
            raise
        return Lease(self.buffers, buf, self._input_slots)

    async def _read_pooled(self, f: Any, sink: FileSink) -> None:
        """Read whole chunks straight into pooled buffers (``readinto``, no other copy); a
        buffer goes back to the pool once its chunk is compressed or found already stored."""
        cs = self.chunk_size
        while True:
            lease = await self._acquire_input()
            try:
                n = await asyncio.to_thread(_fill, f, lease.view[:cs])
            except BaseException:
                lease.release()
                raise
            if not n:
                lease.release()
                return
            try:
                sink._raise_if_closed()
                self._raise_if_failed()
            except BaseException:
                lease.release()
                raise
            sink.size += n
            await self._submit(sink, lease.view[:n], lease)
            if n < cs:
                return

    # --- the pipeline -------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    async def _cpu(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _submit(
        self, sink: FileSink, plain: bytes | memoryview, lease: ChunkOwner | None = None
    ) -> None:
        try:
            await self._sem.acquire()
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if self._error is not None:
            self._sem.release()
            if lease is not None:
                lease.release()
            raise self._error
        task = asyncio.create_task(self._process(plain, lease))
        self._tasks.add(task)
        sink._refs.append(task)
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

    async def _process(self, plain: bytes | memoryview, lease: ChunkOwner | None) -> ChunkRef:
        size = len(plain)
        addr: str = await self._cpu(self.codec.address, plain)
        earlier = self._by_addr.get(addr)
        if earlier is not None:  # the same chunk twice in this image (zero pages, ...)
            if lease is not None:
                lease.release()
            ref = await asyncio.shield(earlier)
            self._count(size, 0, skipped=ref.stored_size)
            return ref
        me = asyncio.current_task()
        assert me is not None
        self._by_addr[addr] = me
        key = chunk_key(self.job, addr)
        if self.dedup:
            info = await self.store.stat(key)
            if info is not None and self.verify_stored and not await self._intact(key, addr, size):
                info = None  # damaged: written again below (an atomic replace)
            if info is not None:
                if lease is not None:
                    lease.release()
                self._preexisting.add(addr)
                self._count(size, 0, skipped=info.size)
                # stored no smaller than the plaintext: a raw frame (or zstd's raw blocks)
                raw = info.size >= size
                return ChunkRef(digest=addr, size=size, stored_size=info.size, raw=raw)
        if size < SMALL_CHUNK:
            blob, raw = await self._cpu(self.codec.pack, plain, addr)
            await self.store.put(key, blob)
            stored = len(blob)
        else:
            stored, raw = await self._encode_put(key, plain, addr, lease)
        self._count(size, stored, raw=raw)
        return ChunkRef(digest=addr, size=size, stored_size=stored, raw=raw)

    async def _intact(self, key: str, addr: str, size: int) -> bool:
        """Whether the stored chunk at ``key`` decodes to ``size`` bytes with address
        ``addr`` (read into a pooled buffer; the decoded plaintext is dropped)."""
        out = Lease(self.buffers, await self.buffers.acquire(), None)
        reuse = True
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
        except asyncio.CancelledError:
            reuse = False  # a thread may still be reading into or decoding from it
            raise
        finally:
            if reuse:
                out.release()
            else:
                out.discard()

    async def _encode_put(
        self, key: str, plain: bytes | memoryview, addr: str, lease: ChunkOwner | None
    ) -> tuple[int, bool]:
        """Compress (or frame raw) into a pooled buffer, free the plaintext, upload straight
        from the buffer. Returns the stored size and whether the frame is raw."""
        out = Lease(self.buffers, await self.buffers.acquire(), None)
        reuse = True
        try:
            data, raw = await self._cpu(self.codec.pack, plain, addr, out.view)
            if lease is not None:
                lease.release()  # compressed: the plaintext buffer can take the next chunk
            await self.store.put(key, data)
            n = len(data)
            if isinstance(data, memoryview):
                data.release()
            return n, raw
        except asyncio.CancelledError:
            reuse = False  # a thread may still be writing or sending it
            raise
        finally:
            if reuse:
                out.release()
            else:
                out.discard()

    def _count(
        self, size: int, stored: int, *, skipped: int | None = None, raw: bool = False
    ) -> None:
        st = self.stats
        st.bytes += size
        st.chunks += 1
        st.chunks_raw += raw
        st.stored_bytes += stored
        if skipped is not None:
            st.bytes_skipped += size
            st.stored_bytes_skipped += skipped
            st.chunks_skipped += 1
        st.retries = getattr(self.store, "retries", 0)
        if self.progress is not None:
            self.progress(st)

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
            await self._sync_chunks()
        with self.timeline.step("manifest"):
            await self._recheck_preexisting()
            assert self._sequence is not None
            manifest = self._build(meta or {}, await self._sequence)
            await self._write_manifest(manifest)
        self._manifest = manifest
        self.stats.finished = time.monotonic()
        try:
            await self.store.delete(f"{self.ref.prefix}/{WRITING_MARKER}")
        except SpotguardError as exc:
            log.warning("could not remove writing marker", extra={"error": str(exc)})
        log.info("image committed", extra={"image": self.url, **self.stats.to_json()})
        return manifest

    async def _sync_chunks(self) -> None:
        """Make every chunk the manifest will name durable, the deduplicated ones included (one
        left unsynced by a crashed writer becomes durable here, or the manifest is not
        written)."""
        keys = sorted(chunk_key(self.job, a) for a in self._by_addr)
        try:
            await self.store.sync(keys)
        except ObjectNotFound as exc:
            raise ImageError(
                f"a chunk of image {self.url} vanished before it was made durable "
                f"(concurrent gc?): {exc}; no manifest written"
            ) from exc

    async def _recheck_preexisting(self) -> None:
        """A chunk we skipped because it was in the store must still be there (a gc racing
        this writer must not leave the manifest pointing at nothing)."""
        addrs: Sequence[str] = sorted(self._preexisting)
        sem = asyncio.Semaphore(self.settings.io_workers)

        async def check(a: str) -> str | None:
            async with sem:
                return None if await self.store.exists(chunk_key(self.job, a)) else a

        missing = [a for a in await asyncio.gather(*(check(a) for a in addrs)) if a]
        if missing:
            raise ImageError(
                f"{len(missing)} deduplicated chunk(s) vanished during the write "
                f"(concurrent gc?), e.g. {missing[0]}; no manifest written"
            )

    def _build(self, meta: dict[str, Any], sequence: int) -> Manifest:
        """The manifest, authenticated with this writer's keys (see spotguard.image.keys)."""
        files = [f.entry() for f in self._files]
        unique: dict[str, int] = {}
        for f in files:
            for c in f.chunks:
                unique[c.digest] = c.stored_size
        totals = Totals(
            files=len(files),
            chunks=sum(len(f.chunks) for f in files),
            unique_chunks=len(unique),
            bytes=sum(f.size for f in files),
            stored_bytes=sum(unique.values()),
        )
        enc = Encryption(key_id=self.cipher.key_id) if self.cipher else None
        m = Manifest(
            job=self.job,
            image_id=self.image_id,
            sequence=sequence,
            codec=Codec(level=self.level, chunk_size=self.chunk_size),
            encryption=enc,
            files=files,
            totals=totals,
            meta=meta,
        )
        try:
            m.auth = self.keys.sign(m.unsigned(), encrypted=enc is not None)
        except (TypeError, ValueError) as exc:  # meta that JSON cannot carry
            raise ImageError(f"image {self.url}: manifest cannot be serialised: {exc}") from exc
        return m

    async def _write_manifest(self, manifest: Manifest) -> None:
        data = manifest.to_bytes()
        try:
            await self.store.put(self.ref.manifest_key, data, if_absent=True)
        except PreconditionFailed as exc:
            # A retried put whose first attempt landed looks like this: same bytes = success.
            existing = await self.store.get(self.ref.manifest_key)
            if existing != data:
                raise ImageError(
                    f"image {self.url} already exists; refusing to overwrite its manifest"
                ) from exc
