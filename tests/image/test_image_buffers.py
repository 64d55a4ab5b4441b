"""Pooled chunk buffers: bounded memory, reuse, and the codec working inside them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import zstandard
from blake3 import blake3

from spotguard.errors import ImageCorrupt
from spotguard.image import ImageSettings, ImageWriter, pull_image
from spotguard.image.buffers import BufferPool
from spotguard.image.codec import ChunkCodec, Cipher, compress_bound, generate_key

CHUNK = 2 << 20


async def test_pool_never_exceeds_its_limit_and_reuses() -> None:
    pool = BufferPool(CHUNK, limit=3)
    held = [await pool.acquire() for _ in range(3)]
    assert pool.allocated == 3 and pool.in_use == 3
    waiter = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.01)
    assert not waiter.done()  # a fourth buffer waits: the memory bound
    pool.release(held[0])
    again = await asyncio.wait_for(waiter, 5)
    assert again is held[0]  # reused, not a new allocation
    assert pool.made == 3 and pool.peak == 3
    for b in (again, *held[1:]):
        pool.release(b)
    pool.close()
    assert pool.allocated == 0


async def test_pool_cancelled_waiter_passes_its_turn_on() -> None:
    pool = BufferPool(CHUNK, limit=1)
    buf = await pool.acquire()
    first = asyncio.create_task(pool.acquire())
    second = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.01)
    pool.release(buf)
    first.cancel()  # woken and cancelled in the same loop turn
    got = await asyncio.wait_for(second, 5)
    assert got is buf
    assert first.cancelled()


async def test_pool_discard_frees_a_slot_for_a_new_buffer() -> None:
    pool = BufferPool(CHUNK, limit=1)
    buf = await pool.acquire()
    pool.discard(buf)
    assert pool.allocated == 0
    other = await asyncio.wait_for(pool.acquire(), 5)
    assert other is not buf and pool.made == 2


@pytest.mark.parametrize("encrypted", [False, True])
def test_codec_into_buffers_round_trips_and_catches_damage(encrypted: bool) -> None:
    cipher = Cipher.from_key(generate_key()) if encrypted else None
    codec = ChunkCodec(1, cipher)
    plain = os.urandom(CHUNK // 2) + bytes(CHUNK // 2)
    addr = codec.address(plain)
    assert addr == (blake3(plain, key=cipher.addr_key) if cipher else blake3(plain)).hexdigest()
    out = bytearray(compress_bound(len(plain)))
    stored = bytes(codec.encode_into(plain, addr, out))
    dest = bytearray(CHUNK)
    assert bytes(codec.decode_into(stored, addr, len(plain), dest)) == plain
    # either encoder's object decodes with either decoder (frames may differ byte for byte)
    assert codec.decode(stored, addr, len(plain)) == plain
    one_shot = codec.encode(plain, addr)
    assert bytes(codec.decode_into(one_shot, addr, len(plain), dest)) == plain
    bad = bytearray(stored)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(ImageCorrupt, match=addr):
        codec.decode_into(bytes(bad), addr, len(plain), dest)
    with pytest.raises(ImageCorrupt, match="manifest says"):
        codec.decode_into(stored, addr, len(plain) - 1, dest)


def test_decode_into_rejects_a_frame_longer_than_the_manifest_says() -> None:
    codec = ChunkCodec(1)
    plain = os.urandom(4096)
    addr = codec.address(plain)
    # a frame without a content size in its header, holding more bytes than claimed
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(plain + b"x")
    with pytest.raises(ImageCorrupt, match="more"):
        codec.decode_into(frame, addr, len(plain), bytearray(8192))


async def test_writer_memory_stays_within_its_buffer_limit(tmp_path: Path) -> None:
    src = tmp_path / "big.img"
    src.write_bytes(os.urandom(12 * CHUNK + 12345))
    settings = ImageSettings(chunk_size=CHUNK, workers=2, max_inflight_mb=8)  # 4 chunks
    async with ImageWriter(str(tmp_path / "store"), "pool", settings=settings) as w:
        await w.add_file(src, "big.img")
        await w.commit()
    assert w.buffers.limit == 4 and w.input_limit < w.buffers.limit
    assert w.buffers.peak <= w.buffers.limit
    assert w.buffers.made <= w.buffers.limit  # 13 chunks went through at most 4 buffers
    pulled = await pull_image(w.url, tmp_path / "dest", settings=settings)
    assert (pulled.dest / "big.img").read_bytes() == src.read_bytes()


async def test_sink_writes_of_odd_sizes_cut_the_same_chunks(tmp_path: Path) -> None:
    data = os.urandom(3 * CHUNK + 777)
    settings = ImageSettings(chunk_size=CHUNK, workers=2)
    store = str(tmp_path / "store")
    async with ImageWriter(store, "sink", settings=settings) as w:
        f = w.file("pieces.img")
        for off in range(0, len(data), 300_001):  # pieces straddle chunk boundaries
            await f.write(data[off : off + 300_001])
        await f.close()
        g = w.file("whole.img")
        await g.write(data)
        await g.close()
        m = await w.commit()
    assert [c.digest for c in m.file("pieces.img").chunks] == [
        c.digest for c in m.file("whole.img").chunks
    ]
    assert m.totals.unique_chunks == 4 and m.codec.hash == "blake3"
    pulled = await pull_image(w.url, tmp_path / "dest", settings=settings)
    assert (pulled.dest / "pieces.img").read_bytes() == data


class _Owner:
    def __init__(self) -> None:
        self.released = 0
        self.discarded = 0

    def release(self) -> None:
        self.released += 1

    def discard(self) -> None:
        self.discarded += 1


async def test_owned_chunks_are_compressed_in_place_and_given_back(tmp_path: Path) -> None:
    data = os.urandom(2 * CHUNK + (1 << 20) + 4096)  # the short last chunk is not small
    settings = ImageSettings(chunk_size=CHUNK, workers=2)
    async with ImageWriter(str(tmp_path / "store"), "owned", settings=settings) as w:
        f = w.file("pages.img")
        owners = [_Owner() for _ in range(3)]
        views = [memoryview(data)[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
        for view, owner in zip(views, owners, strict=True):
            assert await f.write_owned(view, owner)  # whole chunks, then the short last one
            assert owner.released == 0  # kept, not copied: back only once it is compressed
        await f.close()
        g = w.file("split.img")
        await g.write(data[:100])  # something pending: an owned chunk would not start a chunk
        spare = _Owner()
        assert not await g.write_owned(memoryview(data)[100 : 100 + CHUNK], spare)
        await g.write(data[100:])
        await g.close()
        m = await w.commit()
    assert all(o.released >= 1 and not o.discarded for o in owners)  # every buffer came back
    assert spare.released == spare.discarded == 0  # refused: untouched
    assert [c.digest for c in m.file("pages.img").chunks] == [
        c.digest for c in m.file("split.img").chunks
    ]
    pulled = await pull_image(w.url, tmp_path / "dest", settings=settings)
    assert (pulled.dest / "pages.img").read_bytes() == data
