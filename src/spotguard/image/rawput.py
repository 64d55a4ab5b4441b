"""A produced chunk read, hashed and stored raw in one pass, a megabyte at a time.

The GPU memory spotguard copies out of a frozen job (:mod:`spotguard.checkpoint.gpupages`)
went through the chunk pipeline like any file: ``process_vm_readv`` filled a 64 MiB buffer,
then a pipeline thread hashed it and wrote it to the store — three passes over memory that
no cache holds (the buffer written, read to hash, read to write), at a rate the N-rank and
40 GiB rows are bound by (docs/benchmarks.md, "what bounds the GPU-memory copy"). Here one
thread does it piece by piece: read a megabyte into the same small region of the buffer,
hash it and write it to the store while it is still in cache, so memory sees the job's
bytes read once and the store's written once.

A chunk's key is its hash, known only at the end, so this needs a store that names an
object after writing it (``BlockingStore.writes_streamed``: the file store) and an image
without a cipher (addresses unkeyed, frames stored as they are). The first megabyte decides:
if a sample of it packs by ``raw_saving`` (zeros, text, a compressible tensor), the rest of
the chunk is read into the buffer and the caller takes the usual path (hash, compress or
frame raw, store), so nothing compressible is stored raw on a guess from less than this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spotguard.image.codec import ChunkCodec
from spotguard.image.rawframe import RAW_BLOCK, frame_header_parts, raw_frame_size
from spotguard.store.base import PendingPut

#: bytes read, hashed and written at a time (a whole number of raw blocks; small enough that
#: the piece is still in the core's cache when it is hashed and written)
PIECE = 8 * RAW_BLOCK


@dataclass
class Produced:
    """A chunk written raw to a pending object of the store, not yet named."""

    address: str
    size: int
    stored_size: int
    pending: PendingPut


def produce_raw(
    fill: Callable[[int, memoryview], None],
    offset: int,
    size: int,
    buf: memoryview,
    codec: ChunkCodec,
    raw_saving: float | None,
    begin: Callable[[], PendingPut],
) -> Produced | None:
    """Put ``size`` bytes that ``fill(offset + k, view)`` provides into a pending object of
    the store (``begin()``), each piece hashed and written right after it is read (runs in a
    worker thread). None when the first piece packs (see the module): ``buf[:size]`` then
    holds the whole chunk, for the usual path."""
    if codec.cipher is not None:
        raise ValueError("produce_raw: an image with a cipher stores no raw plaintext")
    first = buf[: min(PIECE, size)]
    fill(offset, first)
    if not codec.incompressible(first, raw_saving):
        if len(first) < size:
            fill(offset + len(first), buf[len(first) : size])
        return None
    hasher = codec.hasher()
    pending = begin()
    try:
        head, blocks = frame_header_parts(size)
        pending.write([head])
        for at in range(0, size, PIECE):
            piece = first if at == 0 else buf[: min(PIECE, size - at)]
            if at:
                fill(offset + at, piece)
            hasher.update(piece)
            parts: list[bytes | memoryview] = []
            for b in range(0, len(piece), RAW_BLOCK):
                parts.append(blocks(at + b))
                parts.append(piece[b : b + RAW_BLOCK])
            pending.write(parts)
        return Produced(hasher.hexdigest(), size, raw_frame_size(size), pending)
    except BaseException:
        pending.abort()
        raise
