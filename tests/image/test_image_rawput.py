"""Produced files (the GPU memory copied out of a frozen job) read, hashed and stored raw a
piece at a time by one pipeline thread (:mod:`spotguard.image.rawput`), against a real file
store, read back through the image reader."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import zstandard

from spotguard.contracts import chunk_key
from spotguard.errors import StoreError
from spotguard.image import ImageSettings, generate_key, pull_image
from spotguard.image.codec import ChunkCodec
from spotguard.image.rawframe import raw_frame_into, raw_frame_size
from spotguard.image.rawput import PIECE, produce_raw
from spotguard.image.writer import ImageWriter
from spotguard.store.file import FileStore

MIB = 1 << 20
CHUNK = 4 * MIB


class Source:
    """A producer over ``data``: records every ``fill`` (thread, offset, length)."""

    def __init__(self, data: bytes, fail_at: int | None = None, slow_at: int | None = None):
        self.data = data
        self.fail_at = fail_at
        self.slow_at = slow_at
        self.calls: list[tuple[int, int]] = []
        self.busy = 0
        self.lock = threading.Lock()

    def fill(self, off: int, view: memoryview) -> None:
        with self.lock:
            self.calls.append((off, len(view)))
            self.busy += 1
        try:
            if self.fail_at is not None and off >= self.fail_at:
                raise OSError(3, f"process_vm_readv at {off}: No such process")
            if self.slow_at is not None and off >= self.slow_at:
                threading.Event().wait(0.3)
            view[:] = self.data[off : off + len(view)]
        finally:
            with self.lock:
                self.busy -= 1


def _tmp_files(root: Path) -> list[Path]:
    return list(root.rglob(".tmp-*"))


def _all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


async def _write(
    root: Path, files: dict[str, Source], settings: ImageSettings | None = None
) -> tuple[ImageWriter, object]:
    s = settings or ImageSettings(chunk_size=CHUNK, workers=4)
    async with ImageWriter(f"file://{root}", "job", settings=s) as w:
        for name, src in files.items():
            sink = w.file(name, mode=0o600)
            sink.raw_saving = 0.5
            await sink.produce(len(src.data), src.fill)
        m = await w.commit({})
    return w, m


async def test_a_produced_file_is_stored_raw_a_piece_at_a_time_and_reads_back(
    tmp_path: Path,
) -> None:
    data = os.urandom(2 * CHUNK + 3 * PIECE + 5)
    src = Source(data)
    w, m = await _write(tmp_path / "store", {"gpupages-7-1000-0": src})
    assert w.streams_produced()
    chunks = m.file("gpupages-7-1000-0").chunks  # type: ignore[attr-defined]
    assert [c.size for c in chunks] == [CHUNK, CHUNK, 3 * PIECE + 5]
    assert all(c.raw for c in chunks)
    # one read per piece, never a whole chunk at once: the piece is hashed and written hot
    assert max(n for _, n in src.calls) == PIECE
    assert sorted(src.calls) == [(o, min(PIECE, len(data) - o)) for o in range(0, len(data), PIECE)]
    # the stored object is exactly the raw frame the usual path writes, a standard zstd frame
    store = tmp_path / "store"
    for i, c in enumerate(chunks):
        plain = data[i * CHUNK : i * CHUNK + c.size]
        stored = (store / chunk_key("job", c.digest)).read_bytes()
        assert len(stored) == c.stored_size == raw_frame_size(c.size)
        assert stored == bytes(raw_frame_into(plain, memoryview(bytearray(len(stored)))))
        assert zstandard.ZstdDecompressor().decompress(stored) == plain
    assert not _tmp_files(store)
    got = await pull_image(w.url, tmp_path / "out", settings=ImageSettings())
    assert (got.dest / "gpupages-7-1000-0").read_bytes() == data


async def test_a_chunk_whose_first_piece_packs_takes_the_usual_path(tmp_path: Path) -> None:
    text = b"".join(b"step %08d loss 0.%06d\n" % (i, i * 7 % 999983) for i in range(400_000))
    data = bytes(CHUNK) + text[:CHUNK] + os.urandom(CHUNK)
    w, m = await _write(tmp_path / "store", {"gpupages-7-1000-0": Source(data)})
    chunks = m.file("gpupages-7-1000-0").chunks  # type: ignore[attr-defined]
    assert [c.raw for c in chunks] == [False, False, True]
    assert chunks[0].stored_size < 1000 and chunks[1].stored_size < CHUNK // 2
    assert not _tmp_files(tmp_path / "store")
    got = await pull_image(w.url, tmp_path / "out", settings=ImageSettings())
    assert (got.dest / "gpupages-7-1000-0").read_bytes() == data


async def test_the_same_chunk_produced_twice_is_stored_once(tmp_path: Path) -> None:
    data = os.urandom(CHUNK)
    _, m = await _write(
        tmp_path / "store", {"gpupages-1-1000-0": Source(data), "gpupages-2-1000-0": Source(data)}
    )
    a, b = (m.file(n).chunks[0] for n in ("gpupages-1-1000-0", "gpupages-2-1000-0"))  # type: ignore[attr-defined]
    assert a.digest == b.digest
    stored = [p for p in _all_files(tmp_path / "store") if "/chunks/" in str(p)]
    assert len(stored) == 1
    assert not _tmp_files(tmp_path / "store")


async def test_produce_returns_only_once_every_read_is_done(tmp_path: Path) -> None:
    """The caller lets the job run again once produce returns: no read may still be going."""
    data = os.urandom(3 * CHUNK)
    src = Source(data, slow_at=2 * CHUNK)
    s = ImageSettings(chunk_size=CHUNK, workers=4)
    async with ImageWriter(f"file://{tmp_path}", "job", settings=s) as w:
        sink = w.file("gpupages-1-1000-0")
        sink.raw_saving = 0.5
        await sink.produce(len(data), src.fill)
        assert src.busy == 0
        assert sum(n for _, n in src.calls) == len(data)
        await w.commit({})


async def test_a_failed_read_fails_the_file_and_leaves_no_temporary_object(tmp_path: Path) -> None:
    data = os.urandom(4 * CHUNK)
    src = Source(data, fail_at=2 * CHUNK + PIECE)
    s = ImageSettings(chunk_size=CHUNK, workers=4)

    async def write() -> None:
        async with ImageWriter(f"file://{tmp_path}", "job", settings=s) as w:
            sink = w.file("gpupages-1-1000-0")
            sink.raw_saving = 0.5
            await sink.produce(len(data), src.fill)
            await w.commit({})

    with pytest.raises(OSError, match="No such process"):
        await write()
    await asyncio.sleep(0.1)  # a cancelled chunk's thread finishes its piece
    assert not _tmp_files(tmp_path)
    assert not [p for p in _all_files(tmp_path) if "manifest" in p.name]


async def test_an_encrypted_image_produces_the_usual_way(tmp_path: Path) -> None:
    (tmp_path / "k").write_text(generate_key().hex())
    s = ImageSettings(chunk_size=CHUNK, workers=2, encryption_key_file=tmp_path / "k")
    data = os.urandom(CHUNK + 7)
    src = Source(data)
    w, _ = await _write(tmp_path / "store", {"gpupages-1-1000-0": src}, s)
    assert not w.streams_produced()
    assert max(n for _, n in src.calls) == CHUNK  # whole chunk buffers, then the pipeline
    got = await pull_image(w.url, tmp_path / "out", settings=s)
    assert (got.dest / "gpupages-1-1000-0").read_bytes() == data
    with pytest.raises(ValueError, match="cipher"):
        produce_raw(src.fill, 0, PIECE, memoryview(bytearray(PIECE)),
                    ChunkCodec(1, w.cipher), 0.5, lambda: None)  # type: ignore[arg-type,return-value]  # fmt: skip


def test_a_pending_object_is_named_once_or_removed(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    p = store.begin_put("job/chunks")
    p.write([b"ab", memoryview(b"cd")])
    assert _tmp_files(tmp_path)
    p.commit("job/chunks/ab/abcd")
    assert (tmp_path / "job/chunks/ab/abcd").read_bytes() == b"abcd"
    p.abort()  # after commit: nothing to remove, the object stays
    assert (tmp_path / "job/chunks/ab/abcd").exists()
    with pytest.raises(StoreError):
        p.write([b"x"])
    q = store.begin_put("job/chunks")
    q.write([b"zz"])
    q.abort()
    assert not _tmp_files(tmp_path)
    with pytest.raises(StoreError, match="escapes"):
        store.begin_put("../elsewhere")
