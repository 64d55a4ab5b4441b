"""The least time the N-rank stand-in's freeze and restore can take on this machine.

``bench.ranks`` measures spotguard's freeze and restore of the stand-in (a launcher with N
ranks of half random, half zero memory). This bench does only the work those must do per
byte, with nothing else around it — no CRIU, no pipes, no event loop, no image format: every
64 MiB chunk of every rank's memory is read out of the rank with ``process_vm_readv`` into a
reused buffer (the one copy a freeze makes of each byte: CRIU's pipe references the pages,
spotguard's read copies them), compared with zero, and — if not zero — hashed with BLAKE3 and
written to a file on the store's tmpfs (a raw chunk). The restore floor reads each stored
chunk back (``preadv`` into a reused buffer), hashes it and writes it into a fresh mapping of
a stand-in process with ``process_vm_writev`` (faulting its pages in); zero chunks cost
nothing (the sparse restore leaves them untouched). The pause floor (a leave-running
checkpoint: the job is frozen only until its memory is in host memory) reads every chunk,
zero or not, into a buffer of its own that is held (allocated and touched before the clock:
the least it can cost). Every thread takes chunks from one queue, so any rank's chunk goes to
any free thread: no per-rank chain, no stagger.

If even this floor for N ranks is above ``1.5 x`` spotguard's measured time for one rank,
the target of issue 25 is beyond what this machine does for that work, whatever the
orchestration; where it is below, the gap is what the orchestration costs.

    python -m bench.floor --gib 4 --ranks 1 8 --threads 1 8 16
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
from blake3 import blake3

from bench.pagecopy import _child
from bench.ranks import JOB, _kill
from spotguard.checkpoint.gpupages import writable_anon
from spotguard.checkpoint.procmem import read_memory, write_memory
from spotguard.image.memops import is_zero

CHUNK = 64 << 20


@dataclass(frozen=True)
class Chunk:
    """One chunk of one rank's memory: where it is, and where the freeze stored it."""

    rank: int
    pid: int
    addr: int
    offset: int  # in the rank's mapping: where the restore writes it back
    size: int
    file: Path


def _ranks(launcher: int, count: int) -> list[int]:
    kids = sorted(p.pid for p in psutil.Process(launcher).children())
    if len(kids) != count:
        raise SystemExit(f"floor: expected {count} ranks under {launcher}, found {len(kids)}")
    return kids


def _chunks(pids: list[int], store: Path) -> list[Chunk]:
    """Every 64 MiB chunk of each rank's largest writable anonymous mapping (its data)."""
    out: list[Chunk] = []
    for r, pid in enumerate(pids):
        start, end = max(writable_anon(pid), key=lambda se: se[1] - se[0])
        for off in range(0, end - start, CHUNK):
            n = min(CHUNK, end - start - off)
            out.append(Chunk(r, pid, start + off, off, n, store / f"r{r}-{off // CHUNK}"))
    return out


def _pool(threads: int, items: list[Chunk], work: Callable[[Chunk, memoryview], None]) -> float:
    """``work(chunk, buffer)`` for every item, by ``threads`` threads taking from one queue;
    each thread's 64 MiB buffer is touched before the clock starts. Seconds."""
    todo: queue.SimpleQueue[Chunk] = queue.SimpleQueue()
    for c in items:
        todo.put(c)
    ready = threading.Barrier(threads + 1)

    def worker() -> None:
        buf = bytearray(CHUNK)  # every page written: no first touch inside the clock
        view = memoryview(buf)
        ready.wait()
        while True:
            try:
                c = todo.get_nowait()
            except queue.Empty:
                return
            work(c, view[: c.size])

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    ready.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def freeze_one(c: Chunk, view: memoryview) -> None:
    read_memory(c.pid, c.addr, view)
    if is_zero(view):
        return
    blake3(view).digest()
    fd = os.open(c.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, view)
    finally:
        os.close(fd)


