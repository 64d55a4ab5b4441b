"""Capture side of the image-streamer protocol: CRIU dumps, spotguard receives.

:class:`Capture` listens on ``streamer-capture.sock`` before CRIU starts. For every file CRIU
announces, a reader thread drains the file's pipe into reused piece buffers (the copy out of
the pipe runs with the GIL released, off the event loop) and the loop hands each full piece to
a *sink* — the image writer (chunk, zstd frames in threads, parallel uploads) or a plain
directory. The pieces are bounded (``buffer_bytes``); when the sink is slower than CRIU, the
readers wait for a free piece, the pipes fill and CRIU blocks: back-pressure, never unbounded
RAM.

A capture never decides that an image is complete: EOF on the socket looks the same whether
CRIU finished or died. The caller commits only after CRIU exited 0 (see
:class:`spotguard.stream.direct.StreamTarget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import mmap
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from spotguard.errors import StreamError
from spotguard.image.buffers import Lease
from spotguard.stream import pipes, protocol
from spotguard.stream.service import SocketService

log = logging.getLogger(__name__)

MiB = 1 << 20
_FIRST_PIECE = 256 * 1024  # small files never take a big piece or a slot of the budget


@runtime_checkable
class FileOut(Protocol):
    """One file being written into a sink (``ImageWriter.file(name)`` has this shape).

    ``write`` gets a view of a reused buffer: it is valid only until ``write`` returns, so a
    sink copies what it keeps. A sink may also have ``write_owned(data, owner) -> bool``
    (:class:`OwnsPieces`): it then keeps whole pieces without copying and gives each back
    through ``owner`` when done (the image writer: a piece is one chunk, compressed in place).
    """

    async def write(self, data: memoryview) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class OwnsPieces(Protocol):
    """A :class:`FileOut` that can take a piece's buffer instead of copying it."""

    async def write_owned(self, data: memoryview, owner: Lease) -> bool: ...


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
    pipe_bytes: int = 0  # the smallest pipe CRIU got (the kernel may refuse the size asked)
    owned: int = 0  # bytes the sink kept in the pieces they were read into (no copy)

    @property
    def bytes(self) -> int:
        return sum(self.files.values())

    def to_json(self) -> dict[str, object]:
        return {
            "files": len(self.files),
            "bytes": self.bytes,
            "peak_buffered": self.peak_buffered,
            "owned": self.owned,
            "pipe_bytes": self.pipe_bytes,
            "seconds": None if self.finished is None else self.finished - self.started,
        }


async def _open(sink: CaptureSink, name: str) -> FileOut:
    out = sink.file(name)
    if inspect.isawaitable(out):
        return await out
    return out


