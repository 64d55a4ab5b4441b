"""Serve side of the image-streamer protocol: CRIU restores, spotguard feeds it.

:class:`Serve` listens on ``streamer-serve.sock``. CRIU asks for files one by one; a file the
image has is answered "exists", CRIU hands over a pipe and the file's bytes are fed into it
straight from the source (the image reader: download, verify, decompress, pipelined) — no
staging directory. A file the image lacks is answered "does not exist", as CRIU expects for
optional images (``memfd.img``, ``tty-info.img`` ...). A file asked for twice is served twice.

A feeder thread per file puts the pieces into the pipe (GIL released while it waits), so the
event loop only hands pieces on; writing from the loop itself took it a wake-up and a write
per few pages CRIU took out of a full pipe (docs/benchmarks.md, "Streaming"). Decoded chunks
arrive as :class:`~spotguard.image.buffers.OwnedChunk` maps and go into the pipe by reference
(``vmsplice``): CRIU's read out of the pipe is then the only copy on the restore path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from spotguard.errors import SpotguardError, StreamError
from spotguard.image.buffers import OwnedChunk
from spotguard.stream import pipes, protocol
from spotguard.stream.service import SocketService

log = logging.getLogger(__name__)

MiB = 1 << 20


@runtime_checkable
class ServeSource(Protocol):
    """Where served files come from."""

    def exists(self, name: str) -> bool: ...

    def iter_file(self, name: str) -> AsyncIterator[bytes | OwnedChunk]: ...


@dataclass
class ServeStats:
    """What one serve sent: bytes per file, names asked for that the image lacks."""

    files: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    spliced: int = 0  # bytes that went into CRIU's pipes by reference (vmsplice), not copied
    pipe_bytes: int = 0  # the smallest pipe CRIU got (the kernel may refuse the size asked)
    started: float = field(default_factory=time.time)
    finished: float | None = None
    #: seconds CRIU waited on the socket for each open (request in, pipe received): CRIU
    #: opens files one at a time under one lock shared by all its tasks
    open_seconds: float = 0.0
    open_max: float = 0.0
    opens: int = 0

    @property
    def bytes(self) -> int:
        return sum(self.files.values())

    def to_json(self) -> dict[str, object]:
        return {
            "files": len(self.files),
            "bytes": self.bytes,
            "missing": len(self.missing),
            "spliced": self.spliced,
            "pipe_bytes": self.pipe_bytes,
            "opens": self.opens,
            "open_seconds": round(self.open_seconds, 3),
            "open_max": round(self.open_max, 3),
            "seconds": None if self.finished is None else self.finished - self.started,
        }


class Serve(SocketService):
    """Feed one ``criu restore --stream`` from ``source``.

    ``async with Serve(dir, source) as srv:`` listens; run CRIU in the body, then
    ``await srv.wait()``. Leaving early closes every pipe so CRIU fails instead of hanging.
    """

    SOCKET = protocol.SERVE_SOCKET

    def __init__(
        self,
        images_dir: Path,
        source: ServeSource,
        *,
        pipe_bytes: int = 16 * MiB,
        ahead: int = 2,
    ) -> None:
        self.images_dir = Path(images_dir)
        self.source = source
        self.pipe_bytes = pipe_bytes
        self.ahead = max(1, ahead)  # pieces queued per file for its feeder thread
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.stats = ServeStats()
        self._task: asyncio.Task[None] | None = None
        self._feeds: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None

    async def start(self) -> None:
        self.images_dir.mkdir(parents=True, exist_ok=True)
        listener = protocol.listen(self.images_dir, self.SOCKET)
        self.stats = ServeStats()
        self._task = asyncio.create_task(self._serve(listener), name="stream-serve")

    async def wait(self) -> ServeStats:
        """Wait until CRIU closed the socket and every file was fed; a failed feed (a
        corrupt chunk, an unreachable store) is raised here with its own type."""
        assert self._task is not None, "Serve.start() first"
        try:
            await self._task
        except asyncio.CancelledError:
            if self._failure is None:
                raise
        if self._failure is not None:
            if isinstance(self._failure, SpotguardError):
                raise self._failure
            raise StreamError(f"serve: {self._failure}") from self._failure
        return self.stats

    async def abort(self) -> None:
        self._stop.set()  # feeder threads close CRIU's pipes within pipes.POLL_S
        tasks = [t for t in (self._task, *self._feeds) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _serve(self, listener: socket.socket) -> None:
        conn = await protocol.accept(listener)
        loop = asyncio.get_running_loop()
        opened: asyncio.Queue[_Opened] = asyncio.Queue()
        halt = threading.Event()  # this conversation's end (the feeders have self._stop)

        def put(item: _Opened) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody to tell
                loop.call_soon_threadsafe(opened.put_nowait, item)

        talker = threading.Thread(
            target=self._talk, args=(conn, halt, put), name="serve-socket", daemon=True
        )
        talker.start()
        try:
            while (item := await opened.get()) is not None:
                if isinstance(item, protocol.ProtocolError):
                    raise StreamError(f"serve: {item}") from item
                if isinstance(item, OSError):  # CRIU went away mid-conversation
                    raise StreamError(f"serve: connection to criu failed: {item}") from item
                if isinstance(item, BaseException):
                    raise item
                name, fd = item
                # Feed concurrently: the tasks CRIU restores read their files at once.
                task = asyncio.create_task(self._feed(name, fd), name=f"serve:{name}")
                self._feeds.add(task)
                task.add_done_callback(self._feeds.discard)
            while self._feeds:
                await asyncio.wait(set(self._feeds))
        except BaseException:
            for t in self._feeds:
                t.cancel()
            raise
        finally:
            halt.set()
            try:
                await asyncio.to_thread(talker.join, 2 * protocol.POLL_S)
            finally:
                while not opened.empty():  # pipes handed over after the end: close them
                    item = opened.get_nowait()
                    if isinstance(item, tuple):
                        os.close(item[1])
                conn.close()
                self.stats.finished = time.time()

    def _talk(
        self, conn: protocol.Connection, halt: threading.Event, put: Callable[[_Opened], None]
    ) -> None:
        """The socket conversation with CRIU, on its own thread: every task CRIU restores
        opens its files through this one socket under one lock, so an answer delayed by a
        busy event loop held up every task (their starts were staggered); a thread blocked
        in ``poll`` answers at once. Hands each opened file's pipe to the loop."""
        stop = _Either(halt, self._stop)
        try:
            while True:
                name = conn.read_request_sync(stop)
                if name is None:
                    break
                t0 = time.perf_counter()
                exists = self.source.exists(name)
                conn.send_reply_sync(exists, stop)
                if not exists:
                    with self._lock:
                        self.stats.missing.append(name)
                    continue
                fd = conn.recv_pipe_sync(stop)
                took = time.perf_counter() - t0
                with self._lock:
                    self.stats.opens += 1
                    self.stats.open_seconds += took
                    self.stats.open_max = max(self.stats.open_max, took)
                put((name, fd))
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, typed there
            put(exc)
            return
        put(None)

    async def _feed(self, name: str, fd: int) -> None:
        """Feed one file: the loop pulls pieces from the source, a thread writes them."""
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(self.ahead)
        pieces: queue.SimpleQueue[bytes | OwnedChunk | None] = queue.SimpleQueue()
        done: asyncio.Future[BaseException | None] = loop.create_future()
        sent = 0

        def finished(exc: BaseException | None) -> None:
            if not done.done():
                done.set_result(exc)

        def writer() -> None:
            exc: BaseException | None = None
            try:
                os.set_blocking(fd, False)
                got = protocol.set_pipe_size(fd, self.pipe_bytes)
                with self._lock:
                    self.stats.pipe_bytes = min(got, self.stats.pipe_bytes or got)
                splice = True
                while (data := _get(pieces, self._stop)) is not None:
                    splice = _put(fd, data, self._stop, splice=splice)
                    if splice and isinstance(data, OwnedChunk):
                        with self._lock:
                            self.stats.spliced += data.size
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(slots.release)
            except BaseException as e:  # noqa: BLE001 - handed to the loop below
                exc = e
            finally:
                os.close(fd)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(finished, exc)

        thread = threading.Thread(target=writer, name=f"serve:{name}", daemon=True)
        try:
            thread.start()
        except BaseException:
            os.close(fd)
            raise
        try:
            async for data in self.source.iter_file(name):
                if done.done():
                    break  # the writer stopped (CRIU closed the pipe, or a stop)
                await slots.acquire()
                pieces.put(data)
                sent += len(data)
            pieces.put(None)
            exc = await done
            if isinstance(exc, BrokenPipeError):
                log.info("criu closed %s after %d bytes", name, sent, extra={"file": name})
            elif isinstance(exc, pipes.Interrupted):
                raise StreamError(f"serve: feeding {name} stopped")
            elif exc is not None:
                raise StreamError(f"serve: writing {name} to criu failed: {exc}") from exc
        except asyncio.CancelledError:
            self._stop.set()
            raise
        except Exception as exc:  # noqa: BLE001 - any source failure must stop CRIU; kept typed
            # Stop everything: closing CRIU's pipes makes CRIU fail instead of waiting.
            log.error("serving %s failed: %s", name, exc, extra={"file": name})
            self._failure = exc
            self._stop.set()
            if self._task is not None:
                self._task.cancel()
        finally:
            pieces.put(None)
            self.stats.files[name] = sent


