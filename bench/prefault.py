"""How fast a leave-running checkpoint's hold can be faulted in before the freeze
(``[checkpoint] prefault_hold``, ``stream.pipes.PiecePool.prefault``), by how the pieces'
maps are made.

The hold is made of pieces (one anonymous map of a chunk's size each, advised
``MADV_HUGEPAGE``) faulted in with ``MADV_POPULATE_WRITE`` by one thread per core. Making a
map takes the process's address-space lock for writing, while a populate holds it for
reading for as long as it runs: threads that each make a map and then populate it wait on
one another's populates at every map. Three ways, over ``--gib`` GiB of ``--piece-mib``
pieces, by 1, 4, ... threads:

* ``interleaved``: each thread makes a map, populates it, makes the next;
* ``mapped first``: every map made first (one thread), then the threads populate them;
* ``pool``: ``PiecePool.reserve`` then ``PiecePool.fill`` split over the threads, as
  ``Capture.prefault`` does (the second way, as built).

On the H200 VMs (16 cores, 2026-11-28) the first way made 6.2-6.4 GB/s at 16 threads, the
second 25-28 GB/s (docs/benchmarks.md).

    python -m bench.prefault --gib 32 --threads 1 4 16
"""

from __future__ import annotations

import argparse
import mmap
import threading
import time
from collections.abc import Callable

from spotguard.image.memops import populate
from spotguard.stream.pipes import PiecePool


def _make(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def _threads(threads: int, work: Callable[[int], None]) -> None:
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def interleaved(n: int, size: int, threads: int) -> list[mmap.mmap]:
    out: list[list[mmap.mmap]] = [[] for _ in range(threads)]

    def one(i: int) -> None:
        for _ in range(i, n, threads):
            buf = _make(size)
            populate(buf)
            out[i].append(buf)

    _threads(threads, one)
    return [b for part in out for b in part]


def mapped_first(n: int, size: int, threads: int) -> list[mmap.mmap]:
    bufs = [_make(size) for _ in range(n)]

    def one(i: int) -> None:
        for buf in bufs[i::threads]:
            populate(buf)

    _threads(threads, one)
    return bufs


def pool(n: int, size: int, threads: int) -> PiecePool:
    p = PiecePool(size, n)
    bufs = p.reserve(n)
    _threads(threads, lambda i: p.fill(bufs[i::threads]) and None)
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB to fault in (default 1)")
    ap.add_argument("--piece-mib", type=int, default=64, help="piece size, MiB (a chunk's)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    size = args.piece_mib << 20
    n = max(1, int(args.gib * (1 << 30)) // size)
    ways: dict[str, Callable[[int, int, int], object]] = {
        "interleaved": interleaved,
        "mapped first": mapped_first,
        "pool": pool,
    }
    print(f"{n} pieces of {args.piece_mib} MiB ({n * size / 1e9:.1f} GB)")
    print("| way | threads | GB/s (each run) |")
    print("| --- | --- | --- |")
    for t in args.threads:
        for name, way in ways.items():
            rates = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                made = way(n, size, t)
                rates.append(n * size / 1e9 / (time.perf_counter() - start))
                if isinstance(made, PiecePool):
                    made.close()
                del made
            print(f"| {name} | {t} | {', '.join(f'{r:.1f}' for r in rates)} |", flush=True)


if __name__ == "__main__":
    main()
