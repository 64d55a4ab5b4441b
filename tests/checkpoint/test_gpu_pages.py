"""The GPU memory the driver stages in host memory, moved by spotguard beside CRIU
(:mod:`spotguard.checkpoint.gpupages`), with real CRIU and real processes.

The stand-in for the driver: a job that, told "checkpoint" (SIGUSR1), maps a fresh anonymous
range and fills it — as ``cuCheckpointProcessCheckpoint`` stages device memory — and told
"restore" (SIGUSR2) checks every byte of it and unmaps it, as the driver's restore does. The
range must come back exact through CRIU's restore, having never been in CRIU's pages."""

from __future__ import annotations

import asyncio
import errno
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
from ckpt_helpers import kill_tree, step_named

from sgtest import GatedStore, StagingGpu, until
from spotguard.checkpoint import gpupages, suspend
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.meta import ImageMeta
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget, RestoreSource
from spotguard.errors import GpuError, ImageCorrupt, ImageError, SpotguardError
from spotguard.image import ImageSettings
from spotguard.image.reader import ImageReader
from spotguard.store.base import Data
from spotguard.store.file import FileStore
from spotguard.stream import StreamSource, StreamTarget

MIB = 1 << 20
#: the staged range: a quarter left zero (never written), a quarter stamped per page (packs),
#: half random (stored raw)
STAGED_MIB = 192

JOB = """
import ctypes, mmap, os, random, signal, sys, time
here, n = sys.argv[1], int(sys.argv[2]) << 20
held = {}
own = os.urandom(int(sys.argv[3]) << 20) if len(sys.argv) > 3 else b""  # CRIU's to dump

def stamp(off):
    return b"%016x" % (off * 2654435761 % (1 << 64))

def noise(off):
    return random.Random(off).randbytes(1 << 20)

def staged(sig, frame):
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for off in range(n // 4, n // 2, 4096):
        m[off:off + 16] = stamp(off)
    for off in range(n // 2, n, 1 << 20):
        m[off:off + (1 << 20)] = noise(off)
    c = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(c)
    del c
    held["m"] = m
    open(os.path.join(here, "staged"), "w").write("%x %x\\n" % (addr, addr + n))

def restored(sig, frame):
    m = held.pop("m")
    ok = all(m[off:off + 16] == stamp(off) for off in range(n // 4, n // 2, 4096))
    ok = ok and all(m[off:off + (1 << 20)] == noise(off) for off in range(n // 2, n, 1 << 20))
    ok = ok and m[: n // 4] == bytes(n // 4)
    m.close()
    open(os.path.join(here, "checked"), "a").write("ok\\n" if ok else "BAD\\n")

signal.signal(signal.SIGUSR1, staged)
signal.signal(signal.SIGUSR2, restored)
i = 0
while True:
    print(i, flush=True)
    i += 1
    time.sleep(0.02)
"""


@pytest.fixture
def here(tmp_path: Path) -> Path:
    d = tmp_path / "here"
    d.mkdir()
    return d


async def _start(tmp_path: Path, here: Path, name: str, own_mib: int = 0) -> JobInfo:
    script = tmp_path / "staging_job.py"
    script.write_text(JOB)
    argv = [sys.executable, str(script), str(here), str(STAGED_MIB), str(own_mib)]
    job = await start_job(argv, name, state_dir=tmp_path / "state")
    await until(lambda: _count(job) > 3, "the job's first lines")
    return job


def _count(job: JobInfo) -> int:
    path = job.dir / "stdout"
    return path.read_text().count("\n") if path.exists() else 0


def _numbers(job: JobInfo) -> list[int]:
    return [int(x) for x in (job.dir / "stdout").read_text().split()]


def _settings(tmp_path: Path, criu: str, **kw: object) -> CheckpointSettings:
    return CheckpointSettings(
        state_dir=tmp_path / "state", criu=criu, shm_dir=tmp_path / "shm", criu_timeout=60, **kw
    )


async def _rig(
    tmp_path: Path,
    here: Path,
    criu: str,
    name: str,
    *,
    memory: int = 0,
    own_mib: int = 0,
    **kw: object,
) -> tuple[JobInfo, StagingGpu, Engine]:
    """The staging job started as ``name`` (with ``own_mib`` MiB of random memory of its
    own), its stand-in driver (saying ``memory`` bytes of GPU memory are in use: 0, not
    known) and an engine over both."""
    job = await _start(tmp_path, here, name, own_mib)
    gpu = StagingGpu(here, "staging_job.py", memory=memory)
    return job, gpu, Engine(Criu(criu), gpu, settings=_settings(tmp_path, criu, **kw))


