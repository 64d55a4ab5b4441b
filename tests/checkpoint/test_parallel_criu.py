"""CRIU's ``--page-workers`` (packaging/criu-patches): the processes of a job are dumped and
restored in parallel, byte-identical, with real processes and the patched CRIU.

The job is the N-rank stand-in (bench/ranks_job.py): a launcher with exec'd ranks, each
holding distinct memory (half random, half zero pages) and reporting its SHA-1 before the
checkpoint and on request after it. CRIU's own log (``-v4``) proves the overlap: a rank's
pages were still being written when the next rank's writer started, and (patch 0006) a rank's
parasite was still draining its pages when the next rank's drain started
(test_parallel_drain.py).
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import wait_for
from pageworkers import kill, patched_criu, spans

from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import PAGE_WORKERS_FLAG, Criu, has_page_workers
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
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


@pytest.fixture
def settings(settings: CheckpointSettings) -> CheckpointSettings:
    """CRIU moves every page here (``cpu_pages = "criu"``): these tests are of its own
    parallel paths, which the job's large mappings would otherwise bypass."""
    return settings.model_copy(update={"cpu_pages": "criu"})


@pytest.fixture
def parallel_criu(criu_bin: str, tmp_path: Path) -> Criu:
    return patched_criu(criu_bin, tmp_path, WORKERS)


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


def _rankspans(spans: dict[int, tuple[float, float]]) -> list[tuple[float, float]]:
    # the tree is dumped parents first: the ranks are the last RANKS tasks
    ranks = sorted(spans.values())[-RANKS:]
    assert len(ranks) == RANKS, spans
    return ranks


def _assert_ranks_overlapped(log: Path) -> None:
    ranks = _rankspans(spans(log))
    # a rank's pages were still being written when the next rank's writer started (on a
    # loaded 2-core machine the later ranks' parasites may take longer than a write)
    overlapped = any(ranks[i + 1][0] < ranks[i][1] for i in range(RANKS - 1))
    assert overlapped, f"the ranks' pages were written one after another: {ranks}"


def _assert_prefaulted(log: Path) -> None:
    text = log.read_text(errors="replace")
    assert len(re.findall(r"Prefaulting \d+ MiB", text)) >= RANKS, "no rank was prefaulted"
    assert "Prefault stopped early" not in text


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
        await kill(*pids)


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
        await kill(job.pid)
        restored = await engine.restore(DirectorySource(result.images_dir))
        pids.append(restored.pid)
        await _verify(out, 2)  # and the image holds the same memory
    finally:
        await kill(*pids)


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
        await kill(*pids)


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
        await kill(*pids)


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
    await kill(job.pid)