#: What the socket thread hands the loop: an opened file and its pipe, an error, or None (EOF).
_Opened = tuple[str, int] | BaseException | None


class _Either:
    """Set when either of two events is (the protocol's ``stop`` for the socket thread)."""

    def __init__(self, a: threading.Event, b: threading.Event) -> None:
        self._a, self._b = a, b

    def is_set(self) -> bool:
        return self._a.is_set() or self._b.is_set()


def _put(fd: int, data: bytes | OwnedChunk, stop: threading.Event, *, splice: bool) -> bool:
    """Put one piece into CRIU's pipe: an owned chunk by reference (its pages go into the pipe,
    then it is unmapped), anything else by copy. Returns whether splicing still works."""
    if not isinstance(data, OwnedChunk):
        pipes.put_all(fd, data, stop)
        return splice
    try:
        if splice:
            try:
                pipes.splice_all(fd, data.map, data.size, stop)
                return True
            except pipes.SpliceUnsupported as exc:
                log.info("vmsplice refused (%s): writing pieces instead", exc)
        with memoryview(data.map) as view, view[: data.size] as part:
            pipes.put_all(fd, part, stop)
        return False
    finally:
        data.close()


def _get(
    pieces: queue.SimpleQueue[bytes | OwnedChunk | None], stop: threading.Event
) -> bytes | OwnedChunk | None:
    """The next piece for a feeder thread; raises :class:`pipes.Interrupted` once stopped."""
    while True:
        if stop.is_set():
            raise pipes.Interrupted
        try:
            return pieces.get(timeout=pipes.POLL_S)
        except queue.Empty:
            continue
