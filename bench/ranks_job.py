"""The N-rank stand-in job: a launcher that execs N ranks, each holding MiB of CPU memory.

What CRIU sees on an N-GPU node once the driver has moved each rank's GPU memory into host
memory: N large processes, children of one small launcher. Each rank fills its memory half
with random bytes (distinct per rank and per block: nothing deduplicates) and half with
zeros written page by page (present pages, as a tensor of zeros is), then idles.

Checksums, so a test or benchmark can prove a restored job byte-identical:
- each rank writes ``rank-I.sum`` (its memory's SHA-1) once its memory is filled;
- when ``verify-G`` appears in the output directory (G = 1, 2, ...), each rank hashes its
  memory again and writes ``rank-I.sum-G``.
The ranks open files only to write them (no descriptor is held across a checkpoint).

``--reserve-gib R`` gives each rank what a CUDA process also has: a reservation of R GiB of
address space (private, ``PROT_NONE``, never touched: the driver's unified address range, 16 GiB
on the GPU machines), ``--maps K`` small private mappings, every other one with a page
written, and ``--threads T`` idle threads (a CUDA process has some 60; CRIU looks at every
thread's stack pointer for every page it dumps). CRIU counts the reservation as private
memory and walks every mapping, so these make its per-task work that of a CUDA rank
(``bench/criu_tasks.py``).

    python bench/ranks_job.py launcher --ranks N --mib M --out DIR [--reserve-gib R --maps K
                                       --threads T]
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

MiB = 1 << 20
_BLOCK = 64 * MiB


def _fill(size: int) -> bytearray:
    """``size`` bytes: the first half random, the rest zeros written into every page."""
    buf = bytearray(size)
    view = memoryview(buf)
    half = size // 2
    for off in range(0, half, _BLOCK):
        n = min(_BLOCK, half - off)
        view[off : off + n] = os.urandom(n)
    zeros = bytes(min(_BLOCK, max(size - half, 1)))
    for off in range(half, size, _BLOCK):
        n = min(_BLOCK, size - off)
        view[off : off + n] = zeros[:n]
    return buf


def _digest(buf: bytearray) -> str:
    return hashlib.sha1(buf).hexdigest()


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def _shape(reserve_gib: float, maps: int) -> list[mmap.mmap]:
    """The address-space shape of a CUDA process (module docstring); kept alive by the caller."""
    held: list[mmap.mmap] = []
    if reserve_gib > 0:
        noreserve = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Python 3.12+ names it
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | noreserve
        held.append(mmap.mmap(-1, int(reserve_gib * 1024) * MiB, flags=flags, prot=0))
    for i in range(maps):
        prot = mmap.PROT_READ | mmap.PROT_WRITE if i % 2 else 0
        m = mmap.mmap(-1, 64 * 1024, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=prot)
        if prot:
            m[0] = 1
        held.append(m)
    return held


def rank(
    index: int, mib: int, out: Path, reserve_gib: float = 0.0, maps: int = 0, threads: int = 0
) -> None:
    """One rank: fill, report the checksum, then answer every ``verify-G`` request."""
    _held = _shape(reserve_gib, maps)  # alive as long as the rank runs
    for _ in range(threads):  # idle, as a CUDA process's driver and library threads mostly are
        threading.Thread(target=time.sleep, args=(1e9,), daemon=True).start()
    buf = _fill(mib * MiB)
    _write(out / f"rank-{index}.sum", _digest(buf))
    answered = 0
    while True:
        nxt = answered + 1
        if (out / f"verify-{nxt}").exists():
            _write(out / f"rank-{index}.sum-{nxt}", _digest(buf))
            answered = nxt
            continue
        time.sleep(0.05)


def launcher(
    ranks: int, mib: int, out: Path, reserve_gib: float = 0.0, maps: int = 0, threads: int = 0
) -> int:
    """Exec ``ranks`` ranks and wait for them (they run until killed)."""
    out.mkdir(parents=True, exist_ok=True)
    shape = ["--reserve-gib", str(reserve_gib), "--maps", str(maps), "--threads", str(threads)]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "rank", str(i), str(mib), str(out), *shape],
            stdin=subprocess.DEVNULL,
        )
        for i in range(ranks)
    ]
    _write(out / "launcher.pid", str(os.getpid()))
    codes = [p.wait() for p in procs]
    return max(codes, default=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launcher")
    la.add_argument("--ranks", type=int, required=True)
    la.add_argument("--mib", type=int, required=True)
    la.add_argument("--out", type=Path, required=True)
    ra = sub.add_parser("rank")
    ra.add_argument("index", type=int)
    ra.add_argument("mib", type=int)
    ra.add_argument("out", type=Path)
    for sp in (la, ra):
        sp.add_argument("--reserve-gib", type=float, default=0.0)
        sp.add_argument("--maps", type=int, default=0)
        sp.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    shape = (args.reserve_gib, args.maps, args.threads)
    if args.cmd == "launcher":
        return launcher(args.ranks, args.mib, args.out, *shape)
    rank(args.index, args.mib, args.out, *shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
