"""Naive pipeline vs streamed freeze, same job, same store, one run each.

naive:    criu dump → tmpfs directory, then zstd-compress every file (level 1, all cores), then
          upload the compressed files — one stage after another (what a shell script does).
streamed: criu dump --stream → capture → ImageWriter (chunk, zstd frames in threads, parallel
          uploads, manifest last), all overlapped, through the engine (StreamTarget).

For each: seconds from freeze start to durable image, peak host RAM (RSS of the job, this
process and CRIU, plus tmpfs the naive run stages in; sampled every 20 ms), and restore time
(naive: download + decompress into tmpfs, criu restore; streamed: engine restore from the
store through StreamSource). The planner's prediction is printed next to each actual.

    python -m bench.stream --sizes 512 2048 --store file:///var/tmp/sg-bench
    python -m bench.stream --sizes 512 --store s3 # a local moto server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
import zstandard

from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.planner import Planner, PlannerSettings, estimate
from spotguard.store import open_store
from spotguard.stream import StreamSource, StreamTarget

JOB = """
import random, sys, time
r = random.Random(7)
half = int(sys.argv[1]) // 2
# half random (incompressible, like bf16 weights), half repetitive (like CPU-side pages)
blob = bytearray().join(r.randbytes(1 << 20) for _ in range(half))
blob += bytes(range(256)) * (4096 * half)
while True:
    print(blob[int(time.time()) % len(blob)], flush=True)
    time.sleep(0.5)
