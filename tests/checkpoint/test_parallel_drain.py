"""CRIU patch 0006: with ``--page-workers`` the parasites of several tasks drain their pages
at once (each task's drain runs in its page writer while CRIU's main thread goes on with the
next task). Real processes, the patched CRIU and its ``-v4`` log: two drains overlap and the
image restores byte-identical; a dump failing after some drains, or a rank killed while its
parasite drains, leaves every other process running, untraced, with no parasite mapped."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from ckpt_helpers import mount_args, wait_for
from pageworkers import DRAIN_END, DRAIN_START, kill, patched_criu, spans

from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.criufind import has_parallel_drain
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.errors import CriuError

pytestmark = pytest.mark.criu

#: patch 0006 is one of the patches scripts/install-criu builds: a CRIU without it is stale
NO_DRAIN = "drains one task at a time (no patch 0006): run scripts/install-criu"


@pytest.fixture
def settings(settings: CheckpointSettings) -> CheckpointSettings:
    """CRIU moves every page here (``cpu_pages = "criu"``): these tests are of its own
    parallel paths, which the job's large mappings would otherwise bypass."""
    return settings.model_copy(update={"cpu_pages": "criu"})


@pytest.fixture
def parallel_criu(criu_bin: str, tmp_path: Path) -> Criu:
    return patched_criu(criu_bin, tmp_path, workers=5)  # every task of the job at once


#: A launcher that forks one child per size in MiB (argv: OUT SIZE...). Each child fills a
#: mapping of its size in 4 KiB pages (the parasite splices them one by one: THP would make
#: the drain of a size cheaper than CRIU's page scan of it) with random data, writes its
#: SHA-1 to OUT/sum-I, and again to OUT/sum-I-G whenever OUT/verify-G appears.
SIZED = """
import hashlib, mmap, os, sys, time
out, sizes = sys.argv[1], [int(a) for a in sys.argv[2:]]

def child(i, mib):
    m = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    block = os.urandom(1 << 20) * 16
    for off in range(0, len(m), len(block)):
        m[off : off + len(block)] = block[: len(m) - off]

    def report(name):
        tmp = os.path.join(out, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(hashlib.sha1(m).hexdigest())
        os.replace(tmp, os.path.join(out, name))

    report(f"sum-{i}")
    gen = 1
    while True:
        if os.path.exists(os.path.join(out, f"verify-{gen}")):
            report(f"sum-{i}-{gen}")
            gen += 1
        time.sleep(0.05)

for i, mib in enumerate(sizes):
    if os.fork() == 0:
        child(i, mib)
while True:
    time.sleep(1)
"""
#: the first child's drain (~25 ms per GiB of 4 KiB pages) outlasts what CRIU does for the
#: next, small child before its drain starts (infection, parasite calls, page scan: ~20 ms)
DRAIN_SIZES = (1536, 32, 32)


async def test_ranks_pages_drained_at_once(
    parallel_criu: Criu, settings: CheckpointSettings, tmp_path: Path
) -> None:
    """Patch 0006: CRIU's main thread no longer waits for a task's parasite to drain its pages
    into the page pipe before it goes on with the next task: a rank was still draining when
    the next rank's drain started. The image restores byte-identical."""
    if not has_parallel_drain(parallel_criu.path):
        pytest.fail(f"{parallel_criu.path}: {NO_DRAIN}")
    script = tmp_path / "sized.py"
    script.write_text(SIZED)
    out = tmp_path / "out"
    out.mkdir()
    sizes = [str(mib) for mib in DRAIN_SIZES]
    job = await start_job(
        [sys.executable, str(script), str(out), *sizes], "drains", state_dir=tmp_path / "state"
    )
    pids = [job.pid]
    n = len(DRAIN_SIZES)
    try:
        await wait_for(lambda: all((out / f"sum-{i}").exists() for i in range(n)), "sums", 120)
        engine = Engine(parallel_criu, settings=settings)
        result = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        found = spans(tmp_path / "logs" / "criu-dump.log", DRAIN_START, DRAIN_END)
        drains = sorted(found.values())[-n:]  # parents first: the children are the last n
        overlapped = any(drains[i + 1][0] < drains[i][1] for i in range(n - 1))
        assert overlapped, f"the ranks' pages were drained one after another: {drains}"
        restored = await engine.restore(DirectorySource(result.images_dir))
        pids.append(restored.pid)
        (out / "verify-1").touch()
        await wait_for(
            lambda: all((out / f"sum-{i}-1").exists() for i in range(n)), "verify-1", 120
        )
        for i in range(n):
            before, after = (out / f"sum-{i}").read_text(), (out / f"sum-{i}-1").read_text()
            assert after == before, f"child {i}: memory differs after the checkpoint"
    finally:
        await kill(*pids)


