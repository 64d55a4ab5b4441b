"""Freeze engine benchmark: freeze window, dump and restore throughput, engine overhead.

For each size, a job holding that much memory (CPU: a Python buffer; ``--gpu``: PyTorch
tensors on the GPU plus its CPU side) is

1. frozen by the engine (exit mode, image in tmpfs) and restored by the engine, and
2. a twin job is dumped and restored by the bare calls the engine orders (driver
   lock + checkpoint, ``criu dump``; ``criu restore``, driver restore + unlock), also into tmpfs.

``--warmup N`` first makes N uncounted bare runs per size (the first run at a size pays for
the host finding that much free memory: a 4 GiB dump took 10.5-11.9 s instead of 4-5 s on the
2-core VM); ``--repeat N`` interleaves the two (engine, bare, bare, engine, engine, bare, ...:
each pair in the other order than the one before, so neither always runs first on a warm or
cold machine) and reports medians with the min-max spread. The overhead column is median
engine time / median bare time - 1 for dump and restore together, with the spread of the
per-pair ratios; "engine own ms" is engine time minus the CRIU and driver calls inside it
(scan, snapshot of the job's files, metadata, markers), freeze + restore.
Run: ``python -m bench.freeze --sizes 0.5 2 4 --repeat 3`` (CPU) or ``python -m bench.freeze
--gpu``. Needs root and CRIU (scripts/install-criu). Progress goes to stderr as it happens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import statistics
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
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget

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
    rtl = rr.timeline
    inner = (tl.seconds("capture_files") or 0.0) + (tl.seconds("finish") or 0.0)
    calls = sum(tl.seconds(n) or 0.0 for n in ("gpu_lock", "gpu_checkpoint", "criu_dump"))
    rcalls = (rtl.seconds("criu_restore") or 0.0) - waited
    rcalls += sum(rtl.seconds(n) or 0.0 for n in ("gpu_restore", "gpu_unlock"))
    return {
        "own": (freeze_s - calls + inner) + (restore_s - rcalls),
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


def _med(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _spread(runs: list[dict[str, float]], key: str, fmt: str = ".2f") -> str:
    """Median, and min..max when there is more than one run."""
    vals = [r[key] for r in runs]
    med = format(statistics.median(vals), fmt)
    return med if len(vals) == 1 else f"{med} ({min(vals):{fmt}}..{max(vals):{fmt}})"


def _row(gib: float, es: list[dict[str, float]], bs: list[dict[str, float]]) -> str:
    img = _med(es, "image")
    eng = [e["freeze"] + e["restore"] for e in es]
    bare = [b["dump"] + b["restore"] for b in bs]
    over = statistics.median(eng) / statistics.median(bare) - 1
    pairs = [e / b - 1 for e, b in zip(eng, bare, strict=True)]
    span = f" ({min(pairs) * 100:+.1f}..{max(pairs) * 100:+.1f})" if len(pairs) > 1 else ""
    own = [{"own": e["own"] * 1000} for e in es]
    return (
        f"| {gib} | {len(es)}+{len(bs)} | {img / 2**30:.2f} | {_spread(es, 'freeze')} | "
        f"{_med(es, 'gpu_ckpt'):.2f} | {_spread(es, 'dump')} | "
        f"{img / _med(es, 'freeze') / 1e9:.2f} | {_spread(es, 'restore')} | "
        f"{_med(es, 'criu_restore'):.2f} | {_med(es, 'gpu_restore'):.2f} | "
        f"{img / _med(es, 'restore') / 1e9:.2f} | {_spread(bs, 'dump')} | "
        f"{_spread(bs, 'restore')} | {_spread(own, 'own', '.0f')} | {over * 100:+.1f}%{span} |"
    )


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", type=float, default=None, help="GiB per job")
    p.add_argument("--gpu", action="store_true", help="GPU jobs (PyTorch) instead of CPU jobs")
    p.add_argument("--criu", default=os.environ.get("SPOTGUARD_CRIU"))
    p.add_argument(
        "--repeat", type=int, default=None, help="interleaved engine/bare pairs (CPU 3, GPU 1)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="uncounted bare runs first (CPU 1, GPU 0)"
    )
    args = p.parse_args()
    sizes = args.sizes or ([2.0, 10.0, 40.0] if args.gpu else [0.5, 2.0, 4.0])
    args.repeat = max(1, args.repeat or (1 if args.gpu else 3))
    if args.warmup is None:
        args.warmup = 0 if args.gpu else 1
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
        "| size GiB | runs | image GiB | freeze s | gpu ckpt s | criu dump s | dump GB/s | "
        "restore s | criu restore s | gpu restore s | restore GB/s | bare dump s | "
        "bare restore s | engine own ms | overhead (pairs min..max) |"
    )
    print(head)
    print("|" + " --- |" * (head.count("|") - 1), flush=True)
    rc = 0
    for i, gib in enumerate(sizes):
        argv = [sys.executable, "-c", src, str(gib)]
        es: list[dict[str, float]] = []
        bs: list[dict[str, float]] = []
        try:
            for w in range(args.warmup):  # the first run at a size pays for finding its memory
                r = await _bare_run(criu, args.gpu, argv, f"w{i}-{w}", work / "state", shm)
                print(f"# {gib} GiB warm-up (not counted): " + ", ".join(
                    f"{k} {v:.3f}" for k, v in r.items()), file=sys.stderr, flush=True)  # fmt: skip
            for rep in range(args.repeat):
                order = ("engine", "bare") if rep % 2 == 0 else ("bare", "engine")
                for kind in order:
                    name = f"{kind[0]}{i}-{rep}"
                    if kind == "engine":
                        r = await _engine_run(engine, args.gpu, argv, name, work / "state", shm)
                        es.append(r)
                    else:
                        r = await _bare_run(criu, args.gpu, argv, name, work / "state", shm)
                        bs.append(r)
                    print(f"# {gib} GiB {kind} run {rep + 1}: "
                          + ", ".join(f"{k} {v:.3f}" for k, v in r.items()),
                          file=sys.stderr, flush=True)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - report the size that failed, keep going
            print(f"| {gib} | failed: {exc} |", flush=True)
            rc = 1
            continue
        print(_row(gib, es, bs), flush=True)
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
