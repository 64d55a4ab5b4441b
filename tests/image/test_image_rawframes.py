"""Raw frames for chunks that do not compress (issue 19), and readers of older images."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import zstandard

from spotguard.contracts import chunk_key, manifest_key
from spotguard.errors import ImageCorrupt
from spotguard.image import ImageSettings, generate_key, memops, pull_image, push_dir, verify_image
from spotguard.image.codec import ChunkCodec
from spotguard.image.manifest import ChunkRef
from spotguard.image.rawframe import (
    raw_frame_into,
    raw_frame_parts,
    raw_frame_size,
    raw_frame_spans,
)

CHUNK = 1 << 20


def bf16_like(n: int) -> bytes:
    """Half-precision-looking weights: random mantissas, a narrow band of exponents."""
    rnd = bytearray(os.urandom(n))
    rnd[1::2] = bytes(0x3C + (b & 0x03) for b in rnd[1::2])
    return bytes(rnd)


def test_raw_frame_is_a_standard_zstd_frame() -> None:
    for n in (1, 5, 128 << 10, (128 << 10) + 1, 3 * CHUNK + 7):
        plain = os.urandom(n)
        out = bytearray(raw_frame_size(n))
        frame = bytes(raw_frame_into(plain, memoryview(out)))
        assert len(frame) == raw_frame_size(n)
        assert zstandard.frame_content_size(frame) == n
        assert zstandard.ZstdDecompressor().decompress(frame) == plain  # any zstd reader


def test_sample_decides_per_chunk() -> None:
    codec = ChunkCodec(1, raw_saving=0.03)
    assert codec.incompressible(os.urandom(CHUNK))
    assert not codec.incompressible(bytes(CHUNK))
    assert not codec.incompressible(bf16_like(CHUNK))
    half = os.urandom(CHUNK // 2) + bytes(CHUNK // 2)  # half zero pages: worth compressing
    assert not codec.incompressible(half)
    assert not ChunkCodec(1, raw_saving=0.0).incompressible(os.urandom(CHUNK))
    # the writer's one call: the address and the sample's verdict together
    for data in (os.urandom(CHUNK), bytes(CHUNK), bf16_like(CHUNK), half):
        addr, raw = codec.address_and_raw(bytearray(data))
        assert (addr, raw) == (codec.address(data), codec.incompressible(data))


async def test_incompressible_chunks_stored_raw_and_read_back(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(2 * CHUNK) + bytes(CHUNK) + bf16_like(CHUNK))
    store = (tmp_path / "store").as_uri()
    s = ImageSettings(chunk_size=CHUNK, workers=2)
    res = await push_dir(src, store, "raw", settings=s)
    chunks = res.manifest.file("pages-1.img").chunks
    assert [c.raw for c in chunks] == [True, True, False, False]
    assert res.stats.chunks_raw == 2
    assert all(c.stored_size < c.size + 4096 for c in chunks[:2])
    assert chunks[2].stored_size < 1000 and chunks[3].stored_size < 0.95 * CHUNK
    got = await pull_image(res.image_url, tmp_path / "d", settings=s)
    assert (got.dest / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()
    # the stored object is a plain zstd frame: what older readers decode
    stored = (tmp_path / "store" / chunk_key("raw", chunks[0].digest)).read_bytes()
    plain = zstandard.ZstdDecompressor().decompress(stored)
    assert plain == (src / "pages-1.img").read_bytes()[:CHUNK]
    # turned off: everything compressed (a random chunk then is zstd's own output)
    off = await push_dir(
        src, store, "off", settings=ImageSettings(chunk_size=CHUNK, workers=2, raw_saving=0.0)
    )
    assert not any(c.raw for c in off.manifest.file("pages-1.img").chunks[2:])
    assert off.stats.chunks_raw == 0


async def test_encrypted_raw_chunks_round_trip(tmp_path: Path) -> None:
    (tmp_path / "k").write_text(generate_key().hex())
    s = ImageSettings(chunk_size=CHUNK, workers=2, encryption_key_file=tmp_path / "k")
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages.img").write_bytes(os.urandom(CHUNK))
    res = await push_dir(src, (tmp_path / "store").as_uri(), "enc", settings=s)
    assert [c.raw for c in res.manifest.files[0].chunks] == [True]
    assert (await verify_image(res.image_url, settings=s)).ok


async def test_an_image_of_format_1_still_reads(tmp_path: Path) -> None:
    """A manifest as builds before authenticated images wrote it: format /1, no sequence,
    no auth, no raw flags. A host without keys reads it as before."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages.img").write_bytes(bytes(CHUNK) + os.urandom(999))
    s = ImageSettings(chunk_size=CHUNK, workers=2)
    res = await push_dir(src, (tmp_path / "store").as_uri(), "old", settings=s)
    path = tmp_path / "store" / manifest_key("old", res.manifest.image_id)
    m = json.loads(path.read_text())
    m["format"] = "spotguard-image/1"
    for k in ("sequence", "auth"):
        del m[k]
    for f in m["files"]:
        for c in f["chunks"]:
            del c["raw"]
    path.write_text(json.dumps(m))
    got = await pull_image(res.image_url, tmp_path / "d", settings=s)
    assert got.manifest.sequence == 0
    assert (got.dest / "pages.img").read_bytes() == (src / "pages.img").read_bytes()


