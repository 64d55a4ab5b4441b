"""CRIU's image-streamer protocol, the wire side.

With ``--stream``, CRIU does not open image files itself. It connects to a unix socket in the
images directory (``streamer-capture.sock`` for ``dump``, ``streamer-serve.sock`` for
``restore``) and, for every image file, sends a request naming the file. On dump it then hands
over the write end of a fresh pipe (``SCM_RIGHTS``, one dummy data byte) and writes the file's
bytes into it. On restore the streamer first answers whether the file exists; if it does, CRIU
hands over the read end of a pipe and reads the file from it. EOF on the socket means no more
files; EOF on a pipe means the end of that file. All requests share the one connection.

Each message is a 4-byte little-endian length followed by a protobuf message with a single
field: ``img_streamer_request_entry { required string filename = 1; }`` and
``img_streamer_reply_entry { required bool exists = 1; }``. Two one-field messages do not
justify the protobuf runtime and a generated module; the codec below is the varint and the two
field tags, nothing more, and the tests run it against real CRIU.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import select
import socket
import struct
from pathlib import Path
from typing import Protocol

CAPTURE_SOCKET = "streamer-capture.sock"
SERVE_SOCKET = "streamer-serve.sock"

#: fcntl commands (Linux) to read and set a pipe's capacity.
F_SETPIPE_SZ = 1031
F_GETPIPE_SZ = 1032

_MAX_MESSAGE = 64 * 1024  # a file name; anything bigger is a broken peer
_LEN = struct.Struct("<I")
_POLL_MS = 50  # a thread waiting on the socket looks at its stop flag this often
POLL_S = _POLL_MS / 1000


class Stop(Protocol):
    """What a thread's conversation checks to give up (a ``threading.Event`` has this)."""

    def is_set(self) -> bool: ...


_TAG_FILENAME = 0x0A  # field 1, wire type 2 (length-delimited)
_TAG_EXISTS = 0x08  # field 1, wire type 0 (varint)


