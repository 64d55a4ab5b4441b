"""The capture's reader threads and piece pool, driven through a real socket and real pipes by
a small client speaking CRIU's side of the image-streamer protocol (no CRIU needed)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path

import pytest

from spotguard.stream import Capture, DirSink, protocol
from spotguard.stream.pipes import PiecePool

KiB = 1024


def _criu_like(sock_path: Path, files: dict[str, bytes], opened: threading.Event) -> None:
    """What ``criu dump --stream`` does: one request per file, the pipe's read end passed
    with SCM_RIGHTS, the file's bytes written into the pipe, EOF on the socket at the end."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(sock_path))
    try:
        for name, data in files.items():
            r, w = os.pipe()
            s.sendall(protocol.encode_request(name))
            socket.send_fds(s, [b"\0"], [r])
            os.close(r)
            opened.set()
            with os.fdopen(w, "wb") as f:
                f.write(data)
    finally:
        s.close()


async def test_files_arrive_whole_through_small_pooled_pieces(tmp_path: Path) -> None:
    files = {
        "inventory.img": b"tiny",
        "pages-1.img": os.urandom(3 * 1024 * KiB + 17),  # many pieces, a partial last one
        "pagemap-1.img": bytes(range(256)) * 1000,
    }
    out = tmp_path / "out"
    cap = Capture(tmp_path / "criu", DirSink(out), piece_bytes=256 * KiB, buffer_bytes=512 * KiB)
    async with cap:
        client = asyncio.to_thread(_criu_like, cap.socket_path, files, threading.Event())
        await asyncio.wait_for(client, 60)
        stats = await asyncio.wait_for(cap.wait(), 60)
    for name, data in files.items():
        assert (out / name).read_bytes() == data, name
    assert stats.files == {n: len(d) for n, d in files.items()}
    assert 0 < stats.peak_buffered <= 512 * KiB  # the pool bound held


class _StuckSink:
    """A sink that never finishes a write: the capture's pool fills and reading stops."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    def file(self, name: str) -> _StuckSink:
        return self

    async def write(self, data: memoryview) -> None:
        self.entered.set()
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass


async def test_abort_closes_the_pipe_so_the_writer_gets_epipe(tmp_path: Path) -> None:
    """A streamer that stops must make CRIU fail (EPIPE), never leave it blocked on a pipe."""
    sink = _StuckSink()
    cap = Capture(tmp_path / "criu", sink, piece_bytes=256 * KiB, buffer_bytes=256 * KiB)
    await cap.start()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await asyncio.to_thread(s.connect, str(cap.socket_path))
    r, w = os.pipe()
    s.sendall(protocol.encode_request("pages-1.img"))
    socket.send_fds(s, [b"\0"], [r])
    os.close(r)
    outcome: list[BaseException] = []

    def write_until_refused() -> None:
        chunk = b"\xab" * (64 * KiB)
        try:
            while True:
                os.write(w, chunk)  # blocks once the pool and the pipe are full
        except OSError as exc:
            outcome.append(exc)

    writer = asyncio.create_task(asyncio.to_thread(write_until_refused))
    try:
        await asyncio.wait_for(sink.entered.wait(), 30)
        await cap.abort()
        await asyncio.wait_for(writer, 30)
    finally:
        os.close(w)
        s.close()
    assert len(outcome) == 1 and isinstance(outcome[0], BrokenPipeError)


def test_piece_pool_reuses_buffers_and_wakes_waiters_on_close() -> None:
    from spotguard.stream.pipes import Interrupted

    pool = PiecePool(64 * KiB, 2)
    a, b = pool.take(), pool.take()
    pool.release(a)
    assert pool.take() is a  # reused, not a fresh map
    failed: list[BaseException] = []

    def waiter() -> None:
        try:
            pool.take()  # all out: waits
        except Interrupted as exc:
            failed.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    pool.close()
    t.join(10)
    assert not t.is_alive() and len(failed) == 1
    with pytest.raises(Interrupted):
        pool.take()
    pool.release(b)


_NO_ROOM = """
import resource, sys, threading
from spotguard.stream.pipes import PiecePool
pool = PiecePool(256 << 20, 1)
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
mapped = int(open("/proc/self/statm").read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (mapped + (64 << 20), hard))  # no room for a piece
try:
    pool.take()
    sys.exit("a piece was made with no room for it")
except OSError:
    pass
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
got = []
t = threading.Thread(target=lambda: got.append(pool.take()), daemon=True)
t.start()
t.join(5)
print("took" if got else "stuck", pool.out, pool.made)
"""


def test_a_piece_that_could_not_be_made_leaves_room_for_the_next() -> None:
    """A piece whose map fails (no memory, an address-space limit) must not count as made:
    the pool's bound would shrink for good, and once every piece had failed each later take
    would wait for ever — a capture reader stuck with the job frozen. Real maps under a real
    ``RLIMIT_AS``, in a process of its own."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _NO_ROOM], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["took", "1", "1"]


