"""A held leave-running image's chunks wait raw until the job runs again (``Deferral``).

While the gate is closed, the chunks the hold made room for are neither hashed nor stored;
every other chunk — beyond the hold, or holding a buffer the hold did not grow — goes through
at once, so the producers never run out of buffers while chunks wait (an image larger than
the hold still streams). Once the gate opens, every chunk is stored in its file's order and
the image reads back byte for byte. A real writer, a real file store.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from spotguard.image import ImageSettings, ImageWriter, pull_image
from spotguard.image.buffers import Deferral, Lease
from spotguard.image.writer import ImageWriter as _Writer
from spotguard.stream.pipes import PiecePool

CHUNK = 1 << 20
SETTINGS = ImageSettings(chunk_size=CHUNK, workers=2, max_inflight_mb=2)


def _stored_chunks(store: Path) -> int:
    return sum(1 for p in store.rglob("*") if p.is_file() and "/chunks/" in p.as_posix())


async def _owned(w: _Writer, pool: PiecePool, name: str, data: bytes) -> None:
    """``data`` written as owned pieces of ``pool`` (what the stream capture hands over)."""
    f = w.file(name)
    for off in range(0, len(data), CHUNK):
        buf = await asyncio.to_thread(pool.take)  # waits, as a capture reader does
        piece = data[off : off + CHUNK]
        buf[: len(piece)] = piece
        lease = Lease(pool, buf, None)
        assert await f.write_owned(lease.view[: len(piece)], lease)
    await f.close()


def test_deferral_lets_a_chunk_wait_only_while_closed_and_within_its_credits() -> None:
    d = Deferral()
    d.grant(owned=2, input_=1)
    assert d.take("owned") is None, "open: nothing waits"
    d.close()
    assert d.take(None) is None, "a chunk the hold did not make room for never waits"
    gates = [d.take("owned"), d.take("owned"), d.take("owned")]
    assert gates[0] is not None and gates[1] is not None and gates[2] is None
    assert d.take("input") is not None and d.take("input") is None
    assert d.chunks == 3
    d.open()
    assert gates[0].is_set()


async def test_held_chunks_are_stored_only_once_the_gate_opens(tmp_path: Path) -> None:
    store = tmp_path / "store"
    data = os.urandom(6 * CHUNK)
    held = 8
    pool = PiecePool(CHUNK, 3 + held)  # the capture's pieces: its usual bound + the hold
    async with ImageWriter(str(store), "held", settings=SETTINGS) as w:
        w.hold(held * CHUNK, 0)
        w.deferral.close()
        await asyncio.wait_for(_owned(w, pool, "pages.img", data), 20)
        await asyncio.sleep(0.3)  # the pipeline's threads would have stored them by now
        assert _stored_chunks(store) == 0, "a held chunk was stored while the job was frozen"
        assert w.stats.bytes == 0, "a held chunk was hashed while the job was frozen"
        w.deferral.open()
        m = await asyncio.wait_for(w.commit(), 20)
    assert w.stats.chunks_deferred == 6
    assert len(m.file("pages.img").chunks) == 6
    pulled = await pull_image(w.url, tmp_path / "dest", settings=SETTINGS)
    assert (pulled.dest / "pages.img").read_bytes() == data


async def test_an_image_larger_than_the_hold_goes_on_streaming_while_closed(
    tmp_path: Path,
) -> None:
    """Chunks beyond the hold are stored at once: the capture's pieces never all wait, so a
    dump larger than the hold cannot stall on a closed gate."""
    store = tmp_path / "store"
    held = 3
    data = os.urandom(12 * CHUNK)
    small = b"small file " * 1000  # copied into the writer's own buffers: never waits
    pool = PiecePool(CHUNK, 3 + held)
    async with ImageWriter(str(store), "over", settings=SETTINGS) as w:
        w.hold(held * CHUNK, 0)
        w.deferral.close()
        await asyncio.wait_for(_owned(w, pool, "pages.img", data), 20)  # no deadlock
        f = w.file("core.img")
        await f.write(small)
        await f.close()
        await asyncio.sleep(0.3)
        assert _stored_chunks(store) >= 12 - held, "chunks beyond the hold must not wait"
        w.deferral.open()
        m = await asyncio.wait_for(w.commit(), 20)
    assert w.stats.chunks_deferred == held
    assert [f.name for f in m.files] == ["pages.img", "core.img"]
    pulled = await pull_image(w.url, tmp_path / "dest", settings=SETTINGS)
    assert (pulled.dest / "pages.img").read_bytes() == data
    assert (pulled.dest / "core.img").read_bytes() == small


async def test_a_write_abandoned_with_chunks_waiting_gives_every_buffer_back(
    tmp_path: Path,
) -> None:
    """The freeze fails after the drain (the job runs again, the image is given up): the
    waiting chunks are cancelled, never stored, and their pieces leave the pool."""
    store = tmp_path / "store"
    pool = PiecePool(CHUNK, 8)
    w = ImageWriter(str(store), "abandoned", settings=SETTINGS)
    await w.__aenter__()
    try:
        w.hold(5 * CHUNK, 0)
        w.deferral.close()
        await asyncio.wait_for(_owned(w, pool, "pages.img", os.urandom(4 * CHUNK)), 20)
        assert pool.out == 4
    finally:
        await w.__aexit__(RuntimeError, RuntimeError("freeze failed"), None)
    assert pool.out == 0, "a waiting chunk kept its piece"
    assert _stored_chunks(store) == 0
    assert not list(store.rglob("manifest*")), "an abandoned image left a manifest"


async def test_a_producers_chunks_are_addressed_in_its_thread_unless_they_wait(
    tmp_path: Path,
) -> None:
    """Memory a producer copies in (``produce_owned``: a freeze's copy beside CRIU) has each
    chunk's address found in the thread that copied it, with no trip to the pipeline's pool
    — except while a held image's job is frozen: then nothing is hashed until the gate
    opens, and the pipeline addresses those chunks itself."""
    import threading

    store = tmp_path / "store"
    data = os.urandom(4 * CHUNK)
    pool = PiecePool(CHUNK, 3 + 8)
    where: list[str] = []

    def fill(off: int, view: memoryview) -> None:
        view[:] = data[off : off + len(view)]

    async with ImageWriter(str(store), "early", settings=SETTINGS) as w:
        real = w.address_now

        def seen(plain: bytes | memoryview, raw_saving: float | None) -> object:
            where.append(threading.current_thread().name)
            return real(plain, raw_saving)

        w.address_now = seen  # type: ignore[assignment,method-assign]
        w.hold(8 * CHUNK, 0)
        w.deferral.close()
        await asyncio.wait_for(w.file("held.img").produce_owned(len(data), fill, pool), 20)
        await asyncio.sleep(0.3)
        assert where == [] and w.stats.bytes == 0, "hashed while the job was frozen"
        w.deferral.open()
        for _ in range(200):  # the held chunks go on: addressed by the pipeline
            if len(where) == 4:
                break
            await asyncio.sleep(0.05)
        await asyncio.wait_for(w.file("open.img").produce_owned(len(data), fill, pool), 20)
        m = await asyncio.wait_for(w.commit(), 20)
    assert len(where) == 8
    assert all(n.startswith("image-cpu") for n in where[:4])  # the held ones, by the pipeline
    assert not any(n.startswith("image-cpu") for n in where[4:])  # the producer's own thread
    assert m.file("held.img").chunks == m.file("open.img").chunks  # same bytes, same chunks
    pulled = await pull_image(w.url, tmp_path / "dest", settings=SETTINGS)
    assert (pulled.dest / "open.img").read_bytes() == data
