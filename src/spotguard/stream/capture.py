"""Capture side of the image-streamer protocol: CRIU dumps, spotguard receives.

:class:`Capture` listens on ``streamer-capture.sock`` before CRIU starts. For every file CRIU
announces it drains the file's pipe into pieces and hands each piece to a *sink* as it fills —
the image writer (chunk, zstd frames in threads, parallel uploads) or a plain directory. The
pieces waiting for the sink are bounded (``buffer_bytes``); when the sink is slower than CRIU,
the capture stops reading, the pipe fills and CRIU blocks: back-pressure, never unbounded RAM.

A capture never decides that an image is complete: EOF on the socket looks the same whether
CRIU finished or died. The caller commits only after CRIU exited 0 (see
:class:`spotguard.stream.target.StreamTarget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol, runtime_checkable

from spotguard.errors import StreamError
from spotguard.stream import pipes, protocol

log = logging.getLogger(__name__)

MiB = 1 << 20
_FIRST_PIECE = 256 * 1024  # small files never take a big piece or a slot of the budget


@runtime_checkable
class FileOut(Protocol):
    """One file being written into a sink (``ImageWriter.file(name)`` has this shape)."""

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class CaptureSink(Protocol):
    """Where captured files go: anything with ``file(name)`` returning a :class:`FileOut`
    (directly or awaitably). Files may be open concurrently; CRIU interleaves them."""

    def file(self, name: str) -> FileOut | Awaitable[FileOut]: ...


@dataclass
class CaptureStats:
    """What one capture received: per-file sizes and when data flowed."""

    files: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    first_data: float | None = None
    last_data: float | None = None
    finished: float | None = None
    peak_buffered: int = 0  # bytes read from CRIU and not yet taken by the sink

    @property
    def bytes(self) -> int:
        return sum(self.files.values())

    def to_json(self) -> dict[str, object]:
        return {
            "files": len(self.files),
            "bytes": self.bytes,
            "peak_buffered": self.peak_buffered,
            "seconds": None if self.finished is None else self.finished - self.started,
        }


class _Budget:
    """Bytes held between CRIU's pipes and the sink; waiting here is the back-pressure."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._cond = asyncio.Condition()

    async def take(self, n: int) -> None:
        async with self._cond:
            # One piece is always allowed, so a limit below a piece cannot deadlock.
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used)

    async def give(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


async def _open(sink: CaptureSink, name: str) -> FileOut:
    out = sink.file(name)
    if inspect.isawaitable(out):
        return await out
    return out


class Capture:
    """Receive one ``criu dump --stream`` into ``sink``.

    Use as ``async with Capture(dir, sink) as cap:`` — the socket is listening when the body
    starts (run CRIU there), then ``stats = await cap.wait()`` once CRIU has exited. Leaving
    the block before ``wait()`` finished (an error, a cancellation) aborts: every pipe is
    closed, so a CRIU still running gets EPIPE and fails rather than hanging.
    """

    def __init__(
        self,
        images_dir: Path,
        sink: CaptureSink,
        *,
        piece_bytes: int = 8 * MiB,
        buffer_bytes: int = 256 * MiB,
        pipe_bytes: int = 4 * MiB,
    ) -> None:
        self.images_dir = Path(images_dir)
        self.sink = sink
        self.piece_bytes = max(piece_bytes, _FIRST_PIECE)
        self.pipe_bytes = pipe_bytes
        self.stats = CaptureStats()
        self._budget: _Budget | None = None
        self._buffer_bytes = buffer_bytes
        self._task: asyncio.Task[None] | None = None
        self._files: set[asyncio.Task[None]] = set()
        self._fds: set[int] = set()
        self._conn: protocol.Connection | None = None
        self._idle = False  # parked waiting for CRIU's next request

    @property
    def error(self) -> BaseException | None:
        """Why the capture stopped, once it failed (a sink that refused a piece, a protocol
        error); None while it runs, after it finished cleanly or was cancelled."""
        t = self._task
        if t is None or not t.done() or t.cancelled():
            return None
        return t.exception()

    @property
    def socket_path(self) -> Path:
        return self.images_dir / protocol.CAPTURE_SOCKET

    async def start(self) -> None:
        """Listen on the capture socket; CRIU may be started once this returns."""
        self.images_dir.mkdir(parents=True, exist_ok=True)
        self._budget = _Budget(self._buffer_bytes)
        listener = protocol.listen(self.images_dir, protocol.CAPTURE_SOCKET)
        self.stats = CaptureStats()
        self._task = asyncio.create_task(self._serve(listener), name="stream-capture")

    async def __aenter__(self) -> Capture:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None and not self._task.done():
            await self.abort()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def wait(self) -> CaptureStats:
        """Wait until CRIU closed the socket and every file reached the sink; raise on any
        failure of the protocol or the sink."""
        assert self._task is not None, "Capture.start() first"
        await self._task
        return self.stats

    async def settle(self) -> CaptureStats:
        """CRIU has written every file (it waits in its post-dump step, or has exited): take
        what is still queued on the socket, wait until every file reached the sink, stop.

        The engine completes an image while the tree is still frozen and CRIU still holds
        the socket open, so end-of-socket cannot be the signal there.
        """
        assert self._task is not None, "Capture.start() first"
        while not self._task.done() and not (self._idle and not self._queued()):  # noqa: ASYNC110 - polls socket state, no event to wait on
            await asyncio.sleep(0.002)
        if self._task.done():
            return await self.wait()
        while self._files:
            done, _ = await asyncio.wait(self._files, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                self._files.discard(t)
                t.result()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        return self.stats

    def _queued(self) -> bool:
        """Whether CRIU has sent bytes we have not read yet (EOF counts as not queued)."""
        import socket

        if self._conn is None:
            return True  # not even connected yet
        try:
            return bool(self._conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return False

    async def abort(self) -> None:
        """Stop at once: close the socket and every pipe (CRIU sees EPIPE), drop pending
        pieces. Safe to call more than once."""
        tasks = [t for t in (self._task, *self._files) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for fd in list(self._fds):
            self._close_fd(fd)

    def _close_fd(self, fd: int) -> None:
        if fd in self._fds:
            self._fds.discard(fd)
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    async def _serve(self, listener: object) -> None:
        import socket

        assert isinstance(listener, socket.socket)
        conn = await protocol.accept(listener)
        self._conn = conn
        log.debug("criu connected to the capture socket", extra={"dir": str(self.images_dir)})
        try:
            while True:
                try:
                    self._idle = True
                    name = await conn.read_request()
                    self._idle = False
                    if name is None:
                        break
                    fd = await conn.recv_pipe()
                except protocol.ProtocolError as exc:
                    raise StreamError(f"capture: {exc}") from exc
                self._fds.add(fd)
                os.set_blocking(fd, False)
                protocol.set_pipe_size(fd, self.pipe_bytes)
                if name in self.stats.files:
                    log.info("criu writes %s again; the newer content replaces it", name)
                self.stats.files[name] = 0
                task = asyncio.create_task(self._drain(name, fd), name=f"capture:{name}")
                self._files.add(task)
            # CRIU is done announcing files; wait for the ones still flowing.
            while self._files:
                done, _ = await asyncio.wait(self._files, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    self._files.discard(t)
                    t.result()
        except BaseException:
            for t in self._files:
                t.cancel()
            raise
        finally:
            conn.close()
            self.stats.finished = time.time()
            assert self._budget is not None
            self.stats.peak_buffered = self._budget.peak

    async def _drain(self, name: str, fd: int) -> None:
        """Move one file from its pipe into the sink, piece by piece."""
        assert self._budget is not None
        try:
            out = await _open(self.sink, name)
        except Exception as exc:
            self._close_fd(fd)
            raise StreamError(f"capture: sink refused {name}: {exc}") from exc
        size = _FIRST_PIECE
        budgeted = 0
        buf = bytearray(size)
        filled = 0
        total = 0
        try:
            while True:
                n = await pipes.read_into(fd, memoryview(buf)[filled:])
                if n == 0:
                    break
                now = time.time()
                if self.stats.first_data is None:
                    self.stats.first_data = now
                self.stats.last_data = now
                filled += n
                total += n
                self.stats.files[name] = total
                if filled == len(buf):
                    await out.write(buf)  # type: ignore[arg-type]  # bytes-like, owned by sink
                    if budgeted:
                        await self._budget.give(budgeted)
                    budgeted = self.piece_bytes
                    await self._budget.take(budgeted)
                    buf = bytearray(self.piece_bytes)
                    filled = 0
            if filled:
                await out.write(bytes(memoryview(buf)[:filled]))
            await out.close()
        except OSError as exc:
            raise StreamError(f"capture: reading {name} from criu failed: {exc}") from exc
        finally:
            if budgeted:
                await self._budget.give(budgeted)
            self._close_fd(fd)
        log.debug("captured %s", name, extra={"file": name, "bytes": total})
