"""A streamed restore's GPU pages (:mod:`spotguard.checkpoint.gpupages`) written back from the
image, several chunks of a part at once, through reused buffers.

Why not the reader's in-order window of fresh maps (:meth:`ImageReader.iter_file_owned`): the
bytes are copied into the job (``process_vm_writev``) before the chunk is closed, so nothing
holds its pages afterwards, and a fresh map per chunk made every byte of a 40 GiB restore
fault in two fresh pages — one in spotguard's buffer, one in the job — where memory makes
fresh pages at a fraction of its copy rate (docs/benchmarks.md, "the memory-bandwidth
table"). Reused buffers (one :class:`~spotguard.image.buffers.BufferPool` per restore) leave
the job's own pages as the only fresh ones. Within a part the chunks are independent (each
goes to its own offset), so up to :data:`PUTS_PER_PART` are read and written at once; with
the parts running side by side that puts every core on the copies, and the pool's bound
(:func:`page_buffers`) keeps the memory this takes small. All-zero chunks are neither
fetched nor written: the restored mapping already reads zero.
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import TYPE_CHECKING

from spotguard.errors import ImageError
from spotguard.image.buffers import BufferPool

if TYPE_CHECKING:
    from spotguard.checkpoint.gpupages import PagePut, PageZero
    from spotguard.image.reader import ImageReader

#: chunks of one part read and written at once
PUTS_PER_PART = 2


def page_buffers(reader: ImageReader) -> BufferPool:
    """The reused buffers of one restore's page write-back: the image's chunk size, at most
    two per core (the copies' parallelism; beyond it reads wait for a buffer)."""
    size = max(reader.manifest.codec.chunk_size, 1)
    return BufferPool(size, max(4, 2 * (os.cpu_count() or 2)))


async def write_pages(
    reader: ImageReader,
    name: str,
    size: int,
    put: PagePut,
    buffers: BufferPool,
    *,
    zeros: PageZero | None = None,
    in_flight: int | None = None,
) -> None:
    """Hand every non-zero chunk of file ``name`` (exactly ``size`` bytes) to ``put(offset,
    view)`` in the worker thread that read it, each verified against its authenticated
    address first, and the all-zero ones (by their authenticated address) to ``zeros(offset,
    length)`` where given; ``in_flight`` chunks at once (default :data:`PUTS_PER_PART`),
    started in order."""
    refs = reader.manifest.file(name).chunks
    if sum(r.size for r in refs) != size:
        raise ImageError(f"{reader.url}: {name} does not hold the {size} bytes it should")
    zero = reader.codec.zero_address
    gate = asyncio.Semaphore(in_flight or PUTS_PER_PART)

    async def one(index: int, off: int) -> None:
        try:
            # put in the thread that read and verified the chunk (see ImageReader's ``then``)
            chunk = await reader.read_chunk_owned(
                refs[index], index, buffers, then=functools.partial(put, off)
            )
            chunk.close()
        finally:
            gate.release()

    off = 0
    try:
        async with asyncio.TaskGroup() as tg:
            for index, ref in enumerate(refs):
                if ref.digest != zero(ref.size):
                    await gate.acquire()
                    tg.create_task(one(index, off))
                elif zeros is not None:
                    zeros(off, ref.size)
                off += ref.size
    except BaseExceptionGroup as eg:  # the first failure, as an in-order read would raise it
        raise _first(eg) from None


def _first(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    exc: BaseException = eg
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
