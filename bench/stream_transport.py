"""The streamer's transport alone: CRIU ↔ spotguard through the image-streamer pipes.

Splits the streamed freeze into what CRIU costs and what the capture and the image writer add,
on a plain CPU job (``os.urandom`` memory, so nothing compresses or deduplicates away):

    dump-tmpfs     criu dump into a tmpfs directory (CRIU writing files itself)
    dump-null      criu dump --stream, Capture into a sink that drops every piece
    dump-image     criu dump --stream, Capture → ImageWriter (level 1) → file store on tmpfs
    restore-tmpfs  criu restore from the tmpfs dump
    restore-mem    criu restore --stream, Serve fed from memory (the image's files held as bytes)
    restore-image  criu restore --stream, Serve fed by the ImageReader from the store

Dumps use ``--leave-running`` (same job every time); restores kill what runs first. For each
run: wall seconds, GB/s of image, CPU seconds of this process (the streamer) and of CRIU.

    python -m bench.stream_transport --size-mb 1024 --repeat 3
    python -m bench.stream_transport --cases dump-null --pipe-mb 1 4 64   # pipe sizes
"""

# ruff: noqa: ASYNC240 - a benchmark driver: stat/mkdir on tmpfs between CRIU runs
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from statistics import median
from typing import Any

from spotguard.checkpoint.criu import Criu
from spotguard.errors import CriuError
from spotguard.image import ImageSettings
from spotguard.image.reader import ImageReader
from spotguard.image.writer import ImageWriter
from spotguard.stream import Capture, Serve
from spotguard.stream.direct import ImageSink
from spotguard.stream.sparse import ReaderSource

MiB = 1 << 20
JOB = """
import os, sys, time
blob = os.urandom(int(sys.argv[1]) << 20)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""
CASES = ["dump-tmpfs", "dump-null", "dump-image", "restore-tmpfs", "restore-mem", "restore-image"]


class _Null:
    async def write(self, data: bytes) -> None:
        pass

    async def close(self) -> None:
        pass


class NullSink:
    """Takes every piece and drops it: the capture's own cost, nothing after it."""

    def file(self, name: str) -> _Null:
        return _Null()


class MemSource:
    """Serves files held in memory: restore with no download, verify or decompress."""

    def __init__(self, files: dict[str, bytes], piece: int = 8 * MiB) -> None:
        self.files = files
        self.piece = piece

    def exists(self, name: str) -> bool:
        return name in self.files

    async def iter_file(self, name: str) -> AsyncIterator[bytes]:
        data = memoryview(self.files[name])
        for off in range(0, len(data), self.piece):
            yield data[off : off + self.piece]  # type: ignore[misc]


def _cpu() -> tuple[float, float, float]:
    """CPU seconds: this process, its reaped children (CRIU), the event loop's thread."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime, time.thread_time()


def _subreaper() -> None:
    """Restored trees are detached by CRIU; adopt them so they can be reaped here."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


async def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for _ in range(400):
        _reap()
        if not os.path.exists(f"/proc/{pid}"):
            return
        await asyncio.sleep(0.025)


def _start(work: Path, size_mb: int) -> subprocess.Popen[bytes]:
    script = work / "job.py"
    script.write_text(JOB)
    out = (work / "job.out").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(size_mb)], stdin=subprocess.DEVNULL, stdout=out,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    t0 = time.monotonic()
    while b"ready" not in (work / "job.out").read_bytes():
        if proc.poll() is not None or time.monotonic() - t0 > 120:
            raise RuntimeError("job did not start")
        time.sleep(0.05)
    return proc


async def _restore(criu: Criu, images: Path, stream: bool) -> int:
    for _ in range(30):
        try:
            return await criu.restore(images, stream=stream)
        except CriuError as exc:
            if "File exists" not in exc.log_tail and "Can't fork" not in exc.log_tail:
                raise
            await asyncio.sleep(1.0)
    raise RuntimeError("restore: pids stayed taken")


async def run_case(
    case: str, criu: Criu, pid: int, work: Path, tmpfs_dump: Path, pipe: int
) -> dict[str, Any]:
    kw: dict[str, Any] = {"pipe_bytes": pipe} if pipe else {}  # 0: the component's default
    """One run of ``case``; returns wall seconds, bytes and CPU seconds (ours, CRIU's)."""
    d = Path(tempfile.mkdtemp(prefix="d-", dir=work))
    store = Path(tempfile.mkdtemp(prefix="store-", dir="/dev/shm"))
    cpu0 = _cpu()
    t0 = time.perf_counter()
    nbytes = 0
    extra: dict[str, Any] = {}
    try:
        if case == "dump-tmpfs":
            shutil.rmtree(tmpfs_dump, ignore_errors=True)
            tmpfs_dump.mkdir()
            await criu.dump(pid, tmpfs_dump, leave_running=True)
            nbytes = sum(f.stat().st_size for f in tmpfs_dump.iterdir() if f.suffix == ".img")
        elif case in ("dump-null", "dump-image"):
            if case == "dump-null":
                async with Capture(d, NullSink(), **kw) as cap:
                    await criu.dump(pid, d, leave_running=True, stream=True)
                    stats = await cap.wait()
            else:
                async with ImageWriter(
                    store.as_uri(), "bench", level=1, settings=ImageSettings()
                ) as w:
                    async with Capture(d, ImageSink(w), **kw) as cap:
                        await criu.dump(pid, d, leave_running=True, stream=True)
                        stats = await cap.wait()
                    m = await w.commit({"stream": {"criu_files": [], "renames": {}}})
                    extra["url"] = w.url
                    extra["stored"] = m.totals.stored_bytes
            nbytes = stats.bytes
            extra["peak_buffered_mib"] = stats.peak_buffered / MiB
        elif case == "restore-tmpfs":
            extra["pid"] = await _restore(criu, tmpfs_dump, False)
            nbytes = sum(f.stat().st_size for f in tmpfs_dump.iterdir() if f.suffix == ".img")
        elif case == "restore-mem":
            files = {f.name: f.read_bytes() for f in tmpfs_dump.iterdir() if f.suffix == ".img"}
            cpu0 = _cpu()
            t0 = time.perf_counter()
            async with Serve(d, MemSource(files), **kw) as srv:
                extra["pid"] = await _restore(criu, d, True)
                nbytes = (await srv.wait()).bytes
        else:
            raise ValueError(case)
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if case != "dump-image":
            shutil.rmtree(store, ignore_errors=True)
        else:
            extra["store"] = store
    wall = time.perf_counter() - t0
    cpu1 = _cpu()
    return {"case": case, "seconds": wall, "bytes": nbytes, "ours_cpu": cpu1[0] - cpu0[0],
            "criu_cpu": cpu1[1] - cpu0[1], "loop_cpu": cpu1[2] - cpu0[2], **extra}  # fmt: skip