"""
GiB = 1 << 30


class Peak:
    """Peak of (RSS of our process tree + the job tree + tmpfs staging) sampled every 20 ms."""

    def __init__(self, job_pid: int, staging: Path | None = None) -> None:
        self.job_pid = job_pid
        self.staging = staging
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> int:
        total = 0
        procs: list[psutil.Process] = []
        for root in (os.getpid(), self.job_pid):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(root)
                procs += [p, *p.children(recursive=True)]
        for p in {q.pid: q for q in procs}.values():
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        if self.staging is not None and self.staging.exists():
            for f in self.staging.rglob("*"):
                with contextlib.suppress(OSError):
                    if f.is_file():
                        total += f.stat().st_blocks * 512
        return total

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, await asyncio.to_thread(self.sample))
            await asyncio.sleep(0.02)

    def __enter__(self) -> Peak:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def _job(script: Path, state: Path, name: str, mib: int) -> JobInfo:
    job = await start_job([sys.executable, str(script), str(mib)], name, state_dir=state)
    out = job.dir / "stdout"
    while not out.exists() or out.stat().st_size == 0:  # noqa: ASYNC110 - a file, no event
        await asyncio.sleep(0.1)
    return job


def _compress_dir(src: Path, dst: Path) -> int:
    cctx = zstandard.ZstdCompressor(level=1, threads=-1)
    total = 0
    for f in sorted(src.iterdir()):
        if f.is_file():
            with f.open("rb") as fi, (dst / (f.name + ".zst")).open("wb") as fo:
                cctx.copy_stream(fi, fo, read_size=8 << 20, write_size=8 << 20)
            total += (dst / (f.name + ".zst")).stat().st_size
    return total


async def naive(engine: Engine, job: JobInfo, store_url: str) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="sg-naive-", dir="/dev/shm"))
    dump, packed = root / "dump", root / "packed"
    dump.mkdir()
    packed.mkdir()
    store = open_store(store_url)
    out: dict[str, float] = {}
    try:
        with Peak(job.pid, root) as peak:
            t0 = time.perf_counter()
            await engine.criu.dump(job.pid, dump, leave_running=False)
            out["criu_dump"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            out["stored_bytes"] = await asyncio.to_thread(_compress_dir, dump, packed)
            out["compress"] = time.perf_counter() - t1
            shutil.rmtree(dump)
            t2 = time.perf_counter()
            for f in sorted(packed.iterdir()):
                data = await asyncio.to_thread(f.read_bytes)
                await store.put(f"naive/{job.name}/{f.name}", data)
            out["upload"] = time.perf_counter() - t2
            out["total"] = time.perf_counter() - t0
        out["peak_ram"] = peak.peak
        # restore: download, decompress into tmpfs, criu restore
        t3 = time.perf_counter()
        dump.mkdir()
        dctx = zstandard.ZstdDecompressor()
        for info in await store.list(f"naive/{job.name}/"):
            data = await store.get(info.key)
            name = info.key.rsplit("/", 1)[1].removesuffix(".zst")
            await asyncio.to_thread(
                (dump / name).write_bytes, dctx.decompressobj().decompress(data)
            )
        pid = await engine.criu.restore(dump)
        out["restore"] = time.perf_counter() - t3
        psutil.Process(pid).kill()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        await store.aclose()
    return out


async def streamed(engine: Engine, job: JobInfo, store_url: str, work: Path) -> dict[str, float]:
    target = StreamTarget(store_url, work_root=work, level=1)
    with Peak(job.pid) as peak:
        t0 = time.perf_counter()
        await engine.freeze(job, target, Mode.EXIT)
        total = time.perf_counter() - t0
    assert target.manifest is not None and target.capture_stats is not None
    url = f"{store_url.rstrip('/')}/{job.name}/images/{target.manifest.image_id}"
    t1 = time.perf_counter()
    restored = await engine.restore(StreamSource(url, work_root=work), state_dir=work / "state")
    restore = time.perf_counter() - t1
    psutil.Process(restored.pid).kill()
    return {
        "total": total,
        "stream": total,
        "peak_ram": peak.peak,
        "restore": restore,
        "stored_bytes": target.manifest.totals.stored_bytes,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048], help="job MiB")
    ap.add_argument("--store", default="file:///var/tmp/sg-bench-store")
    ap.add_argument("--criu", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sg-bench-"))
    script = work / "job.py"
    script.write_text(JOB)
    store_url = args.store
    moto = None
    if store_url == "s3":
        import boto3
        from moto.server import ThreadedMotoServer

        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        moto.start()
        host, port = moto.get_host_and_port()
        os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="x",
                          AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
        boto3.client("s3").create_bucket(Bucket="bench")
        store_url = "s3://bench/images"
    engine = Engine(Criu(args.criu))
    planner = Planner(PlannerSettings(throughput_file=work / "throughput.json"))
    rows = []
    try:
        for mib in args.sizes:
            for kind in ("naive", "streamed"):
                job = await _job(script, work / "state", f"b{mib}-{kind}", mib)
                est = estimate(job.pid)
                plan = planner.plan(
                    est, deadline_s=None, store_url=store_url, stream=kind == "streamed"
                )
                if kind == "naive":
                    r = await naive(engine, job, store_url)
                else:
                    r = await streamed(engine, job, store_url, work)
                planner.record(
                    plan, seconds={k: v for k, v in r.items() if k in (
                        "criu_dump", "compress", "upload", "stream", "total")},
                    raw_bytes=est.total, stored_bytes=int(r["stored_bytes"]),
                )  # fmt: skip
                rows.append((mib, kind, est.total, plan.total_s, r))
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nstore={args.store} cpus={os.cpu_count()} thp={planner_thp()}")
    print("| job MiB | pipeline | image GiB | predicted s | freeze→durable s | stages s "
          "| peak host RAM GiB | RAM / image | restore s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for mib, kind, img, pred, r in rows:
        stages = (
            " + ".join(f"{k} {r[k]:.2f}" for k in ("criu_dump", "compress", "upload") if k in r)
            or "overlapped"
        )
        print(
            f"| {mib} | {kind} | {img / GiB:.2f} | {pred:.2f} | {r['total']:.2f} | {stages} "
            f"| {r['peak_ram'] / GiB:.2f} | {r['peak_ram'] / img:.2f} | {r['restore']:.2f} |"
        )


def planner_thp() -> str | None:
    from spotguard.planner import thp_status

    return thp_status().enabled


if __name__ == "__main__":
    asyncio.run(main())
