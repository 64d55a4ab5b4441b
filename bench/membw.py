"""The machine's memory bandwidth, as the N-rank stand-in (bench/ranks.py) uses it: what every
pass over a job's bytes costs when 1, 2, 4, 8 or 16 threads make it at once.

Three kinds of pass, each over ``--gib`` GiB per thread (numpy's copies and fills release the
GIL, so the threads run in parallel):

* ``copy``: a copy between two buffers already in memory (a read and a write per byte: the
  pipe copies of a dump and a restore, a read from a tmpfs store);
* ``fault+write``: writing a fresh anonymous map (the kernel zeroes each page before the
  write: what a restore's prefault and page-in into a new process cost);
* ``read``: each MiB of a buffer in memory copied into one that stays in cache (one read
  from memory per byte: what hashing a chunk costs, the hash itself aside).

The table gives GB/s of bytes moved (a copy counts its bytes once) and the memory traffic it
made (a copy and a fault+write count twice: read and write, zero and write), so that a stage
measured in bench/ranks.py can be set against what the machine does at best.

    python -m bench.membw --gib 1 --threads 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import mmap
import threading
import time
from collections.abc import Callable

import numpy as np


def _run(threads: int, work: Callable[[int], None]) -> float:
    """Seconds for ``threads`` threads to each run ``work(i)``, started together."""
    start = threading.Barrier(threads + 1)

    def one(i: int) -> None:
        start.wait()
        work(i)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def _read(buf: np.ndarray) -> None:
    """Read ``buf`` once: each MiB copied into a small buffer that stays in cache."""
    block = 1 << 20
    small = np.empty(block, dtype=np.uint8)
    for off in range(0, len(buf) - block + 1, block):
        np.copyto(small, buf[off : off + block])


def measure(gib: float, threads: int) -> dict[str, float]:
    """GB/s of each pass with ``threads`` threads, ``gib`` GiB each."""
    n = int(gib * (1 << 30))
    src = [np.full(n, 7, dtype=np.uint8) for _ in range(threads)]
    dst = [np.ones(n, dtype=np.uint8) for _ in range(threads)]
    total = n * threads / 1e9
    out: dict[str, float] = {}
    out["copy"] = total / _run(threads, lambda i: np.copyto(dst[i], src[i]))
    out["read"] = total / _run(threads, lambda i: _read(src[i]))
    dst.clear()
    maps = [mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(threads)]

    def fill(i: int) -> None:
        np.frombuffer(maps[i], dtype=np.uint8)[:] = 3

    out["fault+write"] = total / _run(threads, fill)
    for m in maps:
        m.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB per thread (default 1)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    measure(min(args.gib, 0.25), 1)  # the process's first faults and numpy's set-up aside
    print("| threads | copy GB/s (traffic) | fault+write GB/s (traffic) | read GB/s |")
    print("| --- | --- | --- | --- |")
    for t in args.threads:
        r = measure(args.gib, t)
        print(
            f"| {t} | {r['copy']:.1f} ({2 * r['copy']:.1f}) "
            f"| {r['fault+write']:.1f} ({2 * r['fault+write']:.1f}) | {r['read']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