class Capture(SocketService):
    """Receive one ``criu dump --stream`` into ``sink``.

    Use as ``async with Capture(dir, sink) as cap:`` — the socket is listening when the body
    starts (run CRIU there), then ``stats = await cap.wait()`` once CRIU has exited. Leaving
    the block before ``wait()`` finished (an error, a cancellation) aborts: every pipe is
    closed, so a CRIU still running gets EPIPE and fails rather than hanging.
    """

    SOCKET = protocol.CAPTURE_SOCKET

    def __init__(
        self,
        images_dir: Path,
        sink: CaptureSink,
        *,
        piece_bytes: int = 16 * MiB,
        buffer_bytes: int = 256 * MiB,
        pipe_bytes: int = 16 * MiB,
    ) -> None:
        self.images_dir = Path(images_dir)
        self.sink = sink
        self.piece_bytes = max(piece_bytes, _FIRST_PIECE)
        self.pipe_bytes = pipe_bytes
        self.stats = CaptureStats()
        self._pool: pipes.PiecePool | None = None
        self._stop = threading.Event()
        self._buffer_bytes = buffer_bytes
        self._task: asyncio.Task[None] | None = None
        self._files: set[asyncio.Task[None]] = set()
        self._threads: list[threading.Thread] = []
        self._conn: protocol.Connection | None = None
        self._idle = False  # parked waiting for CRIU's next request
        self._first_error: BaseException | None = None  # the cause, not the files it stopped
        self._settled: CaptureStats | None = None  # what settle() found, once it has

    @property
    def error(self) -> BaseException | None:
        """Why the capture stopped, once it failed (a sink that refused a piece, a protocol
        error); None while it runs, after it finished cleanly or was cancelled."""
        t = self._task
        if t is None or not t.done() or t.cancelled():
            return None
        exc = t.exception()  # marks it retrieved
        return self._first_error or exc

    async def start(self) -> None:
        """Listen on the capture socket; CRIU may be started once this returns."""
        self.images_dir.mkdir(parents=True, exist_ok=True)
        self._pool = pipes.PiecePool(self.piece_bytes, self._buffer_bytes // self.piece_bytes)
        self._stop = threading.Event()
        listener = protocol.listen(self.images_dir, self.SOCKET)
        self.stats = CaptureStats()
        self._settled = None
        self._task = asyncio.create_task(self._serve(listener), name="stream-capture")

    @property
    def pieces(self) -> pipes.PiecePool | None:
        """The pool CRIU's pipes are read into (None before :meth:`start`): a producer of
        other memory of the image may fill its pieces too (:meth:`FileSink.produce_owned`)."""
        return self._pool

    async def prefault(self, nbytes: int, threads: int) -> int:
        """Make the pieces for ``nbytes`` of the image now, before CRIU starts — every map
        first, then their pages faulted in by ``threads`` threads at once
        (:meth:`pipes.PiecePool.reserve`, :meth:`~pipes.PiecePool.fill`): a leave-running
        dump's hold made while the job still runs, so the frozen job does not wait for the
        kernel to zero them. Returns the bytes faulted in; an abort stops it."""
        assert self._pool is not None, "start() first"
        pool, stop = self._pool, self._stop
        bufs = await asyncio.to_thread(pool.reserve, -(-max(0, nbytes) // pool.size))
        if not bufs:
            return 0
        threads = max(1, min(threads, len(bufs)))
        made = await asyncio.gather(
            *(asyncio.to_thread(pool.fill, bufs[i::threads], stop) for i in range(threads))
        )
        return sum(made) * pool.size

    async def wait(self) -> CaptureStats:
        """Wait until CRIU closed the socket and every file reached the sink; raise on any
        failure of the protocol or the sink."""
        assert self._task is not None, "Capture.start() first"
        try:
            await self._task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and not me.cancelling():  # aborted, not our caller cancelled
                raise StreamError("capture: stopped before every file reached the sink") from None
            raise
        return self.stats

    async def settle(self) -> CaptureStats:
        """CRIU has written every file (it waits in its post-dump step, or has exited): take
        what is still queued on the socket, wait until every file reached the sink, stop.

        The engine completes an image while the tree is still frozen and CRIU still holds
        the socket open, so end-of-socket cannot be the signal there.
        """
        assert self._task is not None, "Capture.start() first"
        if self._settled is not None:  # settled before (a leave-running dump's drain)
            return self._settled
        while not self._task.done() and not (self._idle and not self._queued()):  # noqa: ASYNC110 - polls socket state, no event to wait on
            await asyncio.sleep(0.002)
        if self._task.done():
            return await self.wait()
        while self._files:
            done, _ = await asyncio.wait(self._files, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                self._files.discard(t)
                if self._first_error is not None:
                    raise self._first_error
                if t.cancelled():  # aborted while settling: typed, not a cancellation
                    raise StreamError("capture: stopped before every file reached the sink")
                t.result()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._settled = self.stats
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
        """Stop at once: every reader thread closes its pipe (CRIU sees EPIPE), pending
        pieces are dropped. Safe to call more than once."""
        self._halt()
        tasks = [t for t in (self._task, *self._files) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        threads = [t for t in self._threads if t.is_alive()]
        if threads:  # they notice within pipes.POLL_S; CRIU's pipes are closed once they end
            await asyncio.to_thread(_join, threads, 5.0)

    def _halt(self) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.close()

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
                os.set_blocking(fd, False)
                try:
                    got = protocol.set_pipe_size(fd, self.pipe_bytes)
                except OSError:
                    os.close(fd)
                    raise
                self.stats.pipe_bytes = min(got, self.stats.pipe_bytes or got)
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
                    if self._first_error is not None:
                        raise self._first_error
                    t.result()
        except BaseException:
            self._halt()  # a failed capture must make CRIU fail, not wait on a full pipe
            for t in self._files:
                t.cancel()
            raise
        finally:
            conn.close()
            self.stats.finished = time.time()
            assert self._pool is not None
            self.stats.peak_buffered = self._pool.peak * self._pool.size

    async def _drain(self, name: str, fd: int) -> None:
        """Move one file from its pipe into the sink: a thread reads, the loop hands on."""
        try:
            out = await _open(self.sink, name)
        except Exception as exc:
            os.close(fd)
            raise StreamError(f"capture: sink refused {name}: {exc}") from exc
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Item] = asyncio.Queue()

        def put(item: _Item) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody to tell
                loop.call_soon_threadsafe(queue.put_nowait, item)

        assert self._pool is not None
        reader = threading.Thread(
            target=_read_pipe, args=(fd, self._pool, self._stop, put),
            name=f"capture:{name}", daemon=True,
        )  # fmt: skip
        try:
            reader.start()
        except BaseException:
            os.close(fd)
            raise
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(reader)
        total = 0
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, pipes.Interrupted):
                    raise _Halted(f"capture: {name} stopped (capture aborted)")
                if isinstance(item, OSError):
                    raise StreamError(f"capture: reading {name} from criu failed: {item}")
                if isinstance(item, BaseException):
                    raise item
                buf, n, pooled = item
                now = time.time()
                if self.stats.first_data is None:
                    self.stats.first_data = now
                self.stats.last_data = now
                total += n
                self.stats.files[name] = total
                if not pooled:
                    with memoryview(buf) as whole, whole[:n] as piece:
                        await out.write(piece)
                    continue
                assert isinstance(buf, mmap.mmap)
                # The piece goes back to the pool exactly once, by the sink or below.
                owner = Lease(self._pool, buf, None)
                try:
                    # Owned: the sink keeps the view (the one copy was out of the pipe).
                    piece = owner.view[:n]
                    if isinstance(out, OwnsPieces) and await out.write_owned(piece, owner):
                        self.stats.owned += n
                    else:
                        await out.write(piece)
                        piece.release()
                        owner.release()
                except BaseException:
                    owner.release()  # no-op where the sink already gave it back
                    raise
            await out.close()
        except BaseException as exc:
            if self._first_error is None and not isinstance(exc, _Halted | asyncio.CancelledError):
                self._first_error = exc
            self._halt()
            raise
        log.debug("captured %s", name, extra={"file": name, "bytes": total})


class _Halted(StreamError):
    """A file stopped because the capture was halted (by an abort or another file's error)."""


#: What a reader thread hands the loop: (buffer, bytes in it, pooled?), an error, or None (EOF).
_Item = tuple[mmap.mmap | bytearray, int, bool] | BaseException | None


def _read_pipe(
    fd: int, pool: pipes.PiecePool, stop: threading.Event, put: Callable[[_Item], None]
) -> None:
    """Reader thread of one file: fill pieces from the pipe, hand each to the loop, then EOF.
    Small files fill one small piece and never take a pooled one. Pooled pieces start at
    multiples of the piece size (the small start is copied into the first), so a sink whose
    chunks are that size can keep them as chunks. Owns and closes ``fd``."""
    try:
        first = bytearray(_FIRST_PIECE)
        n = pipes.fill(fd, memoryview(first), stop)
        if n < len(first):
            put((first, n, False))
            put(None)
            return
        start = n
        more = True
        while more:
            buf = pool.take()
            try:
                with memoryview(buf) as view:
                    if start:
                        view[:start] = first
                    n = start + pipes.fill(fd, view[start:], stop)
            except BaseException:
                pool.release(buf)
                raise
            start = 0
            more = n == pool.size
            if n:
                put((buf, n, True))
            else:
                pool.release(buf)
        put(None)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the loop, typed there
        put(exc)
    finally:
        os.close(fd)


def _join(threads: list[threading.Thread], timeout: float) -> None:
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
