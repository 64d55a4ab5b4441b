"""The restore's write-back of carried memory: every byte (``write_memory``) against the
all-zero 2 MiB blocks left out (``write_nonzero``), into fresh memory, for a dense chunk and
one whose every other 2 MiB block is zero (memory the job never touched).

    python -m bench.sparsewrite [--mib 64] [--runs 7]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import time
from collections.abc import Callable

from spotguard.checkpoint.procmem import SPARSE_BLOCK, write_memory, write_nonzero


def _fresh(n: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, n + SPARSE_BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    c = ctypes.c_char.from_buffer(m)
    a = ctypes.addressof(c)
    del c
    return m, a + (-a) % SPARSE_BLOCK


def _time(fn: Callable[[int, int, memoryview], object], data: bytearray, runs: int) -> float:
    seconds = []
    for _ in range(runs):
        m, addr = _fresh(len(data))
        t0 = time.perf_counter()
        fn(os.getpid(), addr, memoryview(data))
        seconds.append(time.perf_counter() - t0)
        m.close()
    return statistics.median(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mib", type=int, default=64, help="MiB per write (a chunk)")
    p.add_argument("--runs", type=int, default=7)
    a = p.parse_args()
    n = a.mib << 20
    dense = bytearray(os.urandom(n))
    sparse = bytearray(n)
    for off in range(0, n, 2 * SPARSE_BLOCK):
        sparse[off : off + SPARSE_BLOCK] = os.urandom(min(SPARSE_BLOCK, n - off))
    print("| chunk | every byte ms | zero blocks left out ms | ratio |")
    print("| --- | --- | --- | --- |")
    for name, data in (("dense", dense), ("every other 2 MiB zero", sparse)):
        whole = _time(write_memory, data, a.runs) * 1e3
        left = _time(write_nonzero, data, a.runs) * 1e3
        print(f"| {name}, {a.mib} MiB | {whole:.1f} | {left:.1f} | {left / whole:.2f} |")


if __name__ == "__main__":
    main()
