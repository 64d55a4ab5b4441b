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
import os
import threading
import time
from pathlib import Path

MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def _round(size: int, threads: int) -> float:
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    holder = ctypes.c_char.from_buffer(m)
    base = ctypes.addressof(holder)
    step = -(-size // threads) // (2 << 20) * (2 << 20) or size
    errors: list[int] = []

    def one(lo: int) -> None:
        n = min(step, size - lo)
        if n > 0 and _libc.madvise(base + lo, n, MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    ts = [threading.Thread(target=one, args=(lo,)) for lo in range(0, size, step)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    took = time.perf_counter() - t0
    del holder
    m.close()
    if errors:
        raise OSError(errors[0], f"MADV_POPULATE_WRITE: {os.strerror(errors[0])}")
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