def _stream_target(tmp_path: Path, settings: ImageSettings) -> StreamTarget:
    """A stream into ``tmp_path/store`` (4 MiB chunks: a part is several)."""
    store = f"file://{tmp_path / 'store'}"
    opts = {"chunk_size": 4 * MIB}
    return StreamTarget(store, work_root=tmp_path / "w", writer_options=opts, settings=settings)


async def _continues(job: JobInfo, before: int) -> None:
    """The restored job counts on from where it stopped: no number skipped or repeated."""
    await until(lambda: _count(job) > before + 5, "the restored job's next lines")
    nums = _numbers(job)
    assert nums == list(range(len(nums)))


async def _killed_and_restored(
    job: JobInfo,
    gpu: StagingGpu,
    engine: Engine,
    source: RestoreSource,
    here: Path,
    state_dir: Path | None = None,
) -> None:
    """A paused job that ran on, killed and restored from ``source``: its staged range comes
    back exact, its output is as it was at the pause (carried in the image), then counts on
    from there."""
    await until(lambda: _count(job) > 10, "the job running on")
    kill_tree(job.pid)
    await until(lambda: not psutil.pid_exists(job.pid), "the job gone")
    (here / "checked").unlink()
    stopped_at = _count(job)
    restored = None
    try:
        restored = await engine.restore(source, state_dir=state_dir)
        assert gpu.checks() == ["ok"]
        await _continues(job, stopped_at)
    finally:
        kill_tree(restored.pid if restored else None)


