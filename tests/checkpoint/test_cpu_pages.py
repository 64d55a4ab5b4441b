"""The job's own large private memory, moved by spotguard beside CRIU
(:mod:`spotguard.checkpoint.cpupages`), with real CRIU and real processes.

The job: a parent that maps a range of its own (a quarter never written, a quarter stamped
per page, half random) and a forked child that shares another range with it copy-on-write.
Told "check" (SIGUSR1) each checks every byte it holds; told "change" (SIGUSR2) the parent
unmaps or protects part of its range as ``OUT/do`` says — what a job may do between the
moment spotguard chooses the ranges and the moment CRIU seizes the tree."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
from ckpt_helpers import kill_tree, step_named

from sgtest import until
from spotguard.checkpoint import cpupages, proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.gpupages import Range
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.errors import SpotguardError
from spotguard.image import ImageSettings
from spotguard.image.reader import ImageReader
from spotguard.stream import StreamSource, StreamTarget

MIB = 1 << 20
OWN_MIB = 96  # the parent's own range (the tests move ranges of 64 MiB and more)
SHARED_MIB = 80  # shared with the forked child: left to CRIU
HOLE = (32, 48)  # MiB of the own range unmapped by "change" = hole
PROTECTED = (48, 56)  # ... and protected read-only by "change" = protect

JOB = """
import ctypes, mmap, os, random, signal, sys, time
out, n, shared_n = sys.argv[1], int(sys.argv[2]) << 20, int(sys.argv[3]) << 20
hole = [int(x) << 20 for x in sys.argv[4].split(":")]
prot = [int(x) << 20 for x in sys.argv[5].split(":")]
libc = ctypes.CDLL(None, use_errno=True)
libc.munmap.argtypes = libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
gone = []

def stamp(off):
    return b"%016x" % (off * 2654435761 % (1 << 64))

def noise(off, salt):
    return random.Random(off * 7 + salt).randbytes(1 << 20)

def address(m):
    c = ctypes.c_char.from_buffer(m)
    a = ctypes.addressof(c)
    del c
    return a

def report(name, ok):
    tmp = os.path.join(out, name + ".tmp")
    open(tmp, "w").write("ok" if ok else "BAD")
    os.replace(tmp, os.path.join(out, name))

