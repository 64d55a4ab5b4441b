"""Leave-running pause to a store slower than the copy: the job frozen while its image is
copied into host memory (``[checkpoint] resume_buffer_mb``, default -1: what the host can
spare) against frozen until the store has it (``resume_buffer_mb = 0``, as before).

The job is the N-rank stand-in with one rank (``bench/ranks_job.py``: half random, half zero
pages) holding ``--mib`` MiB, or with ``--gpu`` the demo trainer holding ``--mib`` MiB on the
GPU (``spotguard.demo.job``); the store is S3 on a moto server in a process of its own (an
object store over HTTP on this host: a few hundred MB/s, slower than copying memory), or any
``--store`` URL. Each setting runs ``--repeat`` times, interleaved, on the same job; after
every pause the stand-in's memory is checked unchanged (the trainer: that it trains on), and
the image is read back whole (every distinct chunk fetched and checked against its address).

    python -m bench.pause_store --mib 1024 --repeat 2
    python -m bench.pause_store --gpu --mib 4096 --repeat 1     # a GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ranks import JOB, _kill, _verify, _wait
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.cuda import GpuHook
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings
from spotguard.image.reader import ImageReader
from spotguard.stream import StreamTarget


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _moto() -> tuple[subprocess.Popen[bytes], str]:
    """A moto S3 server in its own process, a bucket in it; the URL of a store there."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )  # fmt: skip
    import boto3

    end = time.monotonic() + 30
    while True:
        try:
            boto3.client("s3").create_bucket(Bucket="pause-bench")
            break
        except Exception:
            if time.monotonic() > end or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.2)
    return proc, "s3://pause-bench/images"


async def _read_back(url: str, settings: ImageSettings) -> int:
    """Every chunk of the image fetched and checked against its address (the reader's
    ``verify``, as ``spotguard images verify``); bytes of plaintext checked."""
    async with ImageReader(url, settings=settings) as reader:
        report = await reader.verify()
    if report.bad:
        raise RuntimeError(f"{url}: {len(report.bad)} chunks failed verification: {report.bad[0]}")
    return report.bytes


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


async def _pause(
    job: JobInfo, setting: int, work: Path, store: str, criu: str | None, hook: GpuHook | None
) -> tuple[dict[str, Any], StreamTarget]:
    """One leave-running freeze of ``job`` under ``resume_buffer_mb = setting``."""
    settings = CheckpointSettings(state_dir=work / "state", resume_buffer_mb=setting)
    engine = Engine(Criu(criu), hook, settings=settings)
    target = StreamTarget(store, work_root=work, settings=ImageSettings())
    t0 = time.monotonic()
    result = await engine.freeze(job, target, Mode.RESUME)
    durable = time.monotonic() - t0
    (staging,) = [s for s in result.timeline.steps if s.name == "staging"]
    row = {
        "resume_buffer_mb": setting, "pause_s": round(result.pause_seconds, 3),
        "durable_s": round(durable, 3), "hold_mb": staging.detail.get("hold_bytes", 0) >> 20,
        "steps": {t.name: round(t.seconds or 0.0, 2) for t in result.timeline.steps},
    }  # fmt: skip
    return row, target


async def run(
    mib: int, repeat: int, store: str, criu: str | None, gpu: bool
) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="sg-pause-bench-"))
    out = work / "out"
    hook: GpuHook | None = None
    if gpu:
        from spotguard.checkpoint.cuda import CudaHook

        hook = CudaHook()
        argv = [sys.executable, "-m", "spotguard.demo.job", "--gpu", "yes", "--mb", str(mib),
                "--steps", "100000", "--step-seconds", "0.05"]  # fmt: skip
        job = await start_job(argv, "pause-bench", state_dir=work)
    else:
        argv = [sys.executable, str(JOB), "launcher", "--ranks", "1", "--mib", str(mib)]
        job = await start_job([*argv, "--out", str(out)], "pause-bench", state_dir=work)
    stdout = job.dir / "stdout"
    rows: list[dict[str, Any]] = []
    try:
        await _wait(
            (lambda: _lines(stdout) > 5) if gpu else (lambda: (out / "rank-0.sum").exists()),
            "the job's memory",
            600,
        )
        # A job's first freeze is slower whatever the setting (its memory walked for the first
        # time, the store's first writes): one untimed run first, then the settings in turn
        plan = [0] + [setting for _ in range(repeat) for setting in (-1, 0)]
        for i, setting in enumerate(plan):
            row, target = await _pause(job, setting, work, store, criu, hook)
            if gpu:
                n = _lines(stdout)
                await _wait(lambda: _lines(stdout) > n + 3, "training", 120)  # noqa: B023
                row["unchanged"] = True  # it trains on (its losses: tests/gpu)
            else:
                row["unchanged"] = await _verify(out, 1, i + 1)
            assert target.url is not None
            row["image_mb"] = await _read_back(target.url, ImageSettings()) >> 20
            if i:  # not the warm-up
                w = target.writer_stats.to_json() if target.writer_stats is not None else {}
                print(row, w.get("step_seconds"), file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        _kill(job.pid)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="MiB of memory of the job")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--store", default="", help="store URL (default: S3 on a moto server)")
    p.add_argument("--criu", default=None)
    p.add_argument("--gpu", action="store_true", help="the demo trainer on the GPU")
    a = p.parse_args()
    server = None
    store = a.store
    if not store:
        server, store = _moto()
    try:
        rows = asyncio.run(run(a.mib, a.repeat, store, a.criu, a.gpu))
    finally:
        if server is not None:
            server.kill()
    kind = "GPU trainer" if a.gpu else "job"
    print(f"\nleave-running pause, a {a.mib} MiB {kind}, store {store.split(':')[0]}")
    print(
        "| resume_buffer_mb | pause s | durable s | image MiB (distinct chunks) | hold MiB "
        "| job unchanged / on |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['resume_buffer_mb']} | {r['pause_s']:.2f} | {r['durable_s']:.2f} | "
            f"{r['image_mb']} | {r['hold_mb']} | {'yes' if r['unchanged'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
