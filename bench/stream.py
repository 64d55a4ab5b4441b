"""Naive pipeline vs streamed freeze, same job, same store, one run each.

naive:    (GPU jobs: driver lock + checkpoint, then) criu dump → tmpfs directory, then
          zstd-compress every file (level 1, all cores), then upload the compressed files
          (file store: copy + fsync) — one stage after another, as a shell script would.
streamed: engine freeze in exit mode with StreamTarget: criu dump --stream → capture →
          ImageWriter (chunks, zstd frames in threads, parallel uploads, manifest last), all
          overlapped.

Each job is started like a real one (``spotguard run``; GPU jobs with ``--no-pid-namespace``).
CPU jobs hold N MiB (half random, half repetitive); ``--gpu`` jobs are PyTorch processes
holding N GiB of bf16 tensors (N(0, 0.02), like weights) on the GPU plus their normal CPU side.

For each run: seconds from freeze start to durable image, peak host RAM — sampled every 20 ms:
the RSS of every process of this benchmark's tree (CRIU included) and of the job's tree, plus
what the naive run holds in tmpfs; a second column gives the rise of the host's used memory
(MemTotal - MemAvailable) over the run plus the job's RSS before it, as a cross-check — the
restore time with its stages, and a check that the job continues after the restore: the
checksum of its data (tensors) after the restore equals the one before the freeze, and its step
counter went on. The planner's prediction (made before each run, from what it learned on the
runs before) is printed next to each actual. The streamed restore is also compared with its
stages measured alone: reading the image from the store (download, verify, decompress) into
nothing, and ``criu restore`` from tmpfs (the naive run's).

    python -m bench.stream --sizes 512 2048 --store file:///var/tmp/sg-bench
    python -m bench.stream --sizes 512 --store s3                  # a local moto server
    python -m bench.stream --gpu --sizes 10 40 --store file:///var/tmp/sg-bench   # GiB

A file store gets a fresh directory under the given one per run, removed after the run (same
data is never deduplicated across runs, and the disk never holds more than one image).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import zstandard

from bench.stacks import Stacks
from spotguard.checkpoint import gpupages, proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.cuda import CudaHook, GpuHook, NoGpu, warm
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo, resolve_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.errors import CheckpointError, CriuError, SpotguardError
from spotguard.image import ImageSettings
from spotguard.image.reader import ImageReader
from spotguard.planner import Estimate, Planner, PlannerSettings, estimate, thp_status
from spotguard.store import open_store
from spotguard.stream import StreamSource, StreamTarget

JOB = """
import hashlib, os, random, sys, time
kind, size, seed, req = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ngpus, rank = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else (1, 0)
if kind == "gpu":
    import torch
    if rank == 0 and ngpus > 1:  # one process per GPU, like a data-parallel job
        import subprocess
        kids = [subprocess.Popen([sys.executable, *sys.argv[:3], str(seed + r), req, str(ngpus),
                                  str(r)]) for r in range(1, ngpus)]
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    left = int(size * (1 << 30)) // 2  # bf16 elements
    tensors = []
    while left > 0:  # 1 GiB tensors, like a model's weights and optimizer state
        k = min(left, 1 << 29)
        t = torch.empty(k, dtype=torch.bfloat16, device=dev)
        tensors.append(t.normal_(0.0, 0.02, generator=gen))
        left -= k
    work = torch.zeros(1 << 20, device=dev)

    def own_checksum():
        h = hashlib.sha256()
        for t in tensors:
            v = t.view(torch.int16)
            for i in range(0, v.numel(), 1 << 27):
                s = int(v[i : i + (1 << 27)].to(torch.int64).sum())
                h.update(s.to_bytes(16, "little", signed=True))
        torch.cuda.empty_cache()  # keep the GPU state at the tensors' size
        return h.hexdigest()[:16]

    def answer(name, text):  # a rank > 0 answers rank 0 through a file
        with open(name + ".tmp", "w") as f:
            f.write(text)
        os.rename(name + ".tmp", name)

    def other(r, want):
        while True:
            try:
                with open(f"{req}.{r}") as f:
                    got, _, s = f.read().partition(" ")
                if got == want:
                    return s
            except FileNotFoundError:
                pass
            time.sleep(0.02)

    def checksum():
        mine = own_checksum()
        if rank:
            answer(f"{req}.{rank}", f"{seen} {mine}")
            return mine
        sums = [mine, *(other(r, seen) for r in range(1, ngpus))]
        return hashlib.sha256(" ".join(sums).encode()).hexdigest()[:16] if ngpus > 1 else mine

    def step():
        work.add_(1.0)
        torch.cuda.synchronize()
