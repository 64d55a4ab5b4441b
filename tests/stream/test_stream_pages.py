"""A streamed restore's GPU pages written back through reused buffers
(:mod:`spotguard.stream.pages`): exact bytes, zero chunks neither read nor handed on, a bounded
number of buffers reused across chunks, and a tampered chunk refused with every buffer back.
The end-to-end path with real CRIU and a real job is tests/checkpoint/test_gpu_pages.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from spotguard.errors import ImageCorrupt
from spotguard.image import ImageSettings, ImageWriter
from spotguard.image.buffers import BufferPool
from spotguard.image.reader import ImageReader
from spotguard.names import chunk_key
from spotguard.stream.pages import write_pages

CHUNK = 1 << 20
NAME = "gpupages-7-7f0000000000-0"


def _data() -> bytes:
    """Random, zero, compressible and a short last chunk."""
    parts = [os.urandom(CHUNK), bytes(CHUNK), b"abcd" * (CHUNK // 4), os.urandom(CHUNK)]
    parts += [bytes(CHUNK), os.urandom(CHUNK), os.urandom(CHUNK // 3)]
    return b"".join(parts)


async def _image(tmp_path: Path, data: bytes) -> tuple[str, ImageSettings]:
    settings = ImageSettings(chunk_size=CHUNK, workers=2)
    async with ImageWriter(str(tmp_path / "store"), "pages", settings=settings) as w:
        f = w.file(NAME)
        await f.write(data)
        await f.close()
        await w.commit()
    return w.url, settings


class _Job:
    """The restored job's memory: what ``put`` wrote, and at which offsets."""

    def __init__(self, size: int) -> None:
        self.mem = bytearray(size)
        self.offsets: list[int] = []
        self._lock = threading.Lock()

    def put(self, off: int, view: memoryview) -> None:
        with self._lock:
            self.offsets.append(off)
            self.mem[off : off + len(view)] = view


async def test_pages_come_back_exact_through_few_reused_buffers(tmp_path: Path) -> None:
    data = _data()
    url, settings = await _image(tmp_path, data)
    job = _Job(len(data))
    async with ImageReader(url, settings=settings) as reader:
        pool = BufferPool(CHUNK, 2)
        await write_pages(reader, NAME, len(data), job.put, pool)
        assert bytes(job.mem) == data
        # the two zero chunks were neither fetched nor written
        assert sorted(job.offsets) == [0, 2 * CHUNK, 3 * CHUNK, 5 * CHUNK, 6 * CHUNK]
        assert reader.stats.bytes == len(data) - 2 * CHUNK
        assert pool.made <= 2 < len(job.offsets) and pool.in_use == 0  # reused, all back
        pool.close()


async def test_a_tampered_chunk_is_refused_and_every_buffer_comes_back(tmp_path: Path) -> None:
    data = _data()
    url, settings = await _image(tmp_path, data)
    async with ImageReader(url, settings=settings) as reader:
        victim = reader.manifest.file(NAME).chunks[3]
        path = tmp_path / "store" / chunk_key("pages", victim.digest)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 1
        path.write_bytes(bytes(raw))
        job = _Job(len(data))
        pool = BufferPool(CHUNK, 4)
        with pytest.raises(ImageCorrupt, match=victim.digest):
            await write_pages(reader, NAME, len(data), job.put, pool)
        assert 3 * CHUNK not in job.offsets  # its bytes never reached the job
        assert pool.in_use == 0
        pool.close()


async def test_a_part_of_another_size_than_the_metadata_says_is_refused(tmp_path: Path) -> None:
    data = _data()
    url, settings = await _image(tmp_path, data)
    async with ImageReader(url, settings=settings) as reader:
        with pytest.raises(Exception, match="does not hold the"):
            await write_pages(
                reader, NAME, len(data) + 1, _Job(len(data) + 1).put, BufferPool(CHUNK, 2)
            )


async def test_a_zero_chunk_read_into_a_used_buffer_reads_zero(tmp_path: Path) -> None:
    data = _data()
    url, settings = await _image(tmp_path, data)
    async with ImageReader(url, settings=settings) as reader:
        refs = reader.manifest.file(NAME).chunks
        pool = BufferPool(CHUNK, 1)
        first = await reader.read_chunk_owned(refs[0], 0, pool)
        assert not first.fresh and bytes(first.map[:CHUNK]) == data[:CHUNK]
        first.close()
        zero = await reader.read_chunk_owned(refs[1], 1, pool)  # the same buffer, dirty
        assert bytes(zero.map[:CHUNK]) == bytes(CHUNK)
        zero.close()
        assert pool.made == 1 and pool.in_use == 0
        pool.close()
