"""What each pass of the GPU-page copy (:mod:`spotguard.checkpoint.gpupages`) costs on this
machine when 1 … N threads make it at once: the profile behind the 40 GiB and N-rank rows.

A restore writes the staged GPU memory back: each chunk is read from the file store (tmpfs:
``preadv`` of 1 MiB pieces into a reused buffer, each hashed with BLAKE3 right after) and
written into the restored process (``process_vm_writev`` into its fresh mapping). A freeze
does the reverse: ``process_vm_readv`` out of the frozen process, hash, write a file to tmpfs
— timed with whole chunks at each step (the chunk pipeline), and a MiB at a time, each piece
hashed and written while in cache (measured no faster: the passes are bound by the kernel, not
by memory traffic; docs/benchmarks.md).
Each pass is timed alone and the restore's two together, over ``--gib`` GiB in 64 MiB chunks,
so the stage that bounds a measured ``gpu_pages`` step can be named in bytes/s.

    python -m bench.pagecopy --gib 16 --threads 1 8 16 32
"""

from __future__ import annotations

import argparse
import mmap
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from blake3 import blake3

from spotguard.checkpoint.procmem import read_memory, write_memory

CHUNK = 64 << 20
PIECE = 1 << 20

CHILD = """
import ctypes, mmap, sys, time
n, fill = int(sys.argv[1]), sys.argv[2] == "1"
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if fill:
    for off in range(0, n, 1 << 20):
        m[off:off + 8] = off.to_bytes(8, "little")
c = ctypes.c_char.from_buffer(m)
print(ctypes.addressof(c), flush=True)
time.sleep(3600)
"""


def _child(size: int, fill: bool) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(size), "1" if fill else "0"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _run(threads: int, chunks: int, work: Callable[[int, memoryview], None]) -> float:
    """``work(chunk_index, buffer)`` over every chunk by ``threads`` threads; seconds."""
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(chunks):
        todo.put(i)

    def worker() -> None:
        buf = mmap.mmap(-1, CHUNK)
        buf.write(os.urandom(1 << 16) * (CHUNK >> 16))  # warm: every page mapped
        view = memoryview(buf)
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            work(i, view)

    return run_threads([threading.Thread(target=worker) for _ in range(threads)])


def run_threads(ts: list[threading.Thread]) -> float:
    """Seconds from starting all of ``ts`` until the last has ended."""
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def _read(files: list[Path]) -> Callable[[int, memoryview], None]:
    def work(i: int, view: memoryview) -> None:
        h = blake3()
        fd = os.open(files[i], os.O_RDONLY)
        try:
            for off in range(0, CHUNK, PIECE):
                os.preadv(fd, [view[off : off + PIECE]], off)
                h.update(view[off : off + PIECE])
        finally:
            os.close(fd)

    return work


def _writev(pid: int, addr: int, files: list[Path] | None) -> Callable[[int, memoryview], None]:
    """Each chunk into ``pid`` at ``addr`` (read from ``files`` and hashed first, if given)."""
    read = _read(files) if files is not None else None

    def work(i: int, view: memoryview) -> None:
        if read is not None:
            read(i, view)
        write_memory(pid, addr + i * CHUNK, view)

    return work


def _readv(pid: int, addr: int) -> Callable[[int, memoryview], None]:
    return lambda i, view: read_memory(pid, addr + i * CHUNK, view)


def _write(out: Path) -> Callable[[int, memoryview], None]:
    out.mkdir(exist_ok=True)
    for f in out.iterdir():
        f.unlink()

    def work(i: int, view: memoryview) -> None:
        with (out / f"w{i}").open("wb", buffering=0) as f:
            f.write(view)

    return work


def _freeze(pid: int, addr: int, out: Path, piece: int) -> Callable[[int, memoryview], None]:
    """A freeze's whole path for each chunk: read it out of ``pid``, hash it, write it to a
    file in ``out`` — the whole chunk at each step (``piece`` = CHUNK: the chunk pipeline),
    or a piece at a time, each hashed and written while in cache (:mod:`spotguard.image.
    rawput`)."""
    out.mkdir(exist_ok=True)
    for f in out.iterdir():
        f.unlink()

    def work(i: int, view: memoryview) -> None:
        h = blake3()
        fd = os.open(out / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for off in range(0, CHUNK, piece):
                v = view[:piece]
                read_memory(pid, addr + i * CHUNK + off, v)
                h.update(v)
                os.write(fd, v)
        finally:
            os.close(fd)

    return work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args()
    size = args.gib << 30
    chunks = size // CHUNK
    work = Path(tempfile.mkdtemp(prefix="sg-pagecopy-", dir=args.dir))
    files = [work / f"c{i}" for i in range(chunks)]
    blob = os.urandom(CHUNK)
    for f in files:
        f.write_bytes(blob)
    print(f"# pagecopy: {args.gib} GiB in 64 MiB chunks, {os.cpu_count()} cpus, store {args.dir}")
    print("| threads | tmpfs read+hash GB/s | writev into fresh GB/s | read+hash+writev GB/s "
          "| readv out of a process GB/s | tmpfs write GB/s "
          "| freeze, whole chunks GB/s | freeze, a MiB at a time GB/s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    src, src_addr = _child(size, True)
    try:
        for t in args.threads:
            rates = [_run(t, chunks, _read(files))]
            for read_first in (False, True):
                dst, addr = _child(size, False)
                rates.append(_run(t, chunks, _writev(dst.pid, addr, files if read_first else None)))
                dst.kill()
                dst.wait()
            rates.append(_run(t, chunks, _readv(src.pid, src_addr)))
            rates.append(_run(t, chunks, _write(work / "w")))
            for piece in (CHUNK, PIECE):
                rates.append(_run(t, chunks, _freeze(src.pid, src_addr, work / "f", piece)))
            gbs = " | ".join(f"{size / s / 1e9:.1f}" for s in rates)
            print(f"| {t} | {gbs} |", flush=True)
    finally:
        src.kill()
        src.wait()
        for f in work.rglob("*"):
            if f.is_file():
                f.unlink()
        for d in sorted(work.rglob("*"), reverse=True):
            d.rmdir()
        work.rmdir()


if __name__ == "__main__":
    main()