else:
    r = random.Random(seed)
    half = int(size) // 2
    # half random (incompressible, like bf16 weights), half repetitive (like CPU-side pages)
    blob = bytearray().join(r.randbytes(1 << 20) for _ in range(half))
    blob += bytes(range(256)) * (4096 * half)

    def checksum():
        return hashlib.blake2b(blob).hexdigest()[:16]

    def step():
        pass

n, seen = 0, ""
if rank:
    answer(f"{req}.{rank}", "ready ")
else:
    for r in range(1, ngpus):  # each rank > 0 has its tensors
        while not os.path.exists(f"{req}.{r}"):
            time.sleep(0.02)
    print("ready", flush=True)
while True:
    step()
    n += 1
    try:
        with open(req) as f:
            want = f.read().strip()
    except FileNotFoundError:
        want = ""
    if want and want != seen:
        seen = want
        line = f"check {want} step {n} sum {checksum()}"
        if not rank:
            print(line, flush=True)
    time.sleep(0.02)
"""
GiB = 1 << 30
CHECK = re.compile(r"^check (\S+) step (\d+) sum (\S+)$", re.M)


def _used_bytes() -> int:
    """The host's used memory (MemTotal - MemAvailable): page cache that can be dropped is
    not counted, tmpfs is."""
    vm = psutil.virtual_memory()
    return int(vm.total - vm.available)


class Peak:
    """Peak of (RSS of our process tree + the job tree + tmpfs staging) sampled every 20 ms,
    and the peak of the host's used memory."""

    def __init__(self, job_pid: int, staging: Path | None = None) -> None:
        self.job_pid = job_pid
        self.staging = staging
        self.peak = 0
        self.sys_base = _used_bytes()
        self.sys_peak = self.sys_base
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
        self.sys_peak = max(self.sys_peak, _used_bytes())
        return total

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, await asyncio.to_thread(self.sample))
            await asyncio.sleep(0.02)

    def __enter__(self) -> Peak:
        self.peak = self.sample()
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


@dataclass
class Bench:
    """What every run needs: the engine (with or without the GPU hook) and where things go."""

    engine: Engine
    gpu: bool
    work: Path
    state: Path
    script: Path
    store_url: str
    file_root: Path | None  # the file store's directory (per run), None for other stores
    notes: list[str] = field(default_factory=list)
    gpus: int = 1  # GPU jobs: one process per GPU, each holding the size given
    profile: bool = False  # sample thread states and kernel stacks (bench.stacks)
    pipe_mib: int = 0  # the streams' pipe size ([image] pipe_mb; 0: the setting's default)


# --- the job ----------------------------------------------------------------------------------


async def _start(b: Bench, name: str, size: float, seed: int) -> tuple[JobInfo, Path]:
    """Start the job through ``spotguard run`` (GPU jobs: ``--no-pid-namespace``)."""
    req = b.work / f"req-{name}"
    argv = [sys.executable, "-c", "from spotguard.cli import main; main()", "run", "--json",
            "--name", name, "--state-dir", str(b.state),
            *(["--no-pid-namespace"] if b.gpu else []), "--",
            sys.executable, str(b.script), "gpu" if b.gpu else "cpu", str(size), str(seed),
            str(req), str(b.gpus), "0"]  # fmt: skip
    done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"spotguard run failed: {done.stderr.strip()[-2000:]}")
    job = resolve_job(name, state_dir=b.state)
    await _wait_line(job, "ready", 900)
    return job, req


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


async def _wait_line(job: JobInfo, what: str, limit: float, pid: int | None = None) -> str:
    """Wait for ``what`` in the job's output; fail early if the job (``pid``) has ended."""
    t0 = time.monotonic()
    while True:
        text = _read(job.dir / "stdout")
        if what in text:
            return text
        gone = not proctree.alive(pid or job.pid)
        if gone or time.monotonic() - t0 > limit:
            why = "ended" if gone else f"after {limit:.0f}s"
            tail = _read(job.dir / "stderr")[-2000:]
            raise RuntimeError(f"job {job.name}: no {what!r} ({why}); stderr: {tail}")
        await asyncio.sleep(0.05)


