"""A freeze's raw chunk is looked up and stored in the thread that addressed it.

On a store that writes a list of buffers (the file store), a chunk that is stored raw needs
no worker of the pipeline: the thread that copied it in (a producer's) or hashed it (the
pipeline's) also asks the store whether it is there and writes it if not — with the store's
own error mapping and retries, and once per address within an image. A real writer, a real
file store.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from spotguard.image import ImageSettings, ImageWriter, pull_image
from spotguard.image.manifest import Manifest
from spotguard.retry import RetryPolicy
from spotguard.store.base import Data
from spotguard.store.file import FileStore

CHUNK = 1 << 20
SETTINGS = ImageSettings(chunk_size=CHUNK, workers=2, max_inflight_mb=4)


class WatchedStore(FileStore):
    """A file store that records which thread wrote each chunk, and fails the first
    ``fail`` chunk writes with a transient error (``EIO``)."""

    def __init__(self, root: Path, fail: int = 0) -> None:
        super().__init__(root, retry=RetryPolicy(attempts=3, initial=0.01, jitter=0.0))
        self.fail = fail
        self.lock = threading.Lock()
        self.writes: list[tuple[str, str]] = []  # (key, thread name)

    def _put_parts(self, key: str, parts: Sequence[Data], if_absent: bool) -> None:
        if "/chunks/" in key:
            with self.lock:
                self.writes.append((key, threading.current_thread().name))
                failing = self.fail > 0
                self.fail -= 1
            if failing:
                raise OSError(errno.EIO, "a transient failure")
        super()._put_parts(key, parts, if_absent)


async def _produce(w: ImageWriter, name: str, data: bytes, fills: list[str]) -> None:
    def fill(off: int, view: memoryview) -> None:
        fills.append(threading.current_thread().name)
        view[:] = data[off : off + len(view)]

    await asyncio.wait_for(w.file(name).produce(len(data), fill), 30)


async def _image(store: FileStore, data: bytes, fills: list[str]) -> tuple[ImageWriter, Manifest]:
    """One image of ``data`` produced as ``pages.img``, committed."""
    async with ImageWriter(store, "onetrip", settings=SETTINGS) as w:
        await _produce(w, "pages.img", data, fills)
        m = await asyncio.wait_for(w.commit(), 30)
    return w, m


async def test_a_producers_raw_chunk_is_stored_in_the_thread_that_copied_it(
    tmp_path: Path,
) -> None:
    """Every raw chunk a producer copies in is written by the thread that copied it — not a
    store worker — and the image reads back byte for byte."""
    store = WatchedStore(tmp_path / "store")
    data = os.urandom(4 * CHUNK)
    fills: list[str] = []
    w, m = await _image(store, data, fills)
    assert len(store.writes) == 4
    assert all(c.raw for c in m.file("pages.img").chunks)
    writers = {t for _, t in store.writes}
    assert not any(t.startswith("store-io") for t in writers), writers
    assert writers <= set(fills)
    pulled = await pull_image(w.url, tmp_path / "dest", settings=SETTINGS)
    assert (pulled.dest / "pages.img").read_bytes() == data


async def test_a_chunk_hashed_by_the_pipeline_is_stored_by_that_worker(tmp_path: Path) -> None:
    """A raw chunk written as bytes (hashed by the pipeline's worker) is stored by the same
    worker: one trip from the event loop per chunk, not two."""
    store = WatchedStore(tmp_path / "store")
    data = os.urandom(3 * CHUNK)
    async with ImageWriter(store, "onetrip", settings=SETTINGS) as w:
        f = w.file("bytes.img")
        await f.write(data)
        await f.close()
        await asyncio.wait_for(w.commit(), 30)
    assert len(store.writes) == 3
    assert all(t.startswith("image-cpu") for _, t in store.writes), store.writes
    pulled = await pull_image(w.url, tmp_path / "dest", settings=SETTINGS)
    assert (pulled.dest / "bytes.img").read_bytes() == data


async def test_a_transient_failure_in_the_producers_thread_is_retried_there(
    tmp_path: Path,
) -> None:
    """The first write fails with a transient error: retried with the store's policy in the
    same thread; the image commits and reads back whole, the retry counted."""
    store = WatchedStore(tmp_path / "store", fail=1)
    data = os.urandom(2 * CHUNK)
    fills: list[str] = []
    w, _ = await _image(store, data, fills)
    assert store.retries == 1
    assert len(store.writes) == 3  # one failed, then two stored
    writers = {t for _, t in store.writes}
    assert writers <= set(fills), writers  # the retry too, in the producer's thread
    pulled = await pull_image(w.url, tmp_path / "dest", settings=SETTINGS)
    assert (pulled.dest / "pages.img").read_bytes() == data


async def test_the_same_raw_chunk_produced_twice_at_once_is_written_once(tmp_path: Path) -> None:
    """Two files with the same bytes produced at the same time: each address is written
    once (the other chunk finds it claimed and waits for it), both files read back."""
    store = WatchedStore(tmp_path / "store")
    data = os.urandom(4 * CHUNK)
    fills: list[str] = []
    async with ImageWriter(store, "onetrip", settings=SETTINGS) as w:
        await asyncio.gather(_produce(w, "a.img", data, fills), _produce(w, "b.img", data, fills))
        m = await asyncio.wait_for(w.commit(), 30)
    keys = [k for k, _ in store.writes]
    assert len(keys) == len(set(keys)) == 4
    assert m.file("a.img").chunks == m.file("b.img").chunks
    pulled = await pull_image(w.url, tmp_path / "dest", settings=SETTINGS)
    assert (pulled.dest / "a.img").read_bytes() == (pulled.dest / "b.img").read_bytes() == data


async def test_a_store_error_in_the_producers_thread_fails_the_image(tmp_path: Path) -> None:
    """A write that keeps failing: the image is not committed, the error is the store's
    (typed, retryable), and no manifest is written."""
    from spotguard.errors import StoreUnavailable

    store = WatchedStore(tmp_path / "store", fail=100)
    data = os.urandom(2 * CHUNK)
    fills: list[str] = []
    err: BaseException | None = None
    try:
        async with ImageWriter(store, "onetrip", settings=SETTINGS) as w:
            await _produce(w, "pages.img", data, fills)
            await asyncio.wait_for(w.commit(), 30)
    except StoreUnavailable as exc:
        err = exc
    assert err is not None and err.retryable
    assert not list((tmp_path / "store").rglob("manifest*"))


async def test_a_chunk_stored_by_a_cancelled_producer_does_not_hold_up_its_twin(
    tmp_path: Path,
) -> None:
    """A producer is cancelled while its thread copies a chunk in; the thread goes on,
    claims and stores it. A later chunk of the same bytes (another file) takes that stored
    chunk rather than waiting for a task that will never run: the image commits and reads
    back."""
    store = WatchedStore(tmp_path / "store")
    data = os.urandom(CHUNK)
    entered, release = threading.Event(), threading.Event()

    def fill(off: int, view: memoryview) -> None:
        entered.set()
        release.wait(10)
        view[:] = data[off : off + len(view)]

    async with ImageWriter(store, "onetrip", settings=SETTINGS) as w:
        cancelled = w.file("cancelled.img")
        first = asyncio.create_task(cancelled.produce(len(data), fill))
        await asyncio.to_thread(entered.wait, 10)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        release.set()
        for _ in range(200):  # the thread stores the chunk after its producer is gone
            if store.writes:
                break
            await asyncio.sleep(0.02)
        twin = w.file("twin.img")
        await twin.write(data)
        await twin.close()
        await cancelled.close()  # nothing of it was submitted: an empty file
        m = await asyncio.wait_for(w.commit(), 20)
    assert len(store.writes) == 1
    assert m.file("twin.img").chunks[0].raw and m.file("cancelled.img").size == 0
    pulled = await pull_image(w.url, tmp_path / "dest", settings=SETTINGS)
    assert (pulled.dest / "twin.img").read_bytes() == data


async def test_a_later_image_finds_the_chunks_its_thread_looked_up_and_checks_them(
    tmp_path: Path,
) -> None:
    """The same memory in a second image: each chunk found by its thread's lookup, nothing
    written, counted as skipped — and each still decoded and checked before it is trusted
    (one cut short on disk is written again)."""
    store = WatchedStore(tmp_path / "store")
    data = os.urandom(3 * CHUNK)
    _, m1 = await _image(store, data, [])
    assert len(store.writes) == 3
    cut = tmp_path / "store" / "onetrip" / "chunks"
    victim = next(p for p in cut.rglob("*") if p.name == m1.file("pages.img").chunks[1].digest)
    victim.write_bytes(victim.read_bytes()[:1000])  # cut short, as a power loss could leave it
    w2, _ = await _image(store, data, [])
    assert len(store.writes) == 4  # only the damaged one written again
    assert w2.stats.chunks_skipped == 2 and w2.stats.bytes_skipped == 2 * CHUNK
    pulled = await pull_image(w2.url, tmp_path / "dest", settings=SETTINGS)
    assert (pulled.dest / "pages.img").read_bytes() == data
