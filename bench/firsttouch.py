"""How fast this machine makes fresh memory the first time and the times after: is the first
touch of the VM's memory dearer (a hypervisor that backs guest memory only when it is first
used), which would make the first checkpoint on a fresh VM the slowest?

Each round maps ``--gib`` GiB of anonymous memory, populates it with ``MADV_POPULATE_WRITE``
from ``--threads`` threads (each its own slice), and unmaps it. The first round on a fresh VM
touches guest memory no one used yet; later rounds get pages the guest kernel freed.

    python -m bench.firsttouch --gib 64 --threads 8 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import time
from pathlib import Path

from spotguard.madvise import populate_split


def _round(size: int, threads: int) -> float:
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    holder = ctypes.c_char.from_buffer(m)
    base = ctypes.addressof(holder)
    t0 = time.perf_counter()
    try:
        populate_split(base, size, threads)
    finally:
        took = time.perf_counter() - t0
        del holder
        m.close()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=64)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    print(f"# firsttouch: {args.gib} GiB, {args.threads} threads, THP {thp}")
    print("| round | s | GB/s |")
    print("| --- | --- | --- |")
    size = args.gib << 30
    for r in range(1, args.rounds + 1):
        s = _round(size, args.threads)
        print(f"| {r} | {s:.2f} | {size / s / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