def test_frame_parts_concatenate_to_the_frame() -> None:
    for n in (0, 1, 128 << 10, (128 << 10) + 1, 3 * CHUNK + 7):
        plain = os.urandom(n)
        whole = bytes(raw_frame_into(plain, memoryview(bytearray(raw_frame_size(n)))))
        assert b"".join(raw_frame_parts(plain)) == whole


def test_raw_frames_decode_by_their_own_reader_and_fail_on_a_flipped_bit() -> None:
    codec = ChunkCodec(1)
    for n in (1, (128 << 10) + 1, 3 * CHUNK + 7):
        plain = os.urandom(n)
        frame = bytearray(raw_frame_into(plain, memoryview(bytearray(raw_frame_size(n)))))
        assert raw_frame_spans(memoryview(frame), n) is not None
        out = bytearray(n)
        addr = codec.address(plain)
        assert bytes(codec.decode_into(frame, addr, n, out)) == plain
        frame[-1] ^= 1
        with pytest.raises(ImageCorrupt, match="hash check"):
            codec.decode_into(frame, addr, n, bytearray(n))


def test_frames_not_exactly_raw_go_to_zstd() -> None:
    codec = ChunkCodec(1)
    plain = os.urandom(CHUNK)
    frame = bytearray(raw_frame_into(plain, memoryview(bytearray(raw_frame_size(CHUNK)))))
    assert raw_frame_spans(memoryview(frame), CHUNK + 1) is None  # another size
    bad = bytearray(frame)
    bad[13] |= 0x02  # first block marked RLE: not the writer's layout
    assert raw_frame_spans(memoryview(bad), CHUNK) is None
    with pytest.raises(ImageCorrupt):
        codec.decode_into(bad, codec.address(plain), CHUNK, bytearray(CHUNK))
    packed = zstandard.ZstdCompressor().compress(plain)  # zstd's own frame of the same bytes
    assert bytes(codec.decode_into(packed, codec.address(plain), CHUNK, bytearray(CHUNK))) == plain