#: A launcher that forks N children (argv: OUT N) with memory of their own and a heartbeat
#: in OUT/beat-I; the last one also holds a userfaultfd, a descriptor CRIU cannot dump, so a
#: dump fails in that task, once the drains of the tasks before it have started.
FAILING = """
import ctypes, os, sys, time
out, n = sys.argv[1], int(sys.argv[2])

def child(i):
    mem = bytearray(os.urandom(64 << 20))
    if i == n - 1:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(323, os.O_CLOEXEC) < 0:  # SYS_userfaultfd (x86-64)
            open(os.path.join(out, "no-uffd"), "w").close()
    beat = 0
    while True:
        beat += 1
        tmp = os.path.join(out, f"beat-{i}.tmp")
        with open(tmp, "w") as f:
            f.write(str(beat))
        os.replace(tmp, os.path.join(out, f"beat-{i}"))
        time.sleep(0.02)

for i in range(n):
    if os.fork() == 0:
        child(i)
while True:
    time.sleep(1)
"""


def _beats(out: Path, n: int) -> list[int]:
    return [int((out / f"beat-{i}").read_text() or 0) for i in range(n)]


def _states(pids: list[int]) -> dict[int, str]:
    """Every thread's state letter per process, and " parasite" where CRIU's parasite (its
    memfd, CRIUMFD) is still mapped."""
    found: dict[int, str] = {}
    for pid in pids:
        states = "".join(
            line.split()[1]
            for task in Path(f"/proc/{pid}/task").iterdir()
            for line in (task / "status").read_text().splitlines()
            if line.startswith("State:")
        )
        maps = Path(f"/proc/{pid}/maps").read_text()
        found[pid] = states + (" parasite" if "CRIUMFD" in maps else "")
    return found


async def test_a_dump_failing_midway_cures_every_drained_task_and_leaves_the_job_running(
    parallel_criu: Criu, tmp_path: Path
) -> None:
    """A dump that fails in a task after the drains of the tasks before it were started (they
    are still infected, their pages in pipes) must wait for those drains, cure every
    parasite and resume the tree: every process alive, none stopped or traced, no parasite
    mapped, each one running on. CRIU is run directly: the engine would refuse the job
    (it holds a descriptor CRIU cannot dump), so the job runs in the host's namespaces."""
    if not has_parallel_drain(parallel_criu.path):
        pytest.fail(f"{parallel_criu.path}: {NO_DRAIN}")
    n = 3
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, str(script), str(out), str(n)]
    job = await start_job(argv, "failing", state_dir=tmp_path / "state", pid_namespace=False)
    try:
        await wait_for(lambda: all((out / f"beat-{i}").exists() for i in range(n)), "beats", 60)
        if (out / "no-uffd").exists():
            pytest.skip("no userfaultfd here: nothing CRIU refuses to dump")
        (tmp_path / "img").mkdir()
        with pytest.raises(CriuError):
            await parallel_criu.dump(
                job.pid, tmp_path / "img", leave_running=False, **mount_args(job.pid)
            )
        text = (tmp_path / "logs" / "criu-dump.log").read_text(errors="replace")
        assert "anon_inode:[userfaultfd]" in text, text[-2000:]
        assert "Can't cure" not in text, text[-2000:]
        # the tasks before the last child were infected, their drains started
        started = {int(m.group(2)) for m in map(DRAIN_START.match, text.splitlines()) if m}
        assert len(started) >= n, text[-2000:]
        pids = proctree.tree(job.pid)
        assert started < set(pids), (started, pids)
        states = _states(pids)
        assert all(set(s) <= set("RSD") for s in states.values()), states
        assert not proctree.tracers(pids)
        before = _beats(out, n)
        await wait_for(
            lambda: all(a > b for a, b in zip(_beats(out, n), before, strict=True)),
            "every child to run on",
            30,
        )
    finally:
        await kill(*proctree.tree(job.pid))