class ProtocolError(Exception):
    """The peer sent something that is not the image-streamer protocol (mapped by callers)."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ProtocolError("truncated varint")


def encode_request(filename: str) -> bytes:
    """A framed ``img_streamer_request_entry`` (what CRIU sends; used by tests and tools)."""
    name = filename.encode()
    body = bytes([_TAG_FILENAME]) + _varint(len(name)) + name
    return _LEN.pack(len(body)) + body


def decode_request(body: bytes) -> str:
    """The file name in an unframed ``img_streamer_request_entry``."""
    if not body or body[0] != _TAG_FILENAME:
        raise ProtocolError(f"not a file request: {body[:16]!r}")
    length, pos = _read_varint(body, 1)
    if pos + length > len(body):
        raise ProtocolError("truncated file name")
    try:
        return body[pos : pos + length].decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError("file name is not UTF-8") from exc


def encode_reply(exists: bool) -> bytes:
    """A framed ``img_streamer_reply_entry``."""
    body = bytes([_TAG_EXISTS, 1 if exists else 0])
    return _LEN.pack(len(body)) + body


def decode_reply(body: bytes) -> bool:
    """``exists`` of an unframed ``img_streamer_reply_entry``."""
    if not body or body[0] != _TAG_EXISTS:
        raise ProtocolError(f"not a file reply: {body[:16]!r}")
    value, _ = _read_varint(body, 1)
    return bool(value)


def listen(images_dir: Path, name: str) -> socket.socket:
    """Bind the streamer socket ``name`` in ``images_dir`` (replacing a stale one) and listen.

    Bound before CRIU starts, so CRIU's ``connect`` never races the streamer.
    """
    path = images_dir / name
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(1)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def set_pipe_size(fd: int, size: int) -> int:
    """Grow a pipe to ``size`` bytes (or the largest the kernel allows below it); returns the
    size set.

    Bigger pipes let CRIU run ahead while a reader or feeder thread is busy. Without
    CAP_SYS_RESOURCE the kernel caps a pipe at ``/proc/sys/fs/pipe-max-size`` (EPERM), a
    large slot array may not be allocatable (ENOMEM): each refusal halves the request, down
    to the size the pipe already has.
    """
    while True:
        try:
            return fcntl.fcntl(fd, F_SETPIPE_SZ, size)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EBUSY, errno.EINVAL, errno.ENOMEM):
                raise
            current = fcntl.fcntl(fd, F_GETPIPE_SZ)
            size //= 2
            if size <= current:
                return current


class Connection:
    """CRIU's end of the streamer socket, read and written without blocking the event loop.

    Reads take exactly the bytes asked for, so a request, the dummy byte that carries a pipe
    and the next request are never merged; descriptors that arrive are queued in order.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._fds: list[int] = []

    @property
    def sock(self) -> socket.socket:
        return self._sock

    async def _wait_readable(self) -> None:
        from spotguard.stream.pipes import wait_fd

        await wait_fd(self._sock.fileno())

    async def _recv_exact(self, n: int) -> bytes | None:
        """``n`` bytes, or None at a clean EOF before the first byte."""
        buf = b""
        while len(buf) < n:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, n - len(buf), 4)
            except (BlockingIOError, InterruptedError):
                await self._wait_readable()
                continue
            self._fds.extend(fds)
            if not data:
                if buf:
                    raise ProtocolError(f"connection closed inside a message ({len(buf)}/{n})")
                return None
            buf += data
        return buf

    async def read_request(self) -> str | None:
        """The next file name CRIU asks for, or None when CRIU is done (EOF)."""
        head = await self._recv_exact(_LEN.size)
        if head is None:
            return None
        (length,) = _LEN.unpack(head)
        if length > _MAX_MESSAGE:
            raise ProtocolError(f"request of {length} bytes: not the image-streamer protocol")
        body = await self._recv_exact(length) if length else b""
        if body is None:
            raise ProtocolError("connection closed inside a request")
        return decode_request(body)

    async def recv_pipe(self) -> int:
        """The pipe end CRIU passes after a request (dump) or a positive reply (restore)."""
        while not self._fds:
            if await self._recv_exact(1) is None:
                raise ProtocolError("connection closed before the file's pipe arrived")
        return self._take_fd()

    def _take_fd(self) -> int:
        """The pipe that arrived; strays closed (never more than one per file)."""
        fd = self._fds.pop(0)
        for extra in self._fds:
            os.close(extra)
        self._fds.clear()
        return fd

    async def send_reply(self, exists: bool) -> None:
        await self._loop.sock_sendall(self._sock, encode_reply(exists))

    # --- the same conversation from a thread (blocking, with a stop flag) -------------------
    def _recv_exact_sync(self, n: int, stop: Stop) -> bytes | None:
        """:meth:`_recv_exact` for a thread: waits in ``poll`` (GIL released), gives up with
        :class:`ProtocolError` once ``stop`` is set."""
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        buf = b""
        while len(buf) < n:
            if stop.is_set():
                raise ProtocolError("stopped")
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, n - len(buf), 4)
            except (BlockingIOError, InterruptedError):
                poller.poll(_POLL_MS)
                continue
            self._fds.extend(fds)
            if not data:
                if buf:
                    raise ProtocolError(f"connection closed inside a message ({len(buf)}/{n})")
                return None
            buf += data
        return buf

    def read_request_sync(self, stop: Stop) -> str | None:
        """:meth:`read_request` for a thread."""
        head = self._recv_exact_sync(_LEN.size, stop)
        if head is None:
            return None
        (length,) = _LEN.unpack(head)
        if length > _MAX_MESSAGE:
            raise ProtocolError(f"request of {length} bytes: not the image-streamer protocol")
        body = self._recv_exact_sync(length, stop) if length else b""
        if body is None:
            raise ProtocolError("connection closed inside a request")
        return decode_request(body)

    def recv_pipe_sync(self, stop: Stop) -> int:
        """:meth:`recv_pipe` for a thread."""
        while not self._fds:
            if self._recv_exact_sync(1, stop) is None:
                raise ProtocolError("connection closed before the file's pipe arrived")
        return self._take_fd()

    def send_reply_sync(self, exists: bool, stop: Stop) -> None:
        """:meth:`send_reply` for a thread."""
        data = memoryview(encode_reply(exists))
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLOUT)
        while data:
            if stop.is_set():
                raise ProtocolError("stopped")
            try:
                data = data[self._sock.send(data) :]
            except (BlockingIOError, InterruptedError):
                poller.poll(_POLL_MS)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._sock.close()


async def accept(listener: socket.socket) -> Connection:
    """Wait for CRIU to connect, then stop listening (one CRIU per streamer)."""
    loop = asyncio.get_running_loop()
    try:
        sock, _ = await loop.sock_accept(listener)
    finally:
        listener.close()
    return Connection(sock)