def test_zero_chunks_take_the_address_of_their_bytes(tmp_path: Path) -> None:
    (tmp_path / "k").write_text(generate_key().hex())
    keyed = ImageSettings(encryption_key_file=tmp_path / "k")
    from spotguard.image.codec import load_key

    for codec in (ChunkCodec(1), ChunkCodec(1, load_key(keyed.encryption_key_file, None))):
        for n in (1, CHUNK, 3 * CHUNK + 5):
            zeros = bytearray(n)
            assert codec.address_of(zeros) == codec.address(bytes(n))
            zeros[n // 2] = 1
            assert codec.address_of(zeros) == codec.address(bytes(zeros))


def test_memops_copy_and_zero_test_without_the_gil() -> None:
    import mmap

    src = bytearray(os.urandom(CHUNK))
    dst = mmap.mmap(-1, 2 * CHUNK)
    with memoryview(dst) as d:
        memops.copy_spans(d, memoryview(src), [(5, 0, 100), (CHUNK, 100, CHUNK - 100)])
        assert d[5:105] == src[:100] and d[CHUNK : 2 * CHUNK - 100] == src[100:]
        memops.copy(d[7:], memoryview(bytes(src)))  # read-only source: the Python copy
        assert d[7 : 7 + CHUNK] == src
        with pytest.raises(ValueError):
            memops.copy_spans(d, memoryview(src), [(2 * CHUNK - 1, 0, 2)])
        d[:] = bytes(2 * CHUNK)
        assert memops.is_zero(d)
        d[2 * CHUNK - 1] = 1
        assert not memops.is_zero(d)
    assert not memops.is_zero(memoryview(bytes(10)))  # read-only: never claimed zero
    dst.close()  # no export left behind


def test_the_zero_test_sees_a_byte_in_any_of_its_strides() -> None:
    """A short first compare, long ones after: a set byte anywhere — either side of every
    stride's edge, the last byte — makes a buffer not zero."""
    import mmap

    n = 2 * memops.ZERO_STRIDE + memops.ZERO_STEP + 3
    buf = mmap.mmap(-1, n)
    edges = [memops.ZERO_STEP + k * memops.ZERO_STRIDE for k in range(3)]
    with memoryview(buf) as v:
        assert memops.is_zero(v) and memops.is_zero(v[5:])
        for at in (0, n - 1, *(e + d for e in edges for d in (-1, 0, 1) if e + d < n)):
            v[at] = 1
            assert not memops.is_zero(v), at
            assert at == n - 1 or memops.is_zero(v[at + 1 :])
            assert at == 0 or memops.is_zero(v[:at])
            v[at] = 0
    buf.close()


async def test_owned_reads_use_the_raw_reader_and_skip_zero_chunks(tmp_path: Path) -> None:
    from spotguard.image import ImageReader

    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(CHUNK) + bytes(CHUNK) + bf16_like(CHUNK) + os.urandom(600_000)
    (src / "pages-1.img").write_bytes(data)
    s = ImageSettings(chunk_size=CHUNK, workers=2)
    res = await push_dir(src, (tmp_path / "store").as_uri(), "own", settings=s)
    chunks = res.manifest.file("pages-1.img").chunks
    assert [c.raw for c in chunks] == [True, False, False, True]
    # the zero chunk is known by its address: reading it needs nothing from the store
    (tmp_path / "store" / chunk_key("own", chunks[1].digest)).unlink()
    async with ImageReader(res.image_url, settings=s) as r:
        got = b""
        async for c in r.iter_file_owned("pages-1.img"):
            got += c.map[: c.size]
            c.close()
        assert got == data
    # a flipped byte in a raw chunk is caught by the raw reader's hash
    path = tmp_path / "store" / chunk_key("own", chunks[0].digest)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 1
    path.write_bytes(bytes(blob))
    async with ImageReader(res.image_url, settings=s) as r:
        with pytest.raises(ImageCorrupt, match="hash check"):
            await r.read_chunk_owned(chunks[0])


async def test_file_store_reads_a_raw_frame_into_place_and_says_when_it_is_not_one(
    tmp_path: Path,
) -> None:
    from spotguard.image.rawframe import RawReadPlan
    from spotguard.store.file import FileStore

    codec = ChunkCodec(1)
    n = 3 * CHUNK + 7
    plain = os.urandom(n)
    store = FileStore(tmp_path)
    await store.put_parts("raw", raw_frame_parts(plain))
    await store.put("zstd", zstandard.ZstdCompressor().compress(plain))
    bad = bytearray(raw_frame_into(plain, memoryview(bytearray(raw_frame_size(n)))))
    bad[13] |= 0x02  # same length, first block header not the writer's
    await store.put("bad", bytes(bad))
    out = bytearray(n)
    plan = RawReadPlan(n, memoryview(out), codec)
    got = await store.get_parts("raw", plan.parts, plan.after)
    assert got == plan.total and plan.layout_ok() and plan.hexdigest() == codec.address(plain)
    assert bytes(out) == plain
    plan.after(0, 1)  # a retry starts the hash over
    assert plan.hexdigest() != codec.address(plain)
    plan.release()
    plan = RawReadPlan(n, memoryview(bytearray(n)), codec)
    assert await store.get_parts("zstd", plan.parts, plan.after) != plan.total
    plan.release()
    plan = RawReadPlan(n, memoryview(bytearray(n)), codec)
    assert await store.get_parts("bad", plan.parts, plan.after) == plan.total
    assert not plan.layout_ok()
    plan.release()
    await store.aclose()


async def test_a_chunk_of_more_blocks_than_one_writev_takes_is_stored_whole(tmp_path: Path) -> None:
    from spotguard.store.file import FileStore

    n = (64 << 20) + 5  # 513 blocks: 1027 buffers, more than IOV_MAX (1024) at once
    plain = os.urandom(n)
    parts = raw_frame_parts(plain)
    assert len(parts) > 1024
    store = FileStore(tmp_path)
    await store.put_parts("big", parts)
    stored = (tmp_path / "big").read_bytes()
    assert stored == bytes(raw_frame_into(plain, memoryview(bytearray(raw_frame_size(n)))))
    await store.aclose()


async def test_a_store_without_reads_parts_fills_the_parts_the_general_way(tmp_path: Path) -> None:
    from spotguard.image.rawframe import RawReadPlan
    from spotguard.store.base import BlockingStore
    from spotguard.store.file import FileStore

    codec = ChunkCodec(1)
    n = (128 << 10) * 3 + 9
    plain = os.urandom(n)
    store = FileStore(tmp_path)
    await store.put_parts("raw", raw_frame_parts(plain))
    out = bytearray(n)
    plan = RawReadPlan(n, memoryview(out), codec)
    got = BlockingStore._get_parts(store, "raw", plan.parts, plan.after)  # the base's way
    assert got == plan.total and plan.layout_ok() and plan.hexdigest() == codec.address(plain)
    assert bytes(out) == plain
    plan.release()
    await store.aclose()


@pytest.mark.parametrize("n", [0, 1, 128 << 10, (128 << 10) + 1, 3 * CHUNK + 7])
@pytest.mark.parametrize("group", [1, 2, 3, 16, 1024])
def test_a_raw_read_in_groups_of_any_size_hashes_and_checks_the_whole_frame(
    n: int, group: int
) -> None:
    """However a store cuts the parts into reads (a group may end between a block's header
    and its bytes), the plan hashes every byte once, in order, and checks every header."""
    from spotguard.image.rawframe import RawReadPlan

    codec = ChunkCodec(1)
    plain = os.urandom(n)
    frame = bytes(raw_frame_into(plain, memoryview(bytearray(raw_frame_size(n)))))
    out = bytearray(n)
    plan = RawReadPlan(n, memoryview(out), codec)
    assert sum(len(p) for p in plan.parts) == plan.total == len(frame)
    pos = 0
    for i in range(0, len(plan.parts), group):
        j = min(len(plan.parts), i + group)
        for p in plan.parts[i:j]:
            p[:] = frame[pos : pos + len(p)]
            pos += len(p)
        plan.after(i, j)
    assert plan.layout_ok() and bytes(out) == plain
    assert plan.hexdigest() == codec.address(plain)
    plan.release()


async def test_short_reads_and_writes_of_a_raw_chunk_resume_where_they_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system may move fewer bytes than asked (a signal, a full pipe of a FUSE
    mount): the store's writev and preadv loops pick up mid-buffer, and the result is the
    same frame, the same plaintext, the same hash."""
    from spotguard.image.rawframe import RawReadPlan
    from spotguard.store import file as filestore

    real_writev, real_preadv = os.writev, os.preadv

    def short_writev(fd: int, bufs: list[memoryview]) -> int:
        return real_writev(fd, [memoryview(bufs[0])[: max(1, len(bufs[0]) // 3)]])

    def short_preadv(fd: int, bufs: list[memoryview], off: int) -> int:
        first = memoryview(bufs[0])
        return real_preadv(fd, [first[: max(1, len(first) // 2)]], off)

    codec = ChunkCodec(1)
    n = 2 * CHUNK + 4099
    plain = os.urandom(n)
    store = filestore.FileStore(tmp_path)
    monkeypatch.setattr(filestore.os, "writev", short_writev)
    await store.put_parts("raw", raw_frame_parts(plain))
    monkeypatch.setattr(filestore.os, "writev", real_writev)
    assert (tmp_path / "raw").read_bytes() == bytes(
        raw_frame_into(plain, memoryview(bytearray(raw_frame_size(n))))
    )
    monkeypatch.setattr(filestore.os, "preadv", short_preadv)
    out = bytearray(n)
    plan = RawReadPlan(n, memoryview(out), codec)
    assert await store.get_parts("raw", plan.parts, plan.after) == plan.total
    assert plan.layout_ok() and bytes(out) == plain
    assert plan.hexdigest() == codec.address(plain)
    plan.release()
    await store.aclose()


async def _image_of_each_kind(
    tmp_path: Path, job: str
) -> tuple[str, ImageSettings, bytes, list[ChunkRef]]:
    """An image of one file whose chunks are raw, zero, compressed and raw (short)."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(CHUNK) + bytes(CHUNK) + bf16_like(CHUNK) + os.urandom(600_000)
    (src / "pages-1.img").write_bytes(data)
    s = ImageSettings(chunk_size=CHUNK, workers=2)
    res = await push_dir(src, (tmp_path / "store").as_uri(), job, settings=s)
    chunks = res.manifest.file("pages-1.img").chunks
    assert [c.raw for c in chunks] == [True, False, False, True]
    return res.image_url, s, data, list(chunks)


async def test_then_gets_every_chunks_verified_bytes_in_the_thread_that_read_them(
    tmp_path: Path,
) -> None:
    """``read_chunk_owned(then=…)`` hands each chunk's verified bytes to ``then`` in a worker
    thread — the store's own for a raw chunk (read, hashed and used without a hop through
    the loop), the decoder's for a compressed one — into reused buffers too."""
    import threading

    from spotguard.image import ImageReader
    from spotguard.image.buffers import BufferPool

    url, s, data, chunks = await _image_of_each_kind(tmp_path, "then")
    loop_thread = threading.current_thread().name
    seen: dict[int, tuple[bytes, str]] = {}

    def then(i: int, view: memoryview) -> None:
        seen[i] = (bytes(view), threading.current_thread().name)

    pool = BufferPool(CHUNK, 2)
    async with ImageReader(url, settings=s) as r:
        for fresh in (True, False):  # a fresh map, then a reused (dirty) buffer
            seen.clear()
            for i, ref in enumerate(chunks):
                chunk = await r.read_chunk_owned(
                    ref, i, None if fresh else pool, then=lambda v, i=i: then(i, v)
                )
                chunk.close()
            assert b"".join(seen[i][0] for i in range(len(chunks))) == data
            names = [seen[i][1] for i in range(len(chunks))]
            assert loop_thread not in names
            assert names[0].startswith("store-io") and names[3].startswith("store-io")
            assert names[2].startswith("image-cpu")
    pool.close()


async def test_then_never_sees_a_tampered_chunk_and_its_own_errors_are_its_own(
    tmp_path: Path,
) -> None:
    """A raw chunk that fails its hash is never handed to ``then`` (ImageCorrupt after the
    refetch); an error ``then`` raises (a process gone) comes out as it is — not as a
    store error, and not retried."""
    from spotguard.errors import StoreError
    from spotguard.image import ImageReader

    url, s, _data, chunks = await _image_of_each_kind(tmp_path, "tamper")
    calls: list[int] = []

    def gone(view: memoryview) -> None:
        calls.append(len(view))
        raise OSError(3, "process_vm_writev of pid 1: No such process")

    async with ImageReader(url, settings=s) as r:
        for ref in (chunks[0], chunks[2]):  # raw, compressed
            calls.clear()
            with pytest.raises(OSError, match="No such process") as err:
                await r.read_chunk_owned(ref, then=gone)
            assert not isinstance(err.value, StoreError)
            assert calls == [ref.size]
    path = tmp_path / "store" / chunk_key("tamper", chunks[0].digest)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 1
    path.write_bytes(bytes(blob))
    async with ImageReader(url, settings=s) as r:
        calls.clear()
        with pytest.raises(ImageCorrupt, match="hash check"):
            await r.read_chunk_owned(chunks[0], then=lambda v: calls.append(len(v)))
        assert calls == []


async def test_put_parts_made_in_the_stores_thread_and_a_read_run_there(tmp_path: Path) -> None:
    """``put_parts`` takes a call that makes the buffers in the store's thread (a raw
    chunk's ~1,000 views are not made in the event loop); ``run_get`` runs a read through
    ``read_parts`` there, with the store's error mapping (a missing object: ObjectNotFound)."""
    import threading

    from spotguard.errors import ObjectNotFound
    from spotguard.store.file import FileStore

    store = FileStore(tmp_path / "s")
    made_in: list[str] = []

    def parts() -> list[bytes]:
        made_in.append(threading.current_thread().name)
        return [b"ab", b"", b"cde"]

    await store.put_parts("k", parts)
    assert await store.get("k") == b"abcde"
    assert made_in and made_in[0].startswith("store-io")
    buf = bytearray(5)

    def read() -> tuple[int, str]:
        got = store.read_parts("k", [memoryview(buf)[:2], memoryview(buf)[2:]], lambda i, j: None)
        return got, threading.current_thread().name

    got, where = await store.run_get("k", read)
    assert (got, bytes(buf)) == (5, b"abcde") and where.startswith("store-io")
    with pytest.raises(ObjectNotFound):
        await store.run_get("gone", lambda: store.read_parts("gone", [memoryview(buf)], print))
    # looked up and written in one call, in the caller's thread: an object there is left
    # alone (its parts never made)
    made_in.clear()
    found = await asyncio.to_thread(store.put_parts_unless_stored_now, "k", parts)
    assert found is not None and found.size == 5 and made_in == []
    assert await asyncio.to_thread(store.put_parts_unless_stored_now, "new", parts) is None
    assert await store.get("new") == b"abcde" and made_in[0].startswith("asyncio")