def _freeze_blocked(block: int) -> Callable[[Chunk, memoryview], None]:
    """The freeze of one chunk a cache-sized block at a time: each block copied out of the
    rank into the thread's small buffer, hashed into the chunk's hasher and, unless all zero,
    written at its offset while it is still in cache — one pass over each byte from RAM
    where the whole-chunk freeze makes three (copy, hash, write). A chunk all zero leaves no
    file; zero blocks of a stored chunk are holes."""

    def freeze_one_blocked(c: Chunk, view: memoryview) -> None:
        h = blake3()
        fd = -1
        try:
            for off in range(0, c.size, block):
                v = view[: min(block, c.size - off)]
                read_memory(c.pid, c.addr + off, v)
                h.update(v)
                if is_zero(v):
                    continue
                if fd < 0:
                    fd = os.open(c.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.pwrite(fd, v, off)
            if fd >= 0:
                os.ftruncate(fd, c.size)
                h.digest()
        finally:
            if fd >= 0:
                os.close(fd)

    return freeze_one_blocked


def _restore_blocked(
    targets: dict[int, tuple[int, int]], block: int
) -> Callable[[Chunk, memoryview], None]:
    """The restore of one chunk a block at a time, verified before any byte is written: one
    pass reads and hashes every block, the next reads each again and writes it into the
    process — the buffer stays in cache, so each byte crosses RAM twice as it is read and
    once as it is written, where the whole-chunk restore copies it into a 64 MiB buffer too."""

    def restore_one_blocked(c: Chunk, view: memoryview) -> None:
        if not c.file.exists():
            return
        fd = os.open(c.file, os.O_RDONLY)
        try:
            h = blake3()
            for off in range(0, c.size, block):
                v = view[: min(block, c.size - off)]
                os.preadv(fd, [v], off)
                h.update(v)
            h.digest()
            pid, base = targets[c.rank]
            for off in range(0, c.size, block):
                v = view[: min(block, c.size - off)]
                os.preadv(fd, [v], off)
                if not is_zero(v):
                    write_memory(pid, base + c.offset + off, v)
        finally:
            os.close(fd)

    return restore_one_blocked


def _restore(targets: dict[int, tuple[int, int]]) -> Callable[[Chunk, memoryview], None]:
    def restore_one(c: Chunk, view: memoryview) -> None:
        if not c.file.exists():  # a zero chunk: never stored, never written back
            return
        fd = os.open(c.file, os.O_RDONLY)
        try:
            os.preadv(fd, [view], 0)
        finally:
            os.close(fd)
        blake3(view).digest()
        pid, base = targets[c.rank]
        write_memory(pid, base + c.offset, view)

    return restore_one


def _pause(items: list[Chunk], threads: int) -> float:
    """The pause floor: every chunk copied into a held buffer of its own. Seconds."""
    held = {id(c): bytearray(c.size) for c in items}  # touched (zero-filled) before the clock

    def pause_one(c: Chunk, view: memoryview) -> None:
        read_memory(c.pid, c.addr, memoryview(held[id(c)]))

    try:
        return _pool(threads, items, pause_one)
    finally:
        held.clear()


def _start(ranks: int, gib: float, work: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """The stand-in job (``bench/ranks_job.py``), once every rank has filled its memory."""
    out = work / "out"
    mib = int(gib * 1024)
    argv = [sys.executable, str(JOB), "launcher", "--ranks", str(ranks), "--mib", str(mib)]
    proc = subprocess.Popen([*argv, "--out", str(out)], stdin=subprocess.DEVNULL)
    end = time.monotonic() + 1200
    while len(list(out.glob("rank-*.sum"))) < ranks:
        if proc.poll() is not None or time.monotonic() > end:
            raise SystemExit("floor: the stand-in's ranks did not start")
        time.sleep(0.05)
    return proc, _ranks(proc.pid, ranks)


#: the small source the destination-only passes copy from (stays in cache: only the
#: destination's cost is measured)
SOURCE = 4 << 20


def _parts(items: list[Chunk], ranks: int, threads: int) -> tuple[float, float]:
    """What the freeze and the restore must do to their destination alone, with the source
    in cache: every stored chunk's bytes written to a fresh file on the store's file system
    (the freeze's tmpfs pages made and filled), and written into a fresh mapping of a
    waiting process (the restore's pages faulted in and filled). Lower bounds of those rows
    that no orchestration or fusion of the other passes can go under. (seconds, seconds)"""
    stored = [c for c in items if c.file.exists()]
    src = memoryview(bytearray(os.urandom(SOURCE)))

    def write_one(c: Chunk, _view: memoryview) -> None:
        fd = os.open(c.file.with_suffix(".w"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for off in range(0, c.size, SOURCE):
                os.write(fd, src[: min(SOURCE, c.size - off)])
        finally:
            os.close(fd)

    try:
        write_s = _pool(threads, stored, write_one)
    finally:
        for c in stored:
            c.file.with_suffix(".w").unlink(missing_ok=True)
    kids = [_child(sum(c.size for c in items if c.rank == r), False) for r in range(ranks)]
    try:
        targets = {r: (kid.pid, addr) for r, (kid, addr) in enumerate(kids)}

        def page_in_one(c: Chunk, _view: memoryview) -> None:
            pid, base = targets[c.rank]
            for off in range(0, c.size, SOURCE):
                write_memory(pid, base + c.offset + off, src[: min(SOURCE, c.size - off)])

        page_in_s = _pool(threads, stored, page_in_one)
    finally:
        for kid, _ in kids:
            kid.kill()
            kid.wait()
    return write_s, page_in_s


def floors(
    items: list[Chunk], ranks: int, threads: int, block: int = 0, parts: list[float] | None = None
) -> tuple[float, float, float, int]:
    """The pause floor, the freeze floor, then the restore floor of the running stand-in's
    ``items`` with ``threads`` threads, whole chunks or ``block`` bytes at a time:
    (seconds, seconds, seconds, bytes stored). ``parts``: a list the destination-only
    seconds of :func:`_parts` are appended to (measured after the restore)."""
    try:
        pause_s = _pause(items, threads)
        freeze_s = _pool(threads, items, _freeze_blocked(block) if block else freeze_one)
        stored = sum(c.file.stat().st_size for c in items if c.file.exists())
        kids = [_child(sum(c.size for c in items if c.rank == r), False) for r in range(ranks)]
        try:
            targets = {r: (kid.pid, addr) for r, (kid, addr) in enumerate(kids)}
            restore = _restore_blocked(targets, block) if block else _restore(targets)
            restore_s = _pool(threads, items, restore)
        finally:
            for kid, _ in kids:
                kid.kill()
                kid.wait()
        if parts is not None:
            parts.extend(_parts(items, ranks, threads))
    finally:
        for c in items:
            c.file.unlink(missing_ok=True)
    return pause_s, freeze_s, restore_s, stored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="memory per rank")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--dir", default="/dev/shm", help="the store's file system")
    ap.add_argument(
        "--block-kib",
        type=int,
        nargs="+",
        default=[0],
        help="work a chunk this many KiB at a time (0: the whole chunk at once)",
    )
    ap.add_argument(
        "--parts",
        action="store_true",
        help="also time the destination alone: the stored bytes written to fresh files, and "
        "into a fresh process (source in cache)",
    )
    ap.add_argument("--json", type=Path, help="append one JSON line per row")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sg-floor-"))
    store = Path(tempfile.mkdtemp(prefix="sg-floor-store-", dir=args.dir))
    print(f"# floor: ranks of {args.gib:g} GiB (half random, half zero), {os.cpu_count()} cpus, "
          f"store {args.dir}")  # fmt: skip
    print("| ranks | threads | block KiB | GB of memory | GB stored | freeze floor s | GB/s "
          "| restore floor s | GB/s | pause floor s | GB/s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    try:
        for n in args.ranks:
            shutil.rmtree(work / "out", ignore_errors=True)
            proc, pids = _start(n, args.gib, work)  # one job per N, every thread count on it
            try:
                items = _chunks(pids, store)
                for t, kib in [(t, k) for t in args.threads for k in args.block_kib]:
                    got: list[float] = []
                    ps, fs, rs, stored = floors(items, n, t, kib << 10, got if args.parts else None)
                    row = {"ranks": n, "gib": args.gib, "threads": t, "block_kib": kib,
                           "freeze_s": round(fs, 3),
                           "restore_s": round(rs, 3), "pause_s": round(ps, 3),
                           "stored": stored}  # fmt: skip
                    total = sum(c.size for c in items)
                    print(f"| {n} | {t} | {kib or 'chunk'} | {total / 1e9:.1f} | "
                          f"{stored / 1e9:.1f} | {fs:.2f} | "
                          f"{total / fs / 1e9:.1f} | {rs:.2f} | {total / rs / 1e9:.1f} | "
                          f"{ps:.2f} | {total / ps / 1e9:.1f} |", flush=True)  # fmt: skip
                    if got:
                        print(f"|   | destination alone: {stored / 1e9:.1f} GB written to fresh "
                              f"files {got[0]:.2f} s ({stored / got[0] / 1e9:.1f} GB/s), into a "
                              f"fresh process {got[1]:.2f} s ({stored / got[1] / 1e9:.1f} GB/s) |",
                              flush=True)  # fmt: skip
                        row.update(write_only_s=round(got[0], 3), page_in_only_s=round(got[1], 3))
                    if args.json:
                        with args.json.open("a") as f:
                            f.write(json.dumps(row) + "\n")
            finally:
                for pid in [*pids, proc.pid]:  # the ranks too: the launcher only waits on them
                    _kill(pid)
                proc.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
