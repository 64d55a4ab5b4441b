"""CRIU's ``--page-workers`` (packaging/criu-patches): the processes of a job are dumped and
restored in parallel, byte-identical, with real processes and the patched CRIU.

The job is the N-rank stand-in (bench/ranks_job.py): a launcher with exec'd ranks, each
holding distinct memory (half random, half zero pages) and reporting its SHA-1 before the
checkpoint and on request after it. CRIU's own log (``-v4``) proves the overlap: a rank's
pages were still being written when the next rank's writer started, and (patch 0006) a rank's
parasite was still draining its pages when the next rank's drain started.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import wait_for

from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import PAGE_WORKERS_FLAG, Criu, has_page_workers
from spotguard.checkpoint.criufind import has_parallel_drain
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.errors import CriuError
from spotguard.image import ImageSettings
from spotguard.stream import StreamSource, StreamTarget

pytestmark = [
    pytest.mark.criu,
    pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning"),
]

REPO = Path(__file__).resolve().parents[2]
RANKS = 3
MIB = 160
WORKERS = RANKS + 2  # no rank waits for a free writer: all may overlap
_TS = r"^\((\d+\.\d+)\)\s+"
_START = re.compile(_TS + r"Writing pages of (\d+) in the background")
_END = re.compile(_TS + r"Wrote pages of (\d+)$")
_DRAIN_START = re.compile(_TS + r"Draining pages of (\d+) in the background")
_DRAIN_END = re.compile(_TS + r"Drained pages of (\d+)$")

#: patch 0006 is one of the patches scripts/install-criu builds: a CRIU without it is stale
NO_DRAIN = "drains one task at a time (no patch 0006): run scripts/install-criu"


@pytest.fixture
def parallel_criu(criu_bin: str, tmp_path: Path) -> Criu:
    if not has_page_workers(criu_bin):
        pytest.fail(f"{criu_bin} has no {PAGE_WORKERS_FLAG}: run scripts/install-criu")
    (tmp_path / "logs").mkdir()
    return Criu(criu_bin, page_workers=WORKERS, log_level=4, log_dir=tmp_path / "logs")


async def _start(tmp_path: Path, name: str, mib: int = MIB) -> tuple[JobInfo, Path]:
    out = tmp_path / "out"
    argv = [sys.executable, str(REPO / "bench" / "ranks_job.py"), "launcher"]
    argv += ["--ranks", str(RANKS), "--mib", str(mib), "--out", str(out)]
    job = await start_job(argv, name, state_dir=tmp_path / "state")
    await wait_for(
        lambda: len(list(out.glob("rank-*.sum"))) == RANKS, "the ranks to fill their memory", 120
    )
    return job, out


async def _verify(out: Path, gen: int) -> None:
    """Every rank hashes its memory again: it must equal the hash from before the dump."""
    (out / f"verify-{gen}").touch()
    await wait_for(
        lambda: all((out / f"rank-{i}.sum-{gen}").exists() for i in range(RANKS)),
        f"the ranks to answer verify-{gen}",
        60,
    )
    for i in range(RANKS):
        before = (out / f"rank-{i}.sum").read_text()
        after = (out / f"rank-{i}.sum-{gen}").read_text()
        assert after == before, f"rank {i}: memory differs after the checkpoint"


def _spans(
    log: Path, start_re: re.Pattern[str] = _START, end_re: re.Pattern[str] = _END
) -> dict[int, tuple[float, float]]:
    """(start, end) of every task's page writer (or, given the drain's lines, of its drain),
    from CRIU's dump log."""
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if m := start_re.match(line):
            start[int(m.group(2))] = float(m.group(1))
        elif m := end_re.match(line):
            end[int(m.group(2))] = float(m.group(1))
    assert set(start) == set(end), f"started {sorted(start)}, ended {sorted(end)}"
    return {pid: (start[pid], end[pid]) for pid in start}


def _rank_spans(spans: dict[int, tuple[float, float]]) -> list[tuple[float, float]]:
    # the tree is dumped parents first: the ranks are the last RANKS tasks
    ranks = sorted(spans.values())[-RANKS:]
    assert len(ranks) == RANKS, spans
    return ranks


