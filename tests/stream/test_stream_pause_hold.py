"""The two ways a leave-running checkpoint's held image shortens the job's pause, with real
CRIU and a real job into a real file store:

* ``[checkpoint] pack_after_resume``: the held chunks are neither hashed nor stored while the
  job is frozen, only once it runs again; the image is still complete and restores exactly;
* ``[checkpoint] prefault_hold``: the room the image is held in is faulted in before the
  freeze, while the job still runs (a ``hold_prefault`` step, about the job's memory).

And when the freeze fails after the job has run again with chunks still waiting, the job
runs on and no image is left.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from stream_helpers import MIB, kill_tree, start_stream_job, wait_done, wait_lines

from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.errors import CheckpointError
from spotguard.image import ImageSettings
from spotguard.image.memops import populate
from spotguard.stream import StreamSource, StreamTarget, pipes
from spotguard.stream.capture import Capture
from spotguard.stream.pipes import Interrupted, PiecePool

pytestmark = pytest.mark.criu

SMALL = {"chunk_size": 1 << 20, "max_inflight": 2}


def _stored_chunks(store: Path) -> int:
    """Chunks of the job's pages in the store (its random memory: stored near 1 MiB each;
    CRIU's small files are chunks of their own, never held)."""
    return sum(
        1
        for p in store.rglob("*")
        if p.is_file() and "/chunks/" in p.as_posix() and p.stat().st_size >= 512 << 10
    )


class CountAt:
    """Faults that raise nothing: count the store's chunks when ``step`` is reached (or
    raise there, ``fail``)."""

    def __init__(self, step: str, store: Path, *, fail: bool = False) -> None:
        self.step, self.store, self.fail = step, store, fail
        self.chunks: int | None = None

    async def before(self, step: str) -> None:
        if step == self.step:
            self.chunks = _stored_chunks(self.store)
            if self.fail:
                raise CheckpointError(f"injected failure before {step}")


async def _restores_exactly(
    engine: Engine, job: JobInfo, url: str, reference: str, tmp_path: Path
) -> None:
    """The job killed, its image restored: it prints what an uninterrupted run prints."""
    kill_tree(job.pid)
    await asyncio.sleep(0.3)
    source = StreamSource(url, settings=ImageSettings(), work_root=tmp_path / "work2")
    restored = await engine.restore(source, state_dir=tmp_path / "state")
    try:
        assert await wait_done(job.dir / "stdout") == reference
    finally:
        kill_tree(restored.pid)


def _engine(criu_bin: str, faults: Any, **settings: Any) -> Engine:
    return Engine(Criu(criu_bin), settings=CheckpointSettings(**settings), faults=faults)


def test_populate_faults_a_buffer_in_at_once() -> None:
    buf = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    before = psutil.Process().memory_info().rss
    assert populate(buf)
    assert psutil.Process().memory_info().rss - before >= 60 << 20  # resident, not lazy
    assert buf[: 1 << 20] == bytes(1 << 20)  # still all zero: only the work moved
    buf.close()


def test_prefaulted_pieces_are_the_ones_taken_and_the_bound_holds() -> None:
    pool = PiecePool(4 << 20, 5)
    assert pool.prefault(3) == 3
    taken = [pool.take() for _ in range(3)]
    assert pool.made == 3, "a prefaulted piece was not reused"
    assert pool.prefault(10) == 2, "the pool's bound counts the pieces out"
    for b in taken:
        pool.release(b)
    stop = threading.Event()
    stop.set()
    assert PiecePool(4 << 20, 5).prefault(3, stop) == 0  # an abort stops it
    pool.close()
    assert pool.prefault(1) == 0
    with pytest.raises(Interrupted):
        pool.take()


async def test_the_capture_makes_every_map_of_the_hold_before_it_faults_any_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A map made while another thread populates waits for that populate (the address-space
    lock), which kept a 16-core prefault at a quarter of the machine's rate: the capture makes
    all of the hold's maps, then faults them in on several threads."""
    events: list[str] = []
    make, fault = PiecePool._make, pipes.populate

    def made(pool: PiecePool) -> mmap.mmap:
        events.append("map")
        return make(pool)

    def faulted(buf: mmap.mmap) -> bool:
        events.append("populate")
        return fault(buf)

    monkeypatch.setattr(PiecePool, "_make", made)
    monkeypatch.setattr(pipes, "populate", faulted)
    unused: Any = None  # nothing is captured: the prefault comes before CRIU
    capture = Capture(tmp_path / "img", unused, piece_bytes=4 << 20, buffer_bytes=32 << 20)
    await capture.start()
    try:
        assert await capture.prefault(24 << 20, threads=3) == 24 << 20
    finally:
        await capture.abort()
    assert events == ["map"] * 6 + ["populate"] * 6, events


def test_reserve_makes_maps_only_and_fill_faults_them_in() -> None:
    """The two halves of the prefault: :meth:`PiecePool.reserve` maps within the pool's bound
    and faults nothing in; :meth:`PiecePool.fill` faults in and frees exactly those pieces."""
    pool = PiecePool(4 << 20, 5)
    before = psutil.Process().memory_info().rss
    bufs = pool.reserve(4)
    assert len(bufs) == 4 and pool.made == 4
    assert psutil.Process().memory_info().rss - before < 8 << 20, "reserve faulted pages in"
    assert pool.reserve(4) and pool.made == 5, "the bound counts reserved maps"
    assert pool.fill(bufs[:2]) == 2
    assert psutil.Process().memory_info().rss - before >= 7 << 20  # two pieces resident
    stop = threading.Event()
    stop.set()
    assert pool.fill(bufs[2:], stop) == 0  # an abort: the rest free as they are, not lost
    taken = [pool.take() for _ in range(4)]
    assert pool.made == 5 and {id(b) for b in taken} == {id(b) for b in bufs}
    pool.close()
    assert pool.reserve(1) == []


