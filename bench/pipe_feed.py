"""How fast can a restore read page data, by the way it is fed? (the serve side's transport)

A reader process stands in for ``criu restore``: it reads N MiB into fresh anonymous memory
(page faults and all, like CRIU filling the job's mappings) from
  tmpfs     a file in /dev/shm (what a staged restore reads),
  write     a pipe that a feeder thread fills with ``write`` (a copy into the pipe),
  vmsplice  a pipe that a feeder thread fills by reference (``splice_all`` of an
            ``OwnedChunk``: the reader's copy out of the pipe is the only one).
The feeder's chunks are ready in memory beforehand, so only the transport is measured.

    python -m bench.pipe_feed --size-mb 4096 --repeat 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import threading
import time

from spotguard.image.buffers import OwnedChunk
from spotguard.stream import pipes, protocol

MiB = 1 << 20
CHUNK = 64 * MiB


def _read_into_fresh_memory(fd: int, size: int, *, pread: bool) -> int:
    dest = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(dest)
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:]], got) if pread else os.readv(fd, [view[got:]])
        if n == 0:
            break
        got += n
    view.release()
    dest.close()
    return got


def _reader_process(fd: int, size: int, *, pread: bool) -> int:
    """Fork a reader; returns its pid. It exits 0 only if it read all ``size`` bytes."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        ok = _read_into_fresh_memory(fd, size, pread=pread) == size
        os._exit(0 if ok else 1)
    return pid


def run(mode: str, size: int, pipe_bytes: int) -> tuple[float, int]:
    """Seconds for the reader to take ``size`` bytes, and the pipe size used."""
    data = os.urandom(CHUNK)
    if mode == "tmpfs":
        path = f"/dev/shm/sg-pipe-feed-{os.getpid()}"
        with open(path, "wb") as f:
            for _ in range(size // CHUNK):
                f.write(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            t = time.perf_counter()
            pid = _reader_process(fd, size, pread=True)
            _, status = os.waitpid(pid, 0)
            took = time.perf_counter() - t
        finally:
            os.close(fd)
            os.unlink(path)
        if status:
            raise RuntimeError("reader failed")
        return took, 0
    chunks = []
    for _ in range(size // CHUNK):  # ready beforehand: only the transport is timed
        c = OwnedChunk(CHUNK)
        c.map[:] = data
        chunks.append(c)
    r, w = os.pipe()
    got = protocol.set_pipe_size(w, pipe_bytes)
    stop = threading.Event()
    t = time.perf_counter()
    pid = _reader_process(r, size, pread=False)
    os.close(r)
    os.set_blocking(w, False)
    for c in chunks:
        if mode == "vmsplice":
            pipes.splice_all(w, c.map, c.size, stop)
        else:
            pipes.put_all(w, c.map, stop)
        c.close()
    os.close(w)
    _, status = os.waitpid(pid, 0)
    took = time.perf_counter() - t
    if status:
        raise RuntimeError("reader failed")
    return took, got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pipe-mb", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["tmpfs", "write", "vmsplice"])
    args = ap.parse_args()
    size = max(1, args.size_mb * MiB // CHUNK) * CHUNK
    print(f"# pipe feed: {size >> 20} MiB into fresh memory, {os.cpu_count()} cpus")
    print("| mode | pipe MiB | median s | GB/s | runs s |")
    print("| --- | --- | --- | --- | --- |")
    for mode in args.modes:
        times, pipe = [], 0
        for _ in range(args.repeat):
            took, pipe = run(mode, size, args.pipe_mb * MiB)
            times.append(took)
        med = statistics.median(times)
        runs = " ".join(f"{x:.2f}" for x in times)
        print(f"| {mode} | {pipe >> 20 or '—'} | {med:.2f} | {size / med / 1e9:.2f} | {runs} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
