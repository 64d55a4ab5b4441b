"""Raw chunks through the file store with many threads at once: is the Python around each
chunk's I/O the limit?

A freeze stores each incompressible chunk as a raw frame written from a list of buffers
(``raw_frame_parts`` → ``FileStore.put_parts``: one ``writev``, a 3-byte header per 128 KiB
block); a restore reads it back into place (``RawReadPlan`` → ``FileStore.get_parts``:
``preadv`` into the blocks, each group hashed as it lands). The copies and the hash run
without the GIL, but the lists of ~1,000 buffers a 64 MiB chunk needs are built and walked
in Python, under it. With one thread that costs little; with one thread per core of a GPU
host the threads queue for the GIL. This bench runs ``--threads`` threads, each writing or
reading its own chunk over and over, and prints GB/s per thread count, so the scaling (or
the lack of it) shows directly.

    python -m bench.rawio --threads 1 8 16 --rounds 10 --dir /dev/shm
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from bench.pagecopy import run_threads
from spotguard.image.codec import ChunkCodec
from spotguard.image.rawframe import RawReadPlan, raw_frame_parts
from spotguard.store import file as filestore
from spotguard.store.file import FileStore

MIB = 1 << 20


def _timed(threads: int, rounds: int, work: Callable[[int], None]) -> float:
    """Seconds for ``threads`` threads to each run ``work(index)`` ``rounds`` times."""
    for i in range(threads):  # once first: files made, pages faulted, caches warm
        work(i)

    def repeat(i: int) -> None:
        for _ in range(rounds):
            work(i)

    return run_threads([threading.Thread(target=repeat, args=(i,)) for i in range(threads)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--dir", default="/dev/shm", help="the store's file system")
    ap.add_argument(
        "--groups", type=int, nargs="+", default=[0], help="parts per preadv (0: the store's)"
    )
    a = ap.parse_args()
    n = a.chunk_mib * MIB
    most = max(a.threads)
    codec = ChunkCodec()
    with tempfile.TemporaryDirectory(prefix="sg-rawio-", dir=a.dir) as tmp:
        store = FileStore(Path(tmp), fsync=False)
        plains = [os.urandom(n) for _ in range(most)]
        outs = [memoryview(mmap.mmap(-1, n)) for _ in range(most)]

        def write(i: int) -> None:
            store._put_parts(f"c/{i}", raw_frame_parts(plains[i]), False)

        def read(i: int) -> None:
            plan = RawReadPlan(n, outs[i], codec)
            try:
                got = store._get_parts(f"c/{i}", plan.parts, plan.after)
                if got != plan.total or not plan.layout_ok():
                    raise SystemExit(f"chunk {i}: not the raw layout written")
                plan.hexdigest()
            finally:
                plan.release()

        print(f"# rawio: {a.chunk_mib} MiB raw chunks, {os.cpu_count()} cpus, store {a.dir}")
        print("| parts per read | threads | write GB/s | read GB/s |")
        print("| --- | --- | --- | --- |")
        default = filestore._PARTS_GROUP
        for group in a.groups:
            filestore._PARTS_GROUP = group or default  # the bench's own knob, not a setting
            for k in a.threads:
                w = _timed(k, a.rounds, write)
                r = _timed(k, a.rounds, read)
                gb = k * a.rounds * n / 1e9
                print(f"| {group or default} | {k} | {gb / w:.1f} | {gb / r:.1f} |", flush=True)
        for o in outs:
            o.release()


if __name__ == "__main__":
    main()