def _assert_ranks_overlapped(log: Path) -> None:
    ranks = _rank_spans(_spans(log))
    # a rank's pages were still being written when the next rank's writer started (on a
    # loaded 2-core machine the later ranks' parasites may take longer than a write)
    overlapped = any(ranks[i + 1][0] < ranks[i][1] for i in range(RANKS - 1))
    assert overlapped, f"the ranks' pages were written one after another: {ranks}"


def _assert_prefaulted(log: Path) -> None:
    text = log.read_text(errors="replace")
    assert len(re.findall(r"Prefaulting \d+ MiB", text)) >= RANKS, "no rank was prefaulted"
    assert "Prefault stopped early" not in text


def _dead(pid: int) -> bool:
    return not proctree.alive(pid)


async def _kill(*pids: int) -> None:
    for pid in pids:
        if proctree.alive(pid):
            proctree.signal_all([pid], signal.SIGKILL)
            await wait_for(partial(_dead, pid), "the job to die", 30)


async def test_ranks_dumped_in_parallel_restore_byte_identical(
    parallel_criu: Criu, settings: CheckpointSettings, tmp_path: Path
) -> None:
    engine = Engine(parallel_criu, settings=settings)
    job, out = await _start(tmp_path, "ranks-dir")
    pids = [job.pid]
    try:
        result = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        _assert_ranks_overlapped(tmp_path / "logs" / "criu-dump.log")
        restored = await engine.restore(DirectorySource(result.images_dir))
        pids.append(restored.pid)
        _assert_prefaulted(tmp_path / "logs" / "criu-restore.log")
        await _verify(out, 1)
    finally:
        await _kill(*pids)


async def test_leave_running_dump_in_parallel_keeps_the_job_identical(
    parallel_criu: Criu, settings: CheckpointSettings, tmp_path: Path
) -> None:
    engine = Engine(parallel_criu, settings=settings)
    job, out = await _start(tmp_path, "ranks-resume")
    pids = [job.pid]
    try:
        result = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.RESUME)
        _assert_ranks_overlapped(tmp_path / "logs" / "criu-dump.log")
        await _verify(out, 1)  # the job went on, memory untouched
        await _kill(job.pid)
        restored = await engine.restore(DirectorySource(result.images_dir))
        pids.append(restored.pid)
        await _verify(out, 2)  # and the image holds the same memory
    finally:
        await _kill(*pids)


async def test_streamed_ranks_dumped_in_parallel_restore_byte_identical(
    parallel_criu: Criu, settings: CheckpointSettings, tmp_path: Path
) -> None:
    engine = Engine(parallel_criu, settings=settings)
    job, out = await _start(tmp_path, "ranks-stream")
    pids = [job.pid]
    store = f"file://{tmp_path / 'store'}"
    s = ImageSettings()
    try:
        target = StreamTarget(store, work_root=tmp_path / "work", settings=s)
        await engine.freeze(job, target, Mode.EXIT)
        assert target.url is not None and target.capture_stats is not None
        assert target.capture_stats.bytes >= RANKS * MIB << 20
        _assert_ranks_overlapped(tmp_path / "logs" / "criu-dump.log")
        source = StreamSource(target.url, settings=s, work_root=tmp_path / "work")
        pids.append((await engine.restore(source)).pid)
        assert source.serve_stats is not None
        assert source.serve_stats.bytes == target.capture_stats.bytes
        _assert_prefaulted(tmp_path / "logs" / "criu-restore.log")
        await _verify(out, 1)
    finally:
        await _kill(*pids)


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
        spans = _spans(tmp_path / "logs" / "criu-dump.log", _DRAIN_START, _DRAIN_END)
        drains = sorted(spans.values())[-n:]  # parents first: the children are the last n
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
        await _kill(*pids)


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
            await parallel_criu.dump(job.pid, tmp_path / "img", leave_running=False)
        text = (tmp_path / "logs" / "criu-dump.log").read_text(errors="replace")
        assert "anon_inode:[userfaultfd]" in text, text[-2000:]
        assert "Can't cure" not in text, text[-2000:]
        # the tasks before the last child were infected, their drains started
        started = {int(m.group(2)) for m in map(_DRAIN_START.match, text.splitlines()) if m}
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
        await _kill(*proctree.tree(job.pid))


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
                m = _DRAIN_START.match(line)
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
            with pytest.raises(CriuError):
                await asyncio.wait_for(criu.dump(job.pid, tmp / "img", leave_running=True), 120)
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
        await _kill(*proctree.tree(job.pid))


