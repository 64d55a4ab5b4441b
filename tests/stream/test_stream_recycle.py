"""Restore's read buffers are reused only once CRIU has read them out of its pipe.

A chunk goes into CRIU's pipe by reference (``vmsplice``): the pipe points at the chunk's
pages until its reader copies them out. A map reused for the next chunk while the pipe still
points at it would hand the job the next chunk's bytes. Here a slow reader drains a real pipe
while the feeder reuses maps as fast as it is allowed: every byte read must be the byte fed.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from spotguard.image.buffers import OwnedChunk, OwnedPool
from spotguard.stream import protocol
from spotguard.stream.serve import _put, _recycle_consumed, _settle

CHUNK = 1 << 20


def _pattern(i: int) -> bytes:
    return bytes([i % 251]) * CHUNK


def test_a_map_is_reused_only_after_the_pipe_reader_has_taken_its_bytes() -> None:
    rfd, wfd = os.pipe()
    protocol.set_pipe_size(wfd, 4 * CHUNK)
    os.set_blocking(wfd, False)
    got = bytearray()

    def slow_reader() -> None:
        with os.fdopen(rfd, "rb", buffering=0) as r:
            while block := r.read(256 << 10):
                got.extend(block)
                time.sleep(0.002)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    pool = OwnedPool(8 * CHUNK)
    in_pipe: deque[tuple[int, OwnedChunk]] = deque()
    stop = threading.Event()
    written, splice, n = 0, True, 40
    try:
        for i in range(n):
            chunk = pool.take(CHUNK)
            chunk.map[:CHUNK] = _pattern(i)
            splice = _put(wfd, chunk, stop, splice=splice)
            written += CHUNK
            _settle(chunk, splice, written, in_pipe)
            _recycle_consumed(wfd, written, in_pipe)
    finally:
        for _end, chunk in in_pipe:
            chunk.close()
        os.close(wfd)
    reader.join(30)
    assert splice  # the chunks went by reference: the case that needs the care
    assert pool.reused > n // 2  # maps were reused (else nothing was tested)
    assert bytes(got) == b"".join(_pattern(i) for i in range(n))
    pool.close()


def test_a_chunk_from_no_pool_is_unmapped_and_a_copied_one_reused_at_once() -> None:
    pool = OwnedPool(4 * CHUNK)
    lone = OwnedChunk(CHUNK)
    in_pipe: deque[tuple[int, OwnedChunk]] = deque()
    _settle(lone, True, CHUNK, in_pipe)
    assert lone.map.closed and not in_pipe
    copied = pool.take(CHUNK)
    _settle(copied, False, CHUNK, in_pipe)
    assert not in_pipe and pool.take(CHUNK) is copied
    pool.close()