@pytest.mark.parametrize("overlap", [True, False], ids=["placed-under-the-restore", "before"])
async def test_staged_memory_streams_beside_criu_and_comes_back_exact(
    patched: str, tmp_path: Path, here: Path, overlap: bool
) -> None:
    """Restored either way: placed while the stand-in driver already reads it (the default,
    :mod:`spotguard.checkpoint.placing`), or all written back before its restore starts."""
    job, gpu, engine = await _rig(
        tmp_path,
        here,
        patched,
        "gpupages-stream",
        restore_overlap=overlap,
        restore_overlap_min_mib=0,
    )
    settings = ImageSettings()
    target = _stream_target(tmp_path, settings)
    frozen = await engine.freeze(job, target, Mode.EXIT)
    lo, hi = (int(x, 16) for x in (here / "staged").read_text().split())
    [carried] = frozen.meta.gpu_pages
    assert (carried.start, carried.end) == (lo, hi)
    assert len(carried.parts) == gpupages.default_workers()
    assert step_named(frozen.timeline, "gpu_pages").detail["bytes"] == STAGED_MIB * MIB
    # CRIU wrote none of the range: its pages images hold only the interpreter's memory
    assert target.capture_stats is not None
    assert target.capture_stats.bytes < STAGED_MIB * MIB // 2
    assert target.url is not None
    async with ImageReader(target.url, settings=settings) as reader:
        names = {f.name for f in reader.manifest.files}
        assert {p.name for p in carried.parts} <= names
        # the quarter left zero is stored as zero chunks (never fetched back)
        zero = reader.codec.zero_address
        refs = [r for p in carried.parts for r in reader.manifest.file(p.name).chunks]
        assert sum(r.digest == zero(r.size) for r in refs) >= (STAGED_MIB // 4) // 4
        assert sum(r.raw for r in refs) >= (STAGED_MIB // 2) // 4  # the random half
    stopped_at = _count(job)
    restored = None
    try:
        source = StreamSource(target.url, work_root=tmp_path / "w", settings=settings)
        restored = await engine.restore(source, state_dir=tmp_path / "state")
        assert step_named(restored.timeline, "gpu_pages").detail["overlap"] is overlap
        where = step_named(restored.timeline, "gpu_restore" if overlap else "gpu_pages")
        assert where.detail["bytes"] == STAGED_MIB * MIB
        if overlap:  # the zero quarter mapped, never fetched; the rest moved into place
            assert where.detail["zero_bytes"] >= STAGED_MIB * MIB // 4
        assert gpu.checks() == ["ok"]  # every byte as staged, read while being placed
        await _continues(job, stopped_at)
    finally:
        kill_tree(restored.pid if restored else None)


async def test_a_tree_criu_left_stopped_runs_again_whatever_proc_shows_at_that_instant(
    patched: str, tmp_path: Path, here: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CRIU leaves the restored tree stopped until the staged memory is placed; the placer's
    set-up then lets the job go from its tracer, and for a moment ``/proc`` shows it running
    before it stops again. A restore that continued only what read as stopped then left the
    job stopped for good (the stand-in driver waited for it in vain). Here every reading of
    "stopped" says no, as it did at that instant: the job must run on all the same."""
    job, gpu, engine = await _rig(
        tmp_path, here, patched, "gpupages-cont", restore_overlap_min_mib=0
    )
    target = _stream_target(tmp_path, ImageSettings())
    await engine.freeze(job, target, Mode.EXIT)
    stopped_at = _count(job)
    monkeypatch.setattr(suspend, "stopped", lambda pid: False)
    restored = None
    try:
        assert target.url is not None
        source = StreamSource(target.url, work_root=tmp_path / "w", settings=ImageSettings())
        restored = await engine.restore(source, state_dir=tmp_path / "state")
        assert gpu.checks() == ["ok"]
        await _continues(job, stopped_at)
    finally:
        kill_tree(restored.pid if restored else None)


async def test_a_leave_running_pause_and_a_staged_image_in_a_directory(
    patched: str, tmp_path: Path, here: Path
) -> None:
    job, gpu, engine = await _rig(
        tmp_path, here, patched, "gpupages-dir", restore_overlap_min_mib=0
    )
    frozen = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.RESUME)
    assert gpu.checks() == ["ok"]  # the running job's range was never touched
    [carried] = frozen.meta.gpu_pages
    for part in carried.parts:
        assert (tmp_path / "img" / part.name).stat().st_size == part.size
    await _killed_and_restored(job, gpu, engine, DirectorySource(tmp_path / "img"), here)


async def test_a_held_pause_copies_the_staged_memory_into_room_faulted_in_before_the_freeze(
    patched: str, tmp_path: Path, here: Path
) -> None:
    """A leave-running pause held in memory (``prefault_hold``, the default): the room the
    GPU memory's copy is held in is made and faulted in with CRIU's, while the job still
    runs, so the frozen job's staged memory is copied into pages that exist — not into
    buffers the writer makes (and the kernel zeroes) while the job waits frozen."""
    job, gpu, engine = await _rig(
        tmp_path, here, patched, "gpupages-held", memory=STAGED_MIB * MIB,
        restore_overlap_min_mib=0,
    )  # fmt: skip
    settings = ImageSettings()
    target = _stream_target(tmp_path, settings)
    frozen = await engine.freeze(job, target, Mode.RESUME)
    assert gpu.checks() == ["ok"]
    (pre,) = [s for s in target.timeline_steps if s.name == "hold_prefault"]
    (dump,) = [s for s in frozen.timeline.steps if s.name == "criu_dump"]
    assert pre.detail["bytes"] >= STAGED_MIB * MIB, pre.detail  # the job's and its GPU's
    assert pre.start + (pre.seconds or 0) <= dump.start, "faulted in while the job was frozen"
    stats = target.writer_stats
    assert stats is not None
    # the staged range is 48 chunks of 4 MiB, each copied into a buffer the writer made
    # before; now the buffers it makes are for compressing (the stamped quarter's 12 chunks
    # and CRIU's pages at most), never one per chunk of the range
    assert stats.buffers_made < STAGED_MIB // 4 * 3 // 4, stats.to_json()
    assert target.url is not None
    source = StreamSource(target.url, work_root=tmp_path / "w", settings=settings)
    await _killed_and_restored(job, gpu, engine, source, here, state_dir=tmp_path / "state")


async def _given_up(task: asyncio.Task[Any], what: str) -> None:
    """Half a second into the stall, ``task`` cancelled: it must end within 30 s."""
    await asyncio.sleep(0.5)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=30)
    assert done, f"the {what} given up still waits for the store"


@pytest.mark.parametrize("mode", [Mode.EXIT, Mode.RESUME])
async def test_a_freeze_given_up_while_the_store_stalls_brings_the_job_back_at_once(
    patched: str, tmp_path: Path, here: Path, mode: Mode
) -> None:
    """The store stalls while the staged GPU memory is copied (nothing held: the copy waits
    for the store, ``resume_buffer_mb = 0``), and the freeze is given up there — a deadline,
    or a notice's exit taking the place of a pause. The job must run again, its GPU state
    back, within seconds — not once the store answers (the engine waited for the copy,
    which waited for the store: measured on an H200, the trainer stayed frozen until then)."""
    # 96 MiB of its own memory through CRIU's pipe: CRIU is still dumping (blocked on its
    # pipe, the store stalled) while the staged memory is copied, as a GPU job's CRIU is
    job, gpu, engine = await _rig(
        tmp_path, here, patched, f"gpupages-stall-{mode}", own_mib=600, resume_buffer_mb=0,
        cpu_pages="criu",
    )  # fmt: skip
    gated = GatedStore(FileStore(tmp_path / "store"))
    target = StreamTarget(
        gated,  # type: ignore[arg-type]
        work_root=tmp_path / "w",
        writer_options={"chunk_size": 4 * MIB},
        settings=ImageSettings(max_inflight_mb=16),
    )
    freezing = asyncio.create_task(engine.freeze(job, target, mode))
    try:
        await asyncio.wait_for(gated.blocked.wait(), 60)
        await _given_up(freezing, "freeze")
        assert freezing.cancelled() or isinstance(freezing.exception(), SpotguardError)
        assert gpu.checks() == ["ok"] and gpu.stuck() == {}
        at = _count(job)
        await until(lambda: _count(job) > at + 5, "the job running on")
        assert target.manifest is None
    finally:
        gated.gate.set()
        await asyncio.wait({freezing}, timeout=60)
        kill_tree(job.pid)


class FullStore(FileStore):
    """A file store out of room for chunks of 1 MiB or more (the staged range's random
    half, stored raw): every such write fails with ``ENOSPC``, which no retry mends."""

    def _put_parts(self, key: str, parts: Sequence[Data], if_absent: bool) -> None:
        if "/chunks/" in key and sum(len(memoryview(p)) for p in parts) >= MIB:
            raise OSError(errno.ENOSPC, "No space left on device")
        super()._put_parts(key, parts, if_absent)


async def test_a_store_failing_under_a_held_pause_leaves_the_job_running_and_no_image(
    patched: str, tmp_path: Path, here: Path
) -> None:
    """The GPU memory held in pieces made before the freeze, the store then refusing it:
    the freeze fails with the store's typed error, the job runs on with its GPU state back
    (the range read back whole, nothing left locked) and no image is committed."""
    job, gpu, engine = await _rig(
        tmp_path, here, patched, "gpupages-held-full", memory=STAGED_MIB * MIB
    )
    target = StreamTarget(
        FullStore(tmp_path / "store"),  # type: ignore[arg-type]
        work_root=tmp_path / "w",
        writer_options={"chunk_size": 4 * MIB},
        settings=ImageSettings(),
    )
    try:
        with pytest.raises(SpotguardError, match="No space left"):
            await asyncio.wait_for(engine.freeze(job, target, Mode.RESUME), 60)
        assert gpu.checks() == ["ok"] and gpu.stuck() == {}
        (pre,) = [s for s in target.timeline_steps if s.name == "hold_prefault"]
        assert pre.detail["bytes"] >= STAGED_MIB * MIB  # the path under test was taken
        at_fail = _count(job)
        await until(lambda: _count(job) > at_fail + 5, "the job running on")
    finally:
        kill_tree(job.pid)
    assert target.manifest is None
    assert not list((tmp_path / "store").rglob("*manifest*")), "a failed freeze left an image"


async def test_a_tampered_chunk_of_staged_memory_fails_the_restore_and_leaves_nothing(
    patched: str, tmp_path: Path, here: Path
) -> None:
    job, gpu, engine = await _rig(
        tmp_path, here, patched, "gpupages-tamper", restore_overlap_min_mib=0
    )
    settings = ImageSettings()
    store = tmp_path / "store"
    target = _stream_target(tmp_path, settings)
    frozen = await engine.freeze(job, target, Mode.EXIT)
    assert target.url is not None
    part = frozen.meta.gpu_pages[0].parts[-1]
    async with ImageReader(target.url, settings=settings) as reader:
        ref = reader.manifest.file(part.name).chunks[-1]
    [stored] = [p for p in store.rglob(f"*{ref.digest}*") if p.is_file()]
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.chmod(0o600)
    stored.write_bytes(bytes(data))
    with pytest.raises(ImageCorrupt, match=ref.digest):
        await engine.restore(
            StreamSource(target.url, work_root=tmp_path / "w", settings=settings),
            state_dir=tmp_path / "state",
        )
    await asyncio.sleep(0.2)
    assert gpu.checks() == []  # the driver's restore never ran on a half-written range
    assert not any(
        str(tmp_path / "staging_job.py") in " ".join(p.info["cmdline"] or [])
        for p in psutil.process_iter(["cmdline"])
    ), "a restored process was left behind"


class SlowSource(StreamSource):
    """A download at a crawl: each chunk handed on 50 ms after it was asked for, the time of
    each kept."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.puts: list[float] = []

    async def get_pages(
        self,
        name: str,
        size: int,
        put: gpupages.PagePut,
        *,
        zero: gpupages.PageZero | None = None,
        in_flight: int | None = None,
    ) -> None:
        def slow(off: int, view: memoryview) -> None:
            time.sleep(0.05)
            put(off, view)
            self.puts.append(time.monotonic())

        await super().get_pages(name, size, slow, zero=zero, in_flight=in_flight)


async def test_a_driver_restore_that_fails_stops_the_placing_and_says_why(
    patched: str, tmp_path: Path, here: Path
) -> None:
    """The driver refusing the image ends the restore at once with the driver's error: the
    rest of the staged memory is not written into a process that cannot run."""
    job, gpu, engine = await _rig(
        tmp_path, here, patched, "gpupages-refused", restore_overlap_min_mib=0
    )
    settings = ImageSettings()
    target = _stream_target(tmp_path, settings)
    await engine.freeze(job, target, Mode.EXIT)
    assert target.url is not None
    gpu.fail_on = "restore"
    source = SlowSource(target.url, work_root=tmp_path / "w", settings=settings)
    with pytest.raises(GpuError, match="injected failure in GPU restore"):
        await engine.restore(source, state_dir=tmp_path / "state")
    failed_at = time.monotonic()
    # the non-zero three quarters are 36 chunks of 4 MiB; only those already in flight land
    assert len(source.puts) < 12, f"{len(source.puts)} chunks written after the driver failed"
    await asyncio.sleep(0.3)
    assert not [t for t in source.puts if t > failed_at], "chunks written after the restore"
    assert gpu.checks() == []
    assert not any(
        str(tmp_path / "staging_job.py") in " ".join(p.info["cmdline"] or [])
        for p in psutil.process_iter(["cmdline"])
    ), "a restored process was left behind"


class StalledSource(StreamSource):
    """A store that stops answering once the staged memory is asked for: every part waits
    for ``gate``."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate = asyncio.Event()
        self.asked = asyncio.Event()

    async def get_pages(self, *args: Any, **kw: Any) -> None:
        self.asked.set()
        await self.gate.wait()
        await super().get_pages(*args, **kw)


@pytest.mark.parametrize("overlap", [True, False], ids=["placed-under-the-restore", "before"])
async def test_a_restore_given_up_while_the_store_stalls_ends_at_once_and_leaves_nothing(
    patched: str, tmp_path: Path, here: Path, overlap: bool
) -> None:
    """The store stalls while the staged memory is fetched (with the driver's restore
    already reading it, where placed) and the restore is given up — the agent stopping, a
    deadline. It ends within seconds, no restored process is left waiting on pages that
    will never come, and the same image restores once the store answers."""
    job, gpu, engine = await _rig(
        tmp_path, here, patched, f"gpupages-restore-stall-{int(overlap)}",
        restore_overlap_min_mib=0 if overlap else 1 << 20,
    )  # fmt: skip
    settings = ImageSettings()
    target = _stream_target(tmp_path, settings)
    await engine.freeze(job, target, Mode.EXIT)
    await until(lambda: not psutil.pid_exists(job.pid), "the job gone")
    assert target.url is not None
    source = StalledSource(target.url, work_root=tmp_path / "w", settings=settings)
    restoring = asyncio.create_task(engine.restore(source, state_dir=tmp_path / "state"))
    try:
        await asyncio.wait_for(source.asked.wait(), 60)
        await _given_up(restoring, "restore")
        await asyncio.sleep(0.3)
        assert not any(
            str(tmp_path / "staging_job.py") in " ".join(p.info["cmdline"] or [])
            for p in psutil.process_iter(["cmdline"])
        ), "a restored process was left behind"
    finally:
        source.gate.set()
        await asyncio.wait({restoring}, timeout=60)
    again = StreamSource(target.url, work_root=tmp_path / "w2", settings=settings)
    restored = await engine.restore(again, state_dir=tmp_path / "state")
    try:
        assert gpu.checks()[-1:] == ["ok"]
    finally:
        kill_tree(restored.pid)


async def test_with_gpu_pages_criu_the_pages_go_through_criu_as_before(
    patched: str, tmp_path: Path, here: Path
) -> None:
    job, gpu, engine = await _rig(tmp_path, here, patched, "gpupages-criu", gpu_pages="criu")
    frozen = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    assert frozen.meta.gpu_pages == []
    assert all(st.name != "gpu_pages" for st in frozen.timeline.steps)
    stopped_at = _count(job)
    restored = None
    try:
        restored = await engine.restore(DirectorySource(tmp_path / "img"))
        assert gpu.checks() == ["ok"]
        await _continues(job, stopped_at)
    finally:
        kill_tree(restored.pid if restored else None)


# --- no CRIU ------------------------------------------------------------------------------
def test_the_staged_ranges_are_the_new_writable_memory_only() -> None:
    assert gpupages.minus([(0, 100)], [(10, 20), (50, 60)]) == [(0, 10), (20, 50), (60, 100)]
    assert gpupages.minus([(0, 100)], [(0, 100)]) == []
    assert gpupages.minus([(0, 100)], [(200, 300)]) == [(0, 100)]
    assert gpupages.merged([(10, 20), (0, 10), (30, 40)]) == [(0, 20), (30, 40)]
    r = gpupages.Range(7, 0x10000000, 0x10000000 + 200 * MIB)
    gp = gpupages.split(r, 3, 4, 64 * MIB)
    assert [p.size for p in gp.parts] == [64 * MIB, 64 * MIB, 64 * MIB, 8 * MIB]
    assert gpupages.GpuPages.from_json(gp.to_json()) == gp


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"ns_pid": 9}, "held no GPU state"),
        ({"start": 5}, "not a range"),
        ({"parts": [{"name": "../../etc/passwd", "offset": 0, "size": 4096}]}, "part name"),
        ({"parts": [{"name": "gpupages-3-1000-0", "offset": 0, "size": 4096}]}, "bytes of a"),
        ({"schema": 99}, "newer than this spotguard"),
    ],
)
def test_metadata_naming_staged_memory_is_checked(change: dict[str, object], why: str) -> None:
    entry: dict[str, object] = {
        "ns_pid": 3,
        "start": 0x1000,
        "end": 0x3000,
        "parts": [{"name": "gpupages-3-1000-0", "offset": 0, "size": 0x2000}],
    }
    doc: dict[str, object] = {
        "job": {"name": "j"},
        "mode": "exit",
        "criu_version": "4.2.1",
        "host": {"kernel": "6.1", "arch": "x86_64", "memory_total": 1 << 30},
        "gpu_processes": [3],
        "gpu_pages": [entry],
    }
    if "schema" in change:
        doc.update(change)
    else:
        entry.update(change)
    with pytest.raises((ImageError, ValueError), match=why):
        ImageMeta.from_json(doc)


async def test_a_file_of_the_image_may_set_its_own_raw_threshold(tmp_path: Path) -> None:
    """GPU memory (``gpu_raw_saving``) is stored raw unless it packs by half; the image's
    other files keep ``raw_saving``."""
    from spotguard.image.writer import ImageWriter

    # packs by about half: random halves, zero halves
    data = b"".join(os.urandom(2048) + bytes(2048) for _ in range(8 * MIB // 4096))
    async with ImageWriter(f"file://{tmp_path}", "j", settings=ImageSettings()) as w:
        gpu = w.file("gpupages-1-1000-0")
        gpu.raw_saving = 0.9
        await gpu.write(data)
        await gpu.close()
        other = w.file("other")
        await other.write(data[::-1])  # not the same chunk (that one is stored once)
        await other.close()
        m = await w.commit({})
    assert all(r.raw for r in m.file("gpupages-1-1000-0").chunks)
    assert not any(r.raw for r in m.file("other").chunks)