async def _check(job: JobInfo, req: Path, token: str, pid: int | None = None) -> tuple[int, str]:
    """Ask the job for its step counter and the checksum of its data."""
    await asyncio.to_thread(req.write_text, token)
    text = await _wait_line(job, f"check {token} ", 300, pid)
    for m in CHECK.finditer(text):
        if m.group(1) == token:
            return int(m.group(2)), m.group(3)
    raise RuntimeError(f"job {job.name}: unreadable check line")


def _ids(pid: int) -> set[int]:
    """Every pid and thread id of the tree: CRIU restores them all with the same numbers."""
    ids: set[int] = set()
    for p in proctree.tree(pid):
        ids.add(p)
        with contextlib.suppress(psutil.Error):
            ids.update(t.id for t in psutil.Process(p).threads())
    return ids


def _held(ids: set[int]) -> bool:
    return any(os.path.exists(f"/proc/{i}") for i in ids)


def _ls(path: Path) -> list[Path]:
    return sorted(path.iterdir())


async def _wait_free(ids: set[int], limit: float = 120) -> float:
    """Wait until the kernel has released every id (zombies and exiting tasks hold them):
    a job without its own PID namespace can only be restored then."""
    t0 = time.perf_counter()
    while _held(ids):
        if time.perf_counter() - t0 > limit:
            break
        await asyncio.sleep(0.05)
    return time.perf_counter() - t0


async def _kill(pid: int) -> None:
    try:
        ids = _ids(pid)
    except SpotguardError:
        return
    proctree.signal_all(sorted(ids & set(proctree.tree(pid))), signal.SIGKILL)
    await _wait_free(ids, 60)


# --- the naive pipeline -----------------------------------------------------------------------


def _compress_dir(src: Path, dst: Path) -> int:
    cctx = zstandard.ZstdCompressor(level=1, threads=-1)
    total = 0
    for f in sorted(src.iterdir()):
        if f.is_file():
            with f.open("rb") as fi, (dst / (f.name + ".zst")).open("wb") as fo:
                cctx.copy_stream(fi, fo, read_size=8 << 20, write_size=8 << 20)
            total += (dst / (f.name + ".zst")).stat().st_size
    return total


def _decompress_dir(src: Path, dst: Path) -> None:
    dctx = zstandard.ZstdDecompressor()
    for f in sorted(src.iterdir()):
        with f.open("rb") as fi, (dst / f.name.removesuffix(".zst")).open("wb") as fo:
            dctx.copy_stream(fi, fo, read_size=8 << 20, write_size=8 << 20)
        f.unlink()