async def test_the_flag_is_given_only_when_on_and_known(criu_bin: str, tmp_path: Path) -> None:
    """On with N >= 2 and a CRIU that lists it; off with 0/1; a CRIU without it (Debian's
    binary, a fake here) is used as it is."""
    assert await Criu(criu_bin, page_workers=3).page_worker_args() == [PAGE_WORKERS_FLAG, "3"]
    assert await Criu(criu_bin, page_workers=1).page_worker_args() == []
    old = tmp_path / "criu"
    old.write_text("#!/bin/sh\necho 'Version: 4.2.1'\necho '  --stream  dump/restore ...'\n")
    old.chmod(0o755)
    assert not has_page_workers(str(old))
    assert await Criu(str(old), page_workers=8, plugins=None).page_worker_args() == []


def test_a_bad_environment_value_is_a_clear_error(
    criu_bin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spotguard.errors import PreflightError

    monkeypatch.setenv("SPOTGUARD_CRIU_PAGE_WORKERS", "many")
    with pytest.raises(PreflightError, match="SPOTGUARD_CRIU_PAGE_WORKERS='many'"):
        Criu(criu_bin)
    monkeypatch.setenv("SPOTGUARD_CRIU_PAGE_WORKERS", "0")
    assert Criu(criu_bin).page_workers == 0


PIPE_MAX = Path("/proc/sys/fs/pipe-max-size")


def _criu_256(criu_bin: str, tmp_path: Path) -> Path:
    """``criu_bin`` limited to 256 open files: a page pipe budget of 64 pipes."""
    if not has_page_workers(criu_bin):
        pytest.fail(f"{criu_bin} has no {PAGE_WORKERS_FLAG}: run scripts/install-criu")
    wrapper = tmp_path / "criu-256"
    wrapper.write_text(f'#!/bin/sh\nulimit -n 256 || exit 1\nexec {criu_bin} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


async def _one_big_rank(criu: Criu, settings: CheckpointSettings, tmp_path: Path, gen: int) -> str:
    """A job of one 640 MiB rank dumped to a directory by ``criu`` and restored, its memory
    the same after; CRIU's dump log."""
    global RANKS
    ranks, RANKS = RANKS, 1
    engine = Engine(criu, settings=settings)
    out = tmp_path / f"out-{gen}"
    argv = [sys.executable, str(REPO / "bench" / "ranks_job.py"), "launcher"]
    argv += ["--ranks", "1", "--mib", "640", "--out", str(out)]
    job = await start_job(argv, f"big-{gen}", state_dir=tmp_path / f"state-{gen}")
    pids = [job.pid]
    try:
        await wait_for(lambda o=out: (o / "rank-0.sum").exists(), "the rank", 120)
        result = await engine.freeze(job, DirectoryTarget(tmp_path / f"img-{gen}"), Mode.EXIT)
        assert criu.log_dir is not None
        text = (criu.log_dir / "criu-dump.log").read_text(errors="replace")
        restored = await engine.restore(DirectorySource(result.images_dir))
        pids.append(restored.pid)
        await _verify(out, 1)
        return text
    finally:
        RANKS = ranks
        await _kill(*pids)


@pytest.mark.serial  # sets fs.pipe-max-size, which every stream on the host reads
async def test_a_large_task_never_runs_criu_out_of_descriptors(
    criu_bin: str, settings: CheckpointSettings, tmp_path: Path
) -> None:
    """One rank holding 640 MiB, dumped with page workers by a CRIU limited to 256 open files
    (a 40 GiB task failed on the GPU machine: 'Can't make pipe for page-pipe: Too many open
    files'). With fs.pipe-max-size at 64 MiB its pages are held in a dozen big pipes and
    written in the background; at 1 MiB (the GPU machines' default, where it cannot be
    raised: ``pipe_max=None`` leaves it) they would need hundreds of descriptors, so the task
    is written in chunks. Both restore byte-identical."""
    wrapper = _criu_256(criu_bin, tmp_path)
    before = await asyncio.to_thread(PIPE_MAX.read_text)
    try:
        for gen, (pipe_max, how) in enumerate(
            [(64 << 20, "in the background"), (1 << 20, "written in chunks")], start=1
        ):
            await asyncio.to_thread(PIPE_MAX.write_text, str(pipe_max))
            logs = tmp_path / f"logs-{gen}"
            logs.mkdir()
            criu = Criu(str(wrapper), page_workers=4, log_level=4, log_dir=logs, pipe_max=None)
            assert how in await _one_big_rank(criu, settings, tmp_path, gen)
    finally:
        await asyncio.to_thread(PIPE_MAX.write_text, before)


@pytest.mark.serial  # sets fs.pipe-max-size, which every stream on the host reads
async def test_a_dump_to_a_directory_raises_the_pipe_limit_so_a_rank_is_written_in_the_background(
    criu_bin: str, settings: CheckpointSettings, tmp_path: Path
) -> None:
    """Only a stream raised fs.pipe-max-size (1 MiB on the GPU machines): a dump to a
    directory (a park, ``spotguard checkpoint --to DIR``) held a rank's pages in 1 MiB pipes,
    so each CUDA rank (~11 GB of private mappings: 11,298 pipes against a budget of 5,000)
    was written in chunks, one rank after another — a 4-GPU DDP job's ``criu_dump`` took
    4.15 s against 0.84 s for one rank. A dump with page workers raises the limit first."""
    wrapper = _criu_256(criu_bin, tmp_path)
    before = await asyncio.to_thread(PIPE_MAX.read_text)
    try:
        await asyncio.to_thread(PIPE_MAX.write_text, str(1 << 20))
        (tmp_path / "logs").mkdir()
        criu = Criu(str(wrapper), page_workers=4, log_level=4, log_dir=tmp_path / "logs")
        text = await _one_big_rank(criu, settings, tmp_path, 1)
        assert "in the background" in text and "written in chunks" not in text, text[-2000:]
        assert int(await asyncio.to_thread(PIPE_MAX.read_text)) == 64 << 20
    finally:
        await asyncio.to_thread(PIPE_MAX.write_text, before)


THREADED = """
import threading, time
for _ in range(12):
    threading.Thread(target=time.sleep, args=(1e9,), daemon=True).start()
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _stack_pages(root: int) -> set[int]:
    """The stack page of every thread but the main one of the tree's threaded process, from
    the stack pointer of the system call each waits in (``syscall``'s 8th field)."""
    from spotguard.stream import sparse

    [proc] = [p for p in proctree.tree(root) if len(list(Path(f"/proc/{p}/task").iterdir())) > 10]
    pages = set()
    for task in Path(f"/proc/{proc}/task").iterdir():
        if task.name != str(proc):
            fields = (task / "syscall").read_text().split()
            assert len(fields) == 9, fields  # blocked in a system call
            pages.add(int(fields[7], 16) & ~(sparse.PAGE - 1))
    return pages


def _entries(images: Path) -> list[Any]:
    from spotguard.stream import sparse

    return [e for f in images.glob("pagemap-*.img")
            for e in sparse.parse_pagemap(f.read_bytes()).entries]  # fmt: skip


async def test_every_threads_stack_page_stays_out_of_lazy_restore(
    parallel_criu: Criu, settings: CheckpointSettings, tmp_path: Path
) -> None:
    """Patch 0005 looks for thread stacks only in the mappings that hold a stack pointer;
    the pagemap must still mark every thread's stack page not lazy (the restorer needs it)
    and the rest of a lazy-capable mapping lazy, as before."""
    from spotguard.stream import sparse

    script = tmp_path / "threaded.py"
    script.write_text(THREADED)
    job = await start_job([sys.executable, str(script)], "threads", state_dir=tmp_path / "state")
    await wait_for(lambda: (job.dir / "stdout").read_text().startswith("ready"), "the job", 30)
    sps = _stack_pages(job.pid)
    assert len(sps) == 12
    engine = Engine(parallel_criu, settings=settings)
    await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.RESUME)
    entries = _entries(tmp_path / "img")
    for sp in sps:
        [e] = [e for e in entries if e.vaddr <= sp < e.vaddr + e.nr_pages * sparse.PAGE]
        assert not e.flags & sparse.PE_LAZY, f"stack page {sp:#x} marked lazy"
    assert sum(e.nr_pages for e in entries if e.flags & sparse.PE_LAZY) > 1000
    await _kill(job.pid)