shared = mmap.mmap(-1, shared_n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for off in range(0, shared_n, 1 << 20):
    shared[off:off + (1 << 20)] = noise(off, 1)
sbase = address(shared)

def shared_ok():
    return all(
        ctypes.string_at(sbase + o, 1 << 20) == noise(o, 1) for o in range(0, shared_n, 1 << 20)
    )

child = os.fork()
if child == 0:
    signal.signal(signal.SIGUSR1, lambda s, f: report("checked-child", shared_ok()))
    while True:
        time.sleep(0.05)

own = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for off in range(n // 4, n // 2, 4096):
    own[off:off + 16] = stamp(off)
for off in range(n // 2, n, 1 << 20):
    own[off:off + (1 << 20)] = noise(off, 2)
base = address(own)

def own_ok():
    ok = True
    for off in range(0, n, 1 << 20):
        if any(lo <= off < hi for lo, hi in gone):
            continue
        got = ctypes.string_at(base + off, 1 << 20)
        if off < n // 4:
            want = bytes(1 << 20)
        elif off < n // 2:
            want = bytearray(1 << 20)
            for p in range(0, 1 << 20, 4096):
                want[p:p + 16] = stamp(off + p)
        else:
            want = noise(off, 2)
        ok = ok and got == want
    return ok

def check(sig, frame):
    report("checked", own_ok() and shared_ok())
    os.kill(child, signal.SIGUSR1)

def change(sig, frame):
    what = open(os.path.join(out, "do")).read().strip()
    if what == "hole":
        libc.munmap(base + hole[0], hole[1] - hole[0], 0)
        gone.append(tuple(hole))
    elif what == "protect":
        libc.mprotect(base + prot[0], prot[1] - prot[0], mmap.PROT_READ)
    open(os.path.join(out, "changed.tmp"), "w").write(what)
    os.replace(os.path.join(out, "changed.tmp"), os.path.join(out, "changed"))

signal.signal(signal.SIGUSR1, check)
signal.signal(signal.SIGUSR2, change)
open(os.path.join(out, "ready.tmp"), "w").write("%x %x" % (base, base + n))
os.replace(os.path.join(out, "ready.tmp"), os.path.join(out, "ready"))
i = 0
while True:
    print(i, flush=True)
    i += 1
    time.sleep(0.02)
"""


@pytest.fixture
def out(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


def _settings(tmp_path: Path, criu: str, **kw: object) -> CheckpointSettings:
    return CheckpointSettings(
        state_dir=tmp_path / "state",
        criu=criu,
        shm_dir=tmp_path / "shm",
        criu_timeout=60,
        cpu_pages_min_mib=64,
        **kw,
    )


async def _start(tmp_path: Path, out: Path, name: str) -> tuple[JobInfo, tuple[int, int]]:
    script = tmp_path / "own_job.py"
    script.write_text(JOB)
    argv = [sys.executable, str(script), str(out), str(OWN_MIB), str(SHARED_MIB)]
    argv += [f"{HOLE[0]}:{HOLE[1]}", f"{PROTECTED[0]}:{PROTECTED[1]}"]
    job = await start_job(argv, name, state_dir=tmp_path / "state")
    await until(lambda: (out / "ready").exists(), "the job's memory", 60)
    lo, hi = (int(x, 16) for x in (out / "ready").read_text().split())
    return job, (lo, hi)


async def _checked(root: int, out: Path) -> None:
    """Both processes of the restored job check every byte they hold."""
    for name in ("checked", "checked-child"):
        (out / name).unlink(missing_ok=True)
    os.kill(root, signal.SIGUSR1)
    await until(lambda: (out / "checked-child").exists(), "the checks", 60)
    assert (out / "checked").read_text() == "ok", "the parent's memory differs"
    assert (out / "checked-child").read_text() == "ok", "the child's memory differs"


def _parent(job: JobInfo) -> int:
    """The job's parent process (the init's child that runs the script)."""
    [pid] = [c.pid for c in psutil.Process(job.pid).children()]
    return pid


def _criu_pages(images: Path) -> int:
    return sum(p.stat().st_size for p in images.glob("pages-*.img"))


async def test_own_memory_moves_beside_criu_and_a_shared_range_stays_with_it(
    patched: str, tmp_path: Path, out: Path
) -> None:
    """Exit, into a directory: the parent's own range is carried in parts of its own and
    none of it in CRIU's pages; the range it shares with its forked child is CRIU's (both
    copies restored from one). Restored, every byte of both processes is as it was."""
    job, (lo, hi) = await _start(tmp_path, out, "cpupages-dir")
    engine = Engine(Criu(patched), settings=_settings(tmp_path, patched))
    restored = None
    try:
        ns_pid = proctree.ns_pid(_parent(job))
        frozen = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        [carried] = frozen.meta.cpu_pages
        assert (carried.start, carried.end) == (lo, hi)
        assert carried.ns_pid == ns_pid
        assert all(p.name.startswith("cpupages-") for p in carried.parts)
        assert frozen.meta.gpu_pages == []
        assert step_named(frozen.timeline, "cpu_pages").detail["bytes"] == OWN_MIB * MIB
        # CRIU wrote the shared range (twice: parent and child) but not the parent's own
        pages = _criu_pages(tmp_path / "img")
        assert SHARED_MIB * MIB <= pages < (SHARED_MIB + OWN_MIB // 2) * MIB * 2
        restored = await engine.restore(DirectorySource(tmp_path / "img"))
        assert step_named(restored.timeline, "cpu_pages").detail["bytes"] == OWN_MIB * MIB
        await _checked(restored.pid, out)
    finally:
        kill_tree(restored.pid if restored else job.pid)


async def test_a_paused_job_streams_its_own_memory_from_the_held_pieces_and_restores(
    patched: str, tmp_path: Path, out: Path
) -> None:
    """Leave-running, streamed to a store: the carried memory goes into the capture's held
    pieces (faulted in before the freeze); the job runs on; the image restores exact."""
    job, (lo, hi) = await _start(tmp_path, out, "cpupages-stream")
    engine = Engine(Criu(patched), settings=_settings(tmp_path, patched))
    settings = ImageSettings()
    target = StreamTarget(
        f"file://{tmp_path / 'store'}", work_root=tmp_path / "w", settings=settings
    )
    restored = None
    try:
        frozen = await engine.freeze(job, target, Mode.RESUME)
        [carried] = frozen.meta.cpu_pages
        assert (carried.start, carried.end) == (lo, hi)
        await _checked(job.pid, out)  # the running job's memory was never touched
        assert target.capture_stats is not None
        # through CRIU's pipes: the shared range twice and the interpreters, none of the own
        # range (whose written three quarters would add 72 MiB)
        assert target.capture_stats.bytes < (2 * SHARED_MIB + 40) * MIB
        kill_tree(job.pid)
        await until(lambda: not psutil.pid_exists(job.pid), "the job gone")
        assert target.url is not None
        source = StreamSource(target.url, work_root=tmp_path / "w", settings=settings)
        restored = await engine.restore(source, state_dir=tmp_path / "state")
        await _checked(restored.pid, out)
    finally:
        kill_tree(restored.pid if restored else job.pid)


async def test_a_tampered_chunk_of_the_carried_memory_fails_the_restore_and_leaves_nothing(
    patched: str, tmp_path: Path, out: Path
) -> None:
    """One stored chunk of a carried part changed in the store: the restore fails on that
    chunk's check (one typed error) before the tree runs, and no restored process is left."""
    job, _ = await _start(tmp_path, out, "cpupages-tamper")
    engine = Engine(Criu(patched), settings=_settings(tmp_path, patched))
    settings = ImageSettings()
    store = tmp_path / "store"
    target = StreamTarget(f"file://{store}", work_root=tmp_path / "w", settings=settings)
    try:
        frozen = await engine.freeze(job, target, Mode.EXIT)
    finally:
        kill_tree(job.pid)
    assert target.url is not None
    part = frozen.meta.cpu_pages[0].parts[-1]
    async with ImageReader(target.url, settings=settings) as reader:
        ref = reader.manifest.file(part.name).chunks[-1]  # the random half: stored raw
    [stored] = [p for p in store.rglob(f"*{ref.digest}*") if p.is_file()]
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.chmod(0o600)
    stored.write_bytes(bytes(data))
    (out / "checked").unlink(missing_ok=True)
    with pytest.raises(SpotguardError, match=r"(?i)corrupt|damaged|digest|verif"):
        await engine.restore(
            StreamSource(target.url, work_root=tmp_path / "w", settings=settings),
            state_dir=tmp_path / "state",
        )
    await asyncio.sleep(0.2)
    assert not any(
        str(tmp_path / "own_job.py") in " ".join(p.info["cmdline"] or [])
        for p in psutil.process_iter(["cmdline"])
    ), "a restored process was left behind"
    assert not (out / "checked").exists()


class ChangeBeforeDump:
    """Faults: just before CRIU starts (the ranges are chosen), the job changes its memory
    as ``out/do`` says, and the freeze goes on."""

    def __init__(self, pid: int, out: Path, what: str) -> None:
        self.pid, self.out, self.what = pid, out, what

    async def before(self, step: str) -> None:
        if step != "criu_dump":
            return
        (self.out / "do").write_text(self.what)
        os.kill(self.pid, signal.SIGUSR2)
        await until(lambda: (self.out / "changed").exists(), "the change", 30)


async def test_a_range_unmapped_in_part_before_the_freeze_is_cut_to_what_is_left(
    patched: str, tmp_path: Path, out: Path
) -> None:
    """Chosen whole, then 16 MiB of it unmapped before CRIU seized the job: the image carries
    the two pieces around the hole, and the restored job has exactly those."""
    job, (lo, hi) = await _start(tmp_path, out, "cpupages-hole")
    faults = ChangeBeforeDump(job.pid, out, "hole")
    engine = Engine(Criu(patched), settings=_settings(tmp_path, patched), faults=faults)
    restored = None
    try:
        frozen = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        got = [(c.start, c.end) for c in frozen.meta.cpu_pages]
        assert got == [(lo, lo + HOLE[0] * MIB), (lo + HOLE[1] * MIB, hi)]
        assert step_named(frozen.timeline, "cpu_pages").detail["chosen"] == 1
        restored = await engine.restore(DirectorySource(tmp_path / "img"))
        await _checked(restored.pid, out)
    finally:
        kill_tree(restored.pid if restored else job.pid)


def _perms_at(pid: int, addr: int) -> str:
    """The protection of the mapping of ``pid`` that holds ``addr``."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            return perms
    raise AssertionError(f"{addr:#x} is not mapped in {pid}")


async def test_a_range_protected_before_the_freeze_is_carried_and_restored_protected(
    patched: str, tmp_path: Path, out: Path
) -> None:
    """Part of a chosen range made read-only before CRIU seized the job (CRIU was already
    told to leave the whole range to spotguard): the freeze carries it all the same — its
    bytes read and written back through ``/proc/PID/mem`` where ``process_vm_*`` fault on
    the protection — and the restored job has every byte, and that part read-only again.
    (Before, such a freeze failed; a job that kept protecting memory inside its large
    mappings could not be frozen at all.)"""
    job, (lo, hi) = await _start(tmp_path, out, "cpupages-protect")
    faults = ChangeBeforeDump(job.pid, out, "protect")
    engine = Engine(Criu(patched), settings=_settings(tmp_path, patched), faults=faults)
    restored = None
    try:
        frozen = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        assert [(c.start, c.end) for c in frozen.meta.cpu_pages] == [(lo, hi)]
        assert step_named(frozen.timeline, "cpu_pages").detail["bytes"] == OWN_MIB * MIB
        restored = await engine.restore(DirectorySource(tmp_path / "img"))
        parent = _parent(JobInfo(name="r", pid=restored.pid, dir=tmp_path))
        assert _perms_at(parent, lo + PROTECTED[0] * MIB).startswith("r--")
        assert _perms_at(parent, lo).startswith("rw-")
        await _checked(restored.pid, out)
    finally:
        kill_tree(restored.pid if restored else job.pid)


async def test_criu_moves_it_all_when_told_to(patched: str, tmp_path: Path, out: Path) -> None:
    """``[checkpoint] cpu_pages = "criu"``: nothing carried beside CRIU; the same restore."""
    job, _ = await _start(tmp_path, out, "cpupages-criu")
    engine = Engine(Criu(patched), settings=_settings(tmp_path, patched, cpu_pages="criu"))
    restored = None
    try:
        frozen = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        assert frozen.meta.cpu_pages == []
        assert not [s for s in frozen.timeline.steps if s.name == "cpu_pages"]
        assert _criu_pages(tmp_path / "img") >= (SHARED_MIB + OWN_MIB // 2) * MIB
        restored = await engine.restore(DirectorySource(tmp_path / "img"))
        await _checked(restored.pid, out)
    finally:
        kill_tree(restored.pid if restored else job.pid)


async def test_candidates_leave_out_small_shared_and_staged_ranges(
    tmp_path: Path, out: Path
) -> None:
    """What :func:`cpupages.candidates` chooses in the running job: the parent's own range
    only — not the range its child shares, not what is below the size, not a GPU range."""
    job, (lo, hi) = await _start(tmp_path, out, "cpupages-choose")
    try:
        tree = proctree.tree(job.pid)
        parent = _parent(job)
        found = await asyncio.to_thread(cpupages.candidates, tree, min_bytes=64 * MIB)
        assert [(r.pid, r.start, r.end, r.prefix) for r in found] == [(parent, lo, hi, "cpupages")]
        staged = [Range(parent, lo + MIB, lo + 2 * MIB)]
        assert cpupages.candidates(tree, staged, min_bytes=64 * MIB) == []
        assert cpupages.candidates(tree, min_bytes=(OWN_MIB + 1) * MIB) == []
    finally:
        kill_tree(job.pid)


#: A parent with a 64 MiB range of its own and a child forked after it, which either keeps
#: the range (shared copy-on-write: argv "keep") or maps a fresh one at the same address and
#: fills it ("fresh": the two overlap, and share nothing).
OVERLAP = """
import ctypes, mmap, os, sys, time
out, how, n = sys.argv[1], sys.argv[2], 64 << 20
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long)
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m.write(os.urandom(n))
c = ctypes.c_char.from_buffer(m)
base = ctypes.addressof(c)
del c
if os.fork() == 0:
    if how == "fresh":
        fixed = 0x10  # MAP_FIXED
        got = libc.mmap(base, n, 3, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | fixed, -1, 0)
        assert got == base
        ctypes.memset(base, 7, n)
    open(os.path.join(out, "child.tmp"), "w").write("%x %x" % (base, base + n))
    os.replace(os.path.join(out, "child.tmp"), os.path.join(out, "child"))
    while True:
        time.sleep(0.1)
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("how", ["keep", "fresh"])
async def test_a_range_another_process_overlaps_is_kept_only_if_it_shares_nothing(
    tmp_path: Path, out: Path, how: str
) -> None:
    """A forked child that keeps its parent's range shares its pages: neither process's copy
    is chosen. One that mapped a fresh range at the same address shares nothing: both
    ranges are chosen whole, though they overlap in address."""
    script = tmp_path / "overlap.py"
    script.write_text(OVERLAP)
    job = await start_job(
        [sys.executable, str(script), str(out), how], f"overlap-{how}", state_dir=tmp_path / "st"
    )
    try:
        await until(lambda: (out / "child").exists(), "the child", 60)
        lo, hi = (int(x, 16) for x in (out / "child").read_text().split())
        tree = proctree.tree(job.pid)
        found = await asyncio.to_thread(cpupages.candidates, tree, min_bytes=64 * MIB)
        got = sorted((r.start, r.end) for r in found)
        assert got == ([] if how == "keep" else [(lo, hi), (lo, hi)])
    finally:
        kill_tree(job.pid)


GONE_JOB = """
import mmap, os, random, signal, sys, time
out, n = sys.argv[1], int(sys.argv[2]) << 20
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # a child that ends is reaped at once
child = os.fork()
if child == 0:
    own = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    own[:] = random.Random(1).randbytes(n)
    open(os.path.join(out, "child"), "w").write("ready")
    while True:
        time.sleep(0.05)
mine = random.Random(2).randbytes(4 << 20)
def check(sig, frame):
    tmp = os.path.join(out, "checked.tmp")
    open(tmp, "w").write("ok" if mine == random.Random(2).randbytes(4 << 20) else "BAD")
    os.replace(tmp, os.path.join(out, "checked"))
signal.signal(signal.SIGUSR1, check)
i = 0
while True:
    print(i, flush=True)
    i += 1
    time.sleep(0.05)
"""


class KillBeforeDump:
    """Faults: just before CRIU starts (the ranges are chosen), ``pid`` is killed and gone."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    async def before(self, step: str) -> None:
        if step != "criu_dump":
            return
        os.kill(self.pid, signal.SIGKILL)
        await until(lambda: not psutil.pid_exists(self.pid), "the child gone", 30)


async def test_a_process_gone_after_its_range_was_chosen_leaves_it_out_of_the_image(
    patched: str, tmp_path: Path, out: Path
) -> None:
    """A process of the job with a range of its own ends between the choice of the ranges and
    CRIU's seize: the image is the tree as CRIU found it, carrying nothing of the gone
    process, and the job restores and runs."""
    script = tmp_path / "gone_job.py"
    script.write_text(GONE_JOB)
    job = await start_job(
        [sys.executable, str(script), str(out), "96"], "cpupages-gone", state_dir=tmp_path / "state"
    )
    await until(lambda: (out / "child").exists(), "the child's memory", 60)
    [child] = [c.pid for c in psutil.Process(_parent(job)).children()]  # a host pid
    engine = Engine(
        Criu(patched), settings=_settings(tmp_path, patched), faults=KillBeforeDump(child)
    )
    restored = None
    try:
        frozen = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        assert frozen.meta.cpu_pages == []
        assert step_named(frozen.timeline, "cpu_pages").detail["chosen"] == 1
        restored = await engine.restore(DirectorySource(tmp_path / "img"))
        root = restored.pid
        await until(lambda: len(proctree.tree(root)) >= 2, "the restored job", 30)
        [parent] = [c.pid for c in psutil.Process(root).children()]
        os.kill(parent, signal.SIGUSR1)
        await until(lambda: (out / "checked").exists(), "the check", 60)
        assert (out / "checked").read_text() == "ok"
    finally:
        kill_tree(restored.pid if restored else job.pid)


_GUARDED = """
import ctypes, mmap, os, signal, sys, time
out = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
m = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m[:] = bytes(range(256)) * (4 << 12)
c = ctypes.c_char.from_buffer(m)
base = ctypes.addressof(c)
del c
libc.mprotect(base + (1 << 20), 2 << 20, 0)  # PROT_NONE

def publish(name, text):
    # written whole, then renamed: the test never reads a file still empty
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))