def test_spliced_chunks_reach_the_reader_intact_after_they_are_unmapped() -> None:
    """vmsplice puts a chunk's pages into the pipe by reference; the chunk is unmapped at once
    and fresh maps are written meanwhile, yet the reader gets every byte as it was."""
    import hashlib

    from spotguard.image.buffers import OwnedChunk
    from spotguard.stream.pipes import splice_all

    r, w = os.pipe()
    os.set_blocking(w, False)
    expect = hashlib.blake2b()
    got = hashlib.blake2b()
    received = 0

    def reader() -> None:
        nonlocal received
        with os.fdopen(r, "rb", buffering=0) as f:
            while data := f.read(1 << 20):
                got.update(data)
                received += len(data)

    t = threading.Thread(target=reader)
    t.start()
    stop = threading.Event()
    sizes = [3 * KiB * KiB + 123, 1, 4096, 2 * KiB * KiB]
    try:
        for i, size in enumerate(sizes):
            chunk = OwnedChunk(size)
            data = os.urandom(size)
            chunk.map[:size] = data
            expect.update(data)
            splice_all(w, chunk.map, size, stop)
            chunk.close()
            scribble = OwnedChunk(size)  # a new map touched while the pipe holds the old pages
            scribble.map[:size] = bytes([i]) * size
            scribble.close()
    finally:
        os.close(w)
        t.join(10)
    assert received == sum(sizes)
    assert got.digest() == expect.digest()


def test_splice_into_a_closed_pipe_is_a_broken_pipe() -> None:
    from spotguard.image.buffers import OwnedChunk
    from spotguard.stream.pipes import splice_all

    r, w = os.pipe()
    os.close(r)
    chunk = OwnedChunk(8192)
    try:
        with pytest.raises(BrokenPipeError):
            splice_all(w, chunk.map, 8192, threading.Event())
    finally:
        chunk.close()
        os.close(w)


class _OwningSink:
    """Keeps whole pieces (no copy) and gives them back only later, like the image writer
    compressing a chunk where it lies; records where each kept piece starts in its file."""

    def __init__(self) -> None:
        self.data: dict[str, bytearray] = {}
        self.starts: dict[str, list[int]] = {}
        self.held: list[tuple[memoryview, object]] = []

    def file(self, name: str) -> _OwningSink.Out:
        self.data[name] = bytearray()
        self.starts[name] = []
        return _OwningSink.Out(self, name)

    class Out:
        def __init__(self, sink: _OwningSink, name: str) -> None:
            self.sink, self.name = sink, name

        async def write(self, data: memoryview) -> None:
            self.sink.data[self.name] += data

        async def write_owned(self, data: memoryview, owner: object) -> bool:
            self.sink.starts[self.name].append(len(self.sink.data[self.name]))
            self.sink.data[self.name] += data  # "compressed" later: the buffer is kept
            self.sink.held.append((data, owner))
            if len(self.sink.held) > 1:  # give back all but the newest
                view, old = self.sink.held.pop(0)
                view.release()
                old.release()  # type: ignore[attr-defined]
            return True

        async def close(self) -> None:
            for view, owner in self.sink.held:
                view.release()
                owner.release()  # type: ignore[attr-defined]
            self.sink.held.clear()


async def test_pieces_are_chunk_aligned_and_kept_without_a_copy(tmp_path: Path) -> None:
    piece = 512 * KiB
    files = {
        "pages-1.img": os.urandom(5 * piece + 4097),  # small start folded into the first piece
        "fs-1.img": b"small",
    }
    sink = _OwningSink()
    cap = Capture(tmp_path / "criu", sink, piece_bytes=piece, buffer_bytes=3 * piece)
    async with cap:
        client = asyncio.to_thread(_criu_like, cap.socket_path, files, threading.Event())
        await asyncio.wait_for(client, 60)
        stats = await asyncio.wait_for(cap.wait(), 60)
    for name, data in files.items():
        assert bytes(sink.data[name]) == data, name
    assert sink.starts["pages-1.img"] == [i * piece for i in range(6)]
    assert stats.owned == len(files["pages-1.img"])  # every byte of it kept in place
    assert stats.peak_buffered <= 3 * piece


def test_splice_puts_pages_into_the_pipe_by_reference_not_by_copy() -> None:
    """Proof that no copy is made: bytes changed after the splice (which OwnedChunk's users
    never do) are what the reader gets. A copying feeder would deliver the old bytes."""
    from spotguard.image.buffers import OwnedChunk
    from spotguard.stream.pipes import splice_all

    r, w = os.pipe()
    os.set_blocking(w, False)
    chunk = OwnedChunk(8192)
    try:
        chunk.map[:8192] = b"a" * 8192
        splice_all(w, chunk.map, 8192, threading.Event())
        chunk.map[:8192] = b"b" * 8192
        got = b""
        while len(got) < 8192:
            got += os.read(r, 8192 - len(got))
        assert got == b"b" * 8192
    finally:
        chunk.close()
        os.close(r)
        os.close(w)