async def restore_image(criu: Criu, work: Path, url: str, pipe: int) -> dict[str, Any]:
    kw: dict[str, Any] = {"pipe_bytes": pipe} if pipe else {}
    d = Path(tempfile.mkdtemp(prefix="d-", dir=work))
    cpu0 = _cpu()
    t0 = time.perf_counter()
    try:
        async with ImageReader(url, settings=ImageSettings()) as reader:
            names = {f.name for f in reader.manifest.files}
            async with Serve(d, ReaderSource(reader, names, {}), **kw) as srv:
                pid = await _restore(criu, d, True)
                nbytes = (await srv.wait()).bytes
    finally:
        shutil.rmtree(d, ignore_errors=True)
    wall = time.perf_counter() - t0
    cpu1 = _cpu()
    return {"case": "restore-image", "seconds": wall, "bytes": nbytes, "pid": pid,
            "ours_cpu": cpu1[0] - cpu0[0], "criu_cpu": cpu1[1] - cpu0[1],
            "loop_cpu": cpu1[2] - cpu0[2]}  # fmt: skip


def _print(r: dict[str, Any], pipe: int) -> None:
    gbs = r["bytes"] / r["seconds"] / 1e9
    more = f" buffered≤{r['peak_buffered_mib']:.0f}MiB" if "peak_buffered_mib" in r else ""
    print(f"| {r['case']} | {pipe >> 20} | {r['bytes'] / 2**30:.2f} | {r['seconds']:.2f} | "
          f"{gbs:.2f} | {r['ours_cpu']:.2f} | {r['loop_cpu']:.2f} | {r['criu_cpu']:.2f} |"
          f"{more}", flush=True)  # fmt: skip


async def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    ap.add_argument("--pipe-mb", type=int, nargs="+", default=[0], help="0: the default")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--criu", default=os.environ.get("SPOTGUARD_CRIU"))
    args = ap.parse_args()
    _subreaper()
    criu = Criu(args.criu)
    work = Path(tempfile.mkdtemp(prefix="sgt-", dir="/tmp"))
    tmpfs_dump = Path(tempfile.mkdtemp(prefix="sgt-dump-", dir="/dev/shm"))
    print(f"# stream transport: {args.size_mb} MiB job, {os.cpu_count()} cpus, "
          f"criu {await criu.version()}, pipe-max-size "
          f"{Path('/proc/sys/fs/pipe-max-size').read_text().strip()}")  # fmt: skip
    print("| case | pipe MiB | GiB | s | GB/s | streamer CPU s | of it event loop | criu CPU s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    summary: dict[tuple[str, int], list[float]] = {}
    job = _start(work, args.size_mb)
    pid = job.pid
    running = True
    url = None
    try:
        if any(c.startswith("restore") for c in args.cases) and "dump-tmpfs" not in args.cases:
            args.cases.insert(0, "dump-tmpfs")
        for case in [c for c in CASES if c in args.cases]:
            for pipe_mb in args.pipe_mb:
                pipe = pipe_mb << 20
                for _ in range(args.repeat):
                    if case.startswith("restore") and running:
                        await _kill(pid)
                        running = False
                    if case == "restore-image":
                        if url is None:
                            raise RuntimeError("restore-image needs dump-image first")
                        r = await restore_image(criu, work, url, pipe)
                    else:
                        r = await run_case(case, criu, pid, work, tmpfs_dump, pipe)
                    if "url" in r:
                        if url is not None:
                            shutil.rmtree(prev_store, ignore_errors=True)  # noqa: F821
                        url, prev_store = r["url"], r["store"]
                    if "pid" in r:
                        pid = r["pid"]
                        await _kill(pid)
                    _print(r, pipe)
                    summary.setdefault((case, pipe_mb), []).append(r["seconds"])
    finally:
        if running:
            await _kill(pid)
        with contextlib.suppress(ProcessLookupError):
            job.kill()
        job.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tmpfs_dump, ignore_errors=True)
        with contextlib.suppress(NameError):
            shutil.rmtree(prev_store, ignore_errors=True)
    if args.repeat > 1:
        print("\n| case | pipe MiB | median s | runs |")
        print("| --- | --- | --- | --- |")
        for (case, p), secs in summary.items():
            print(f"| {case} | {p} | {median(secs):.2f} | {len(secs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