def check(sig, frame):
    libc.mprotect(base + (1 << 20), 2 << 20, mmap.PROT_READ | mmap.PROT_WRITE)
    ok = m[:] == bytes(range(255, -1, -1)) * (4 << 12)
    publish("checked", "ok" if ok else "BAD")

signal.signal(signal.SIGUSR1, check)
publish("ready", "%x" % base)
while True:
    time.sleep(0.05)
"""


async def test_memory_protected_even_against_reading_is_read_and_written_back(
    tmp_path: Path, out: Path
) -> None:
    """The copy beside CRIU reads and writes a range whose middle the process made
    inaccessible (``PROT_NONE``): ``process_vm_*`` fault there, ``/proc/PID/mem`` does not —
    every byte read as the process has it, and written back where the process finds it."""
    import subprocess

    from spotguard.checkpoint.procmem import read_memory, write_memory

    proc = await asyncio.to_thread(subprocess.Popen, [sys.executable, "-c", _GUARDED, str(out)])
    try:
        await until(lambda: (out / "ready").exists(), "the guarded process", 30)
        base = int((out / "ready").read_text(), 16)
        buf = bytearray(4 << 20)
        read_memory(proc.pid, base, memoryview(buf))
        assert buf == bytes(range(256)) * (4 << 12)
        buf[:] = bytes(range(255, -1, -1)) * (4 << 12)
        write_memory(proc.pid, base, memoryview(buf))
        os.kill(proc.pid, signal.SIGUSR1)
        await until(lambda: (out / "checked").exists(), "the process's check", 30)
        assert (out / "checked").read_text() == "ok"
        # where nothing is mapped at all, still an error that names the process and address
        with pytest.raises(OSError, match=f"of pid {proc.pid} at 0x1000"):
            read_memory(proc.pid, 0x1000, memoryview(bytearray(4096)))
    finally:
        proc.kill()
        proc.wait()