def _copy_fsync(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with src.open("rb") as fi, dst.open("wb") as fo:
        shutil.copyfileobj(fi, fo, 8 << 20)
        fo.flush()
        os.fsync(fo.fileno())


async def _upload(b: Bench, src: Path, prefix: str) -> None:
    """One file after another, as ``aws s3 cp`` / ``cp && sync`` would."""
    if b.file_root is not None:
        for f in _ls(src):
            await asyncio.to_thread(_copy_fsync, f, b.file_root / prefix / f.name)
        return
    store = open_store(b.store_url)
    try:
        for f in _ls(src):
            await store.put(f"{prefix}/{f.name}", await asyncio.to_thread(f.read_bytes))
    finally:
        await store.aclose()


async def _download(b: Bench, prefix: str, dst: Path) -> None:
    if b.file_root is not None:  # the store's copy is dropped once fetched (tmpfs stores)
        for f in _ls(b.file_root / prefix):
            await asyncio.to_thread(shutil.copyfile, f, dst / f.name)
            await asyncio.to_thread(f.unlink)
        return
    store = open_store(b.store_url)
    try:
        for info in await store.list(f"{prefix}/"):
            data = await store.get(info.key)
            await asyncio.to_thread((dst / info.key.rsplit("/", 1)[1]).write_bytes, data)
    finally:
        await store.aclose()


async def _criu_restore(engine: Engine, images: Path, ids: set[int]) -> tuple[int, float]:
    """``criu restore`` after the job's ids are free; returns (pid, seconds waited)."""
    waited = await _wait_free(ids)
    for _ in range(60):
        t0 = time.perf_counter()
        try:
            return await engine.criu.restore(images), waited
        except CriuError as exc:
            if "File exists" not in exc.log_tail:
                raise
            await asyncio.sleep(1.0)
            waited += time.perf_counter() - t0 + 1.0
    raise RuntimeError("criu restore: the job's pids stayed taken")


async def naive(b: Bench, job: JobInfo) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="sg-naive-", dir="/dev/shm"))
    dump, packed = root / "dump", root / "packed"
    dump.mkdir()
    packed.mkdir()
    prefix = f"naive/{job.name}"
    gpu = b.engine.gpu
    out: dict[str, Any] = {}
    try:
        ids = _ids(job.pid)
        gpids = await gpu.gpu_pids(proctree.tree(job.pid))
        gns = [proctree.ns_pid(p) for p in gpids]
        with Peak(job.pid, root) as peak:
            t0 = time.perf_counter()
            if gpids:
                await gpu.lock(gpids, b.engine.settings.gpu_lock_timeout)
                await gpu.checkpoint(gpids)
            out["gpu_checkpoint"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            await b.engine.criu.dump(job.pid, dump, leave_running=False)
            out["criu_dump"] = time.perf_counter() - t1
            out["image_bytes"] = sum(f.stat().st_size for f in dump.iterdir())
            t1 = time.perf_counter()
            out["stored_bytes"] = await asyncio.to_thread(_compress_dir, dump, packed)
            out["compress"] = time.perf_counter() - t1
            shutil.rmtree(dump)
            t1 = time.perf_counter()
            await _upload(b, packed, prefix)
            out["upload"] = time.perf_counter() - t1
            out["total"] = time.perf_counter() - t0
        out["peak_ram"], out["sys_peak"] = peak.peak, peak.sys_peak - peak.sys_base
        shutil.rmtree(packed)
        # restore: download, decompress into tmpfs, criu restore, GPU restore + unlock
        packed.mkdir()
        dump.mkdir()
        rs: dict[str, float] = {}
        t0 = time.perf_counter()
        await _download(b, prefix, packed)
        rs["download"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        await asyncio.to_thread(_decompress_dir, packed, dump)
        rs["decompress"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        pid, waited = await _criu_restore(b.engine, dump, ids)
        rs["criu_restore"] = time.perf_counter() - t1 - waited
        t1 = time.perf_counter()
        if gpids:
            new = proctree.host_pids_by_ns_pid(pid)
            back = [new[n] for n in gns]
            await gpu.restore(back)
            await gpu.unlock(back)
        rs["gpu_restore"] = time.perf_counter() - t1
        out["restore"] = time.perf_counter() - t0 - waited
        out["restore_stages"] = rs
        out["pid_wait"] = waited
        out["restored_pid"] = pid
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


# --- the streamed pipeline --------------------------------------------------------------------


async def _read_alone(url: str) -> tuple[float, int]:
    """Read every file of the image from the store (download, verify, decompress) into
    nothing: the restore pipeline's fetch stage alone."""
    t0 = time.perf_counter()
    n = 0
    async with ImageReader(url, settings=ImageSettings()) as reader:
        for f in reader.manifest.files:
            async for data in reader.iter_file(f.name):
                n += len(data)
    return time.perf_counter() - t0, n


async def streamed(b: Bench, job: JobInfo) -> dict[str, Any]:
    settings = ImageSettings(pipe_mb=b.pipe_mib) if b.pipe_mib else ImageSettings()
    target = StreamTarget(b.store_url, work_root=b.work, level=1, settings=settings)
    ids = _ids(job.pid)
    with Peak(job.pid) as peak, _profile(b, job.pid) as prof_freeze:
        wall0 = time.time()
        t0 = time.perf_counter()
        res = await b.engine.freeze(job, target, Mode.EXIT)
        returned = time.perf_counter() - t0
    assert target.manifest is not None
    tl = res.timeline
    dump_start = next(s.start for s in tl.steps if s.name == "criu_dump")
    # Durable = the manifest committed (the end of the target's stream_durable step). The
    # engine returns later: in exit mode CRIU ends the job only after that (freeing its memory
    # takes seconds at 40 GiB), and the naive pipeline pays the same inside its criu_dump.
    durable_step = next(s for s in target.timeline_steps if s.name == "stream_durable")
    durable = durable_step.start + (durable_step.seconds or 0.0) - wall0
    out: dict[str, Any] = {
        "total": durable,
        "returned": returned,
        "gpu_checkpoint": (tl.seconds("gpu_lock") or 0.0) + (tl.seconds("gpu_checkpoint") or 0.0),
        "stream": wall0 + durable - dump_start,
        "criu_dump": tl.seconds("criu_dump") or 0.0,
        "gpu_pages": tl.seconds("gpu_pages") or 0.0,  # inside criu_dump: the tree frozen
        "peak_ram": peak.peak,
        "sys_peak": peak.sys_peak - peak.sys_base,
        "image_bytes": target.manifest.totals.bytes,
        "stored_bytes": target.manifest.totals.stored_bytes,
    }
    cs = target.capture_stats
    if cs is not None:  # a full capture buffer means the writer held CRIU back, not CRIU us
        out["capture"] = {
            "peak_buffered_mib": cs.peak_buffered / 2**20,
            "pipe_bytes": cs.pipe_bytes,
            "first_data_s": (cs.first_data or cs.started) - wall0,
            "last_data_s": (cs.last_data or cs.started) - wall0,
        }
    if target.writer_stats is not None:  # where the chunk pipeline waited, summed over chunks
        out["writer"] = target.writer_stats.to_json()
        print(f"chunk pipeline: {out['writer']['step_seconds']} over {out['writer']['seconds']} s",
              file=sys.stderr, flush=True)  # fmt: skip
    out["steps"] = {
        s.name: [round(s.start - wall0, 3), round(s.seconds or 0.0, 3)]
        for s in [*tl.steps, *target.timeline_steps]
    }
    url = f"{b.store_url.rstrip('/')}/{job.name}/images/{target.manifest.image_id}"
    out["read_alone"], _ = await _read_alone(url)
    waited = await _wait_free(ids)
    for _ in range(30):  # the engine does not retry a streamed restore: the source is used up
        t0 = time.perf_counter()
        try:
            source = StreamSource(url, settings=settings, work_root=b.work)
            with _profile(b, None) as prof_restore:
                rr = await b.engine.restore(source, state_dir=b.state)
            break
        except CheckpointError as exc:
            if "File exists" not in str(exc) and "Can't fork" not in str(exc):
                raise
            await asyncio.sleep(1.0)
            waited += time.perf_counter() - t0
    else:
        raise RuntimeError("streamed restore: the job's pids stayed taken")
    out["restore"] = time.perf_counter() - t0
    rt = rr.timeline
    out["restore_stages"] = {
        "source": rt.seconds("source") or 0.0,
        "criu_restore": rt.seconds("criu_restore") or 0.0,
        # the GPU memory written back beside CRIU (checkpoint/gpupages.py)
        "gpu_pages": rt.seconds("gpu_pages") or 0.0,
        "gpu_restore": (rt.seconds("gpu_restore") or 0.0) + (rt.seconds("gpu_unlock") or 0.0),
        "other": sum(rt.seconds(n) or 0.0 for n in ("preflight", "put_files", "finish")),
    }
    placed = next((st for st in rt.steps if st.name == "gpu_restore"), None)
    if placed is not None and placed.detail.get("overlap"):
        # the GPU memory placed while the driver restored (checkpoint/placing.py)
        out["restore_overlap"] = {
            k: placed.detail.get(k) for k in ("pages_s", "faults", "bytes", "zero_bytes")
        }
    if source.serve_stats is not None:
        out["serve"] = source.serve_stats.to_json()
    out["pid_wait"] = waited
    out["restored_pid"] = rr.pid
    if b.profile:
        out["profile"] = {
            "freeze": prof_freeze.table(f"streamed freeze of {job.name}"),
            "restore": prof_restore.table(f"streamed restore of {job.name}"),
        }
        print(out["profile"]["freeze"] + "\n\n" + out["profile"]["restore"] + "\n",
              file=sys.stderr, flush=True)  # fmt: skip
    return out


def _profile(b: Bench, job_pid: int | None) -> contextlib.AbstractContextManager[Any]:
    """Thread states and kernel stacks over a stage (``--profile``), else nothing."""
    return Stacks(job_pid) if b.profile else contextlib.nullcontext()


# --- main -------------------------------------------------------------------------------------


def _file_root(url: str) -> Path | None:
    return Path(urlparse(url).path) if url.startswith("file://") else None


def _row(
    size: float, unit: str, kind: str, est: Estimate, pred: float, r: dict[str, Any], gpus: int = 1
) -> str:
    if kind == "naive":
        stages = " + ".join(
            f"{k} {r[k]:.2f}" for k in ("gpu_checkpoint", "criu_dump", "compress", "upload")
        )
    else:
        beside = f", of it gpu_pages {r['gpu_pages']:.2f}" if r.get("gpu_pages") else ""
        stages = (
            f"gpu_checkpoint {r['gpu_checkpoint']:.2f} + stream {r['stream']:.2f}{beside} "
            f"(engine returned at {r['returned']:.2f}: CRIU ends the job after the commit)"
        )
    rs = " + ".join(f"{k} {v:.2f}" for k, v in r["restore_stages"].items())
    if ov := r.get("restore_overlap"):
        rs += f" (of it, pages placed under the driver's restore in {ov['pages_s']:.2f} s, "
        rs += f"{ov['faults']} reads waited)"
    ok = "same" if r["check_ok"] else "DIFFERENT"
    return (
        f"| {f'{gpus} x ' if gpus > 1 else ''}{size:g} {unit} | {kind} | "
        f"{r['image_bytes'] / GiB:.2f} | "
        f"{r['stored_bytes'] / GiB:.2f} | {pred:.1f} | {r['total']:.2f} | {stages} | "
        f"{r['peak_ram'] / GiB:.2f} | {r['peak_ram'] / est.total:.2f} | "
        f"{(r['sys_peak'] + r['job_rss']) / GiB:.2f} | {r['restore']:.2f} | {rs} | "
        f"{ok} (step {r['step_before']}→{r['step_after']}) |"
    )


HEAD = (
    "| job | pipeline | image GiB | stored GiB | predicted s | freeze→durable s | stages s | "
    "peak RAM GiB (RSS+tmpfs) | peak / (GPU+CPU) | host used Δ + job RSS GiB | restore s | "
    "restore stages s | data after restore |"
)


async def run_one(
    b: Bench, planner: Planner, size: float, kind: str, seed: int
) -> tuple[Estimate, float, dict[str, Any]]:
    name = f"sb-{kind}-{str(size).replace('.', '_')}-{seed}"
    job, req = await _start(b, name, size, seed)
    restored: int | None = None
    try:
        step0, sum0 = await _check(job, req, "before")
        est = estimate(job.pid)
        if b.gpu and not est.gpu_bytes:
            gp = await b.engine.gpu.gpu_pids(proctree.tree(job.pid))
            est = Estimate(b.engine.gpu.memory_used(gp), est.cpu_bytes, "driver+psutil")
        beside = kind == "streamed" and await gpupages.carried_beside(
            b.engine.criu, b.engine.settings.gpu_pages
        )
        plan = planner.plan(
            est, deadline_s=None, store_url=b.store_url, stream=kind == "streamed", beside=beside
        )
        job_rss = proctree.rss_bytes(proctree.tree(job.pid))
        r = await (naive(b, job) if kind == "naive" else streamed(b, job))
        restored = int(r["restored_pid"])
        planner.record(
            plan,
            seconds={k: float(r[k]) for k in (
                "gpu_checkpoint", "gpu_pages", "criu_dump", "compress", "upload", "stream",
                "total") if k in r},
            raw_bytes=int(r["image_bytes"]), stored_bytes=int(r["stored_bytes"]),
        )  # fmt: skip
        step1, sum1 = await _check(job, req, "after", restored)
        r.update(
            job_rss=job_rss,
            step_before=step0,
            step_after=step1,
            check_ok=sum1 == sum0 and step1 > step0,
            checksum=sum0,
            predicted=plan.stages,
            predicted_total=plan.total_s,
            estimate={"gpu_bytes": est.gpu_bytes, "cpu_bytes": est.cpu_bytes},
        )
        return est, plan.total_s, r
    finally:
        await _kill(restored if restored is not None else job.pid)
        if b.file_root is not None:
            shutil.rmtree(b.file_root, ignore_errors=True)


async def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=None,
                    help="job size: MiB (CPU jobs, default 512 2048) or GiB with --gpu "
                    "(default 10 40)")  # fmt: skip
    ap.add_argument("--gpu", action="store_true", help="PyTorch jobs holding GPU tensors")
    ap.add_argument("--store", default="file:///var/tmp/sg-bench-store")
    ap.add_argument("--pipelines", nargs="+", default=["naive", "streamed"])
    ap.add_argument("--gpus", type=int, default=1,
                    help="GPU jobs: spread over this many GPUs, one process per GPU, each "
                    "holding the size given (a data-parallel job's shape)")  # fmt: skip
    ap.add_argument("--criu", default=os.environ.get("SPOTGUARD_CRIU"))
    ap.add_argument("--profile", action="store_true",
                    help="streamed runs: sample each thread's state and kernel stack in the "
                    "freeze and the restore (bench.stacks), print where each waits")  # fmt: skip
    ap.add_argument("--pipe-mib", type=int, default=0,
                    help="streamed runs: the streams' pipe size, MiB ([image] pipe_mb; "
                    "default: the setting's)")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None, help="append each run as a JSON line")
    ap.add_argument(
        "--throughput",
        type=Path,
        default=None,
        help="the planner's throughput file, kept between invocations "
        "(default: a fresh one, so the first prediction uses the defaults)",
    )
    args = ap.parse_args()
    sizes = args.sizes or ([10.0, 40.0] if args.gpu else [512.0, 2048.0])
    unit = "GiB" if args.gpu else "MiB"
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
    file_root = _file_root(store_url)
    if file_root is not None:  # a fresh directory per benchmark, removed after each run
        file_root = file_root / f"run-{uuid.uuid4().hex[:8]}"
        store_url = file_root.as_uri()
    criu = Criu(args.criu)
    hook: GpuHook = CudaHook() if args.gpu else NoGpu()
    settings = CheckpointSettings(state_dir=work / "state", criu=criu.path)
    b = Bench(Engine(criu, hook, settings=settings), args.gpu, work, work / "state", script,
              store_url, file_root, gpus=args.gpus if args.gpu else 1,
              profile=args.profile, pipe_mib=args.pipe_mib)  # fmt: skip
    planner = Planner(PlannerSettings(throughput_file=args.throughput or work / "tp.json"))
    where = f"{os.cpu_count()} cpus, thp {thp_status().enabled}, criu {await criu.version()}"
    if args.gpu:  # loaded before the runs, as the agent does at start (startup.warm_gpu)
        w = warm()
        inv = hook.inventory()
        where += f", {inv.count} x {inv.model}, driver {inv.driver} (loaded in {w.seconds:.2f} s)"
    print(f"# stream benchmark: store {args.store} ({store_url}), {where}", flush=True)
    print(HEAD + "\n|" + " --- |" * (HEAD.count("|") - 1), flush=True)
    rows: list[dict[str, Any]] = []
    rc = 0
    try:
        for i, size in enumerate(sizes):
            for j, kind in enumerate(args.pipelines):
                try:
                    est, pred, r = await run_one(b, planner, size, kind, 7 + 10 * i + j)
                except Exception as exc:  # noqa: BLE001 - report the run that failed, go on
                    print(f"| {size:g} {unit} | {kind} | failed: {exc!r} |", flush=True)
                    rc = 1
                    continue
                print(_row(size, unit, kind, est, pred, r, b.gpus), flush=True)
                r.update(size=size, unit=unit, pipeline=kind, gpus=b.gpus)
                rows.append(r)
                if args.json is not None:
                    with args.json.open("a") as f:
                        f.write(json.dumps(r, default=str) + "\n")
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    _summary(rows)
    return rc


def _summary(rows: list[dict[str, Any]]) -> None:
    """Speed-up per size, and the streamed restore against its stages measured alone."""
    print("\n| job | naive / streamed freeze→durable | streamed peak / (GPU+CPU) | "
          "restore: streamed criu+fetch s | read alone s | naive criu restore (tmpfs) s | "
          "pipelined / slowest stage |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in sorted({r["size"] for r in rows}):
        n = next((r for r in rows if r["size"] == s and r["pipeline"] == "naive"), None)
        st = next((r for r in rows if r["size"] == s and r["pipeline"] == "streamed"), None)
        if n is None or st is None:
            continue
        rs = st["restore_stages"]
        piped = rs["source"] + rs["criu_restore"] + rs.get("gpu_pages", 0.0)
        slowest = max(st["read_alone"], n["restore_stages"]["criu_restore"])
        total = st["estimate"]["gpu_bytes"] + st["estimate"]["cpu_bytes"]
        print(
            f"| {s:g} {st['unit']} | {n['total'] / st['total']:.2f}x | "
            f"{st['peak_ram'] / total:.2f} | {piped:.2f} | {st['read_alone']:.2f} | "
            f"{n['restore_stages']['criu_restore']:.2f} | {piped / slowest:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
