"""Freeze engine benchmark: freeze window, dump and restore throughput, engine overhead.

For each size, one job holding that much memory (CPU: a Python buffer; ``--gpu``: PyTorch
tensors on the GPU plus its CPU side) is

1. frozen by the engine (exit mode, image in tmpfs) and restored by the engine, and
2. a twin job is dumped and restored by the bare calls the engine orders (driver
   lock + checkpoint, ``criu dump``; ``criu restore``, driver restore + unlock).

The overhead column is engine time / bare time - 1 for dump and restore together.
Run: ``python -m bench.freeze --sizes 0.5 2 4`` (CPU) or ``python -m bench.freeze --gpu``.
Needs root and CRIU (scripts/install-criu). Prints a table; numbers are single runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.cuda import CudaHook, GpuHook, NoGpu, _Driver, inventory
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.targets import DirectorySource, DirectoryTarget

CPU_JOB = """
import os, sys, time
n = int(float(sys.argv[1]) * (1 << 30))
block = os.urandom(1 << 20)
buf = bytearray(block) * (n >> 20)
print("ready", flush=True)
i = 0
while True:
    buf[(i * 4096) % len(buf)] ^= 1
    i += 1
    time.sleep(0.01)
"""

GPU_JOB = """
import sys, time, torch
n = int(float(sys.argv[1]) * (1 << 30)) // 4
x = torch.randn(n, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    x.mul_(1.0000001)
    torch.cuda.synchronize()
    time.sleep(0.01)
"""


async def _ready(job: JobInfo, limit: float = 600) -> None:
    out = job.dir / "stdout"
    t0 = time.monotonic()
    while "ready" not in (out.read_text() if out.exists() else ""):
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"job {job.name} did not get ready")
        await asyncio.sleep(0.1)


def _kill(pid: int) -> None:
    proctree.signal_all([pid], signal.SIGKILL)
    t0 = time.monotonic()
    while proctree.alive(pid) and time.monotonic() - t0 < 30:
        time.sleep(0.05)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


async def _engine_run(
    engine: Engine, gpu: bool, argv: list[str], name: str, state: Path, shm: Path
) -> dict[str, float]:
    job = await start_job(argv, name, state_dir=state, pid_namespace=not gpu)
    await _ready(job)
    t0 = time.perf_counter()
    res = await engine.freeze(job, DirectoryTarget(shm / name), Mode.EXIT)
    freeze_s = time.perf_counter() - t0
    _kill(job.pid)
    size = _du(res.images_dir)
    t0 = time.perf_counter()
    rr = await engine.restore(DirectorySource(res.images_dir))
    # time spent waiting for the kernel to free the killed job's PIDs is not restore work
    step = next(s for s in rr.timeline.steps if s.name == "criu_restore")
    waited = float(step.detail.get("pid_wait_s", 0.0))
    restore_s = time.perf_counter() - t0 - waited
    _kill(rr.pid)
    shutil.rmtree(res.images_dir, ignore_errors=True)
    tl = res.timeline
    return {
        "image": size,
        "freeze": freeze_s,
        "gpu_ckpt": (tl.seconds("gpu_lock") or 0) + (tl.seconds("gpu_checkpoint") or 0),
        "dump": tl.seconds("criu_dump") or 0.0,
        "restore": restore_s,
        "criu_restore": (rr.timeline.seconds("criu_restore") or 0.0) - waited,
        "gpu_restore": (rr.timeline.seconds("gpu_restore") or 0)
        + (rr.timeline.seconds("gpu_unlock") or 0),
    }


async def _bare_run(
    criu: Criu, gpu: bool, argv: list[str], name: str, state: Path, shm: Path
) -> dict[str, float]:
    job = await start_job(argv, name, state_dir=state, pid_namespace=not gpu)
    await _ready(job)
    images = shm / name
    images.mkdir(parents=True)
    tree = proctree.tree(job.pid)
    gpids = [p for p in tree if proctree.uses_device(p, "/dev/nvidia")] if gpu else []
    # snapshot of the job's files, as any correct dump of a running job must do
    saved = {p: p.read_bytes() for p in (job.dir / "stdout", job.dir / "stderr") if p.exists()}
    t0 = time.perf_counter()
    if gpids:
        drv = _Driver.get()
        await asyncio.gather(*(asyncio.to_thread(drv.lock, p, 10000) for p in gpids))
        await asyncio.gather(*(asyncio.to_thread(drv.checkpoint, p) for p in gpids))
    await asyncio.to_thread(
        subprocess.run,
        [
            criu.path,
            "dump",
            "-t",
            str(job.pid),
            "-D",
            str(images),
            "-o",
            "d.log",
            "--ext-unix-sk",
            "--file-locks",
        ],
        check=True,
    )
    dump_s = time.perf_counter() - t0
    _kill(job.pid)
    for p, data in saved.items():
        p.write_bytes(data)
    ns = {proctree.ns_pid(p) for p in gpids}
    pidfile = images / "pid"
    argv = [criu.path, "restore", "-D", str(images), "-o", "r.log", "-d", "--pidfile",
            str(pidfile), "--ext-unix-sk", "--file-locks"]  # fmt: skip
    for _ in range(120):  # the kernel may hold a just-killed job's PIDs for a while
        t0 = time.perf_counter()
        done = await asyncio.to_thread(subprocess.run, argv, capture_output=True)
        if done.returncode == 0:
            break
        await asyncio.sleep(1.0)
    else:
        raise RuntimeError("bare criu restore kept failing")
    root = int(pidfile.read_text())
    if ns:
        new = [h for n, h in proctree.host_pids_by_ns_pid(root).items() if n in ns]
        drv = _Driver.get()
        await asyncio.gather(*(asyncio.to_thread(drv.restore, p, None) for p in new))
        await asyncio.gather(*(asyncio.to_thread(drv.unlock, p) for p in new))
    restore_s = time.perf_counter() - t0
    _kill(root)
    shutil.rmtree(images, ignore_errors=True)
    return {"dump": dump_s, "restore": restore_s}


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", type=float, default=None, help="GiB per job")
    p.add_argument("--gpu", action="store_true", help="GPU jobs (PyTorch) instead of CPU jobs")
    p.add_argument("--criu", default=os.environ.get("SPOTGUARD_CRIU"))
    args = p.parse_args()
    sizes = args.sizes or ([2.0, 10.0, 40.0] if args.gpu else [0.5, 2.0, 4.0])
    work = Path(tempfile.mkdtemp(prefix="spotguard-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="spotguard-bench-", dir="/dev/shm"))
    criu = Criu(args.criu)
    gpu_hook: GpuHook = CudaHook() if args.gpu else NoGpu()
    settings = CheckpointSettings(state_dir=work / "state", criu=criu.path)
    engine = Engine(criu, gpu_hook, settings=settings)
    src = GPU_JOB if args.gpu else CPU_JOB
    inv = inventory()
    where = f"{platform.node()} {os.cpu_count()} cores, kernel {platform.release()}"
    if args.gpu:
        where += f", {inv.count} x {inv.model}, driver {inv.driver}"
    print(
        f"# freeze benchmark ({'GPU' if args.gpu else 'CPU'} jobs) on {where}, "
        f"criu {await criu.version()}, images in tmpfs"
    )
    head = (
        "| size GiB | image GiB | freeze s | gpu ckpt s | criu dump s | dump GB/s | "
        "restore s | criu restore s | gpu restore s | restore GB/s | bare dump s | "
        "bare restore s | overhead |"
    )
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    rc = 0
    for i, gib in enumerate(sizes):
        argv = [sys.executable, "-c", src, str(gib)]
        try:
            e = await _engine_run(engine, args.gpu, argv, f"e{i}", work / "state", shm)
            b = await _bare_run(criu, args.gpu, argv, f"b{i}", work / "state", shm)
        except Exception as exc:  # noqa: BLE001 - report the size that failed, keep going
            print(f"| {gib} | failed: {exc} |")
            rc = 1
            continue
        img = e["image"]
        over = (e["freeze"] + e["restore"]) / (b["dump"] + b["restore"]) - 1
        print(
            f"| {gib} | {img / 2**30:.2f} | {e['freeze']:.2f} | {e['gpu_ckpt']:.2f} | "
            f"{e['dump']:.2f} | {img / e['freeze'] / 1e9:.2f} | {e['restore']:.2f} | "
            f"{e['criu_restore']:.2f} | {e['gpu_restore']:.2f} | "
            f"{img / e['restore'] / 1e9:.2f} | {b['dump']:.2f} | {b['restore']:.2f} | "
            f"{over * 100:+.1f}% |",
            flush=True,
        )
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