def _kill_on_drain(log: Path, victims: set[int], done: threading.Event) -> list[int]:
    """Follow CRIU's log as it is written and SIGKILL the first of ``victims`` whose drain
    starts (``Draining pages of PID in the background``); the pids killed."""
    killed: list[int] = []
    while not log.exists() and not done.is_set():
        time.sleep(0.001)
    if done.is_set():
        return killed
    with log.open(errors="replace") as f:
        part = ""
        while not done.is_set() and not killed:
            chunk = f.read()
            if not chunk:
                time.sleep(0.0005)
                continue
            part += chunk
            *lines, part = part.split("\n")
            for line in lines:
                m = DRAIN_START.match(line)
                if m and int(m.group(2)) in victims:
                    os.kill(int(m.group(2)), signal.SIGKILL)
                    killed.append(int(m.group(2)))
                    break
    return killed


async def test_a_rank_killed_while_its_pages_drain_fails_the_dump_and_frees_the_rest(
    parallel_criu: Criu, tmp_path: Path
) -> None:
    """Patch 0006 hands a task's drain to its page writer and puts CRIU's SIGCHLD handler (its
    parasite-crash check) back: the writer itself must notice its task die while the
    parasite drains. A rank SIGKILLed as its drain starts fails the dump in bounded time, and
    every other process of the tree is resumed — not stopped, not traced, no parasite
    mapped — and runs on. CRIU is run directly, the job in the host's namespaces (the pids in
    CRIU's log are then the ones to kill)."""
    if not has_parallel_drain(parallel_criu.path):
        pytest.fail(f"{parallel_criu.path}: {NO_DRAIN}")
    script = tmp_path / "sized.py"
    script.write_text(SIZED)
    # the drain of 2 GiB of 4 KiB pages lasts ~50-100 ms here; on a loaded host the kill may
    # land after it: the rest must be freed either way, and one of three must land inside
    for i in range(3):
        if await _kill_a_draining_rank(parallel_criu, script, tmp_path / f"try-{i}"):
            return
    pytest.fail("no kill landed while the rank's pages drained (three tries)")


async def _kill_a_draining_rank(criu: Criu, script: Path, tmp: Path) -> bool:
    """One try of the test above: True when the rank died before its drain ended."""
    out = tmp / "out"
    out.mkdir(parents=True)
    argv = [sys.executable, str(script), str(out), "2048", "32", "32"]
    job = await start_job(argv, "killed-drain", state_dir=tmp / "state", pid_namespace=False)
    assert criu.log_dir is not None
    log = criu.log_dir / "criu-dump.log"
    log.unlink(missing_ok=True)  # the watcher follows this dump's log, not the last one's
    try:
        await wait_for(lambda: all((out / f"sum-{i}").exists() for i in range(3)), "sums", 120)
        pids = proctree.tree(job.pid)
        big = max(pids[1:], key=lambda p: proctree.rss_bytes([p]))
        (tmp / "img").mkdir()
        done = threading.Event()
        watcher = asyncio.create_task(asyncio.to_thread(_kill_on_drain, log, {big}, done))
        try:
            dump = criu.dump(job.pid, tmp / "img", leave_running=True, **mount_args(job.pid))
            with pytest.raises(CriuError):
                await asyncio.wait_for(dump, 120)
        finally:
            done.set()
            killed = await watcher
        assert killed == [big], "the rank's drain was never seen starting"
        text = log.read_text(errors="replace")
        uncured = {int(p) for p in re.findall(r"Can't cure \(pid: (\d+)\)", text)}
        assert uncured <= {big}, text[-3000:]  # the dead rank has nothing left to cure
        rest = [p for p in proctree.tree(job.pid) if p != big]
        assert len(rest) == len(pids) - 1, (pids, rest)
        states = _states(rest)
        assert all(set(st) <= set("RSD") for st in states.values()), states
        assert not proctree.tracers(rest)
        (out / "verify-1").touch()
        await wait_for(
            lambda: all((out / f"sum-{i}-1").exists() for i in (1, 2)), "the rest to run on", 60
        )
        return f"Drained pages of {big}" not in text
    finally:
        await kill(*proctree.tree(job.pid))
