"""Raw frames: a chunk stored as one standard zstd frame of raw (stored) blocks.

GPU memory is often near-incompressible; such a chunk is stored behind a frame header and a
3-byte header per 128 KiB block, built by copying, no compressor (see
:mod:`spotguard.image.codec`, "Raw frames"). Every zstd reader decodes it; spotguard's own
reader recognises the exact layout and copies the blocks out itself (:func:`copy_raw_into`),
hashing each few megabytes as they land. All copies run without the GIL
(:mod:`spotguard.image.memops`), and :func:`raw_frame_parts` lets a store that writes a list
of buffers store the chunk from the plaintext with no copy at all.
"""

from __future__ import annotations

import functools
from typing import Any

from spotguard.image import memops

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
RAW_BLOCK = 128 << 10  # the largest zstd block
RAW_HEADER = 0xE0  # frame header descriptor: single segment, 8-byte content size, no checksum


def raw_frame_size(size: int) -> int:
    """Bytes of a raw zstd frame holding ``size`` plaintext bytes."""
    return 4 + 1 + 8 + 3 * max(1, -(-size // RAW_BLOCK)) + size


@functools.lru_cache(maxsize=8)
def _raw_blocks(n: int) -> tuple[tuple[int, int, bool], ...]:
    """``(offset, size, last)`` of each block of a raw frame of ``n`` plaintext bytes (cached:
    a job's chunks come in few sizes, and a 64 MiB chunk has 512 blocks)."""
    starts = range(0, n, RAW_BLOCK)
    return tuple((o, min(RAW_BLOCK, n - o), o + RAW_BLOCK >= n) for o in starts) or ((0, 0, True),)


@functools.lru_cache(maxsize=8)
def _block_headers(n: int) -> tuple[bytes, ...]:
    """The 3-byte header of each block of a raw frame of ``n`` plaintext bytes."""
    return tuple(_block_header(size, last) for _, size, last in _raw_blocks(n))


@functools.lru_cache(maxsize=8)
def _headers(n: int) -> bytes:
    """Every header of a raw frame of ``n`` bytes, in order, joined: what a read that puts
    them side by side (:class:`RawReadPlan`) must find, checked in one compare."""
    return _frame_header(n) + b"".join(_block_headers(n))


def _frame_header(n: int) -> bytes:
    return ZSTD_MAGIC + bytes((RAW_HEADER,)) + n.to_bytes(8, "little")


def _block_header(size: int, last: bool) -> bytes:
    return ((size << 3) | int(last)).to_bytes(3, "little")


def raw_frame_into(plain: bytes | memoryview, out: memoryview) -> memoryview:
    """Write ``plain`` into ``out`` as one zstd frame of raw (stored) blocks; the frame's view.

    Format (RFC 8878): magic, frame header descriptor ``0xE0`` (single segment, 8-byte frame
    content size), the content size, then blocks of at most 128 KiB, each behind a 3-byte
    little-endian header ``size << 3 | type 0 (raw) << 1 | last``. The blocks are copied
    without the GIL (:mod:`spotguard.image.memops`): the pipeline's threads frame at once."""
    src = memoryview(plain).cast("B")
    n = len(src)
    head = _frame_header(n)
    out[: len(head)] = head
    pos = len(head)
    spans: list[tuple[int, int, int]] = []
    for off, size, last in _raw_blocks(n):
        out[pos : pos + 3] = _block_header(size, last)
        spans.append((pos + 3, off, size))
        pos += 3 + size
    memops.copy_spans(out, src, spans)
    return out[:pos]


def raw_frame_parts(plain: bytes | memoryview) -> list[bytes | memoryview]:
    """The raw frame of ``plain`` as a list of buffers (headers, and views of ``plain`` for
    the blocks) whose concatenation is :func:`raw_frame_into`'s frame: a store that writes a
    list of buffers at once (``writev``) stores the chunk without copying it first."""
    src = memoryview(plain).cast("B")
    n = len(src)
    parts: list[bytes | memoryview] = [_frame_header(n)]
    for (off, size, _), head in zip(_raw_blocks(n), _block_headers(n), strict=True):
        parts.append(head)
        if size:
            parts.append(src[off : off + size])
    return parts


def raw_frame_spans(frame: memoryview, size: int) -> list[tuple[int, int, int]] | None:
    """Where the plaintext of a raw frame of ``size`` bytes lies, as ``(plain_offset,
    frame_offset, n)`` spans — or None when ``frame`` is not exactly such a frame (another
    zstd frame: the caller decodes it with zstd; malformed bytes fail there, or the hash)."""
    if len(frame) != raw_frame_size(size) or bytes(frame[:13]) != _frame_header(size):
        return None
    spans: list[tuple[int, int, int]] = []
    pos = 13
    for off, n, last in _raw_blocks(size):
        if bytes(frame[pos : pos + 3]) != _block_header(n, last):
            return None
        spans.append((off, pos + 3, n))
        pos += 3 + n
    return spans


_HASH_GROUP = 8  # raw blocks copied, then hashed while still in cache (1 MiB)


def copy_raw_into(
    hasher: Any, frame: memoryview, spans: list[tuple[int, int, int]], plain: memoryview
) -> None:
    """Copy a raw frame's blocks (``spans`` from :func:`raw_frame_spans`) into ``plain``,
    feeding ``hasher`` a megabyte at a time right after each is copied."""
    for i in range(0, len(spans), _HASH_GROUP):
        group = spans[i : i + _HASH_GROUP]
        memops.copy_spans(plain, frame, group)
        start = group[0][0]
        end = group[-1][0] + group[-1][2]
        hasher.update(plain[start:end])


class RawReadPlan:
    """Where a raw frame of ``size`` bytes goes when a store reads it into a list of buffers:
    its headers side by side into one small scratch buffer, its blocks straight into ``out``
    (a writable view of at least ``size`` bytes). ``after(i, j)`` (the store calls it as
    ``parts[i:j]`` are filled) hashes the blocks just read; a call with ``i == 0`` starts
    over (a store's retry reads the object again).

    Built and checked with as little Python per chunk as it can: a restore runs one of these
    per 64 MiB chunk in each of up to one thread per core, and the Python parts of them share
    one GIL (``bench.rawio`` on a 16-core GPU host: 16 threads read 10.3 GB/s with the
    plan of one small buffer per header, 15.6 GB/s with this one, both in groups of 16
    parts). The parts are the frame header, then for block ``b`` its header (part
    ``1 + 2b``) and its bytes (part ``2 + 2b``)."""

    def __init__(self, size: int, out: memoryview, codec: Any) -> None:
        self.size = size
        self._codec = codec
        self._heads = bytearray(len(_headers(size)))
        self._hv = memoryview(self._heads)
        hv = self._hv
        parts: list[memoryview] = [hv[:13]]
        pos = 13
        for off, n, _ in _raw_blocks(size):
            parts.append(hv[pos : pos + 3])
            pos += 3
            if n:
                parts.append(out[off : off + n])
        self.parts = parts
        self._out = out
        self.total = raw_frame_size(size)
        self._hasher: Any = None

    def after(self, i: int, j: int) -> None:
        if i == 0:
            self._hasher = self._codec.hasher()
        first = max(0, (i - 1) // 2)  # the first block whose bytes (part 2 + 2b) are in i..j
        last = (j - 3) // 2  # the last one
        if last >= first and self.size:
            a = first * RAW_BLOCK
            b = min(self.size, (last + 1) * RAW_BLOCK)
            self._hasher.update(self._out[a:b])

    def layout_ok(self) -> bool:
        """Whether the headers read are exactly the writer's raw layout for ``size``."""
        return self._heads == _headers(self.size)

    def hexdigest(self) -> str:
        return str(self._hasher.hexdigest()) if self._hasher is not None else ""

    def release(self) -> None:
        """Drop the views of ``out`` (its map can then be closed)."""
        for p in self.parts:
            p.release()
        self.parts = []
        self._hv.release()