def test_a_reserve_that_runs_out_of_maps_leaves_the_rest_to_be_made_on_demand(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefault is an optimisation: a map refused (ENOMEM) ends it early, and the pieces it
    did not make are not counted as made — else :meth:`PiecePool.take` would wait forever
    for pieces that do not exist."""
    pool = PiecePool(4 << 20, 4)
    real, calls = pool._make, [0]

    def refused_after_two() -> mmap.mmap:
        calls[0] += 1
        if calls[0] > 2:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real()

    monkeypatch.setattr(pool, "_make", refused_after_two)
    bufs = pool.reserve(4)
    assert len(bufs) == 2 and pool.made == 2
    assert pool.fill(bufs) == 2
    monkeypatch.setattr(pool, "_make", real)
    taken = [pool.take() for _ in range(4)]  # the two refused are made on demand
    assert pool.made == 4 and len({id(b) for b in taken}) == 4


@pytest.mark.parametrize("later", [True, False], ids=["after-resume", "while-frozen"])
async def test_held_chunks_are_stored_only_once_the_job_runs_again(
    later: bool, criu_bin: str, job_script: Path, reference_output: str, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    # nccl_rebuild: the first step after CRIU let the tree go, before the image is finished
    faults = CountAt("nccl_rebuild", store)
    engine = _engine(criu_bin, faults, pack_after_resume=later)
    job = await start_stream_job(job_script, tmp_path / "state", f"pack-{str(later).lower()}")
    target = StreamTarget(f"file://{store}", work_root=tmp_path / "work", writer_options=SMALL,
                          settings=ImageSettings(pipe_mb=1))  # fmt: skip
    await engine.freeze(job, target, Mode.RESUME)
    assert target.manifest is not None and target.url is not None
    assert target.writer_stats is not None
    deferred = target.writer_stats.chunks_deferred
    assert faults.chunks is not None
    if later:
        # the job's 48 MiB of pages were held raw: none of those chunks stored while frozen
        assert deferred >= MIB, target.writer_stats.to_json()
        assert faults.chunks == 0, faults.chunks
    else:  # processed as they came (how many were stored by then is the machine's pace)
        assert deferred == 0
    await _restores_exactly(engine, job, target.url, reference_output, tmp_path)


async def test_the_hold_is_faulted_in_before_the_freeze(
    criu_bin: str, job_script: Path, reference_output: str, tmp_path: Path
) -> None:
    engine = _engine(criu_bin, None, prefault_hold=True)
    job = await start_stream_job(job_script, tmp_path / "state", "prefault")
    target = StreamTarget(f"file://{tmp_path / 'store'}", work_root=tmp_path / "work",
                          writer_options=SMALL, settings=ImageSettings(pipe_mb=1))  # fmt: skip
    result = await engine.freeze(job, target, Mode.RESUME)
    (pre,) = [s for s in target.timeline_steps if s.name == "hold_prefault"]
    (dump,) = [s for s in result.timeline.steps if s.name == "criu_dump"]
    assert pre.detail["bytes"] >= MIB << 20, pre.detail  # about the job's resident memory
    assert pre.start + (pre.seconds or 0) <= dump.start, "faulted in while the job was frozen"
    assert target.url is not None
    await _restores_exactly(engine, job, target.url, reference_output, tmp_path)


async def test_an_exit_checkpoint_neither_prefaults_nor_holds_chunks_back(
    criu_bin: str, job_script: Path, tmp_path: Path
) -> None:
    engine = _engine(criu_bin, None, prefault_hold=True, pack_after_resume=True)
    job = await start_stream_job(job_script, tmp_path / "state", "exit")
    target = StreamTarget(f"file://{tmp_path / 'store'}", work_root=tmp_path / "work",
                          writer_options=SMALL, settings=ImageSettings())  # fmt: skip
    try:
        await engine.freeze(job, target, Mode.EXIT)
    finally:
        kill_tree(job.pid)
    assert not [s for s in target.timeline_steps if s.name == "hold_prefault"]
    assert target.writer_stats is not None and target.writer_stats.chunks_deferred == 0


async def test_a_freeze_failing_with_held_chunks_waiting_leaves_the_job_running_and_no_image(
    criu_bin: str, job_script: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    faults = CountAt("nccl_rebuild", store, fail=True)
    engine = _engine(criu_bin, faults, pack_after_resume=True, prefault_hold=True)
    job = await start_stream_job(job_script, tmp_path / "state", "fail-held")
    target = StreamTarget(f"file://{store}", work_root=tmp_path / "work", writer_options=SMALL,
                          settings=ImageSettings(pipe_mb=1))  # fmt: skip
    try:
        with pytest.raises(CheckpointError, match="injected failure"):
            await asyncio.wait_for(engine.freeze(job, target, Mode.RESUME), 60)
        at_fail = (job.dir / "stdout").read_text().count("\n")
        await wait_lines(job.dir / "stdout", at_fail + 5, limit=20)  # it runs on
    finally:
        kill_tree(job.pid)
    assert target.manifest is None
    assert not list(store.rglob("*manifest*")), "a failed freeze left an image"
