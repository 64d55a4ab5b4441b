"""Non-blocking pipe I/O on the event loop: wait for a pipe end, read into big buffers, write
from memoryviews. One wake-up moves up to a pipe's capacity (1 to 4 MiB), so the loop thread
stays far from being the bottleneck (see docs/streaming.md for the measured figures)."""

from __future__ import annotations

import asyncio
import os


async def wait_fd(fd: int, *, write: bool = False) -> None:
    """Return once ``fd`` is readable (or writable), or has hung up."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    if write:
        loop.add_writer(fd, ready)
    else:
        loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def read_into(fd: int, view: memoryview) -> int:
    """Read what the pipe holds into ``view`` (at least one byte); 0 means EOF."""
    while True:
        try:
            return os.readv(fd, [view])
        except (BlockingIOError, InterruptedError):
            await wait_fd(fd)


async def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write all of ``data`` into a non-blocking pipe, waiting while it is full.

    Raises BrokenPipeError when the reader has gone."""
    view = memoryview(data).cast("B")
    while view:
        try:
            n = os.write(fd, view)
        except (BlockingIOError, InterruptedError):
            await wait_fd(fd, write=True)
            continue
        view = view[n:]
